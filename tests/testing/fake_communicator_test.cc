// testing::FakeGroup / FakeAsyncCommunicator through testing::RunRanks: collectives
// that complete late (the group's delay) and never (HoldFrom), as a user's own
// shutdown handling meets them; seeds (testing/seed.h).
#include "testing/fake_communicator.h"

#include <chrono>
#include <set>

#include "gtest/gtest.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "testing/run.h"
#include "testing/seed.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

// Three all-reduces through a device that takes 100 ms each: right values,
// at least 300 ms.
TEST(FakeCommunicatorTest, CollectivesCompleteLate) {
  auto group = std::make_shared<FakeGroup>(2, std::chrono::milliseconds(100));
  RunReport report;
  absl::Status s = RunRanks(
      [](dist::Context& ctx, StepLog& log) -> absl::Status {
        nn::Tensor x = nn::full({3}, static_cast<double>(ctx.rank() + 1));
        for (int i = 0; i < 3; ++i) {
          std::shared_ptr<dist::Work> work = ctx.communicator().all_reduce_async(x);
          work->wait();
          RETURN_IF_ERROR(log.EndStep(x.to_vector<float>()[0]));
        }
        return absl::OkStatus();
      },
      {.ranks = 2, .fake_group = group}, &report);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GE(report.seconds, 0.3);
  EXPECT_EQ(report.ranks[1].losses, (std::vector<double>{3, 6, 12}));
  EXPECT_EQ(group->completed(), 3);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(group->abort_calls(r), 0);
}

// The second collective never completes: the user's wait on it is ended by
// the stop (CancelledError, which the function below catches to clean up, as
// a program's shutdown path would, and rethrows), the watchdog names the
// collective, and every fake communicator was aborted once.
TEST(FakeCommunicatorTest, CollectiveThatNeverCompletesIsTimedOutAndAborted) {
  auto group = std::make_shared<FakeGroup>(2);
  group->HoldFrom(2);
  std::atomic<int> cleaned_up{0};
  RunOptions options{.ranks = 2, .fake_group = group};
  options.spawn.timeout_s = 0.5;
  absl::Status s = RunRanks(
      [&](dist::Context& ctx, StepLog&) -> absl::Status {
        nn::Tensor x = nn::ones({4});
        ctx.communicator().all_reduce(x);
        try {
          ctx.communicator().all_reduce(x);
        } catch (const dist::CancelledError&) {
          cleaned_up.fetch_add(1);
          throw;
        }
        return absl::OkStatus();
      },
      options);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 0 (cpu): waiting in all_reduce #2"), absl::string_view::npos)
      << s;
  EXPECT_EQ(cleaned_up.load(), 2);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(group->abort_calls(r), 1) << "rank " << r;
  EXPECT_EQ(group->completed(), 1);
}

// Faults and fakes together: the fault wraps the fake.
TEST(FakeCommunicatorTest, FaultsApplyOverTheFake) {
  auto group = std::make_shared<FakeGroup>(2);
  RunOptions options{.ranks = 2,
                     .faults = {{.action = FaultAction::kThrow,
                                 .rank = 1,
                                 .collective = 2,
                                 .error = absl::InternalError("lost")}},
                     .fake_group = group};
  absl::Status s = RunRanks(
      [](dist::Context& ctx, StepLog&) -> absl::Status {
        nn::Tensor x = nn::ones({4});
        for (int i = 0; i < 3; ++i) ctx.communicator().all_reduce(x);
        return absl::OkStatus();
      },
      options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 (cpu) threw: lost"), absl::string_view::npos) << s;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(group->abort_calls(r), 1) << "rank " << r;
}

TEST(FakeCommunicatorTest, GroupOfAnotherSizeIsRefused) {
  absl::Status s = RunRanks([](dist::Context&, StepLog&) { return absl::OkStatus(); },
                       {.ranks = 3, .fake_group = std::make_shared<FakeGroup>(2)});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("fake_group has 2 ranks; the run has 3"), absl::string_view::npos)
      << s;
}

// --- Seeds ---------------------------------------------------------------------

TEST(SeedTest, DeriveSeedSeparatesItsParts) {
  std::set<uint64_t> seen;
  for (uint64_t step = 0; step < 100; ++step) seen.insert(DeriveSeed(7, {step}));
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(DeriveSeed(7, {3, 4}), DeriveSeed(7, {3, 4}));
  EXPECT_NE(DeriveSeed(7, {3, 4}), DeriveSeed(7, {4, 3}));
  EXPECT_NE(DeriveSeed(7, {}), DeriveSeed(8, {}));
}

// A ScopedSeed's draws leave the thread's own stream where it was.
TEST(SeedTest, ScopedSeedRestoresTheThreadsGenerator) {
  nn::manual_seed(1, 2);
  const std::vector<float> a = nn::randn({4}).to_vector<float>();
  const std::vector<float> b = nn::randn({4}).to_vector<float>();
  nn::manual_seed(1, 2);
  EXPECT_EQ(nn::randn({4}).to_vector<float>(), a);
  std::vector<float> inside;
  {
    ScopedSeed scope(99);
    inside = nn::randn({4}).to_vector<float>();
  }
  EXPECT_EQ(nn::randn({4}).to_vector<float>(), b);
  EXPECT_NE(inside, a);
}

// SameOnEveryRank: every rank draws the same batch; the ranks' own streams differ.
TEST(SeedTest, SameOnEveryRankDrawsAlikeOnEveryRank) {
  RunReport report;
  absl::Status s = RunRanks(
      [](dist::Context& ctx, StepLog& log) -> absl::Status {
        double shared, own;
        {
          SameOnEveryRank scope(3, /*step=*/0);
          shared = nn::randn({1}).item();
        }
        own = nn::randn({1}).item();
        RETURN_IF_ERROR(log.EndStep(shared));
        return log.EndStep(own);
      },
      {.ranks = 3}, &report);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(report.ranks[1].losses[0], report.ranks[0].losses[0]);
  EXPECT_EQ(report.ranks[2].losses[0], report.ranks[0].losses[0]);
  EXPECT_NE(report.ranks[1].losses[1], report.ranks[0].losses[1]);
  EXPECT_NE(report.ranks[0].losses[1], report.ranks[0].losses[0]);
}

TEST(SeedTest, ScopedDeterminismTurnsTf32OffAndBack) {
  nn::set_allow_tf32(true);
  {
    ScopedDeterminism determinism;
    EXPECT_FALSE(nn::allow_tf32());
  }
  EXPECT_TRUE(nn::allow_tf32());
  nn::set_allow_tf32(false);
}

}  // namespace
}  // namespace tandem::testing
