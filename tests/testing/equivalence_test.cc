// testing::CheckEquivalence: a data-parallel function matches one rank on 2, 3
// and 4 ranks; a deliberate difference is reported at its step, parameter,
// element and rank; losses, step counts and run failures are reported too.
#include "testing/equivalence.h"

#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

class EquivalenceTest : public ::testing::TestWithParam<int> {};

TEST_P(EquivalenceTest, DataParallelTrainingMatchesOneRank) {
  EquivalenceReport report;
  absl::Status s = CheckEquivalence(TrainWith({}), {.ranks = GetParam()}, &report);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE(report.first_difference.has_value());
  EXPECT_EQ(report.steps_compared, 5);
  ASSERT_EQ(report.n_ranks.ranks.size(), static_cast<size_t>(GetParam()));
  for (const RankRecord& r : report.n_ranks.ranks) {
    ASSERT_EQ(r.losses.size(), 5u);
    ASSERT_EQ(r.parameters[4].size(), 4u);  // l1.weight, l1.bias, l2.weight, l2.bias
    EXPECT_EQ(r.parameters[4][0].name, "l1.weight");
  }
  // The loss fell, so the comparison was made on a run that trained.
  EXPECT_LT(report.one_rank.ranks[0].losses[4], report.one_rank.ranks[0].losses[0]);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EquivalenceTest, ::testing::Values(2, 3, 4));

// Every rank changes l2.bias after step 3's update: steps 0-2 agree, and the
// first difference is step 3, l2.bias element 0, on rank 0 (the first rank
// compared).
TEST(EquivalenceDifferenceTest, DeliberateChangeIsReportedAtItsStepAndParameter) {
  EquivalenceReport report;
  absl::Status s = CheckEquivalence(
      TrainWith({.perturb_step = 3, .perturb_name = "l2.bias", .perturb_by = 1e-3}),
      {.ranks = 2}, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(report.first_difference.has_value());
  const Difference& d = *report.first_difference;
  EXPECT_EQ(d.step, 3);
  EXPECT_EQ(d.what, "l2.bias");
  EXPECT_EQ(d.element, 0);
  EXPECT_EQ(d.rank, 0);
  EXPECT_NEAR(d.n_ranks - d.one_rank, 1e-3, 1e-5);
  EXPECT_NE(s.message().find("2 ranks differ from 1 rank at step 3: parameter l2.bias[0] on "
                             "rank 0"),
            absl::string_view::npos)
      << s;
}

// Only rank 1's l1.weight element 5 changes after step 1: reported on rank 1,
// element 5, step 1 (rank 0 agrees there).
TEST(EquivalenceDifferenceTest, ChangeOnOneRankNamesThatRankAndElement) {
  EquivalenceReport report;
  absl::Status s = CheckEquivalence(TrainWith({.perturb_step = 1,
                                               .perturb_name = "l1.weight",
                                               .perturb_element = 5,
                                               .perturb_rank = 1,
                                               .perturb_by = -2e-3}),
                                    {.ranks = 3}, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(report.first_difference.has_value());
  EXPECT_EQ(report.first_difference->step, 1);
  EXPECT_EQ(report.first_difference->what, "l1.weight");
  EXPECT_EQ(report.first_difference->element, 5);
  EXPECT_EQ(report.first_difference->rank, 1);
  EXPECT_NE(s.message().find("parameter l1.weight[5] on rank 1"), absl::string_view::npos) << s;
}

// Below the tolerance a change is accepted; with atol = rtol = 0 the same
// change is a difference.
TEST(EquivalenceDifferenceTest, ToleranceDecides) {
  const TrainKnobs small{.perturb_step = 2, .perturb_name = "l2.bias", .perturb_by = 2e-6};
  absl::Status within = CheckEquivalence(TrainWith(small), {.ranks = 2, .parameters = {0, 1e-5}});
  EXPECT_TRUE(within.ok()) << within;
  EquivalenceReport report;
  absl::Status s =
      CheckEquivalence(TrainWith(small), {.ranks = 2, .parameters = {0, 0}}, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(report.first_difference.has_value());
  EXPECT_LE(report.first_difference->step, 2);
}

// Without DataParallel nothing broadcasts rank 0's weights (rank 1 starts
// from its own stream's) nor averages gradients: a real non-equivalence,
// found at the first step's loss.
TEST(EquivalenceDifferenceTest, TrainingWithoutDataParallelIsNotEquivalent) {
  EquivalenceReport report;
  absl::Status s =
      CheckEquivalence(TrainWith({.data_parallel = false}), {.ranks = 2}, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(report.first_difference.has_value());
  EXPECT_EQ(report.first_difference->step, 0);
  EXPECT_EQ(report.first_difference->what, "loss");
}

// The ranks' losses are combined (their mean) and compared per step.
TEST(EquivalenceDifferenceTest, LossDifferenceIsReported) {
  EquivalenceReport report;
  absl::Status s = CheckEquivalence(TrainWith({.scale_loss_step = 2}), {.ranks = 2}, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(report.first_difference.has_value());
  EXPECT_EQ(report.first_difference->step, 2);
  EXPECT_EQ(report.first_difference->what, "loss");
  EXPECT_EQ(report.first_difference->rank, -1);
  EXPECT_NE(s.message().find("at step 2: loss (2 ranks' losses combined)"), absl::string_view::npos)
      << s;
  // kSum: the mean loss of every rank summed is twice the one-rank loss.
  absl::Status summed =
      CheckEquivalence(TrainWith({}), {.ranks = 2, .combine_losses = LossCombine::kSum});
  EXPECT_NE(summed.message().find("at step 0: loss"), absl::string_view::npos) << summed;
}

TEST(EquivalenceDifferenceTest, FewerStepsOnNRanksAreReported) {
  EquivalenceReport report;
  absl::Status s = CheckEquivalence(TrainWith({.n_rank_steps = 3}), {.ranks = 2}, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_TRUE(report.first_difference.has_value());
  EXPECT_EQ(report.first_difference->step, 3);
  EXPECT_EQ(report.first_difference->what, "step count");
  EXPECT_NE(s.message().find("3 steps recorded with 2 ranks, 5 with 1"), absl::string_view::npos)
      << s;
}

// A run that fails is returned as that run's failure, its code kept.
TEST(EquivalenceDifferenceTest, FailingRunIsReturnedNamingTheRun) {
  absl::Status s = CheckEquivalence(
      [](dist::Context& ctx, StepLog&) -> absl::Status {
        if (ctx.world_size() > 1 && ctx.rank() == 1) return absl::NotFoundError("no shard 1");
        return absl::OkStatus();
      },
      {.ranks = 2});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("the 2-rank run: rank 1 (cpu) returned"), absl::string_view::npos)
      << s;
}

TEST(EquivalenceDifferenceTest, BadOptionsAreRefused) {
  absl::Status s = CheckEquivalence(TrainWith({}), {.ranks = 0});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("ranks must be at least 1, not 0"), absl::string_view::npos) << s;
  s = CheckEquivalence(TrainWith({}), {.parameters = {-1, 0}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rtol -1"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace tandem::testing
