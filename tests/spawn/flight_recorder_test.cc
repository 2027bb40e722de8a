// The flight recorder through spawn (CPU ranks, testing::RunRanks): its dump in
// the log after a watchdog timeout and after a rank's failure, once, after the
// error line, naming the rank that went ahead; the on-demand dump of
// Context::DumpFlightRecorder; SpawnOptions::flight_recorder_entries (wrap-around,
// 0, a bad value); and Work::sequence() / is_completed() of the asynchronous
// fake communicator (testing/fake_communicator.h).
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "nn/status_macros.h"
#include "spawn/spawn.h"
#include "testing/fake_communicator.h"
#include "testing/faults.h"
#include "testing/run.h"

namespace tandem::testing {
namespace {

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

int Count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

RunOptions Options(std::vector<Fault> faults, double timeout_s = 30) {
  RunOptions options{.ranks = 2, .faults = std::move(faults), .record_parameters = false};
  options.spawn.timeout_s = timeout_s;
  return options;
}

// Each step one all_reduce of 256 floats; `steps` steps.
TrainingFunction AllReduces(int steps) {
  return [steps](dist::Context& ctx, StepLog& log) -> absl::Status {
    nn::Tensor x = nn::ones({256});
    for (int step = 0; step < steps; ++step) {
      ctx.communicator().all_reduce(x);
      RETURN_IF_ERROR(log.EndStep(static_cast<double>(step)));
    }
    return absl::OkStatus();
  };
}

// Rank 1 hangs after step 1 (two all-reduces done); rank 0 waits in #3. The
// watchdog's line keeps its form; the rings follow it in the log, once, and
// the last line names rank 0 as the one that went ahead.
TEST(FlightRecorderSpawnTest, TimeoutLogsEveryRingAndWhoWentAhead) {
  RunReport report;
  absl::Status s = RunRanks(
      AllReduces(6), Options({{.action = FaultAction::kHang, .rank = 1, .step = 1}}, 0.5),
      &report);
  ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(Contains(std::string(s.message()),
                       "rank 0 (cpu): waiting in all_reduce #3 for"))
      << s;
  EXPECT_FALSE(Contains(std::string(s.message()), "flight recorder")) << s;
  const std::string& log = report.log;
  EXPECT_EQ(Count(log, "flight recorder: rank 0 (cpu) [in-process (faults injected)]: 3 "
                       "collectives entered, the last 3 (oldest first):"),
            1)
      << log;
  EXPECT_EQ(Count(log, "flight recorder: rank 1 (cpu) [in-process (faults injected)]: 2 "
                       "collectives entered"), 1)
      << log;
  EXPECT_TRUE(Contains(log, "flight recorder: rank 0 (cpu) #2 all_reduce float32[256] completed"))
      << log;
  EXPECT_TRUE(Contains(log, "flight recorder: rank 0 (cpu) #3 all_reduce float32[256] entered: "
                            "entered "))
      << log;
  EXPECT_TRUE(Contains(log, "not completed")) << log;
  EXPECT_TRUE(Contains(log, "flight recorder: the ranks first differ at #3: rank 0 (cpu) entered "
                            "#3 all_reduce float32[256]; rank 1 (cpu) had entered only 2 "
                            "collectives"))
      << log;
  // After the error line: a first-error-line search still finds the watchdog's.
  const size_t error = log.find("ERROR: watchdog: a collective did not complete within 0.5 s");
  ASSERT_NE(error, std::string::npos) << log;
  EXPECT_LT(error, log.find("flight recorder")) << log;
}

// A rank's own failure (not a timeout) brings the dump too, once per rank.
TEST(FlightRecorderSpawnTest, FailureLogsTheRings) {
  RunReport report;
  absl::Status s = RunRanks(
      AllReduces(6), Options({{.action = FaultAction::kThrow, .rank = 1, .step = 2}}), &report);
  ASSERT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_EQ(Count(report.log, "flight recorder: rank 1 (cpu) [in-process (faults injected)]: "
                              "3 collectives entered"),
            1)
      << report.log;
  EXPECT_EQ(Count(report.log, "flight recorder: rank 0 (cpu) [in-process (faults injected)]"),
            1) << report.log;
}

// A run that succeeds logs no ring.
TEST(FlightRecorderSpawnTest, SuccessfulRunLogsNoRing) {
  RunReport report;
  ASSERT_TRUE(RunRanks(AllReduces(3), Options({}), &report).ok());
  EXPECT_FALSE(Contains(report.log, "flight recorder")) << report.log;
}

TEST(FlightRecorderSpawnTest, OnDemandDumpWrapsAroundAtTheConfiguredSize) {
  RunOptions options = Options({});
  options.spawn.flight_recorder_entries = 4;
  std::vector<std::string> dumps(2);
  absl::Status s = RunRanks(
      [&](dist::Context& ctx, StepLog&) -> absl::Status {
        nn::Tensor x = nn::ones({8}, {.dtype = nn::kFloat64});
        for (int i = 0; i < 9; ++i) ctx.communicator().all_reduce(x);
        ctx.communicator().barrier();
        dumps[ctx.local_rank()] = ctx.DumpFlightRecorder();
        if (ctx.communicator().FlightRecords().size() != 4) {
          return absl::InternalError("the ring does not hold 4 records");
        }
        return absl::OkStatus();
      },
      options);
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < 2; ++r) {
    const std::string who = "flight recorder: rank " + std::to_string(r) + " (cpu)";
    EXPECT_TRUE(Contains(dumps[r], who + " [in-process]: 10 collectives entered, the last 4 "
                                          "(oldest first):\n"))
        << dumps[r];
    EXPECT_FALSE(Contains(dumps[r], "#6 ")) << dumps[r];
    EXPECT_TRUE(Contains(dumps[r], who + " #7 all_reduce float64[8] completed")) << dumps[r];
    EXPECT_TRUE(Contains(dumps[r], who + " #10 barrier completed")) << dumps[r];
    EXPECT_EQ(Count(dumps[r], "\n"), 5) << dumps[r];
  }
}

TEST(FlightRecorderSpawnTest, ZeroEntriesTurnItOff) {
  RunOptions options = Options({{.action = FaultAction::kHang, .rank = 1, .step = 0}}, 0.5);
  options.spawn.flight_recorder_entries = 0;
  std::string dump;
  RunReport report;
  absl::Status s = RunRanks(
      [&](dist::Context& ctx, StepLog& log) -> absl::Status {
        nn::Tensor x = nn::ones({4});
        ctx.communicator().all_reduce(x);
        if (ctx.rank() == 0) dump = ctx.DumpFlightRecorder();
        RETURN_IF_ERROR(log.EndStep(0.0));
        ctx.communicator().all_reduce(x);
        return absl::OkStatus();
      },
      options, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(dump, "flight recorder: rank 0 (cpu): disabled "
                  "(SpawnOptions::flight_recorder_entries = 0)\n");
  EXPECT_FALSE(Contains(report.log, "flight recorder")) << report.log;
}

TEST(FlightRecorderSpawnTest, NegativeEntriesAreRefused) {
  RunOptions options = Options({});
  options.spawn.flight_recorder_entries = -1;
  absl::Status s = RunRanks(AllReduces(1), options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(std::string(s.message()), "flight_recorder_entries must be in [0, 1048576], "
                                                  "not -1"))
      << s;
}

// The fake's device completes #1 and holds #2: the first handle becomes
// complete without a wait, the second stays incomplete until the timeout's
// abort ends it; both carry their numbers, and the dump shows #2 in flight.
TEST(FlightRecorderSpawnTest, FakeWorkReportsCompletionWithoutWaiting) {
  auto group = std::make_shared<FakeGroup>(2);
  group->HoldFrom(2);
  RunOptions options = Options({}, 0.5);
  options.fake_group = group;
  std::atomic<int> checked{0};
  RunReport report;
  absl::Status s = RunRanks(
      [&](dist::Context& ctx, StepLog&) -> absl::Status {
        nn::Tensor x = nn::ones({4});
        nn::Tensor y = nn::ones({4});
        std::shared_ptr<dist::Work> first = ctx.communicator().all_reduce_async(x);
        std::shared_ptr<dist::Work> second = ctx.communicator().all_reduce_async(y);
        if (first->sequence() != 1 || second->sequence() != 2) {
          return absl::InternalError("wrong sequence numbers");
        }
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!first->is_completed() && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (!first->is_completed()) return absl::InternalError("#1 never completed");
        if (second->is_completed()) return absl::InternalError("#2 completed while held");
        checked.fetch_add(1);
        first->wait();
        second->wait();  // ended by the timeout's abort: CancelledError
        return absl::OkStatus();
      },
      options, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(checked.load(), 2);
  EXPECT_TRUE(Contains(report.log, "flight recorder: rank 0 (cpu) [fake-async]: 2 collectives "
                                   "entered"))
      << report.log;
  EXPECT_TRUE(Contains(report.log, "flight recorder: rank 1 (cpu) #2 all_reduce_async float32[4] "
                                   "entered: "))
      << report.log;
}

}  // namespace
}  // namespace tandem::testing
