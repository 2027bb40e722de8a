// testing::RunRanks with faults: each action at a step and at a collective, on CPU
// ranks. A hang is ended by spawn's watchdog within its timeout, naming the
// rank; errors keep their code and name the rank; a slow rank changes nothing
// but the time. Bad faults are refused before anything runs.
#include "testing/faults.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>
#include <thread>

#include "gtest/gtest.h"
#include "testing/internal/fault_plan.h"
#include "testing/run.h"
#include "tests/spawn/inert_communicator.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

bool Contains(const absl::Status& s, absl::string_view part) {
  return s.message().find(part) != absl::string_view::npos;
}

// A run's options with a short watchdog.
RunOptions Options(std::vector<Fault> faults, double timeout_s = 30) {
  RunOptions options{.ranks = 2, .faults = std::move(faults)};
  options.spawn.timeout_s = timeout_s;
  return options;
}

// Rank 1 hangs after step 2; rank 0 goes on into step 3's gradient all-reduce
// and waits there. The watchdog ends the run after timeout_s, names rank 1 as
// the one that never came (its last collective completed, rank 0's waiting),
// and the stop ends the hang.
TEST(FaultsTest, HangAtAStepIsEndedByTheWatchdogWithinTheTimeoutNamingTheRank) {
  constexpr double kTimeoutS = 0.5;
  RunReport report;
  absl::Status s = RunRanks(TrainWith({.steps = 6}),
                       Options({{.action = FaultAction::kHang, .rank = 1, .step = 2}}, kTimeoutS),
                       &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(Contains(s, "a collective did not complete within 0.5 s")) << s;
  EXPECT_TRUE(Contains(s, "rank 0 (cpu): waiting in all_reduce")) << s;
  EXPECT_TRUE(Contains(s, "rank 1 (cpu): last completed")) << s;
  EXPECT_GE(report.seconds, kTimeoutS);
  EXPECT_LT(report.seconds, kTimeoutS + 10) << "the hang outlived the watchdog's timeout";
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].where, "rank 1: step 2");
  EXPECT_EQ(report.faults[0].outcome, "cancelled by the stop");
  EXPECT_GE(report.faults[0].seconds, kTimeoutS * 0.8);
  EXPECT_EQ(report.ranks[1].losses.size(), 3u);  // steps 0, 1, 2
  EXPECT_EQ(report.ranks[0].losses.size(), 3u);  // step 3's all-reduce never completed
  EXPECT_NE(report.log.find("injected hang (rank 1: step 2) ended by the stop"), std::string::npos)
      << report.log;
}

// A hang inside a collective: the rank entered it and stays there, its peer
// waits in it too. (DataParallel's constructor makes 6 collectives for this
// model; collective 8 is step 1's gradient all-reduce.)
TEST(FaultsTest, HangInACollectiveIsEndedByTheWatchdog) {
  RunReport report;
  absl::Status s = RunRanks(TrainWith({}),
                       Options({{.action = FaultAction::kHang, .rank = 0, .collective = 8}}, 0.5),
                       &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(Contains(s, "rank 0 (cpu): waiting in all_reduce_async #8")) << s;
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].where, "rank 0: all_reduce_async #8");
  EXPECT_EQ(report.faults[0].outcome, "cancelled by the stop");
  EXPECT_EQ(report.ranks[0].losses.size(), 1u);  // step 0 only
}

// A hang that nothing stops (the last step: no rank waits for this one) ends
// after hang_limit_s with an error saying so, instead of holding the test.
TEST(FaultsTest, HangThatNoStopEndsIsReportedAfterTheLimit) {
  RunOptions options = Options({{.action = FaultAction::kHang, .rank = 1, .step = 4}});
  options.hang_limit_s = 0.3;
  RunReport report;
  absl::Status s = RunRanks(TrainWith({}), options, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s, "rank 1 (cpu) threw: injected hang (rank 1: step 4) was not "
                          "cancelled within 0.3 s"))
      << s;
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].outcome, "not cancelled");
}

TEST(FaultsTest, ThrowAtAStepFailsTheRunNamingTheRank) {
  RunReport report;
  absl::Status s = RunRanks(TrainWith({}),
                       Options({{.action = FaultAction::kThrow,
                                 .rank = 1,
                                 .step = 1,
                                 .error = absl::InternalError("disk full")}}),
                       &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s, "rank 1 (cpu) threw: disk full")) << s;
  EXPECT_EQ(report.ranks[1].losses.size(), 2u);
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].outcome, "threw");
}

TEST(FaultsTest, ReturnErrorAtAStepKeepsItsCode) {
  absl::Status s = RunRanks(TrainWith({}), Options({{.action = FaultAction::kReturnError,
                                                .rank = 0,
                                                .step = 0,
                                                .error = absl::DataLossError("bad shard")}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_TRUE(Contains(s, "rank 0 (cpu) returned: DATA_LOSS: bad shard")) << s;
}

TEST(FaultsTest, ThrowInACollectiveFailsTheRunNamingTheRank) {
  RunReport report;
  absl::Status s = RunRanks(TrainWith({}),
                       Options({{.action = FaultAction::kThrow,
                                 .rank = 0,
                                 .collective = 7,
                                 .error = absl::InternalError("NIC gone")}}),
                       &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s, "rank 0 (cpu) threw: NIC gone")) << s;
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_NE(report.faults[0].where.find(" #7"), std::string::npos) << report.faults[0].where;
}

// At a collective, a returned error is the communicator's asynchronous error:
// the watchdog fails the run with its code and message, naming the rank, while
// the ranks are still training (the loop would otherwise run for minutes).
TEST(FaultsTest, ReturnErrorAtACollectiveIsAnAsynchronousLibraryError) {
  RunReport report;
  absl::Status s = RunRanks(
      [](dist::Context& ctx, StepLog& log) -> absl::Status {
        nn::Tensor x = nn::ones({4});
        for (int step = 0; step < 100000; ++step) {
          ctx.communicator().all_reduce(x);
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          RETURN_IF_ERROR(log.EndStep(0.0));
        }
        return absl::OkStatus();
      },
      Options({{.action = FaultAction::kReturnError,
                .rank = 1,
                .collective = 3,
                .error = absl::UnavailableError("connection reset by peer")}}),
      &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(Contains(s, "rank 1 (cpu): connection reset by peer")) << s;
  EXPECT_LT(report.seconds, 20);
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].outcome, "reported the error asynchronously");
  EXPECT_GE(report.ranks[1].losses.size(), 2u);  // the steps before the fault
}

// A slow rank, at a step or in a collective, changes the time and nothing
// else: the records are those of a run without the fault, bit for bit.
TEST(FaultsTest, SlowRankChangesOnlyTheTime) {
  RunReport clean, slow;
  ASSERT_TRUE(RunRanks(TrainWith({}), Options({}), &clean).ok());
  absl::Status s = RunRanks(TrainWith({}),
                       Options({{.action = FaultAction::kSlow,
                                 .rank = 1,
                                 .step = 1,
                                 .delay = std::chrono::milliseconds(300)},
                                {.action = FaultAction::kSlow,
                                 .rank = 0,
                                 .collective = 5,
                                 .delay = std::chrono::milliseconds(200)}}),
                       &slow);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GE(slow.seconds, 0.5);
  ASSERT_EQ(slow.faults.size(), 2u);
  for (const FaultEvent& e : slow.faults) EXPECT_EQ(e.outcome, "slept");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(slow.ranks[r].losses, clean.ranks[r].losses) << "rank " << r;
    ASSERT_EQ(slow.ranks[r].parameters.size(), clean.ranks[r].parameters.size());
    for (size_t step = 0; step < clean.ranks[r].parameters.size(); ++step) {
      for (size_t i = 0; i < clean.ranks[r].parameters[step].size(); ++i) {
        EXPECT_EQ(slow.ranks[r].parameters[step][i].values,
                  clean.ranks[r].parameters[step][i].values)
            << "rank " << r << " step " << step;
      }
    }
  }
}

// The same seed gives the same records, bit for bit; another seed other weights.
TEST(FaultsTest, RunsAreDeterministicForASeed) {
  RunReport a, b, c;
  ASSERT_TRUE(RunRanks(TrainWith({}), Options({}), &a).ok());
  ASSERT_TRUE(RunRanks(TrainWith({}), Options({}), &b).ok());
  RunOptions other = Options({});
  other.spawn.seed = 5;
  ASSERT_TRUE(RunRanks(TrainWith({}), other, &c).ok());
  EXPECT_EQ(a.ranks[0].losses, b.ranks[0].losses);
  EXPECT_EQ(a.ranks[1].parameters[4][0].values, b.ranks[1].parameters[4][0].values);
  EXPECT_NE(a.ranks[0].parameters[0][0].values, c.ranks[0].parameters[0][0].values);
}

// A communicator whose device has failed (what NCCL's event queries return
// after a fault on the device).
class FailedDevice final : public InertCommunicator {
 public:
  FailedDevice() : InertCommunicator(0, 1) {}
  absl::Status PollDeviceError() override {
    return absl::InternalError("CUDA error on cuda:0: cudaErrorIllegalAddress");
  }
};

// The wrapper that injects faults forwards the device's error, which spawn
// tells from the communicator's own (PollAsyncError): a wrapped NCCL
// communicator's device fault must not be lost, nor restarted as a
// communicator error.
TEST(FaultsTest, TheFaultWrapperForwardsTheDevicesError) {
  internal::FaultPlan plan({}, 1, 1.0);
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  comms.push_back(std::make_unique<FailedDevice>());
  auto wrapped = plan.Wrap(std::move(comms));
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  ASSERT_EQ(wrapped->size(), 1u);
  const absl::Status device = (*wrapped)[0]->PollDeviceError();
  EXPECT_EQ(device.message(), "CUDA error on cuda:0: cudaErrorIllegalAddress") << device;
  EXPECT_TRUE((*wrapped)[0]->PollAsyncError().ok());
}

TEST(FaultsTest, BadFaultsAreRefusedNamingTheValue) {
  auto refused = [](std::vector<Fault> faults, absl::string_view part) {
    std::atomic<int> ran{0};
    absl::Status s = RunRanks(
        [&](dist::Context&, StepLog&) {
          ran.fetch_add(1);
          return absl::OkStatus();
        },
        Options(std::move(faults)));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(Contains(s, part)) << s << " lacks \"" << part << "\"";
    EXPECT_EQ(ran.load(), 0);
  };
  refused({{.rank = 2, .step = 0}}, "rank 2 is not a rank of a run of 2");
  refused({{.rank = 0}}, "set exactly one of step and collective");
  refused({{.rank = 0, .step = 1, .collective = 2}}, "set exactly one of step and collective");
  refused({{.rank = 0, .step = -1}}, "step -1 < 0");
  refused({{.rank = 0, .collective = 0}}, "collectives count from 1");
  refused({{.action = FaultAction::kSlow, .rank = 0, .step = 0}}, "delay 0 ms");
  refused({{.rank = 0, .step = 0, .error = absl::OkStatus()}}, "its error is OK");
  refused({{.rank = 1, .step = 3}, {.action = FaultAction::kHang, .rank = 1, .step = 3}},
          "fault 1 (hang at rank 1, step 3): fault 0 (throw at rank 1, step 3) is at the same");
}

}  // namespace
}  // namespace tandem::testing
