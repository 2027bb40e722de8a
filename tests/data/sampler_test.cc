#include "data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

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

DistributedBatchSampler Global(int64_t n, int64_t global, int replicas, int rank, bool shuffle,
                               bool drop_last, DistributedTail tail, int64_t batch = 0) {
  return DistributedBatchSampler(DistributedOptions{.dataset_size = n,
                                                    .batch_size = batch,
                                                    .global_batch_size = global,
                                                    .num_replicas = replicas,
                                                    .rank = rank,
                                                    .shuffle = shuffle,
                                                    .drop_last = drop_last,
                                                    .seed = 5,
                                                    .tail = tail});
}

// A global batch G over N ranks: rank r takes G/N samples, one more when
// r < G mod N, and the ranks' batches k, concatenated in rank order, are batch
// k of one rank with batch G, for every tail, N dividing G or not.
TEST(DistributedGlobalBatchTest, RanksConcatenateToOneRankWithTheGlobalBatch) {
  int64_t checked = 0;
  for (int64_t n : {0, 1, 5, 17, 40, 64, 130}) {
    for (int replicas = 1; replicas <= 5; ++replicas) {
      for (int64_t global = replicas; global <= 13; ++global) {
        for (DistributedTail tail : {DistributedTail::kWrapGlobalBatch, DistributedTail::kUneven,
                                     DistributedTail::kPaddle}) {
          if (tail == DistributedTail::kPaddle && global % replicas != 0) continue;
          for (bool drop_last : {false, true}) {
            if (tail == DistributedTail::kUneven && drop_last) continue;
            for (bool shuffle : {false, true}) {
              const std::string what = "n=" + std::to_string(n) + " G=" + std::to_string(global) +
                                       " N=" + std::to_string(replicas) + " tail " +
                                       DistributedTailName(tail) +
                                       " drop_last=" + std::to_string(drop_last);
              std::vector<std::vector<std::vector<int64_t>>> per_rank;
              size_t most = 0;
              for (int r = 0; r < replicas; ++r) {
                DistributedBatchSampler s = Global(n, global, replicas, r, shuffle, drop_last, tail);
                per_rank.push_back(Pass(s));
                ASSERT_EQ(static_cast<int64_t>(per_rank.back().size()), s.num_batches()) << what;
                most = std::max(most, per_rank.back().size());
                const int64_t share = global / replicas + (r < global % replicas ? 1 : 0);
                for (size_t k = 0; k < per_rank.back().size(); ++k) {
                  const auto& b = per_rank.back()[k];
                  // Full global batches give the rank its share; only the tail differs.
                  if (tail == DistributedTail::kWrapGlobalBatch || k + 1 < per_rank.back().size()) {
                    ASSERT_EQ(static_cast<int64_t>(b.size()), share) << what << " rank " << r;
                  }
                  ASSERT_TRUE(!b.empty() && static_cast<int64_t>(b.size()) <= share) << what;
                }
              }
              if (tail == DistributedTail::kPaddle) {
                // N divides G: the same batches as batch_size G/N.
                for (int r = 0; r < replicas; ++r) {
                  DistributedBatchSampler b = Tailed(n, global / replicas, replicas, r, shuffle,
                                                     drop_last, DistributedTail::kPaddle);
                  ASSERT_EQ(per_rank[r], Pass(b)) << what;
                }
                ++checked;
                continue;
              }
              DistributedBatchSampler one = Global(n, global, 1, 0, shuffle, drop_last, tail);
              const auto expected = Pass(one);
              ASSERT_EQ(most, expected.size()) << what;
              for (size_t k = 0; k < most; ++k) {
                std::vector<int64_t> joined;
                for (int r = 0; r < replicas; ++r) {
                  if (k < per_rank[r].size()) {
                    joined.insert(joined.end(), per_rank[r][k].begin(), per_rank[r][k].end());
                  }
                }
                ASSERT_EQ(joined, expected[k]) << what << " batch " << k;
              }
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 1000);
  // 64 over 3 ranks: 22, 21, 21, contiguous.
  for (int r = 0; r < 3; ++r) {
    DistributedBatchSampler s =
        Global(200, 64, 3, r, false, false, DistributedTail::kWrapGlobalBatch);
    const auto batches = Pass(s);
    ASSERT_EQ(batches.size(), 4u);
    const int64_t first = r == 0 ? 0 : 22 + 21 * (r - 1);
    std::vector<int64_t> expected(r == 0 ? 22 : 21);
    std::iota(expected.begin(), expected.end(), first);
    EXPECT_EQ(batches[0], expected) << "rank " << r;
  }
}

// N dividing G gives exactly the batches of batch_size G/N (the run without
// global_batch_size), and the same batch_size alongside is accepted.
TEST(DistributedGlobalBatchTest, DividedGlobalBatchIsThePerRankBatch) {
  for (int replicas : {1, 2, 4}) {
    for (int r = 0; r < replicas; ++r) {
      DistributedBatchSampler plain(50, 3, replicas, r, true, false, 7);
      DistributedBatchSampler global(DistributedOptions{.dataset_size = 50,
                                                        .global_batch_size = 3 * replicas,
                                                        .num_replicas = replicas,
                                                        .rank = r,
                                                        .seed = 7});
      DistributedBatchSampler both = Global(50, 3 * replicas, replicas, r, true, false,
                                            DistributedTail::kWrapGlobalBatch, /*batch=*/3);
      EXPECT_EQ(Pass(global), Pass(plain));
      DistributedBatchSampler seed5(50, 3, replicas, r, true, false, 5);
      EXPECT_EQ(Pass(both), Pass(seed5));
    }
  }
}

// 4 ranks shrink to 3 with G = 8 (2, 2, 2, 2 -> 3, 3, 2): restored at the same
// (epoch, position), the 3 ranks take the samples the 4 would have taken.
TEST(DistributedGlobalBatchTest, ShrunkWorldResumesOnTheSameSamples) {
  std::vector<int64_t> four, three;
  for (int r = 0; r < 4; ++r) {
    DistributedBatchSampler s = Global(40, 8, 4, r, true, false, DistributedTail::kWrapGlobalBatch);
    s.set_state({2, 3});
    for (const auto& b : Pass(s)) four.insert(four.end(), b.begin(), b.end());
  }
  for (int r = 0; r < 3; ++r) {
    DistributedBatchSampler s = Global(40, 8, 3, r, true, false, DistributedTail::kWrapGlobalBatch);
    s.set_state({2, 3});
    const auto batches = Pass(s);
    ASSERT_EQ(batches.size(), 2u);
    EXPECT_EQ(batches[0].size(), r < 2 ? 3u : 2u);
    for (const auto& b : batches) three.insert(three.end(), b.begin(), b.end());
  }
  std::sort(four.begin(), four.end());
  std::sort(three.begin(), three.end());
  EXPECT_EQ(four.size(), 16u);
  EXPECT_EQ(four, three);
}

std::string ErrorOf(const DistributedOptions& options) {
  try {
    DistributedBatchSampler s(options);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(DistributedGlobalBatchTest, RefusesContradictionsNamingTheValues) {
  const std::string fewer = ErrorOf({.dataset_size = 10, .global_batch_size = 2, .num_replicas = 3});
  EXPECT_NE(fewer.find("global batch size 2 is smaller than the 3 replicas"), std::string::npos)
      << fewer;
  const std::string contradicts = ErrorOf(
      {.dataset_size = 10, .batch_size = 4, .global_batch_size = 8, .num_replicas = 3});
  EXPECT_NE(contradicts.find("batch size 4 per rank contradicts global batch size 8 over 3 "
                             "replicas"),
            std::string::npos)
      << contradicts;
  const std::string uneven_batch = ErrorOf(
      {.dataset_size = 10, .batch_size = 2, .global_batch_size = 7, .num_replicas = 3});
  EXPECT_NE(uneven_batch.find("batch size 2 per rank contradicts global batch size 7"),
            std::string::npos)
      << uneven_batch;
  const std::string paddle = ErrorOf({.dataset_size = 10,
                                      .global_batch_size = 8,
                                      .num_replicas = 3,
                                      .tail = DistributedTail::kPaddle});
  EXPECT_NE(paddle.find("tail 'paddle'"), std::string::npos) << paddle;
  EXPECT_NE(paddle.find("global batch size 8 does not divide by 3 replicas"), std::string::npos)
      << paddle;
  const std::string neither = ErrorOf({.dataset_size = 10, .num_replicas = 2});
  EXPECT_NE(neither.find("batch size 0 and global batch size 0"), std::string::npos) << neither;
  const std::string no_replicas = ErrorOf({.dataset_size = 10, .batch_size = 2, .num_replicas = 0});
  EXPECT_NE(no_replicas.find("num_replicas 0: must be at least 1"), std::string::npos)
      << no_replicas;
  const std::string negative = ErrorOf({.dataset_size = 10, .global_batch_size = -4});
  EXPECT_NE(negative.find("global batch size -4"), std::string::npos) << negative;
  const std::string uneven_drop = ErrorOf({.dataset_size = 10,
                                           .global_batch_size = 8,
                                           .num_replicas = 3,
                                           .drop_last = true,
                                           .tail = DistributedTail::kUneven});
  EXPECT_NE(uneven_drop.find("global batch size 8"), std::string::npos) << uneven_drop;
  EXPECT_EQ(ErrorOf({.dataset_size = 10, .global_batch_size = 3, .num_replicas = 3}), "(accepted)");
}

}  // namespace
}  // namespace tandem::data
