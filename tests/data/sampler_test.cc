#include "data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <set>

#include "nn/error.h"

namespace tandem::data {
namespace {

std::vector<std::vector<int64_t>> Pass(BatchSampler& sampler) {
  sampler.reset();
  std::vector<std::vector<int64_t>> batches;
  while (auto batch = sampler.next()) batches.push_back(*batch);
  return batches;
}

TEST(SamplerTest, SequentialAndRandom) {
  EXPECT_EQ(SequentialSampler(4).Order(7), (std::vector<int64_t>{0, 1, 2, 3}));
  RandomSampler a(100, 42), b(100, 42), c(100, 43);
  EXPECT_EQ(a.Order(0), b.Order(0));
  EXPECT_NE(a.Order(0), a.Order(1));
  EXPECT_NE(a.Order(0), c.Order(0));
  std::vector<int64_t> sorted = a.Order(3);
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, SequentialSampler(100).Order(0));
  EXPECT_TRUE(RandomSampler(0, 1).Order(0).empty());
}

TEST(SamplerTest, SimpleBatchSamplerSizesAndEpochs) {
  SimpleBatchSampler keep(std::make_shared<SequentialSampler>(10), 4, false);
  EXPECT_EQ(keep.num_batches(), 3);
  auto batches = Pass(keep);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[2], (std::vector<int64_t>{8, 9}));
  SimpleBatchSampler drop(std::make_shared<SequentialSampler>(10), 4, true);
  EXPECT_EQ(Pass(drop).size(), 2u);

  SimpleBatchSampler random(std::make_shared<RandomSampler>(10, 5), 3, false);
  auto epoch0 = Pass(random);
  EXPECT_EQ(random.get_state().epoch, 0);
  auto epoch1 = Pass(random);
  EXPECT_EQ(random.get_state().epoch, 1);
  EXPECT_NE(epoch0, epoch1);
  random.set_epoch(0);
  EXPECT_EQ(Pass(random), epoch0);
  EXPECT_THROW(SimpleBatchSampler(std::make_shared<SequentialSampler>(3), 0, false), Error);
}

// Concatenation of the ranks' batches, global batch by global batch.
std::vector<int64_t> GlobalOrder(int64_t n, int64_t batch, int replicas, bool drop_last,
                                 int64_t epoch) {
  std::vector<std::vector<std::vector<int64_t>>> per_rank;
  for (int r = 0; r < replicas; ++r) {
    DistributedBatchSampler s(n, batch, replicas, r, /*shuffle=*/true, drop_last, /*seed=*/99);
    s.set_epoch(epoch);
    per_rank.push_back(Pass(s));
    EXPECT_EQ(static_cast<int64_t>(per_rank.back().size()), s.num_batches());
  }
  std::vector<int64_t> order;
  for (size_t g = 0; g < per_rank[0].size(); ++g) {
    for (int r = 0; r < replicas; ++r) {
      EXPECT_EQ(per_rank[r].size(), per_rank[0].size());
      EXPECT_EQ(static_cast<int64_t>(per_rank[r][g].size()), batch);
      order.insert(order.end(), per_rank[r][g].begin(), per_rank[r][g].end());
    }
  }
  return order;
}

TEST(DistributedBatchSamplerTest, NRanksTimesBEqualsOneRankTimesNB) {
  for (int64_t n : {1, 3, 7, 64, 100, 101}) {
    for (int replicas : {1, 2, 3, 4, 8}) {
      for (int64_t batch : {1, 3, 8}) {
        for (bool drop_last : {false, true}) {
          for (int64_t epoch : {0, 1, 5}) {
            EXPECT_EQ(GlobalOrder(n, batch, replicas, drop_last, epoch),
                      GlobalOrder(n, batch * replicas, 1, drop_last, epoch))
                << "n=" << n << " N=" << replicas << " B=" << batch << " drop_last=" << drop_last
                << " epoch=" << epoch;
          }
        }
      }
    }
  }
}

TEST(DistributedBatchSamplerTest, PaddingWrapsAndDropLastDrops) {
  // 10 samples, 2 ranks x batch 3 = 6 per global batch: 2 global batches, the
  // second padded with the first two positions of the permutation.
  const std::vector<int64_t> order = GlobalOrder(10, 3, 2, false, 0);
  ASSERT_EQ(order.size(), 12u);
  EXPECT_EQ(order[10], order[0]);
  EXPECT_EQ(order[11], order[1]);
  std::set<int64_t> seen(order.begin(), order.end());
  EXPECT_EQ(seen.size(), 10u);  // every sample visited
  EXPECT_EQ(GlobalOrder(10, 3, 2, true, 0).size(), 6u);
  // Without shuffle, the permutation is the identity.
  DistributedBatchSampler r1(10, 3, 2, 1, /*shuffle=*/false, false, 0);
  auto batches = Pass(r1);
  EXPECT_EQ(batches[0], (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(batches[1], (std::vector<int64_t>{9, 0, 1}));
}

TEST(DistributedBatchSamplerTest, DatasetSmallerThanWorld) {
  for (int r = 0; r < 4; ++r) {
    DistributedBatchSampler s(2, 1, 4, r, /*shuffle=*/false, /*drop_last=*/false, 0);
    auto batches = Pass(s);
    ASSERT_EQ(batches.size(), 1u);
    EXPECT_EQ(batches[0], std::vector<int64_t>{r % 2});
  }
  DistributedBatchSampler dropped(2, 1, 4, 0, true, /*drop_last=*/true, 0);
  EXPECT_TRUE(Pass(dropped).empty());
  DistributedBatchSampler empty(0, 2, 2, 1, true, false, 0);
  EXPECT_TRUE(Pass(empty).empty());
}

TEST(DistributedBatchSamplerTest, EpochsAdvanceAndSetEpochReproduces) {
  DistributedBatchSampler s(50, 4, 2, 0, true, false, 7);
  auto e0 = Pass(s);
  auto e1 = Pass(s);
  auto e2 = Pass(s);
  EXPECT_EQ(s.get_state().epoch, 2);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e1, e2);
  s.set_epoch(1);
  EXPECT_EQ(Pass(s), e1);
  EXPECT_EQ(Pass(s), e2);  // iterating again advances to epoch 2
  // Another rank with the same seed draws the same permutation: disjoint slices.
  DistributedBatchSampler other(50, 4, 2, 1, true, false, 7);
  auto o0 = Pass(other);
  EXPECT_NE(o0[0], e0[0]);
}

TEST(DistributedBatchSamplerTest, StateResumesMidEpoch) {
  DistributedBatchSampler s(40, 2, 2, 1, true, false, 3);
  Pass(s);
  s.reset();  // epoch 1
  std::vector<std::vector<int64_t>> first_half;
  for (int k = 0; k < 4; ++k) first_half.push_back(*s.next());
  const SamplerState state = s.get_state();
  EXPECT_EQ(state.epoch, 1);
  EXPECT_EQ(state.position, 4);
  std::vector<std::vector<int64_t>> rest;
  while (auto b = s.next()) rest.push_back(*b);

  DistributedBatchSampler resumed(40, 2, 2, 1, true, false, 3);
  resumed.set_state(state);
  EXPECT_EQ(Pass(resumed), rest);
  EXPECT_EQ(resumed.get_state().epoch, 1);
  EXPECT_THROW(resumed.set_state({0, 100}), Error);
}

TEST(DistributedBatchSamplerTest, RejectsBadArguments) {
  EXPECT_THROW(DistributedBatchSampler(10, 2, 2, 2), Error);
  EXPECT_THROW(DistributedBatchSampler(10, 0, 2, 0), Error);
  EXPECT_THROW(DistributedBatchSampler(10, 2, 0, 0), Error);
  EXPECT_THROW(DistributedBatchSampler(-1, 2, 1, 0), Error);
}

// paddle.io.DistributedBatchSampler.__iter__ (shuffle off) restated step by step
// as Paddle's Python writes it: pad the index list by repeating it to
// total = ceil(n/N)*N, take each global batch's contiguous slice, split the last
// (partial) global batch evenly, then cut this rank's list into batches.
std::vector<std::vector<int64_t>> PaddleBatches(int64_t n, int64_t batch, int64_t nranks,
                                                int64_t rank, bool drop_last) {
  const int64_t num_samples = (n + nranks - 1) / nranks;  // math.ceil(n / nranks)
  const int64_t total_size = num_samples * nranks;
  std::vector<int64_t> indices(n);
  std::iota(indices.begin(), indices.end(), 0);
  const int64_t padding_size = total_size - n;
  if (padding_size <= n) {
    indices.insert(indices.end(), indices.begin(), indices.begin() + padding_size);
  } else {
    std::vector<int64_t> repeated;
    for (int64_t k = 0; k < (padding_size + n - 1) / n; ++k) {
      repeated.insert(repeated.end(), indices.begin(), indices.begin() + n);
    }
    indices.insert(indices.end(), repeated.begin(), repeated.begin() + padding_size);
  }
  EXPECT_EQ(static_cast<int64_t>(indices.size()), total_size);
  if (nranks > 1) {
    std::vector<int64_t> subsampled;
    const int64_t last_batch_size = total_size % (batch * nranks);
    EXPECT_EQ(last_batch_size % nranks, 0);
    const int64_t last_local_batch_size = last_batch_size / nranks;
    const int64_t end = static_cast<int64_t>(indices.size()) - last_batch_size;
    for (int64_t i = rank * batch; i < end; i += batch * nranks) {
      subsampled.insert(subsampled.end(), indices.begin() + i, indices.begin() + i + batch);
    }
    const std::vector<int64_t> tail(indices.begin() + end, indices.end());
    subsampled.insert(subsampled.end(), tail.begin() + rank * last_local_batch_size,
                      tail.begin() + (rank + 1) * last_local_batch_size);
    indices = subsampled;
  }
  EXPECT_EQ(static_cast<int64_t>(indices.size()), num_samples);
  std::vector<std::vector<int64_t>> batches;
  std::vector<int64_t> current;
  for (int64_t idx : indices) {
    current.push_back(idx);
    if (static_cast<int64_t>(current.size()) == batch) {
      batches.push_back(current);
      current.clear();
    }
  }
  if (!drop_last && !current.empty()) batches.push_back(current);
  // __len__
  EXPECT_EQ(static_cast<int64_t>(batches.size()),
            (num_samples + (drop_last ? 0 : batch - 1)) / batch);
  return batches;
}

DistributedBatchSampler Tailed(int64_t n, int64_t batch, int replicas, int rank, bool shuffle,
                               bool drop_last, DistributedTail tail) {
  return DistributedBatchSampler(DistributedOptions{.dataset_size = n,
                                                    .batch_size = batch,
                                                    .num_replicas = replicas,
                                                    .rank = rank,
                                                    .shuffle = shuffle,
                                                    .drop_last = drop_last,
                                                    .seed = 5,
                                                    .tail = tail});
}

TEST(DistributedTailTest, PaddleTailIsPaddlesIndicesForEverySize) {
  int64_t cases = 0;
  for (int64_t n = 0; n <= 41; ++n) {
    for (int64_t batch = 1; batch <= 7; ++batch) {
      for (int replicas = 1; replicas <= 6; ++replicas) {
        for (bool drop_last : {false, true}) {
          for (int r = 0; r < replicas; ++r) {
            DistributedBatchSampler s =
                Tailed(n, batch, replicas, r, /*shuffle=*/false, drop_last, DistributedTail::kPaddle);
            const auto expected = PaddleBatches(n, batch, replicas, r, drop_last);
            ASSERT_EQ(s.num_batches(), static_cast<int64_t>(expected.size()));
            ASSERT_EQ(Pass(s), expected) << "n=" << n << " B=" << batch << " N=" << replicas
                                         << " rank " << r << " drop_last=" << drop_last;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 42 * 7 * 21 * 2);
}

// With shuffle, kPaddle permutes the padded list: the same batch sizes as
// Paddle's, every sample at least once, at most N-1 repeats, a new order each epoch.
TEST(DistributedTailTest, PaddleTailShuffledHasPaddlesStructure) {
  for (int64_t n : {1, 5, 10, 23, 64}) {
    for (int64_t batch : {1, 3, 4}) {
      for (int replicas : {1, 2, 3, 4}) {
        std::vector<int64_t> seen;
        for (int r = 0; r < replicas; ++r) {
          DistributedBatchSampler s =
              Tailed(n, batch, replicas, r, /*shuffle=*/true, false, DistributedTail::kPaddle);
          const auto shuffled = Pass(s);
          const auto plain = PaddleBatches(n, batch, replicas, r, false);
          ASSERT_EQ(shuffled.size(), plain.size());
          for (size_t k = 0; k < plain.size(); ++k) EXPECT_EQ(shuffled[k].size(), plain[k].size());
          for (const auto& b : shuffled) seen.insert(seen.end(), b.begin(), b.end());
          if (n >= 10) EXPECT_NE(Pass(s), shuffled) << "epoch 1 repeats epoch 0";
        }
        const int64_t total = (n + replicas - 1) / replicas * replicas;
        EXPECT_EQ(static_cast<int64_t>(seen.size()), total);
        EXPECT_EQ(static_cast<int64_t>(std::set<int64_t>(seen.begin(), seen.end()).size()), n)
            << "n=" << n << " B=" << batch << " N=" << replicas;
      }
    }
  }
}

// kUneven: every sample exactly once; the ranks' batches, global batch by global
// batch, concatenate to one rank's batches of N*B; batch counts differ by at most one.
TEST(DistributedTailTest, UnevenTailVisitsEverySampleOnce) {
  for (int64_t n = 0; n <= 41; ++n) {
    for (int64_t batch = 1; batch <= 6; ++batch) {
      for (int replicas = 1; replicas <= 5; ++replicas) {
        for (bool shuffle : {false, true}) {
          std::vector<std::vector<std::vector<int64_t>>> per_rank;
          int64_t most = 0, fewest = INT64_MAX;
          for (int r = 0; r < replicas; ++r) {
            DistributedBatchSampler s =
                Tailed(n, batch, replicas, r, shuffle, false, DistributedTail::kUneven);
            per_rank.push_back(Pass(s));
            ASSERT_EQ(static_cast<int64_t>(per_rank.back().size()), s.num_batches());
            most = std::max(most, s.num_batches());
            fewest = std::min(fewest, s.num_batches());
            for (const auto& b : per_rank.back()) {
              EXPECT_TRUE(!b.empty() && static_cast<int64_t>(b.size()) <= batch);
            }
          }
          EXPECT_LE(most - fewest, 1);
          std::vector<int64_t> order;
          for (int64_t g = 0; g < most; ++g) {
            for (int r = 0; r < replicas; ++r) {
              if (g < static_cast<int64_t>(per_rank[r].size())) {
                order.insert(order.end(), per_rank[r][g].begin(), per_rank[r][g].end());
              }
            }
          }
          DistributedBatchSampler one =
              Tailed(n, batch * replicas, 1, 0, shuffle, false, DistributedTail::kUneven);
          std::vector<int64_t> expected;
          for (const auto& b : Pass(one)) expected.insert(expected.end(), b.begin(), b.end());
          ASSERT_EQ(order, expected) << "n=" << n << " B=" << batch << " N=" << replicas;
          std::sort(order.begin(), order.end());
          std::vector<int64_t> all(n);
          std::iota(all.begin(), all.end(), 0);
          ASSERT_EQ(order, all);
        }
      }
    }
  }
  // 10 samples, 3 ranks x 3: one full global batch, then 1 sample for rank 0.
  EXPECT_EQ(Pass(*std::make_unique<DistributedBatchSampler>(
                Tailed(10, 3, 3, 0, false, false, DistributedTail::kUneven))),
            (std::vector<std::vector<int64_t>>{{0, 1, 2}, {9}}));
  EXPECT_EQ(Tailed(10, 3, 3, 2, false, false, DistributedTail::kUneven).num_batches(), 1);
}

TEST(DistributedTailTest, DefaultIsWrapGlobalBatchAndUnevenRefusesDropLast) {
  EXPECT_EQ(DistributedOptions{}.tail, DistributedTail::kWrapGlobalBatch);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(Pass(*std::make_unique<DistributedBatchSampler>(
                  Tailed(10, 3, 2, r, true, false, DistributedTail::kWrapGlobalBatch))),
              Pass(*std::make_unique<DistributedBatchSampler>(10, 3, 2, r, true, false, 5)));
  }
  try {
    Tailed(10, 3, 2, 0, false, /*drop_last=*/true, DistributedTail::kUneven);
    FAIL() << "kUneven with drop_last was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'uneven'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("drop_last"), std::string::npos) << e.what();
  }
  EXPECT_STREQ(DistributedTailName(DistributedTail::kPaddle), "paddle");
}

}  // namespace
}  // namespace tandem::data
