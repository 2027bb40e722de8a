// AbortGuard: serialises a communicator's library calls with its abort, which
// spawn's watchdog makes from its own thread while the rank thread may still be
// using the communicator. Internal to spawn (and its tests' fake communicator).
//
//   void Collective() {                       // rank thread
//     AbortGuard::Use use(guard_);
//     if (use.aborted()) throw CancelledError(...);
//     ncclAllReduce(..., comm_, ...);         // comm_ cannot be freed meanwhile
//   }
//   void Abort() {                            // watchdog thread
//     guard_.Abort([&] { ncclCommAbort(comm_); });
//   }
//
// Contract: a Use holds the guard for one short library call that never waits
// for the device (see nccl_communicator.cc for why NCCL's enqueue does not);
// never hold one across a host wait, or the abort that would end the wait
// could not run. After Abort, every Use sees aborted() and must not touch the
// library object.
#ifndef TANDEM_SPAWN_INTERNAL_ABORT_GUARD_H_
#define TANDEM_SPAWN_INTERNAL_ABORT_GUARD_H_

#include <atomic>
#include <mutex>

namespace tandem::dist::internal {

class AbortGuard {
 public:
  class Use {
   public:
    explicit Use(AbortGuard& guard)
        : lock_(guard.mutex_), aborted_(guard.aborted_.load(std::memory_order_relaxed)) {}
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    // True when the communicator was aborted: the caller must not use it.
    bool aborted() const { return aborted_; }

   private:
    std::lock_guard<std::mutex> lock_;
    bool aborted_;
  };

  // Runs abort() under the guard, once: it waits for a Use in progress to end,
  // and later calls do nothing. Returns whether this call ran it.
  template <typename Fn>
  bool Abort(Fn&& abort) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_.load(std::memory_order_relaxed)) return false;
    abort();
    aborted_.store(true, std::memory_order_release);
    return true;
  }

  // Lock-free; true once Abort has run.
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

 private:
  std::mutex mutex_;
  std::atomic<bool> aborted_{false};
};

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_INTERNAL_ABORT_GUARD_H_
