#include "nn/interrupt.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

namespace tandem::nn {
namespace {
thread_local const std::function<void()>* t_check = nullptr;
}  // namespace

ScopedInterruptCheck::ScopedInterruptCheck(std::function<void()> check)
    : check_(std::move(check)), previous_(t_check) {
  t_check = check_ ? &check_ : nullptr;
}

ScopedInterruptCheck::~ScopedInterruptCheck() { t_check = previous_; }

bool HasInterruptCheck() { return t_check != nullptr; }

void CheckInterrupt() {
  if (t_check != nullptr) (*t_check)();
}

namespace internal {

void WaitUntil(const std::function<bool()>& ready) {
  using Clock = std::chrono::steady_clock;
  constexpr int kImmediateRetries = 16;
  constexpr auto kYieldFor = std::chrono::milliseconds(1);
  constexpr auto kMaxSleep = std::chrono::microseconds(100);
  for (int i = 0; i < kImmediateRetries; ++i) {
    if (ready()) return;
    CheckInterrupt();
  }
  const Clock::time_point start = Clock::now();
  while (Clock::now() - start < kYieldFor) {
    if (ready()) return;
    CheckInterrupt();
    std::this_thread::yield();
  }
  auto sleep = std::chrono::microseconds(5);
  while (!ready()) {
    CheckInterrupt();
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, kMaxSleep);
  }
}

}  // namespace internal
}  // namespace tandem::nn
