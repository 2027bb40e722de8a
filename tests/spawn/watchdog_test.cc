// The watchdog's timeout (spawn/internal/watchdog.h) on traces set by hand: the
// status names the ranks the stuck ones wait for (those that have not entered
// their collective) in its message and carries them as a payload
// (GetLaggingRanks), which RestartPolicy::leave_out_failed_rank reads; a
// collective every rank entered names nobody.
#include "spawn/internal/watchdog.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "spawn/internal/restart.h"
#include "tests/spawn/inert_communicator.h"

namespace tandem::dist::internal {
namespace {

bool Contains(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

struct Progress {
  uint64_t entered = 0;
  uint64_t completed = 0;
};

// One watchdog over CPU ranks whose collectives stand as `ranks` says, those
// in flight entered 1 s ago, watched with a 10 ms timeout until it fails the
// run; returns the run's first failure.
absl::Status TimeOut(const std::vector<Progress>& ranks) {
  const int world = static_cast<int>(ranks.size());
  std::ostringstream console;
  auto logger = Logger::Create(world, {.console = &console});
  EXPECT_TRUE(logger.ok()) << logger.status();
  const std::vector<std::unique_ptr<Communicator>> comms;  // nothing to abort
  Watchdog watchdog(std::vector<nn::Device>(world, nn::Device::CPU()), logger->get(),
                    /*group=*/nullptr, &comms);
  const int64_t second_ago = SteadyNowNs() - 1'000'000'000;
  for (int r = 0; r < world; ++r) {
    CollectiveTrace* t = watchdog.trace(r);
    t->entered.store(ranks[r].entered);
    t->completed.store(ranks[r].completed);
    t->op.store("all_reduce");
    t->entered_ns.store(second_ago);
  }
  // No rank thread: Watch returns once the timeout has stopped the run and the
  // (empty) abort is done.
  watchdog.Joined();
  const std::atomic<uint64_t> sigints{0};
  StepAgreement agreement(world, /*signals=*/nullptr, /*grace_s=*/1);
  watchdog.Watch(/*timeout_s=*/0.01, sigints, 0, agreement, [](int) {});
  return watchdog.result();
}

TEST(WatchdogTimeoutTest, NamesTheOneRankThatHasNotEnteredTheCollective) {
  const absl::Status s = TimeOut({{9, 8}, {9, 8}, {8, 8}, {9, 8}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(GetFailureCause(s), FailureCause::kTimeout);
  EXPECT_EQ(GetLaggingRanks(s), (std::vector<int>{2}));
  EXPECT_TRUE(Contains(s.message(), "rank 2 (cpu): last completed all_reduce #8 (running);"))
      << s;
  EXPECT_TRUE(Contains(s.message(),
                       "; the ranks in all_reduce #9 wait for rank 2 (cpu), which has not "
                       "entered it"))
      << s;
}

// A rank behind that waits in an earlier collective of its own is still the
// one the others wait for.
TEST(WatchdogTimeoutTest, NamesARankBehindThatWaitsInAnEarlierCollective) {
  const absl::Status s = TimeOut({{9, 8}, {8, 7}, {9, 8}});
  EXPECT_EQ(GetLaggingRanks(s), (std::vector<int>{1})) << s;
}

TEST(WatchdogTimeoutTest, NamesEveryRankBehind) {
  const absl::Status s = TimeOut({{9, 8}, {8, 8}, {7, 7}, {9, 8}});
  EXPECT_EQ(GetLaggingRanks(s), (std::vector<int>{1, 2})) << s;
  EXPECT_TRUE(Contains(s.message(), "wait for rank 1 (cpu) and rank 2 (cpu), which have not "
                                    "entered it"))
      << s;
}

// Every rank entered the collective and it does not complete (the collective
// itself hangs, or a rank is slow inside it): nobody is named.
TEST(WatchdogTimeoutTest, NamesNobodyWhenEveryRankEnteredTheCollective) {
  const absl::Status s = TimeOut({{9, 8}, {9, 8}, {9, 8}});
  EXPECT_EQ(GetFailureCause(s), FailureCause::kTimeout) << s;
  EXPECT_TRUE(GetLaggingRanks(s).empty()) << s;
  EXPECT_FALSE(s.GetPayload("tandem.dist/lagging_ranks").has_value()) << s;
  EXPECT_FALSE(Contains(s.message(), "wait for")) << s;
}

// A communicator whose asynchronous error is raised, and whose rank's thread
// joined, right after the watchdog's poll found none: what happens when a run's
// last collectives and its ranks' return fall between one round's poll and the
// watchdog's next look at the joins (a loaded machine).
class ErrorAfterFirstPoll final : public ::tandem::testing::InertCommunicator {
 public:
  explicit ErrorAfterFirstPoll(Watchdog** watchdog)
      : InertCommunicator(0, 1), watchdog_(watchdog) {}
  std::string kind() const override { return "error-after-first-poll"; }
  absl::Status PollAsyncError() override {
    if (polls_++ == 0) {
      (*watchdog_)->Joined();
      return absl::OkStatus();
    }
    return absl::UnavailableError("injected asynchronous error");
  }
  int polls() const { return polls_; }

 private:
  Watchdog** watchdog_;
  int polls_ = 0;
};

TEST(WatchdogAsyncErrorTest, AnErrorRaisedBetweenAPollAndTheLastJoinFailsTheRun) {
  std::ostringstream console;
  auto logger = Logger::Create(1, {.console = &console});
  ASSERT_TRUE(logger.ok()) << logger.status();
  Watchdog* watchdog_ptr = nullptr;
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(std::make_unique<ErrorAfterFirstPoll>(&watchdog_ptr));
  const auto* comm = static_cast<const ErrorAfterFirstPoll*>(comms[0].get());
  Watchdog watchdog({nn::Device::CPU()}, logger->get(), /*group=*/nullptr, &comms);
  watchdog_ptr = &watchdog;
  const std::atomic<uint64_t> sigints{0};
  StepAgreement agreement(1, /*signals=*/nullptr, /*grace_s=*/1);
  watchdog.Watch(/*timeout_s=*/10, sigints, 0, agreement, [](int) {});
  const absl::Status s = watchdog.result();
  EXPECT_EQ(comm->polls(), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(Contains(s.message(), "rank 0")) << s;
  EXPECT_TRUE(Contains(s.message(), "injected asynchronous error")) << s;
}

// A communicator whose asynchronous error is raised once `raise` is set.
class ErrorOnceRaised final : public ::tandem::testing::InertCommunicator {
 public:
  explicit ErrorOnceRaised(const std::atomic<bool>* raise)
      : InertCommunicator(0, 1), raise_(raise) {}
  std::string kind() const override { return "error-once-raised"; }
  absl::Status PollAsyncError() override {
    return raise_->load() ? absl::UnavailableError("injected asynchronous error")
                          : absl::OkStatus();
  }

 private:
  const std::atomic<bool>* raise_;
};

// PolledAfterEveryRankFinished (the processes' last round waits for it) reads
// true only after a round of polls that followed every rank's Finish, and an
// error that round found has stopped the run by then.
TEST(WatchdogAsyncErrorTest, PolledAfterEveryRankFinishedComesAfterThatRoundsFailure) {
  std::ostringstream console;
  auto logger = Logger::Create(1, {.console = &console});
  ASSERT_TRUE(logger.ok()) << logger.status();
  std::atomic<bool> raise{false};
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.push_back(std::make_unique<ErrorOnceRaised>(&raise));
  Watchdog watchdog({nn::Device::CPU()}, logger->get(), /*group=*/nullptr, &comms);
  const std::atomic<uint64_t> sigints{0};
  StepAgreement agreement(1, /*signals=*/nullptr, /*grace_s=*/1);
  std::thread watch([&] {
    watchdog.Watch(/*timeout_s=*/0.05, sigints, 0, agreement, [](int) {});  // polls every 5 ms
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(watchdog.PolledAfterEveryRankFinished());  // the rank still runs
  raise = true;  // the rank's last collectives raised it, then it returned
  watchdog.Finish(0);
  while (!watchdog.PolledAfterEveryRankFinished()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(watchdog.stop_requested());
  const absl::Status s = watchdog.result();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  watchdog.Joined();
  watch.join();
}

TEST(LaggingRanksTest, PayloadRoundTripsAndIsAbsentByDefault) {
  EXPECT_TRUE(GetLaggingRanks(absl::DeadlineExceededError("x")).empty());
  const absl::Status s = WithLaggingRanks(absl::DeadlineExceededError("x"), {0, 3, 12});
  EXPECT_EQ(GetLaggingRanks(s), (std::vector<int>{0, 3, 12}));
  EXPECT_EQ(s.message(), "x");
}

}  // namespace
}  // namespace tandem::dist::internal
