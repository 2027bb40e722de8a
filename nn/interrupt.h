// Stop-aware host waits: a thread can ask that its waits on the GPU end early.
//
// Every place where nn makes the host wait for the device (Tensor::item(),
// to(cpu), nn::Synchronize, a staged host-to-device copy refilling its buffer)
// waits through WaitUntil below. On a thread with no interrupt check installed
// it blocks as the CUDA runtime would. On a thread with one installed (spawn
// installs one on every rank thread) it polls instead, and calls the check
// between polls; the check throws to abandon the wait. Why: a stream may wait
// on a collective that will never complete (a peer failed before issuing it),
// and a blocking wait would then never return.
//
//   nn::ScopedInterruptCheck check([&] { if (stop.stop_requested()) throw Stopped(); });
//   x.item();   // returns with the value, or throws Stopped once stop is requested
//
// nn knows nothing of why a wait should end (ranks, signals, watchdogs): the
// check decides, and what it throws reaches the caller of the wait unchanged.
// A wait abandoned this way leaves its work queued on the device; whatever that
// work still writes (a staging buffer, a pinned destination) is kept from reuse
// until the device has passed it.
//
// Thread-safety: the check is the calling thread's own (thread-local); it is
// called only on that thread.
#ifndef TANDEM_NN_INTERRUPT_H_
#define TANDEM_NN_INTERRUPT_H_

#include <functional>

namespace tandem::nn {

// Installs `check` as the calling thread's interrupt check for the scope's
// lifetime (the previous one, if any, is restored after). `check` returns to
// let the wait go on and throws to end it.
class ScopedInterruptCheck {
 public:
  explicit ScopedInterruptCheck(std::function<void()> check);
  ~ScopedInterruptCheck();
  ScopedInterruptCheck(const ScopedInterruptCheck&) = delete;
  ScopedInterruptCheck& operator=(const ScopedInterruptCheck&) = delete;

 private:
  std::function<void()> check_;
  const std::function<void()>* previous_;
};

// True when the calling thread has an interrupt check installed.
bool HasInterruptCheck();
// Calls the calling thread's check (which may throw); nothing when none.
void CheckInterrupt();

namespace internal {

// Returns once ready() returns true; ready() may throw (a device error), which
// ends the wait. With an interrupt check installed, calls it between polls. The
// poll backs off: a few immediate retries, then yields for about 1 ms, then
// sleeps growing to 100 us between polls (a wait of t gains at most ~100 us,
// never more than t/10 once t > 1 ms). Without a check: the same polling.
// Callers that can block in a library call instead (cudaStreamSynchronize) do
// so when !HasInterruptCheck().
void WaitUntil(const std::function<bool()>& ready);

}  // namespace internal
}  // namespace tandem::nn

#endif  // TANDEM_NN_INTERRUPT_H_
