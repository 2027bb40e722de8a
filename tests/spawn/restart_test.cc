// Restarts in the same process (SpawnOptions::restart, spawn/restart.h) on CPU
// ranks, through testing::RunRanks and its faults: after an exception, a
// communicator's asynchronous error or a collective's timeout the training
// function starts again on every rank, restores its in-memory snapshot and
// ends with the same parameters, bit for bit, as a run without the fault;
// with a snapshot every K steps at most K steps are run again. The failures
// that end the run still do (a returned rank, a policy turned off, the
// restarts used up, several processes), and the snapshot store keeps the
// newest step every rank holds. A world shrink (leave_out_failed_rank)
// continues on the ranks left, bit for bit as a run of that many ranks from
// the same step, after a rank's failure or after a timeout that names the one
// rank its peers waited for.
#include "spawn/restart.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/sampler.h"
#include "gtest/gtest.h"
#include "nn/ops/dropout.h"
#include "nn/ops/index.h"
#include "nn/ops/loss.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"
#include "spawn/internal/restart.h"
#include "spawn/signals.h"
#include "spawn/train/checkpoint.h"
#include "testing/run.h"
#include "tests/spawn/inert_communicator.h"
#include "tests/spawn/restart_fixture.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

// A checkpoint path of this process's own (two suites run at once, e.g. from
// two build trees, would otherwise remove each other's file).
std::string TempCheckpoint(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), getpid(), "_", name);
}


struct FaultCase {
  std::string name;
  Fault fault;
  double timeout_s;
  const char* failure;  // in the restart's log line
  int step_delay_ms = 0;
};

class RestartAfterFaultTest : public ::testing::TestWithParam<FaultCase> {};

// A snapshot every step: the run after the fault is the run without it.
TEST_P(RestartAfterFaultTest, ContinuesBitForBitFromTheSnapshot) {
  const FaultCase& c = GetParam();
  const RunReport reference = Reference(2, {});
  RunReport report;
  absl::Status s = RunRanks(Restartable({.step_delay_ms = c.step_delay_ms}),
                            Options(2, {c.fault}, /*max_restarts=*/2, c.timeout_s), &report);
  ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
  EXPECT_EQ(report.attempts, 2) << report.log;
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_TRUE(Contains(report.log, "spawn: restart 1 of 2 after: ")) << report.log;
  EXPECT_TRUE(Contains(report.log, c.failure)) << report.log;
  EXPECT_TRUE(Contains(report.log, "; attempt 1 resumes from the snapshot of step ")) << report.log;
  EXPECT_TRUE(Contains(report.log, " s (stop, abort, joins, new communicators)")) << report.log;
  ExpectSameBits(reference, report);
}

// DataParallel's constructor makes 6 collectives for this model; collective 9
// is a gradient all-reduce of step 2.
INSTANTIATE_TEST_SUITE_P(
    Faults, RestartAfterFaultTest,
    ::testing::Values(FaultCase{"Throw",
                                {.action = FaultAction::kThrow, .rank = 1, .step = 4},
                                30,
                                "rank 1 (cpu) threw: injected fault"},
                      FaultCase{"ReturnErrorAtStep",
                                {.action = FaultAction::kReturnError, .rank = 0, .step = 6},
                                30,
                                "rank 0 (cpu) returned: INTERNAL: injected fault"},
                      FaultCase{"CommunicatorError",
                                {.action = FaultAction::kReturnError,
                                 .rank = 0,
                                 .collective = 9,
                                 .error = absl::UnavailableError("injected network failure")},
                                30,
                                "rank 0 (cpu): injected network failure",
                                /*step_delay_ms=*/40},
                      FaultCase{"HangTimedOut",
                                {.action = FaultAction::kHang, .rank = 1, .step = 3},
                                0.5,
                                "watchdog: a collective did not complete within 0.5 s"}),
    [](const ::testing::TestParamInfo<FaultCase>& info) { return info.param.name; });

// A snapshot every K steps: the attempt resumes from the newest multiple of K
// that every rank stored, so at most K steps are run again, and it still ends
// bit for bit as the run without the fault.
TEST(RestartTest, SnapshotEveryKStepsRedoesAtMostKSteps) {
  constexpr int kEvery = 3;
  for (const int ranks : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks");
    const RunReport reference = Reference(ranks, {.snapshot_every = kEvery});
    auto steps_run = std::make_shared<std::vector<std::atomic<int>>>(ranks);
    RunReport report;
    absl::Status s = RunRanks(
        Restartable({.snapshot_every = kEvery, .steps_run = steps_run}),
        Options(ranks, {{.action = FaultAction::kThrow, .rank = ranks - 1, .step = 7}}), &report);
    ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
    EXPECT_EQ(report.attempts, 2);
    // Step index 7 is the 8th step; the newest common multiple of 3 is 6.
    EXPECT_TRUE(Contains(report.log, "attempt 1 resumes from the snapshot of step 6"))
        << report.log;
    for (int r = 0; r < ranks; ++r) {
      const int redone = (*steps_run)[r].load() - 12;
      EXPECT_GE(redone, 0);
      EXPECT_LE(redone, kEvery) << "rank " << r;
    }
    ExpectSameBits(reference, report);
  }
}

// Two faults and one restart: the second failure ends the run, named with the
// count of restarts used, and keeps its code.
TEST(RestartTest, RestartsExhaustedEndTheRunWithTheLastFailureAndTheCount) {
  RunReport report;
  absl::Status s = RunRanks(Restartable({}),
                            Options(2,
                                    {{.action = FaultAction::kThrow, .rank = 0, .step = 2},
                                     {.action = FaultAction::kReturnError,
                                      .rank = 1,
                                      .step = 5,
                                      .error = absl::DataLossError("second fault")}},
                                    /*max_restarts=*/1),
                            &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_TRUE(Contains(s.message(),
                       "spawn: gave up after 1 restart; the last failure: rank 1 "
                       "(cpu) returned: DATA_LOSS: second fault"))
      << s;
  EXPECT_FALSE(s.GetPayload("tandem.dist/failure_cause").has_value());
  EXPECT_EQ(report.attempts, 2);
  EXPECT_EQ(report.faults.size(), 2u);
}

// A rank whose function returned while the others went on into a collective
// is a program error: the watchdog fails the run at once, not restarted.
TEST(RestartTest, ReturnedRankEndsTheRun) {
  RunReport report;
  absl::Status s = RunRanks(Restartable({.rank1_returns_after = 3}),
                            Options(2, {}, /*max_restarts=*/3, /*timeout_s=*/0.5), &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s.message(), "rank 1 (cpu) returned from its function")) << s;
  EXPECT_EQ(report.attempts, 1);
  EXPECT_TRUE(Contains(report.log, "spawn: not restarting: local rank 1's function returned"))
      << report.log;
  EXPECT_FALSE(Contains(report.log, "spawn: restart 1")) << report.log;
}

// A communicator whose asynchronous error the test raises (once, through
// `raise`, on rank 1's); it has no collectives: the ranks below make none.
class RaisedAsyncError final : public InertCommunicator {
 public:
  RaisedAsyncError(int rank, std::atomic<bool>* raise)
      : InertCommunicator(rank, 2), raise_(raise) {}
  std::string kind() const override { return "raised-async-error"; }
  absl::Status PollAsyncError() override {
    if (rank() != 1 || !raise_->exchange(false)) return absl::OkStatus();
    return absl::UnavailableError("injected asynchronous error");
  }

 private:
  std::atomic<bool>* raise_;
};

// Set when the rank thread that made it exits, after its function returned.
struct ThreadExit {
  std::atomic<bool>* exited = nullptr;
  ~ThreadExit() {
    if (exited != nullptr) exited->store(true);
  }
};

// A communicator's asynchronous error found after one rank's function
// returned, while another rank still ran its last code (a run's last ~100 ms on
// a loaded machine): the ranks ran the same steps, the error is judged by its
// cause (on_comm_error: restarted), not as a rank that returned while the
// others went on. Rank 1 raises the error only once rank 0's thread has exited.
TEST(RestartTest, AsyncErrorAfterOneRankReturnedRestarts) {
  std::atomic<bool> raise{false};
  std::atomic<bool> rank0_exited{false};
  std::atomic<int> attempts{0};
  dist::SpawnHooks hooks;
  hooks.make_communicators = [&raise](const std::vector<nn::Device>& devices)
      -> absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> {
    std::vector<std::unique_ptr<dist::Communicator>> comms;
    for (size_t r = 0; r < devices.size(); ++r) {
      comms.push_back(std::make_unique<RaisedAsyncError>(static_cast<int>(r), &raise));
    }
    return comms;
  };
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  std::ostringstream log;
  options.console = &log;
  options.timeout_s = 30;
  options.restart.max_restarts = 1;
  absl::Status s = dist::RunSpawnWithHooks(
      "cpu", 2, options, hooks, [](int) {},
      [&](dist::Context& ctx) -> absl::Status {
        if (ctx.rank() == 0) attempts.fetch_add(1);
        if (ctx.attempt() > 0) return absl::OkStatus();  // the restart: no error
        if (ctx.rank() == 0) {
          thread_local ThreadExit exit;
          exit.exited = &rank0_exited;
          return absl::OkStatus();
        }
        while (!rank0_exited.load() && !ctx.stop_requested()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        raise = true;
        while (!ctx.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ctx.check_stop();
        return absl::OkStatus();
      });
  EXPECT_TRUE(s.ok()) << s << "\n" << log.str();
  EXPECT_EQ(attempts.load(), 2) << log.str();
  EXPECT_TRUE(Contains(log.str(), "spawn: restart 1 of 1 after: rank 1 (cpu): injected "
                                  "asynchronous error"))
      << log.str();
  EXPECT_FALSE(Contains(log.str(), "not restarting")) << log.str();
}

// A communicator whose device fails (rank 1's, once `raise` is set): the
// watchdog's PollDeviceError finds what NCCL's event queries return after a
// fault on the device. The communicator of rank `async_rank` (-1: none) also
// raises its own asynchronous error then (NCCL's kernels fail with the device,
// or a peer's with it). What the watchdog sees is latched by rank 0's
// PollCompleted, as NCCL's event queries are, so that every poll of one round
// sees the same failures.
class RaisedDeviceError final : public InertCommunicator {
 public:
  RaisedDeviceError(int rank, std::atomic<bool>* raise, std::atomic<bool>* latched, int async_rank)
      : InertCommunicator(rank, 2), raise_(raise), latched_(latched), async_rank_(async_rank) {}
  std::string kind() const override { return "raised-device-error"; }
  void PollCompleted() override {
    if (rank() == 0 && raise_->load()) latched_->store(true);
  }
  absl::Status PollDeviceError() override {
    if (rank() != 1 || !latched_->load()) return absl::OkStatus();
    return absl::InternalError("CUDA error on cuda:1 (rank 1) while following NCCL collective "
                               "#7: cudaErrorIllegalAddress (an illegal memory access was "
                               "encountered)");
  }
  absl::Status PollAsyncError() override {
    if (rank() != async_rank_ || !latched_->load()) return absl::OkStatus();
    return absl::UnavailableError("injected asynchronous error");
  }

 private:
  std::atomic<bool>* raise_;
  std::atomic<bool>* latched_;
  int async_rank_;
};

// Runs two CPU ranks over RaisedDeviceError communicators with up to two
// restarts, on_comm_error and on_exception on; rank 1 sets `raise` on the
// first attempt, or throws dist::DeviceError when `throw_on_rank` is set.
// Returns the run's status; *attempts, *log: what happened.
absl::Status RunWithDeviceFailure(int async_rank, bool throw_on_rank, int* attempts,
                                  std::string* log_text) {
  std::atomic<bool> raise{false};
  std::atomic<bool> latched{false};
  std::atomic<int> started{0};
  dist::SpawnHooks hooks;
  hooks.make_communicators = [&raise, &latched, async_rank](
                                 const std::vector<nn::Device>& devices)
      -> absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> {
    std::vector<std::unique_ptr<dist::Communicator>> comms;
    for (size_t r = 0; r < devices.size(); ++r) {
      comms.push_back(std::make_unique<RaisedDeviceError>(static_cast<int>(r), &raise, &latched,
                                                          async_rank));
    }
    return comms;
  };
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  std::ostringstream log;
  options.console = &log;
  options.timeout_s = 30;
  options.restart = {.max_restarts = 2, .on_exception = true, .on_comm_error = true};
  absl::Status s = dist::RunSpawnWithHooks(
      "cpu", 2, options, hooks, [](int) {},
      [&](dist::Context& ctx) -> absl::Status {
        if (ctx.rank() == 0) started.fetch_add(1);
        if (ctx.attempt() > 0) return absl::OkStatus();  // a restart would succeed
        if (ctx.rank() == 1) {
          if (throw_on_rank) {
            throw dist::DeviceError("all_reduce #3: CUDA error on cuda:1 (rank 1) while "
                                    "following NCCL collective #2: cudaErrorIllegalAddress");
          }
          raise = true;
        }
        while (!ctx.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ctx.check_stop();
        return absl::OkStatus();
      });
  *attempts = started.load();
  *log_text = log.str();
  return s;
}

// A CUDA error of the device is not a communicator's error: a restart in the
// process would run on the same broken CUDA context. The run ends with it,
// naming the device, although on_comm_error is on and restarts are left.
TEST(RestartTest, ADeviceErrorTheWatchdogFindsEndsTheRunWithoutARestart) {
  int attempts = 0;
  std::string log;
  absl::Status s = RunWithDeviceFailure(/*async_rank=*/-1, /*throw_on_rank=*/false, &attempts,
                                        &log);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s << "\n" << log;
  EXPECT_TRUE(Contains(s.message(), "rank 1 (cpu): CUDA error on cuda:1 (rank 1) while following "
                                    "NCCL collective #7: cudaErrorIllegalAddress"))
      << s;
  EXPECT_EQ(attempts, 1) << log;
  EXPECT_TRUE(Contains(log, "spawn: not restarting: a CUDA error on a device")) << log;
  EXPECT_FALSE(Contains(log, "spawn: restart 1")) << log;
}

// The device's error and the communicator's at the same poll: the device's is
// the cause (NCCL's kernels fail with the device), and the run ends.
TEST(RestartTest, ADeviceErrorIsTheCauseOverTheCommunicatorErrorItBrings) {
  int attempts = 0;
  std::string log;
  absl::Status s = RunWithDeviceFailure(/*async_rank=*/1, /*throw_on_rank=*/false, &attempts,
                                        &log);
  EXPECT_TRUE(Contains(s.message(), "cudaErrorIllegalAddress")) << s;
  EXPECT_FALSE(Contains(s.message(), "injected asynchronous error")) << s;
  EXPECT_EQ(attempts, 1) << log;
  EXPECT_TRUE(Contains(log, "spawn: not restarting: a CUDA error on a device")) << log;
}

// The same error thrown on the rank (NCCL's next collective throws the CUDA
// error its event query kept, as dist::DeviceError): not restarted under
// on_exception either.
TEST(RestartTest, ADeviceErrorThrownOnARankEndsTheRunWithoutARestart) {
  int attempts = 0;
  std::string log;
  absl::Status s = RunWithDeviceFailure(/*async_rank=*/-1, /*throw_on_rank=*/true, &attempts,
                                        &log);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s << "\n" << log;
  EXPECT_TRUE(Contains(s.message(), "rank 1 (cpu) threw: all_reduce #3: CUDA error on cuda:1"))
      << s;
  EXPECT_EQ(attempts, 1) << log;
  EXPECT_TRUE(Contains(log, "spawn: not restarting: a CUDA error on a device")) << log;
}

// Rank 1's device fails and rank 0's communicator reports an error of its own
// at the same round of polls (its peer went with the device). The device's
// error is the cause whichever rank the watchdog asks first: a restart would
// meet the broken device again.
TEST(RestartTest, ADeviceErrorIsTheCauseOverAnotherRanksCommunicatorError) {
  int attempts = 0;
  std::string log;
  absl::Status s = RunWithDeviceFailure(/*async_rank=*/0, /*throw_on_rank=*/false, &attempts,
                                        &log);
  EXPECT_TRUE(Contains(s.message(), "rank 1 (cpu): CUDA error on cuda:1")) << s;
  EXPECT_FALSE(Contains(s.message(), "injected asynchronous error")) << s;
  EXPECT_EQ(attempts, 1) << log;
  EXPECT_TRUE(Contains(log, "spawn: not restarting: a CUDA error on a device")) << log;
}

// What a failed attempt's devices held after its joins (spawn/launch.cc's
// wait for their streams, which needs a GPU): a device whose streams returned
// a CUDA error makes the failure the device's, whatever its cause was, and is
// named; a kernel's unread report is only added; a stopped run is left as it
// is and the words logged.
TEST(RestartTest, ABrokenDeviceFoundAfterTheJoinsMakesTheFailureTheDevices) {
  std::ostringstream console;
  auto logger = dist::Logger::Create(1, {.console = &console});
  ASSERT_TRUE(logger.ok()) << logger.status();
  const absl::Status failure = dist::internal::WithFailureCause(
      absl::InternalError("rank 0 (cuda:0): NCCL error: unhandled cuda error"),
      dist::internal::FailureCause::kCommunicator);
  const std::vector<std::string> none;
  const std::vector<std::string> report = {"nll_loss: target 12 of sample 3 is out of range"};
  const std::vector<std::string> broken = {"cuda:0 (cudaErrorIllegalAddress (an illegal memory "
                                           "access was encountered))"};

  absl::Status s = dist::internal::WithDeviceErrorsFound(failure, none, broken, **logger);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "rank 0 (cuda:0): NCCL error: unhandled cuda error; the CUDA context of "
                         "cuda:0 (cudaErrorIllegalAddress (an illegal memory access was "
                         "encountered)) has failed (a fault on the device)");
  EXPECT_EQ(dist::internal::GetFailureCause(s), dist::internal::FailureCause::kDevice);

  s = dist::internal::WithDeviceErrorsFound(failure, report, none, **logger);
  EXPECT_EQ(s.message(), "rank 0 (cuda:0): NCCL error: unhandled cuda error; a kernel had also "
                         "reported, unread before the stop: nll_loss: target 12 of sample 3 is "
                         "out of range");
  EXPECT_EQ(dist::internal::GetFailureCause(s), dist::internal::FailureCause::kCommunicator);

  s = dist::internal::WithDeviceErrorsFound(failure, report, broken, **logger);
  EXPECT_TRUE(Contains(s.message(), "out of range; the CUDA context of cuda:0")) << s;
  EXPECT_EQ(dist::internal::GetFailureCause(s), dist::internal::FailureCause::kDevice);

  EXPECT_EQ(dist::internal::WithDeviceErrorsFound(failure, none, none, **logger), failure);
  EXPECT_TRUE(dist::internal::WithDeviceErrorsFound(absl::OkStatus(), report, broken, **logger)
                  .ok());

  const absl::Status stopped = dist::internal::StoppedStatus("SIGTERM", 4, "");
  EXPECT_EQ(dist::internal::WithDeviceErrorsFound(stopped, none, broken, **logger), stopped);
  EXPECT_TRUE(Contains(console.str(), "spawn: the CUDA context of cuda:0")) << console.str();
}

// Uneven steps that a communicator's asynchronous error stops before the
// watchdog sees them: local rank 0's function returned after no collective;
// rank 1 entered all_reduce #1, which rank 0 never enters, and its
// communicator then reports an error (the ranks' own program made it wait for
// good). Rank 0's exit is held after its function returned (its communicator's
// ReleaseGraphs waits for the stop), so the watchdog's own check for uneven
// steps cannot come first: the error is the run's failure, judged by its cause.
// A new attempt would run the same steps: the run ends.
class UnevenThenAsyncError final : public InertCommunicator {
 public:
  UnevenThenAsyncError(int rank, bool hold_exit, std::atomic<bool>* entered)
      : InertCommunicator(rank, 2), hold_exit_(hold_exit), entered_(entered) {}
  std::string kind() const override { return "uneven-then-async-error"; }
  absl::Status PollAsyncError() override {
    if (rank() != 1 || !entered_->exchange(false)) return absl::OkStatus();
    return absl::UnavailableError("injected asynchronous error");
  }
  std::vector<std::string> ReleaseGraphs(const std::string&) override {
    while (hold_exit_ && !stop_requested()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return {};
  }

 private:
  void AllReduceImpl(nn::Tensor&, dist::ReduceOp) override {
    entered_->store(true);
    while (!stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  const bool hold_exit_;
  std::atomic<bool>* entered_;
};

TEST(RestartTest, UnevenStepsEndTheRunWhenAnAsyncErrorComesFirst) {
  std::atomic<bool> entered{false};
  std::atomic<int> made{0};
  std::atomic<int> attempts{0};
  dist::SpawnHooks hooks;
  hooks.make_communicators = [&](const std::vector<nn::Device>& devices)
      -> absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> {
    const bool first = made.fetch_add(1) == 0;  // a restart's communicators hold nothing
    std::vector<std::unique_ptr<dist::Communicator>> comms;
    for (size_t r = 0; r < devices.size(); ++r) {
      comms.push_back(std::make_unique<UnevenThenAsyncError>(static_cast<int>(r),
                                                             first && r == 0, &entered));
    }
    return comms;
  };
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  std::ostringstream log;
  options.console = &log;
  options.timeout_s = 30;
  options.restart.max_restarts = 1;
  absl::Status s = dist::RunSpawnWithHooks(
      "cpu", 2, options, hooks, [](int) {},
      [&](dist::Context& ctx) -> absl::Status {
        if (ctx.rank() == 0) attempts.fetch_add(1);
        if (ctx.attempt() > 0 || ctx.rank() == 0) return absl::OkStatus();
        nn::Tensor x = nn::ones({4});
        ctx.communicator().all_reduce(x);
        ctx.check_stop();
        return absl::OkStatus();
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s << "\n" << log.str();
  EXPECT_TRUE(Contains(s.message(), "injected asynchronous error")) << s;
  EXPECT_EQ(attempts.load(), 1) << log.str();
  EXPECT_TRUE(Contains(log.str(), "spawn: not restarting: local rank 0's function returned "
                                  "after entering 0 collective(s), while local rank 1 entered 1"))
      << log.str();
  EXPECT_FALSE(Contains(log.str(), "spawn: restart 1")) << log.str();
}

// A rank that stays outside any abortable wait (a sleep) for more than
// timeout_s after the stop ends the run: it could as well never come back.
TEST(RestartTest, RankOutsideAnyAbortableWaitEndsTheRun) {
  RunReport report;
  absl::Status s = RunRanks(
      Restartable({.rank1_sleeps_after = 3, .rank1_sleep_ms = 1500}),
      Options(2, {{.action = FaultAction::kThrow, .rank = 0, .step = 2}}, 2, /*timeout_s=*/0.5),
      &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s.message(), "rank 0 (cpu) threw: injected fault")) << s;
  EXPECT_EQ(report.attempts, 1);
  EXPECT_TRUE(Contains(report.log, "spawn: not restarting: local rank 1 left its function "))
      << report.log;
  EXPECT_TRUE(Contains(report.log, "it was outside any abortable wait")) << report.log;
}

// A stop signal, even one that came before the failure, ends the run.
TEST(RestartTest, StopSignalEndsTheRun) {
  RunOptions options = Options(2, {{.action = FaultAction::kThrow, .rank = 1, .step = 3}});
  options.spawn.stop_signals = {SIGUSR1};
  RunReport report;
  absl::Status s =
      RunRanks(Restartable({.rank0_raises_after = 2, .rank0_signal = SIGUSR1}), options, &report);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(report.attempts, 1);
  EXPECT_TRUE(Contains(report.log, "spawn: not restarting: a stop was asked")) << report.log;
}

// Communicators that cannot be rebuilt are a start-up failure: the run ends,
// naming it and the failure it was restarting from.
TEST(RestartTest, CommunicatorsThatCannotBeRebuiltEndTheRun) {
  int made = 0;
  dist::SpawnHooks hooks;
  hooks.make_communicators = [&made](const std::vector<nn::Device>& devices)
      -> absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> {
    if (made++ > 0) return absl::UnavailableError("no network");
    auto group = std::make_shared<dist::InProcessGroup>(static_cast<int>(devices.size()));
    std::vector<std::unique_ptr<dist::Communicator>> comms;
    for (size_t r = 0; r < devices.size(); ++r) {
      comms.push_back(
          std::make_unique<dist::InProcessCommunicator>(static_cast<int>(r), devices[r], group));
    }
    return comms;
  };
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  std::ostringstream log;
  options.console = &log;
  options.restart.max_restarts = 2;
  absl::Status s = dist::RunSpawnWithHooks(
      "cpu", 2, options, hooks, [](int) {},
      [](dist::Context& ctx) -> absl::Status {
        if (ctx.rank() == 1) throw Error("boom");
        // No collective: these plain in-process communicators are not
        // cancelled by the watchdog's abort; rank 0 waits for the stop.
        while (!ctx.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ctx.check_stop();
        return absl::OkStatus();
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(Contains(s.message(),
                       "spawn: restart 1: rebuilding the communicators failed (the "
                       "run ends): no network; the failure restarted: rank 1 (cpu) "
                       "threw: boom"))
      << s;
  EXPECT_EQ(made, 2);
}

// The policy decides per kind of failure.
TEST(RestartTest, FailureKindsTurnedOffEndTheRun) {
  struct Case {
    dist::RestartPolicy policy;
    Fault fault;
    double timeout_s;
    const char* why;
    int step_delay_ms = 0;
  };
  const Case cases[] = {
      {{.max_restarts = 2, .on_exception = false},
       {.action = FaultAction::kThrow, .rank = 1, .step = 2},
       30,
       "on_exception is off"},
      {{.max_restarts = 2, .on_comm_error = false},
       {.action = FaultAction::kReturnError, .rank = 1, .collective = 9},
       30,
       "on_comm_error is off",
       40},
      {{.max_restarts = 2, .on_timeout = false},
       {.action = FaultAction::kHang, .rank = 0, .step = 2},
       0.5,
       "on_timeout is off"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    RunOptions options = Options(2, {c.fault}, 2, c.timeout_s);
    options.spawn.restart = c.policy;
    RunReport report;
    absl::Status s = RunRanks(Restartable({.step_delay_ms = c.step_delay_ms}), options, &report);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(report.attempts, 1);
    EXPECT_TRUE(Contains(report.log, c.why)) << report.log;
  }
}

// No restarts (the default): a failure ends the run as before, and snapshots
// are not kept.
TEST(RestartTest, WithoutRestartsAFailureEndsTheRunAsBefore) {
  RunOptions options = Options(2, {{.action = FaultAction::kThrow, .rank = 1, .step = 2}});
  options.spawn.restart = {};
  RunReport report;
  absl::Status s = RunRanks(Restartable({}), options, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Contains(s.message(), "rank 1 (cpu) threw: injected fault")) << s;
  EXPECT_FALSE(Contains(report.log, "restart")) << report.log;
  EXPECT_EQ(report.attempts, 1);
}

TEST(RestartTest, BadPolicyIsRefusedNamingTheValue) {
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  options.restart.max_restarts = -1;
  absl::Status s = dist::spawn([](dist::Context&) {}, 2, "cpu", options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s.message(), "RestartPolicy::max_restarts must be 0 or more, not -1")) << s;
}

// Several processes: refused at start-up, before any process joins.
TEST(RestartTest, SeveralProcessesAreRefused) {
  using dist::Processes;
  const dist::RestartPolicy restarts{.max_restarts = 1};
  const dist::LaunchInfo two{.processes = 2, .index = 0, .evidence = "OMPI_COMM_WORLD_SIZE=2"};
  const dist::LaunchInfo one{};
  absl::Status s = dist::internal::CheckRestartPolicy(restarts, Processes::kAuto, two);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(Contains(s.message(), "in a job of several processes (OMPI_COMM_WORLD_SIZE=2)")) << s;
  EXPECT_TRUE(Contains(s.message(), "OpenMPI cannot cancel an operation in flight")) << s;
  EXPECT_EQ(dist::internal::CheckRestartPolicy(restarts, Processes::kOn, one).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(dist::internal::CheckRestartPolicy(restarts, Processes::kOff, two).ok());
  EXPECT_TRUE(dist::internal::CheckRestartPolicy(restarts, Processes::kAuto, one).ok());
  EXPECT_TRUE(dist::internal::CheckRestartPolicy({}, Processes::kAuto, two).ok());
  // Through spawn: kOn joins other processes, so it is refused first.
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  options.processes = Processes::kOn;
  options.restart = restarts;
  s = dist::spawn([](dist::Context&) {}, 1, "cpu", options);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

// A snapshot over the limit is refused with its size; the run goes on.
TEST(RestartTest, SnapshotOverTheLimitIsRefusedWithItsSize) {
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  options.restart = {.max_restarts = 1, .max_snapshot_bytes = 100};
  std::vector<absl::Status> saved(2);
  absl::Status s = dist::spawn(
      [&](dist::Context& ctx) {
        Mlp net;
        int64_t step = 3;
        saved[ctx.rank()] = dist::SaveSnapshot(ctx, {.model = &net, .step = &step});
      },
      2, "cpu", options);
  ASSERT_TRUE(s.ok()) << s;
  for (const absl::Status& one : saved) {
    EXPECT_EQ(one.code(), absl::StatusCode::kResourceExhausted) << one;
    EXPECT_TRUE(Contains(one.message(), "bytes, more than RestartPolicy::max_snapshot_bytes (100)"))
        << one;
  }
}

// Restore errors and the no-restart case: SaveSnapshot keeps nothing and
// RestoreSnapshot restores nothing.
TEST(RestartTest, WithoutRestartsSnapshotsAreNotKept) {
  absl::Status s = dist::spawn(
      [](dist::Context& ctx) -> absl::Status {
        Mlp net;
        int64_t step = 1;
        dist::TrainingState state{.model = &net, .step = &step};
        RETURN_IF_ERROR(dist::SaveSnapshot(ctx, state));
        if (ctx.attempt_info().snapshots != nullptr) return absl::InternalError("a store");
        ASSIGN_OR_RETURN(const bool restored, dist::RestoreSnapshot(ctx, state));
        if (restored) return absl::InternalError("restored");
        return absl::OkStatus();
      },
      2, "cpu", DefaultTestSpawnOptions());
  EXPECT_TRUE(s.ok()) << s;
}

// World shrink: 3 ranks, rank 2 fails after step 5; with
// leave_out_failed_rank the next attempt runs on 2 ranks, each restoring the
// snapshot of step 5 of the rank it was, the sampler and DataParallel given the
// global batch (12) so it is kept. It ends with the parameters, bit for bit, of
// a 2-rank run started from a checkpoint of the same step, and near those of
// the uninterrupted 3-rank run (the same samples per step, summed in another
// order). With a global batch of 8, 4 ranks (2 samples each) shrink to 3 that
// do not divide it (3, 3, 2), their gradients weighed by rows.
constexpr int64_t kShrinkRows = 48;
constexpr int kShrinkSteps = 12;

struct ShrinkRun {
  int64_t global_batch = 12;    // DistributedOptions / DataParallelOptions::global_batch_size
  int fault_rank = -1;          // fails after step 5 of the first attempt
  int sleep_rank = -1;          // sleeps after step 5 of the first attempt, not stop-aware
  int sleep_ms = 0;
  std::string save_checkpoint;  // written at step 5 (every rank)
  std::string load_checkpoint;  // loaded before the first step
  std::mutex mu;
  std::vector<std::vector<float>> final_parameters;  // by rank of the last attempt
  std::vector<int> world_sizes;                      // ctx.world_size() per call, rank 0
};

// log: RunRanks's (its faults fire at EndStep, after each step's snapshot), or null.
absl::Status TrainShrinkable(dist::Context& ctx, ShrinkRun& run, StepLog* log = nullptr) {
  Mlp net;
  dist::DataParallel dp(net, ctx, {.global_batch_size = run.global_batch});
  optim::SGD sgd(net.parameters(), {.lr = 0.05, .momentum = 0.9});
  data::DistributedBatchSampler sampler({.dataset_size = kShrinkRows,
                                         .global_batch_size = run.global_batch,
                                         .num_replicas = ctx.world_size(),
                                         .rank = ctx.rank(),
                                         .seed = 5});
  nn::Tensor data_x, data_y;
  {
    SameOnEveryRank shared(/*seed=*/11, /*step=*/0);
    data_x = nn::randn({kShrinkRows, 6});
    data_y = nn::randn({kShrinkRows, 1});
  }
  int64_t step = 0;
  dist::TrainingState state{.model = &net, .optimizer = &sgd, .sampler = &sampler, .step = &step};
  if (ctx.rank() == 0) {
    std::lock_guard<std::mutex> lock(run.mu);
    run.world_sizes.push_back(ctx.world_size());
  }
  if (!run.load_checkpoint.empty()) {
    RETURN_IF_ERROR(dist::LoadTrainingCheckpoint(ctx, run.load_checkpoint, state));
  }
  RETURN_IF_ERROR(dist::RestoreSnapshot(ctx, state).status());
  sampler.reset();
  while (step < kShrinkSteps) {
    std::optional<std::vector<int64_t>> batch = sampler.next();
    if (!batch.has_value()) {
      sampler.reset();
      continue;
    }
    const nn::Tensor rows = nn::from_vector<int64_t>(*batch, {static_cast<int64_t>(batch->size())},
                                                     {.dtype = nn::kInt64});
    nn::Tensor loss =
        nn::mse_loss(dp(nn::index_select(data_x, rows)), nn::index_select(data_y, rows));
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    RETURN_IF_ERROR(dist::SaveSnapshot(ctx, state));
    if (step == 5 && !run.save_checkpoint.empty()) {
      RETURN_IF_ERROR(dist::SaveTrainingCheckpoint(ctx, run.save_checkpoint, state));
    }
    if (step == 5 && ctx.attempt() == 0 && ctx.rank() == run.fault_rank) {
      return absl::InternalError("injected fault");
    }
    if (step == 5 && ctx.attempt() == 0 && ctx.rank() == run.sleep_rank) {
      std::this_thread::sleep_for(std::chrono::milliseconds(run.sleep_ms));
    }
    if (log != nullptr) RETURN_IF_ERROR(log->EndStep(loss.item()));
  }
  std::vector<float> values;
  for (const nn::Tensor& p : net.parameters()) {
    for (const float v : p.to_vector<float>()) values.push_back(v);
  }
  std::lock_guard<std::mutex> lock(run.mu);
  if (run.final_parameters.size() < static_cast<size_t>(ctx.world_size())) {
    run.final_parameters.resize(ctx.world_size());
  }
  run.final_parameters[ctx.rank()] = std::move(values);
  return absl::OkStatus();
}

absl::Status SpawnShrinkable(ShrinkRun& run, int ranks, dist::RestartPolicy policy,
                             std::string* log) {
  dist::SpawnOptions options = DefaultTestSpawnOptions();
  std::ostringstream out;
  options.console = &out;
  options.restart = policy;
  absl::Status s = dist::spawn([&run](dist::Context& ctx) { return TrainShrinkable(ctx, run); },
                               ranks, "cpu", options);
  if (log != nullptr) *log = out.str();
  return s;
}

// Through RunRanks, with its faults and a watchdog of `timeout_s`.
absl::Status RunShrinkable(ShrinkRun& run, int ranks, std::vector<Fault> faults,
                           double timeout_s, RunReport* report) {
  RunOptions options = Options(ranks, std::move(faults), /*max_restarts=*/1, timeout_s);
  options.spawn.restart.leave_out_failed_rank = true;
  options.record_parameters = false;
  return RunRanks(
      [&run](dist::Context& ctx, StepLog& log) { return TrainShrinkable(ctx, run, &log); },
      options, report);
}

TEST(RestartTest, LeaveOutFailedRankContinuesOnFewerRanksFromTheSnapshot) {
  const std::string checkpoint = TempCheckpoint("restart_test_shrink.ckpt");
  ShrinkRun shrunk{.fault_rank = 2, .save_checkpoint = checkpoint};
  std::string log;
  absl::Status s = SpawnShrinkable(shrunk, 3, {.max_restarts = 1, .leave_out_failed_rank = true},
                                   &log);
  ASSERT_TRUE(s.ok()) << s << "\n" << log;
  EXPECT_EQ(shrunk.world_sizes, (std::vector<int>{3, 2}));
  EXPECT_TRUE(Contains(log, "spawn: restart 1 of 1 after: rank 2 (cpu) returned: INTERNAL: "
                            "injected fault; attempt 1 resumes from the snapshot of step 5 on "
                            "2 ranks, without local rank 2 (cpu), the rank whose function "
                            "failed; recovery "))
      << log;
  EXPECT_TRUE(Contains(log, "was written by 3 rank(s), this run has 2: generator states are "
                            "not restored"))
      << log;
  ASSERT_EQ(shrunk.final_parameters.size(), 2u);

  // The same step's checkpoint, continued by a 2-rank run.
  ShrinkRun from_file{.load_checkpoint = checkpoint};
  s = SpawnShrinkable(from_file, 2, {}, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(from_file.final_parameters.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(shrunk.final_parameters[r], from_file.final_parameters[r]) << "rank " << r;
  }

  // The uninterrupted 3-rank run: the same samples per step (the global batch
  // kept), averaged over 3 ranks instead of 2.
  ShrinkRun whole;
  s = SpawnShrinkable(whole, 3, {}, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(whole.final_parameters.size(), 3u);
  ASSERT_EQ(whole.final_parameters[0].size(), shrunk.final_parameters[0].size());
  for (size_t i = 0; i < whole.final_parameters[0].size(); ++i) {
    EXPECT_NEAR(whole.final_parameters[0][i], shrunk.final_parameters[0][i], 1e-5) << i;
  }
  std::remove(checkpoint.c_str());
}

// 4 ranks with a global batch of 8 (2 samples each); rank 2 fails after step
// 5 and 3 ranks finish with the same global batch (3, 3, 2 samples): bit for
// bit a 3-rank run from the checkpoint of step 5, and near the uninterrupted
// 4-rank run.
TEST(RestartTest, LeaveOutFailedRankKeepsAGlobalBatchTheRanksLeftDoNotDivide) {
  const std::string checkpoint = TempCheckpoint("restart_test_shrink_uneven.ckpt");
  ShrinkRun shrunk{.global_batch = 8, .fault_rank = 2, .save_checkpoint = checkpoint};
  std::string log;
  absl::Status s = SpawnShrinkable(shrunk, 4, {.max_restarts = 1, .leave_out_failed_rank = true},
                                   &log);
  ASSERT_TRUE(s.ok()) << s << "\n" << log;
  EXPECT_EQ(shrunk.world_sizes, (std::vector<int>{4, 3}));
  EXPECT_TRUE(Contains(log, "attempt 1 resumes from the snapshot of step 5 on 3 ranks, without "
                            "local rank 2 (cpu)"))
      << log;
  ASSERT_EQ(shrunk.final_parameters.size(), 3u);

  ShrinkRun from_file{.global_batch = 8, .load_checkpoint = checkpoint};
  s = SpawnShrinkable(from_file, 3, {}, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(from_file.final_parameters.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(shrunk.final_parameters[r], from_file.final_parameters[r]) << "rank " << r;
  }

  // The uninterrupted 4-rank run: the same 8 samples per step, weighed by rows.
  ShrinkRun whole{.global_batch = 8};
  s = SpawnShrinkable(whole, 4, {}, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(whole.final_parameters.size(), 4u);
  const std::vector<float>& a = whole.final_parameters[0];
  const std::vector<float>& b = shrunk.final_parameters[0];
  ASSERT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  std::printf("global batch 8, 4 ranks then 3 (3, 3, 2) vs 4 throughout: largest parameter "
              "difference %.3g\n", worst);
  EXPECT_LE(worst, 1e-5);
  EXPECT_GT(worst, 0.0f) << "4 and 3 ranks sum in another order; equal bits would mean one "
                            "of the runs did not shrink";
  std::remove(checkpoint.c_str());
}

// A failure that names no single rank's function (here a communicator's
// error) keeps every device, and the log says why.
TEST(RestartTest, LeaveOutFailedRankKeepsEveryRankWithoutOneFailedFunction) {
  RunOptions options =
      Options(3, {{.action = FaultAction::kReturnError,
                   .rank = 0,
                   .collective = 9,
                   .error = absl::UnavailableError("injected network failure")}});
  options.spawn.restart.leave_out_failed_rank = true;
  RunReport report;
  absl::Status s = RunRanks(Restartable({.step_delay_ms = 40}), options, &report);
  ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
  EXPECT_EQ(report.attempts, 2);
  EXPECT_TRUE(Contains(report.log, " on every rank (none left out: no rank's function failed "
                                   "(a communicator's error)); recovery "))
      << report.log;
}

// A timeout because one rank never entered the collective its peers wait in
// (4 ranks, rank 2 hangs in a stop-aware wait after step 5, testing's kHang):
// the watchdog names it, and the next attempt runs on the 3 other ranks from
// the snapshot of step 5, bit for bit as a 3-rank run from a checkpoint of
// that step.
TEST(RestartTest, LeaveOutFailedRankLeavesOutTheRankATimeoutNames) {
  const std::string checkpoint = TempCheckpoint("restart_test_timeout_shrink.ckpt");
  ShrinkRun shrunk{.save_checkpoint = checkpoint};
  RunReport report;
  absl::Status s = RunShrinkable(shrunk, 4, {{.action = FaultAction::kHang, .rank = 2, .step = 4}},
                                 /*timeout_s=*/1, &report);
  ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
  EXPECT_EQ(shrunk.world_sizes, (std::vector<int>{4, 3}));
  EXPECT_EQ(report.attempts, 2);
  ASSERT_EQ(report.faults.size(), 1u);
  EXPECT_EQ(report.faults[0].outcome, "cancelled by the stop");
  EXPECT_TRUE(Contains(report.log, "spawn: restart 1 of 1 after: watchdog: a collective did not "
                                   "complete within 1 s;"))
      << report.log;
  EXPECT_TRUE(Contains(report.log, "wait for rank 2 (cpu), which has not entered it; attempt 1 "
                                   "resumes from the snapshot of step 5 on 3 ranks, without "
                                   "local rank 2 (cpu), the rank the watchdog's timeout named; "
                                   "recovery "))
      << report.log;
  ASSERT_EQ(shrunk.final_parameters.size(), 3u);

  ShrinkRun from_file{.load_checkpoint = checkpoint};
  s = SpawnShrinkable(from_file, 3, {}, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(from_file.final_parameters.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(shrunk.final_parameters[r].empty()) << "rank " << r;
    EXPECT_EQ(shrunk.final_parameters[r], from_file.final_parameters[r]) << "rank " << r;
  }
  std::remove(checkpoint.c_str());
}

// The rank a timeout names must still leave its function within timeout_s of
// the stop: one stuck outside any abortable wait (a plain sleep) ends the run.
TEST(RestartTest, LeaveOutFailedRankStillEndsTheRunForARankOutsideAnyAbortableWait) {
  ShrinkRun stuck{.sleep_rank = 2, .sleep_ms = 2500};
  RunReport report;
  absl::Status s = RunShrinkable(stuck, 3, {}, /*timeout_s=*/0.5, &report);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(Contains(s.message(), "wait for rank 2 (cpu), which has not entered it")) << s;
  EXPECT_FALSE(s.GetPayload("tandem.dist/lagging_ranks").has_value());
  EXPECT_FALSE(s.GetPayload("tandem.dist/failure_cause").has_value());
  EXPECT_EQ(report.attempts, 1);
  EXPECT_EQ(stuck.world_sizes, (std::vector<int>{3}));
  EXPECT_TRUE(Contains(report.log, "spawn: not restarting: local rank 2 left its function "))
      << report.log;
  EXPECT_TRUE(Contains(report.log, "it was outside any abortable wait")) << report.log;
}

// A timeout that names two ranks behind (both hang after step 3), or none
// (every rank entered the collective, one is slow inside it), keeps every
// device, and the log says why.
TEST(RestartTest, LeaveOutFailedRankKeepsEveryRankWhenATimeoutNamesNotExactlyOne) {
  struct Case {
    std::vector<Fault> faults;
    const char* why;
  };
  const Case cases[] = {
      {{{.action = FaultAction::kHang, .rank = 1, .step = 3},
        {.action = FaultAction::kHang, .rank = 2, .step = 3}},
       " on every rank (none left out: the watchdog's timeout named 2 ranks that the others "
       "waited for (local ranks 1 and 2)); recovery "},
      {{{.action = FaultAction::kSlow,
         .rank = 2,
         .collective = 9,
         .delay = std::chrono::milliseconds(30000)}},
       " on every rank (none left out: the watchdog's timeout named no rank that the others "
       "waited for (every rank had entered the collective)); recovery "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    RunOptions options = Options(4, c.faults, /*max_restarts=*/1, /*timeout_s=*/0.5);
    options.spawn.restart.leave_out_failed_rank = true;
    RunReport report;
    absl::Status s = RunRanks(Restartable({}), options, &report);
    ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
    EXPECT_EQ(report.attempts, 2);
    EXPECT_EQ(report.ranks.size(), 4u);
    EXPECT_TRUE(Contains(report.log, "watchdog: a collective did not complete within 0.5 s"))
        << report.log;
    EXPECT_TRUE(Contains(report.log, c.why)) << report.log;
  }
}

// The store: the newest step every rank holds, older ones dropped.
TEST(SnapshotStoreTest, KeepsTheNewestStepEveryRankHolds) {
  dist::SnapshotStore store(2, 0);
  EXPECT_EQ(store.CommittedStep(), std::nullopt);
  ASSERT_TRUE(store.Put(0, 1, "a1").ok());
  EXPECT_EQ(store.CommittedStep(), std::nullopt);
  ASSERT_TRUE(store.Put(1, 1, "b1").ok());
  EXPECT_EQ(store.CommittedStep(), 1);
  ASSERT_TRUE(store.Put(0, 2, "a2").ok());  // rank 1 has not reached step 2
  EXPECT_EQ(store.CommittedStep(), 1);
  ASSERT_NE(store.Get(1, 1), nullptr);
  EXPECT_EQ(*store.Get(1, 1), "b1");
  ASSERT_TRUE(store.Put(1, 2, "b2").ok());
  EXPECT_EQ(store.CommittedStep(), 2);
  EXPECT_EQ(store.Get(0, 1), nullptr);  // dropped
  EXPECT_EQ(store.bytes(), 4);
  ASSERT_TRUE(store.Put(0, 3, "a3").ok());
  store.DiscardAfter(store.CommittedStep());
  EXPECT_EQ(store.Get(0, 3), nullptr);
  EXPECT_EQ(store.CommittedStep(), 2);
  store.DiscardAfter(std::nullopt);
  EXPECT_EQ(store.CommittedStep(), std::nullopt);
  dist::SnapshotStore small(1, 3);
  absl::Status s = small.Put(0, 7, "abcd");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(s.message(), "snapshot of step 7 on local rank 0: 4 bytes")) << s;
}

}  // namespace
}  // namespace tandem::testing
