// AbortGuard: serialises a communicator's library calls with its abort, which
// spawn's watchdog makes from its own thread while the rank thread may still be
// using the communicator. spawn's NCCL communicator and tandem::testing's fake
// asynchronous one use it; so can a communicator of your own (SpawnHooks).
//
//   void Collective() {                       // rank thread
//     AbortGuard::Use use(guard_);
//     if (use.aborted()) throw CancelledError(...);
//     ncclAllReduce(..., comm_, ...);         // comm_ cannot be freed meanwhile
//   }
//   absl::Status Abort(deadline) {            // watchdog thread
//     if (guard_.Abort([&] { ncclCommAbort(comm_); }, deadline) ==
//         AbortGuard::Outcome::kTimedOut) return error naming the call in progress;
//   }
//
// Contract: a Use holds the guard for one short library call that never waits
// for the device (see nccl_communicator.cc for why NCCL's enqueue does not);
// never hold one across a host wait. After Abort, every Use sees aborted() and
// must not touch the library object.
//
// Neither side waits for good on the other:
//  - A Use never waits behind an abort: once one is requested it gives up at
//    once and reports aborted() (a rank thread blocked on the guard while the
//    abort waits on something that thread must release, such as a CUDA graph it
//    would destroy as it unwinds, would otherwise deadlock the process).
//  - Abort waits for a Use in progress at most `deadline`. A library call that
//    has not returned by then (a rank stuck inside NCCL) is reported as
//    kTimedOut and the abort does not run: aborting under a call in progress
//    could free what the call uses. The caller escalates (spawn ends the
//    process with the error named: a hang is the one outcome it never accepts).
#ifndef TANDEM_SPAWN_COMM_ABORT_GUARD_H_
#define TANDEM_SPAWN_COMM_ABORT_GUARD_H_

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

namespace tandem::dist {

class AbortGuard {
 public:
  enum class Outcome {
    kRan,       // this call ran the abort
    kAlready,   // an earlier call ran it
    kTimedOut,  // a Use was still in progress at the deadline: the abort did not run
  };

  class Use {
   public:
    // `what` names the call for an abort that times out behind it ("all_reduce
    // #12"); it must outlive the Use.
    explicit Use(AbortGuard& guard, const char* what = "a library call") : guard_(guard) {
      // Uncontended (the usual case): one try_lock. Contended: by the watchdog's
      // short try-locks (PollAsyncError) or by an abort, which this must not
      // wait behind. (Polling try_lock rather than a timed mutex: the timed
      // lock's pthread_mutex_clocklock is invisible to ThreadSanitizer.)
      while (!guard.mutex_.try_lock()) {
        if (guard.abort_requested_.load(std::memory_order_acquire)) {
          aborted_ = true;
          return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      locked_ = true;
      aborted_ = guard.aborted_.load(std::memory_order_relaxed) ||
                 guard.abort_requested_.load(std::memory_order_acquire);
      guard.in_use_ = what;
    }
    ~Use() {
      if (!locked_) return;
      guard_.in_use_ = nullptr;
      guard_.mutex_.unlock();
    }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    // True when the communicator was aborted, or an abort is on its way: the
    // caller must not use it.
    bool aborted() const { return aborted_; }

   private:
    AbortGuard& guard_;
    bool locked_ = false;
    bool aborted_ = false;
  };

  // Runs abort() under the guard, once. Every Use from now on gives up at once;
  // a Use in progress is waited for at most `deadline` (see the file comment).
  // On kTimedOut, *in_use (when given) names the call in progress; a later
  // Abort may try again.
  template <typename Fn>
  Outcome Abort(Fn&& abort, std::chrono::nanoseconds deadline, std::string* in_use = nullptr) {
    abort_requested_.store(true, std::memory_order_release);
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    const auto give_up = std::chrono::steady_clock::now() + deadline;
    while (!lock.try_lock() && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (!lock.owns_lock()) {
      // Read without the lock: the pointer names a string literal that outlives
      // the call; at worst it names the call that has just ended.
      if (in_use != nullptr) {
        const char* what = in_use_.load(std::memory_order_relaxed);
        *in_use = what != nullptr ? what : "a library call";
      }
      return Outcome::kTimedOut;
    }
    if (aborted_.load(std::memory_order_relaxed)) return Outcome::kAlready;
    abort();
    aborted_.store(true, std::memory_order_release);
    return Outcome::kRan;
  }

  // Runs fn() under the guard unless the guard is busy or aborted (the
  // watchdog's polls must never wait for a rank's call). Returns whether it ran.
  template <typename Fn>
  bool TryUse(Fn&& fn) {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock() || aborted_.load(std::memory_order_relaxed) ||
        abort_requested_.load(std::memory_order_acquire)) {
      return false;
    }
    fn();
    return true;
  }

  // Lock-free; true once Abort has run.
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

 private:
  std::mutex mutex_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> abort_requested_{false};
  std::atomic<const char*> in_use_{nullptr};  // what the Use holding mutex_ calls
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_COMM_ABORT_GUARD_H_
