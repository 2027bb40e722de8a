// nn's stop-aware host wait (nn/interrupt.h): WaitUntil returns when ready,
// calls the thread's interrupt check between polls, and what the check throws
// ends the wait. The check is per thread and scoped.
#include "nn/interrupt.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "gtest/gtest.h"

namespace tandem::nn {
namespace {

struct Stopped : std::runtime_error {
  Stopped() : std::runtime_error("stopped") {}
};

TEST(InterruptTest, WaitUntilReturnsWhenAnotherThreadMakesItReady) {
  std::atomic<bool> ready{false};
  std::thread device([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ready.store(true);
  });
  internal::WaitUntil([&] { return ready.load(); });
  EXPECT_TRUE(ready.load());
  device.join();
}

TEST(InterruptTest, InstalledCheckEndsAWaitThatNeverCompletes) {
  std::atomic<bool> stop{false};
  std::atomic<int> checks{0};
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stop.store(true);
  });
  ScopedInterruptCheck check([&] {
    checks.fetch_add(1);
    if (stop.load()) throw Stopped();
  });
  EXPECT_TRUE(HasInterruptCheck());
  EXPECT_THROW(internal::WaitUntil([] { return false; }), Stopped);
  EXPECT_GT(checks.load(), 1);
  watchdog.join();
}

TEST(InterruptTest, ReadyFirstMeansNoCheckIsNeeded) {
  int checks = 0;
  ScopedInterruptCheck check([&] { ++checks; });
  internal::WaitUntil([] { return true; });
  EXPECT_EQ(checks, 0);
}

TEST(InterruptTest, ErrorsFromReadyEndTheWait) {
  EXPECT_THROW(internal::WaitUntil([]() -> bool { throw std::logic_error("device error"); }),
               std::logic_error);
}

TEST(InterruptTest, ChecksAreScopedAndPerThread) {
  EXPECT_FALSE(HasInterruptCheck());
  EXPECT_NO_THROW(CheckInterrupt());
  {
    ScopedInterruptCheck outer([] { throw Stopped(); });
    EXPECT_THROW(CheckInterrupt(), Stopped);
    {
      ScopedInterruptCheck inner([] {});
      EXPECT_NO_THROW(CheckInterrupt());
    }
    EXPECT_THROW(CheckInterrupt(), Stopped);
    bool other_thread_has_one = true;
    std::thread other([&] { other_thread_has_one = HasInterruptCheck(); });
    other.join();
    EXPECT_FALSE(other_thread_has_one);
  }
  EXPECT_FALSE(HasInterruptCheck());
}

}  // namespace
}  // namespace tandem::nn
