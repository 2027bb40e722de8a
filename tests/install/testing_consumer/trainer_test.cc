// trainer_test: a user's GoogleTest tests of their own training function,
// built against the installed package (tests/install/CMakeLists.txt builds and
// runs it): it matches one rank on 2 and 4 ranks, a hang on one rank is ended
// by the watchdog naming that rank, and a deliberate bug is caught at its step.
#include <string>

#include "gtest/gtest.h"
#include "nn/nn.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "testing/gtest/assertions.h"
#include "testing/testing.h"

namespace {

namespace nn = ::tandem::nn;
namespace dist = ::tandem::dist;
namespace tt = ::tandem::testing;

struct Regressor : nn::Module {
  Regressor()
      : l1(register_module("l1", nn::Linear(4, 16))),
        l2(register_module("l2", nn::Linear(16, 1))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

// The user's training function: one global batch of 32 per step, drawn alike
// on every rank; each rank trains on its part. `bug_on_ranks`: with several
// ranks, step 2's update is skipped (a deliberate bug).
absl::Status Train(dist::Context& ctx, tt::StepLog& log, bool bug_on_ranks) {
  Regressor net;
  dist::DataParallel dp(net, ctx);
  tandem::optim::Adam adam(net.parameters(), {.lr = 1e-2});
  for (int step = 0; step < 6; ++step) {
    nn::Tensor x, y;
    {
      tt::SameOnEveryRank shared(/*seed=*/42, step);
      x = nn::randn({32, 4});
      y = nn::randn({32, 1});
    }
    nn::Tensor loss = nn::mse_loss(dp(ctx.split(x)), ctx.split(y));
    loss.backward();
    if (!(bug_on_ranks && ctx.world_size() > 1 && step == 2)) adam.step();
    adam.zero_grad();
    RETURN_IF_ERROR(log.EndStep(loss, net));
  }
  return absl::OkStatus();
}

tt::TrainingFunction Trainer(bool bug) {
  return [bug](dist::Context& ctx, tt::StepLog& log) { return Train(ctx, log, bug); };
}

TEST(TrainerTest, MatchesOneRank) {
  EXPECT_TRUE(tt::EquivalentToOneRank(Trainer(false), {.ranks = 2}));
  EXPECT_TRUE(tt::EquivalentToOneRank(Trainer(false), {.ranks = 4}));
}

TEST(TrainerTest, DeliberateBugIsFoundAtItsStep) {
  tt::EquivalenceReport report;
  absl::Status s = tt::CheckEquivalence(Trainer(true), {.ranks = 2}, &report);
  ASSERT_FALSE(s.ok());
  ASSERT_TRUE(report.first_difference.has_value()) << s;
  EXPECT_EQ(report.first_difference->step, 2) << s;
  EXPECT_EQ(report.first_difference->what, "l1.weight") << s;
}

TEST(TrainerTest, HangOnOneRankIsEndedByTheWatchdog) {
  tt::RunOptions options{.ranks = 2,
                         .faults = {{.action = tt::FaultAction::kHang, .rank = 1, .step = 3}}};
  options.spawn.timeout_s = 0.5;
  tt::RunReport report;
  absl::Status s = tt::RunRanks(Trainer(false), options, &report);
  EXPECT_TRUE(tt::StatusIs(s, absl::StatusCode::kDeadlineExceeded, "rank 1 (cpu): last completed"));
  EXPECT_LT(report.seconds, 10.0);
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].outcome, "cancelled by the stop");
}

}  // namespace
