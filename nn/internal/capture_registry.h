// Which streams are being captured into CUDA graphs now, per device, and the
// lock, one per device, that orders what other threads do on a device's
// streams against the start of a capture there. Used by nn/cuda/graph.cc
// (CudaGraph) and, through it, by Storage's free and first use on another
// stream (nn/internal/allocator.h). Plain pointers and no CUDA header, so the
// rules are tested on the CPU with fake streams
// (tests/nn/capture_registry_test.cc). Internal to nn.
//
// Why it exists: a thread that records an event on, waits on, or frees memory
// on a stream that another thread is capturing does not run that work: CUDA
// adds it to the capture (the capture mode, cudaStreamCaptureModeThreadLocal
// here, only decides which *unsafe* calls, cudaMalloc and the like, other
// threads may make). An event recorded there joins the waiting stream to the
// capture (its later work is captured too, and cudaStreamEndCapture fails with
// cudaErrorStreamCaptureUnjoined); a capturing stream that waits for an event
// recorded outside the capture, or frees memory the graph did not allocate,
// invalidates the capture. So such work is done under the stream's device
// lock: at once when no capture runs on the stream (a capture cannot begin
// meanwhile: Begin takes the lock), else deferred or redirected (below).
//
// Per device, not process-wide: a replay on one GPU from another thread
// (CudaGraph::Replay) never stalls a capture or a replay on another GPU. A
// capture records only work of its own device (the capturing thread's stream,
// the streams its event waits fork into: the communicator's of that device;
// copies between GPUs refuse to be captured), so work on another device's
// streams can never join it.
//
// The locks are recursive: work done under a device's lock (a replay's
// pre-replay hooks) may reach a Storage's first use on that device again.
// Lock order: the device locks in ascending order (ReleaseOrDefer and
// RunAfterUsersOrQueue take several), then the list of deferred releases;
// work run under one device's lock must not need another device's lock (a
// replay's hooks must not free a storage that another GPU's stream used).
//
// Thread-safe.
#ifndef TANDEM_NN_INTERNAL_CAPTURE_REGISTRY_H_
#define TANDEM_NN_INTERNAL_CAPTURE_REGISTRY_H_

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "nn/internal/stream_uses.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*
struct CUevent_st;   // cudaEvent_t is CUevent_st*

namespace tandem::nn::internal {

class CaptureRegistry {
 public:
  // A release deferred by ReleaseOrDefer: the devices it touches, and itself.
  using Release = std::pair<std::vector<int>, std::function<void()>>;

  // A capture of `stream` on `device` begins (call before
  // cudaStreamBeginCapture; waits for work other threads do under the device's
  // lock). `mark`: an event that `record` records on `stream`, after all of its
  // eager work (RunOrMark hands it to first uses from other streams). `record`
  // runs under the device's lock, so that the work other threads queue on
  // `stream` under it (a replay's wait, a free) comes before the mark, never
  // between the mark and the capture; it returns whether it recorded (if not,
  // nothing is registered). Returns that.
  template <typename Record>
  bool Begin(int device, CUstream_st* stream, CUevent_st* mark, Record&& record) {
    Slot& slot = SlotOf(device);
    std::lock_guard<std::recursive_mutex> lock(slot.mu);
    if (!record()) return false;
    slot.captures.push_back({stream, mark, {}});
    return true;
  }
  // The same with `mark` already recorded.
  void Begin(int device, CUstream_st* stream, CUevent_st* mark) {
    Begin(device, stream, mark, [] { return true; });
  }

  // The capture of `stream` has ended (call after cudaStreamEndCapture):
  // returns the work RunAfterUsersOrQueue deferred to it, in order, for the
  // capturing thread to run now.
  std::vector<std::function<void()>> End(int device, CUstream_st* stream) {
    Slot& slot = SlotOf(device);
    std::lock_guard<std::recursive_mutex> lock(slot.mu);
    auto it = std::find_if(slot.captures.begin(), slot.captures.end(),
                           [&](const Capture& c) { return c.stream == stream; });
    if (it == slot.captures.end()) return {};
    std::vector<std::function<void()>> after = std::move(it->after);
    slot.captures.erase(it);
    return after;
  }

  // Runs `fn` under `device`'s lock unless a capture runs on the device now;
  // returns whether it ran.
  template <typename Fn>
  bool RunUnlessCapturing(int device, Fn&& fn) {
    Slot& slot = SlotOf(device);
    std::lock_guard<std::recursive_mutex> lock(slot.mu);
    if (!slot.captures.empty()) return false;
    fn();
    return true;
  }

  // A free on `owner` (a stream of `device`) that must first wait for `users`
  // (streams of any device: a peer copy's destination is another GPU's), under
  // the locks of `device` and of every user's device, taken in ascending order
  // (a capture on a user's device cannot begin between the check and the wait
  // recorded there). If `owner` is being captured, queues `later` for the
  // capturing thread (End) and returns false. Otherwise, for each user in
  // order: wait_mark(user, mark) when the user's stream is being captured on
  // its device (the event its Begin got: the user's eager work; an event
  // recorded on that stream would join `owner` to the capture), else
  // wait(user); then done(); returns true.
  // (`later` becomes a std::function only when it is queued; `users` may be
  // held by `later`: it is not read once `later` has been moved.)
  template <typename Wait, typename WaitMark, typename Done, typename Later>
  bool RunAfterUsersOrQueue(int device, CUstream_st* owner, const std::vector<StreamRef>& users,
                            Wait&& wait, WaitMark&& wait_mark, Done&& done, Later&& later) {
    // The common case, every user of the owner's device: one lock, no
    // allocation.
    std::unique_lock<std::recursive_mutex> own(SlotOf(device).mu, std::defer_lock);
    std::vector<std::unique_lock<std::recursive_mutex>> locks;
    if (std::all_of(users.begin(), users.end(),
                    [&](const StreamRef& user) { return user.device == device; })) {
      own.lock();
    } else {
      std::vector<int> devices{device};
      for (const StreamRef& user : users) devices.push_back(user.device);
      std::sort(devices.begin(), devices.end());
      devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
      locks.reserve(devices.size());
      for (int d : devices) locks.emplace_back(SlotOf(d).mu);
    }
    if (Capture* capture = Find(SlotOf(device), owner)) {
      capture->after.emplace_back(std::forward<Later>(later));
      return false;
    }
    for (const StreamRef& user : users) {
      if (const Capture* capture = Find(SlotOf(user.device), user.stream)) {
        wait_mark(user, capture->mark);
      } else {
        wait(user);
      }
    }
    done();
    return true;
  }

  // Under `device`'s lock: captured(mark) when `stream` is being captured
  // (the event Begin got), else now().
  template <typename Now, typename Captured>
  void RunOrMark(int device, CUstream_st* stream, Now&& now, Captured&& captured) {
    Slot& slot = SlotOf(device);
    std::lock_guard<std::recursive_mutex> lock(slot.mu);
    if (const Capture* capture = Find(slot, stream)) {
      captured(capture->mark);
    } else {
      now();
    }
  }

  // Runs `release` under the locks of `devices` unless a capture runs on one
  // of them; then keeps it until TakeDeferred. Returns whether it ran.
  bool ReleaseOrDefer(std::vector<int> devices, std::function<void()> release) {
    std::sort(devices.begin(), devices.end());
    devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
    std::vector<std::unique_lock<std::recursive_mutex>> locks;
    bool capturing = false;
    for (int device : devices) {
      Slot& slot = SlotOf(device);
      locks.emplace_back(slot.mu);
      capturing = capturing || !slot.captures.empty();
    }
    if (capturing) {
      // Under the device locks still: a capture that ends now takes it after.
      std::lock_guard<std::mutex> lock(deferred_mu_);
      deferred_.emplace_back(std::move(devices), std::move(release));
      return false;
    }
    release();
    return true;
  }

  // The releases ReleaseOrDefer kept, taken: the thread that ended a capture
  // passes each to ReleaseOrDefer again (one whose devices still capture is
  // kept again, for the last of those captures to end).
  std::vector<Release> TakeDeferred() {
    std::lock_guard<std::mutex> lock(deferred_mu_);
    std::vector<Release> taken;
    taken.swap(deferred_);
    return taken;
  }

  // Captures running on `device` now (for tests and checks).
  int captures(int device) {
    Slot& slot = SlotOf(device);
    std::lock_guard<std::recursive_mutex> lock(slot.mu);
    return static_cast<int>(slot.captures.size());
  }

 private:
  struct Capture {
    CUstream_st* stream;
    CUevent_st* mark;
    std::vector<std::function<void()>> after;  // RunAfterUsersOrQueue's, for End
  };
  struct Slot {
    std::recursive_mutex mu;
    std::vector<Capture> captures;  // guarded by mu
  };

  // The slot of `device`, made on first use; its address never changes.
  Slot& SlotOf(int device) {
    std::lock_guard<std::mutex> lock(slots_mu_);
    return slots_[device];
  }
  static Capture* Find(Slot& slot, CUstream_st* stream) {
    for (Capture& c : slot.captures) {
      if (c.stream == stream) return &c;
    }
    return nullptr;
  }

  std::mutex slots_mu_;
  std::map<int, Slot> slots_;  // guarded by slots_mu_ (the map; each slot by its own lock)
  std::mutex deferred_mu_;
  std::vector<Release> deferred_;  // guarded by deferred_mu_
};

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_CAPTURE_REGISTRY_H_
