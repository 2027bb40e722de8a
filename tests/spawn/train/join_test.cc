// DataParallel::join() on in-process CPU ranks: ranks with 10, 10 and 7 batches
// (of unequal sizes) train as one rank on the union of each step's batches, with
// and without SyncBatchNorm; an error inside the loop still fails the run at
// once; a collective that is not joinable, and a rank with no step, are one error.
// ZeroRedundancyOptimizer and comm hooks inside join(): join_zero_hooks_test.cc.
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/nn.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/join_net.h"
#include "tests/spawn/train/sync_bn_net.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using ::tandem::testing::ScaledError;

class JoinTest : public ::testing::Test {
 protected:
  SpawnOptions options_{.timeout_s = 60, .seed = 7, .console = &console_};
  std::ostringstream console_;
};

template <typename Net>
void ExpectUnevenMatchesOneRank(const SpawnOptions& options, bool sync, const char* what) {
  const int world = 3;
  auto one = spawn([&](Context& ctx) { return TrainUneven<Net>(ctx, world, true, false); }, 1,
                   "cpu", options);
  auto many = spawn([&](Context& ctx) { return TrainUneven<Net>(ctx, world, false, sync); }, world,
                    "cpu", options);
  ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
  const Plan plan = MakePlan(world);
  for (int r = 0; r < world; ++r) {
    const JoinRun& run = (*many)[r];
    const double params = ScaledError(run.params, (*one)[0].params);
    const double buffers = ScaledError(run.buffers, (*one)[0].buffers);
    std::printf("join, %s, 3 ranks with 10/10/7 steps vs 1 rank on each step's union, rank %d: "
                "max relative difference parameters %.3g, buffers %.3g\n",
                what, r, params, buffers);
    EXPECT_LE(params, 1e-5) << what << " rank " << r;
    EXPECT_LE(buffers, 1e-5) << what << " rank " << r;
    ASSERT_EQ(run.step_samples.size(), static_cast<size_t>(StepsOf(r, world)));
    for (int s = 0; s < StepsOf(r, world); ++s) {
      EXPECT_EQ(run.step_samples[s], plan.rows[s][world - 1].second - plan.rows[s][0].first)
          << "step " << s;
    }
  }
}

TEST_F(JoinTest, UnevenStepsTrainAsOneRankOnEachStepsUnion) {
  ExpectUnevenMatchesOneRank<PlainNet>(options_, false, "conv + linear");
}

TEST_F(JoinTest, UnevenStepsWithSyncBatchNormTrainAsOneRank) {
  ExpectUnevenMatchesOneRank<BnNet>(options_, true, "SyncBatchNorm");
}

// Rank 1 throws in its third step; the others are in their step's collectives
// or joined: the run ends with rank 1's error long before the 60 s timeout.
TEST_F(JoinTest, ErrorInsideTheLoopFailsTheRunAtOnce) {
  const auto start = std::chrono::steady_clock::now();
  auto result = spawn([](Context& ctx) {
    PlainNet net;
    DataParallel dp(net, ctx);
    auto join = dp.join();
    for (int s = 0; s < (ctx.rank() == 2 ? 1 : 5); ++s) {
      if (ctx.rank() == 1 && s == 2) throw std::runtime_error("rank 1's own failure");
      nn::sum(dp(nn::randn({2, 2, 5, 5}))).backward();
    }
  }, 3, "cpu", options_);
  const double seconds = ::tandem::testing::SecondsSince(start);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(std::string(result.message()).find("rank 1's own failure"), std::string::npos)
      << result;
  EXPECT_LT(seconds, 20) << result;
}

TEST_F(JoinTest, CollectiveThatIsNotJoinableIsOneErrorOnEveryRank) {
  auto result = spawn([](Context& ctx) {
    PlainNet net;
    DataParallel dp(net, ctx);
    auto join = dp.join();
    for (int s = 0; s < (ctx.rank() == 0 ? 3 : 4); ++s) {
      Tensor loss = nn::sum(dp(nn::randn({2, 2, 5, 5})));
      loss.backward();
      Tensor logged = loss.detach().clone();
      ctx.communicator().all_reduce(logged);  // not through the guard
    }
  }, 2, "cpu", options_);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(std::string(result.message())
                .find("DataParallel::join: rank 0 made 1 collective(s) in a step that a rank "
                      "whose data ran out cannot answer"),
            std::string::npos)
      << result;
}

// A collective of the active rank's own after the other rank joined (a
// checkpoint's save at a stop signal, here an all_gather at its last step
// only, so no earlier step counted it): the mismatch names the join's step
// agreement, in which the joined rank waits, and says what to do.
TEST_F(JoinTest, ACollectiveAfterARankJoinedNamesTheJoinsAgreement) {
  auto result = spawn([](Context& ctx) {
    PlainNet net;
    DataParallel dp(net, ctx);
    auto join = dp.join();
    const int steps = ctx.rank() == 0 ? 2 : 4;
    for (int s = 0; s < steps; ++s) {
      nn::sum(dp(nn::randn({2, 2, 5, 5}))).backward();
      if (s == 3) {
        ctx.communicator().all_gather(nn::zeros({3}, {.dtype = nn::kInt64}));
      }
    }
  }, 2, "cpu", options_);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(std::string(result.message())
                .find("from DataParallel::join's step agreement (a rank whose data ran out "
                      "answers only the other ranks' DataParallel steps"),
            std::string::npos)
      << result;
}

TEST_F(JoinTest, RankWithoutAStepIsOneErrorAndBadUsesAreRefused) {
  auto result = spawn([](Context& ctx) {
    PlainNet net;
    DataParallel dp(net, ctx);
    auto join = dp.join();
    for (int s = 0; s < (ctx.rank() == 1 ? 0 : 2); ++s) nn::sum(dp(nn::randn({2, 2, 5, 5}))).backward();
  }, 2, "cpu", options_);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(std::string(result.message())
                .find("rank 1 ran out of data before its first step inside join()"),
            std::string::npos)
      << result;
  auto refused = spawn([](Context& ctx) {
    PlainNet net;
    DataParallel dp(net, ctx);
    std::vector<std::string> errors;
    {
      auto sync_off = dp.no_sync();
      errors.push_back(::tandem::testing::ErrorOf([&] { auto j = dp.join(); }));
    }
    auto join = dp.join();
    errors.push_back(::tandem::testing::ErrorOf([&] { auto j = dp.join(); }));
    errors.push_back(::tandem::testing::ErrorOf([&] { auto n = dp.no_sync(); }));
    Tensor t = nn::ones({1});
    errors.push_back(::tandem::testing::ErrorOf([&] { join.all_reduce(t, ReduceOp::kMax); }));
    nn::sum(dp(nn::randn({2, 2, 5, 5}))).backward();
    return errors;
  }, 2, "cpu", options_);
  ASSERT_TRUE(refused.ok()) << refused.status();
  const std::vector<std::string>& e = (*refused)[0];
  EXPECT_NE(e[0].find("join() needs gradients reduced in backward"), std::string::npos) << e[0];
  EXPECT_NE(e[1].find("join() inside join()"), std::string::npos) << e[1];
  EXPECT_EQ(e[2], "") << "accumulation inside join() works (compose_test.cc)";
  EXPECT_NE(e[3].find("only a sum is joinable"), std::string::npos) << e[3];
}

}  // namespace
}  // namespace tandem::dist
