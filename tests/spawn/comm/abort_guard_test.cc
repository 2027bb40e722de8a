// AbortGuard (spawn/comm/abort_guard.h): neither a rank's library call nor
// the watchdog's abort waits for good on the other.
#include "spawn/comm/abort_guard.h"

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace tandem::dist::internal {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A Use that starts while an abort runs does not queue behind it: the abort
// may itself wait on something the rank thread releases only once its call
// has given up (NCCL's last abort waits until every CUDA graph holding its
// collectives is destroyed; a rank thread destroys its graph as it unwinds).
// The abort here waits up to 10 s for the rank's Use to give up; a guard whose
// Use queues behind the abort deadlocks for those 10 s and the checks fail.
TEST(AbortGuardTest, AUseDoesNotWaitBehindAnAbort) {
  AbortGuard guard;
  std::atomic<bool> abort_running{false};
  std::atomic<bool> use_gave_up{false};
  std::thread watchdog([&] {
    const AbortGuard::Outcome outcome = guard.Abort(
        [&] {
          abort_running.store(true);
          const Clock::time_point start = Clock::now();
          while (!use_gave_up.load() && SecondsSince(start) < 10) std::this_thread::sleep_for(1ms);
        },
        std::chrono::seconds(10));
    EXPECT_EQ(outcome, AbortGuard::Outcome::kRan);
  });
  while (!abort_running.load()) std::this_thread::sleep_for(1ms);
  const Clock::time_point start = Clock::now();
  {
    AbortGuard::Use use(guard, "all_reduce");
    EXPECT_TRUE(use.aborted()) << "a Use during an abort must not touch the library object";
  }
  use_gave_up.store(true);
  EXPECT_LT(SecondsSince(start), 2.0) << "the Use waited behind the abort";
  watchdog.join();
  EXPECT_TRUE(guard.aborted());
  AbortGuard::Use later(guard);
  EXPECT_TRUE(later.aborted());
}

// A library call that does not return holds the guard: the abort gives up at
// its deadline, names the call, and does not run; once the call returns, a
// second abort runs.
TEST(AbortGuardTest, AbortGivesUpAtItsDeadlineAndNamesTheCallInProgress) {
  AbortGuard guard;
  std::atomic<bool> inside{false};
  std::atomic<bool> release{false};
  std::thread rank([&] {
    AbortGuard::Use use(guard, "all_reduce");
    ASSERT_FALSE(use.aborted());
    inside.store(true);
    while (!release.load()) std::this_thread::sleep_for(1ms);
  });
  while (!inside.load()) std::this_thread::sleep_for(1ms);
  bool ran = false;
  std::string in_use;
  const Clock::time_point start = Clock::now();
  EXPECT_EQ(guard.Abort([&] { ran = true; }, 50ms, &in_use), AbortGuard::Outcome::kTimedOut);
  const double waited = SecondsSince(start);
  EXPECT_GE(waited, 0.045);
  EXPECT_LT(waited, 2.0);
  EXPECT_FALSE(ran) << "the abort ran under a call in progress";
  EXPECT_EQ(in_use, "all_reduce");
  EXPECT_FALSE(guard.aborted());
  release.store(true);
  rank.join();
  EXPECT_EQ(guard.Abort([&] { ran = true; }, 1s), AbortGuard::Outcome::kRan);
  EXPECT_TRUE(ran);
  EXPECT_EQ(guard.Abort([] {}, 1s), AbortGuard::Outcome::kAlready);
}

// The watchdog's polls never wait for a rank's call, and stop once an abort
// has been asked for.
TEST(AbortGuardTest, TryUseRunsOnlyWhenTheGuardIsFreeAndNotAborted) {
  AbortGuard guard;
  int polls = 0;
  EXPECT_TRUE(guard.TryUse([&] { ++polls; }));
  {
    AbortGuard::Use use(guard);
    auto other = std::async(std::launch::async, [&] { return guard.TryUse([&] { ++polls; }); });
    EXPECT_FALSE(other.get());
  }
  EXPECT_EQ(polls, 1);
  EXPECT_EQ(guard.Abort([] {}, 1s), AbortGuard::Outcome::kRan);
  EXPECT_FALSE(guard.TryUse([&] { ++polls; }));
  EXPECT_EQ(polls, 1);
}

}  // namespace
}  // namespace tandem::dist::internal
