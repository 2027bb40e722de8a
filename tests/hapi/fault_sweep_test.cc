// A fault at every collective of a whole fit (start-up broadcasts, training
// steps, periodic checkpoint saves, evaluation, the final save): whatever the
// collective, the run ends within seconds with a status naming the faulty rank,
// never a hang and never a crash; under a restart policy it restarts once and
// ends with the fault-free run's losses.
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/layers.h"
#include "nn/nn.h"
#include "optim/adam.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"
#include "tests/hapi/step_log_callback.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;

// fit with evaluation every epoch and a checkpoint every 2 steps, inside a
// rank's function; each step is reported to the StepLog.
absl::Status FitWithEvaluationAndCheckpoints(const std::string& dir, dist::Context& ctx,
                                             testing::StepLog& log) {
  Model model([] { return std::make_shared<Net>(); });
  model.prepare(
      [](std::vector<nn::Tensor> params) {
        return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = 1e-2});
      },
      CrossEntropy(), {MakeMetric<Accuracy>()});
  auto h = model.fit(testing::Classification(16, 10),
                     {.epochs = 2,
                      .batch_size = 8 / ctx.world_size(),
                      .seed = 3,
                      .eval_data = testing::Classification(6, 11),
                      .checkpoint = {.dir = dir, .every_steps = 2},
                      .callbacks = {testing::StepLogReport(&log)}});
  return h.status();
}

// Per process: ctest runs each case as a process of its own, several at once,
// and the cases' checkpoints must not meet (one run would resume from another's).
std::string FreshDir(const std::string& name) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/fault_sweep_", getpid(), "_", name);
  std::filesystem::remove_all(dir);
  return dir;
}

// Each action at rank `rank`'s collective n, for every `stride`-th n the fit
// reaches (from 1).
void SweepEveryCollective(testing::FaultAction action, int rank, uint64_t stride = 1) {
  uint64_t fired = 0;
  for (uint64_t n = 1; n < 400; n += stride) {
    const std::string dir = FreshDir(absl::StrCat(testing::FaultActionName(action), "_", rank));
    testing::RunOptions options{.ranks = 2, .record_parameters = false, .hang_limit_s = 20};
    options.spawn.timeout_s = 1;
    options.faults = {{.action = action, .rank = rank, .collective = n,
                       .error = absl::InternalError("injected")}};
    testing::RunReport report;
    const absl::Status s = testing::RunRanks(
        [&dir](dist::Context& ctx, testing::StepLog& log) {
          return FitWithEvaluationAndCheckpoints(dir, ctx, log);
        },
        options, &report);
    if (report.faults.empty()) {  // past the fit's last collective
      EXPECT_TRUE(s.ok()) << s;
      break;
    }
    ++fired;
    const std::string where = absl::StrCat(testing::FaultActionName(action), " at rank ", rank,
                                           ", collective ", n, " (", report.faults[0].where, ")");
    EXPECT_FALSE(s.ok()) << where;
    EXPECT_NE(s.message().find(absl::StrCat("rank ", rank)), absl::string_view::npos)
        << where << ": " << s;
    // A throw or an error: at once; a hang: the 1 s watchdog, then the stop.
    EXPECT_LT(report.seconds, 5.0) << where << ": " << s;
  }
  EXPECT_GT(fired * stride, 20u) << "the fit's collectives were not reached";
  std::cout << testing::FaultActionName(action) << " at rank " << rank << ": " << fired
            << " collectives, each ending the run\n";
  std::filesystem::remove_all(FreshDir(absl::StrCat(testing::FaultActionName(action), "_", rank)));
}

TEST(FaultSweepTest, ThrowAtEveryCollectiveEndsTheRunNamingTheRank) {
  SweepEveryCollective(testing::FaultAction::kThrow, 0);
  SweepEveryCollective(testing::FaultAction::kThrow, 1);
}

TEST(FaultSweepTest, AsyncErrorAtEveryCollectiveEndsTheRunNamingTheRank) {
  SweepEveryCollective(testing::FaultAction::kReturnError, 1);
}

// Each hang waits for the 1 s watchdog: every third collective.
TEST(FaultSweepTest, HangAtEveryThirdCollectiveEndsAfterTheTimeoutNamingTheRank) {
  SweepEveryCollective(testing::FaultAction::kHang, 1, /*stride=*/3);
}


// The same faults under a restart policy: every one restarts once from the
// newest snapshot and the fit ends with the fault-free run's losses, bit for
// bit. An asynchronous error in the last ~100 ms of a run is found after every
// rank's function has returned (the watchdog polls every min(timeout_s / 10,
// 100 ms); this whole fit takes a few ms, so here every one is): it restarts
// too, rather than ending the run as if one rank had gone on past the others.
void SweepEveryCollectiveWithARestart(testing::FaultAction action) {
  const std::string dir = FreshDir("restart");
  auto fit = [&dir](dist::Context& ctx, testing::StepLog& log) {
    return FitWithEvaluationAndCheckpoints(dir, ctx, log);
  };
  testing::RunOptions options{.ranks = 2, .record_parameters = false, .hang_limit_s = 20};
  options.spawn.timeout_s = 1;
  options.spawn.restart = {.max_restarts = 1};
  testing::RunReport clean;
  ASSERT_TRUE(testing::RunRanks(fit, options, &clean).ok());
  int fired = 0;
  for (uint64_t n = 1; n < 400; ++n) {
    std::filesystem::remove_all(dir);
    options.faults = {{.action = action, .rank = 1, .collective = n,
                       .error = absl::InternalError("injected")}};
    testing::RunReport report;
    const absl::Status s = testing::RunRanks(fit, options, &report);
    if (report.faults.empty()) break;
    ++fired;
    const std::string where = absl::StrCat(testing::FaultActionName(action), " at collective ", n,
                                           " (", report.faults[0].where, ")");
    EXPECT_TRUE(s.ok()) << where << ": " << s << "\n" << report.log;
    EXPECT_EQ(report.attempts, 2) << where;
    EXPECT_LT(report.seconds, 5.0) << where;
    for (int r = 0; r < 2; ++r) EXPECT_EQ(report.ranks[r].losses, clean.ranks[r].losses) << where;
  }
  EXPECT_GT(fired, 20) << "the fit's collectives were not reached";
  std::cout << testing::FaultActionName(action) << " at rank 1 under a restart policy: " << fired
            << " collectives, each restarted once\n";
  std::filesystem::remove_all(dir);
}

TEST(FaultSweepTest, UnderARestartPolicyEveryThrowRestartsOnce) {
  SweepEveryCollectiveWithARestart(testing::FaultAction::kThrow);
}

TEST(FaultSweepTest, UnderARestartPolicyEveryAsyncErrorRestartsOnce) {
  SweepEveryCollectiveWithARestart(testing::FaultAction::kReturnError);
}

}  // namespace
}  // namespace tandem::hapi
