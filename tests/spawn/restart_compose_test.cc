// In-process restarts (SpawnOptions::restart) combined with DataParallel's
// uneven-input mode (join()) on CPU ranks: a fault inside the guard, thrown or
// returned, restarts from the snapshot and ends with the bits of the run
// without it; a snapshot after a rank's last batch cannot resume inside the
// guard and fails every attempt, naming the rank.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "data/sampler.h"
#include "gtest/gtest.h"
#include "nn/ops/index.h"
#include "nn/ops/loss.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint.h"
#include "testing/run.h"
#include "tests/testing/same_bits.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

bool Contains(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

// 3 ranks, 2 rows each a step, DistributedTail::kUneven over 38 rows: ranks 0
// and 1 run 7 steps, rank 2 runs 6 (its last share is empty) and answers the
// others' 7th inside the guard. A snapshot after every step; the loop leaves
// the guard through finish() only when no step failed.
constexpr int64_t kRows = 38;
absl::Status TrainInsideJoin(dist::Context& ctx, StepLog& log) {
  nn::Tensor data_x, data_y;
  {
    SameOnEveryRank shared(/*seed=*/11, /*step=*/0);
    data_x = nn::randn({kRows, 6});
    data_y = nn::randn({kRows, 1});
  }
  Mlp net;
  dist::DataParallel dp(net, ctx);
  optim::SGD sgd(net.parameters(), {.lr = 0.05, .momentum = 0.9});
  data::DistributedBatchSampler sampler({.dataset_size = kRows, .batch_size = 2,
                                         .num_replicas = ctx.world_size(), .rank = ctx.rank(),
                                         .seed = 5, .tail = data::DistributedTail::kUneven});
  int64_t step = 0;
  dist::TrainingState state{.model = &net, .optimizer = &sgd, .sampler = &sampler, .step = &step};
  ASSIGN_OR_RETURN(const bool restored, dist::RestoreSnapshot(ctx, state));
  if (!restored) sampler.reset();
  auto join = dp.join();
  while (std::optional<std::vector<int64_t>> batch = sampler.next()) {
    const nn::Tensor rows = nn::from_vector<int64_t>(*batch, {static_cast<int64_t>(batch->size())},
                                                     {.dtype = nn::kInt64});
    nn::Tensor loss = nn::mse_loss(dp(nn::index_select(data_x, rows)),
                                   nn::index_select(data_y, rows));
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    RETURN_IF_ERROR(dist::SaveSnapshot(ctx, state));
    RETURN_IF_ERROR(log.EndStep(loss.item(), net));  // an injected fault fires here
  }
  return join.finish();
}

RunOptions JoinOptions(std::vector<Fault> faults) {
  RunOptions options{.ranks = 3, .faults = std::move(faults)};
  options.spawn.timeout_s = 30;
  options.spawn.restart = {.max_restarts = 2};
  return options;
}

// A rank that returns an error inside the guard leaves through the guard's
// end, which answers the others' steps until their data runs out, so the
// other ranks return OK before the failing one does. That is the rank's own
// failure after the same collectives as its peers, not ranks running
// different steps: the run restarts and ends as the run without the fault.
TEST(RestartComposeTest, ErrorReturnedInsideJoinRestarts) {
  RunReport reference;
  ASSERT_TRUE(RunRanks(TrainInsideJoin, JoinOptions({}), &reference).ok());
  ASSERT_EQ(reference.ranks[0].losses.size(), 7u);
  ASSERT_EQ(reference.ranks[2].losses.size(), 6u);
  for (const int fault_rank : {0, 1}) {
    SCOPED_TRACE(fault_rank);
    RunReport report;
    absl::Status s = RunRanks(TrainInsideJoin,
                              JoinOptions({{.action = FaultAction::kReturnError,
                                            .rank = fault_rank, .step = 3,
                                            .error = absl::DataLossError("disk gone")}}),
                              &report);
    ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
    EXPECT_EQ(report.attempts, 2);
    EXPECT_TRUE(Contains(report.log, absl::StrCat("spawn: restart 1 of 2 after: rank ",
                                                  fault_rank, " (cpu) returned: DATA_LOSS: "
                                                  "disk gone")))
        << report.log;
    EXPECT_FALSE(Contains(report.log, "not restarting")) << report.log;
    ExpectSameLossesAndParameters(reference, report);
  }
}

// A joined rank answers the others' steps by replaying its own last step, so
// every rank needs a step inside the guard. A snapshot stored after rank 2's
// last batch (step 6; ranks 0 and 1 run a 7th) leaves rank 2 none on the
// attempt that resumes from it: every attempt fails on every rank with the
// join's error naming rank 2, and the run gives up (no hang).
TEST(RestartComposeTest, ResumingInsideJoinAfterARanksLastBatchFailsNamingIt) {
  RunReport report;
  absl::Status s = RunRanks(TrainInsideJoin,
                            JoinOptions({{.action = FaultAction::kThrow, .rank = 0, .step = 6}}),
                            &report);
  EXPECT_EQ(report.attempts, 3);
  EXPECT_TRUE(Contains(s.message(), "spawn: gave up after 2 restarts")) << s;
  EXPECT_TRUE(Contains(s.message(), "DataParallel::join: rank 2 ran out of data before its "
                                    "first step inside join()"))
      << s;
  EXPECT_TRUE(Contains(s.message(), "; this attempt of a restarted run resumes from the snapshot "
                                    "of step 6: a snapshot stored after a rank's last batch "
                                    "leaves it none"))
      << s;
  EXPECT_TRUE(Contains(report.log, "resumes from the snapshot of step 6")) << report.log;
}

// The rule the join case narrows: a rank that returned OK while a peer went
// on into a collective it never entered is still a program error (uneven
// steps without join()), not restarted.
TEST(RestartComposeTest, ReturnedRankWhileAPeerWaitsStillEndsTheRun) {
  RunReport report;
  RunOptions options = JoinOptions({});
  options.ranks = 2;
  options.spawn.timeout_s = 5;
  absl::Status s = RunRanks(
      [](dist::Context& ctx, StepLog& log) -> absl::Status {
        Mlp net;
        dist::DataParallel dp(net, ctx);
        for (int step = 0; step < (ctx.rank() == 1 ? 2 : 4); ++step) {
          nn::Tensor loss = nn::mse_loss(dp(nn::ones({2, 6})), nn::zeros({2, 1}));
          loss.backward();
          RETURN_IF_ERROR(log.EndStep(loss.item(), net));
        }
        return absl::OkStatus();
      },
      options, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(report.attempts, 1);
  EXPECT_TRUE(Contains(report.log, "spawn: not restarting: local rank 1's function returned"))
      << report.log;
}

}  // namespace
}  // namespace tandem::testing
