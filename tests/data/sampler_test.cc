#include "data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
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

}  // namespace
}  // namespace tandem::data
