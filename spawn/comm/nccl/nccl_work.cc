// The handle of an asynchronous NCCL collective (all_reduce_async,
// reduce_scatter_async): how it waits for its collective, in and out of CUDA
// graph captures and at its thread's exit (the rules:
// internal/work_wait.h). Compiled only with CUDA.
#include <cuda_runtime_api.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/cuda/internal/capture_mode.h"
#include "nn/error.h"
#include "nn/graph.h"
#include "nn/internal/allocator.h"
#include "nn/interrupt.h"
#include "spawn/comm/nccl/internal/nccl_work.h"
#include "spawn/comm/nccl/internal/work_wait.h"

namespace tandem::dist::internal {
namespace {

// The handle of an asynchronous collective. Destroyed unwaited, it makes the
// destroying thread's compute stream wait for the collective, so memory freed
// after it on that stream (the tensor, held by Communicator's wrapper until this
// is gone) is not reused while NCCL may still read or write it.
//
// Which wait, where (internal/work_wait.h has the rules and CUDA's reasons):
//  - Made inside a CUDA graph capture (`capture`, CudaGraph::CaptureId(); 0
//    when none ran), the collective is recorded in the graph, not run, and
//    done_ was recorded in the capture: CUDA refuses to query such an event
//    (cudaErrorCapturedEvent, left as the thread's last error, where the next
//    kernel's launch check would report it against that kernel, and a query
//    inside the capture may invalidate it), and a wait on it from any other
//    capture (a later one on the same thread) would merge two captures, which
//    invalidates the later one. Such a handle never queries it: is_completed()
//    is true (nothing of it runs outside the graph; each replay is followed by
//    the watchdog as one "graph replay"), wait() joins the compute stream back
//    inside its own capture, and anywhere else is a clear error, and the
//    destructor waits only inside its own capture.
//  - Made outside any capture and waited for (or destroyed) inside one on the
//    calling thread's stream (a warm-up step's handle dropped in the captured
//    step): the capturing stream cannot wait for an event recorded outside its
//    capture (CUDA invalidates the capture, which Capture() reported as "the
//    step synchronised with the host"). The host waits for the event instead,
//    stop-aware and in relaxed capture mode (a query of an event recorded
//    outside the capture is legal there); the collective is then over, so
//    neither the captured work after it nor the tensor's free can come early.
//  - Destroyed by a thread_local at its thread's exit after the thread's
//    streams were given back (a thread_local made before the thread's first
//    stream is destroyed after them): the host waits as well (ThreadStream
//    throws there; without a wait the tensor would be freed on its owning
//    stream unordered after the collective).
class NcclWork final : public Work {
 public:
  NcclWork(cudaEvent_t done, nn::Device device, std::shared_ptr<EventPool> pool, uint64_t capture)
      : done_(done), device_(device), pool_(std::move(pool)), capture_(capture) {}
  ~NcclWork() override {
    // Destructors must not throw: a failing wait is reported by the next checked
    // call. ThreadStream throws when the destroying thread has no stream on the
    // device yet and none can be made (a broken context): not std::terminate.
    // A host wait abandoned by the stop throws CancelledError: the abort then
    // ends the collective.
    if (!waited_) {
      try {
        nn::internal::CudaDeviceScope on_device(device_);
        switch (Plan(/*destructor=*/true)) {
          case WorkWaitPath::kStream:
            if (StreamWaitEvent(nn::internal::ThreadStream(device_), done_, 0) != cudaSuccess) {
              cudaGetLastError();  // not for the next kernel's launch check to report
            }
            break;
          case WorkWaitPath::kHost:
            (void)WaitOnHost();
            break;
          case WorkWaitPath::kNone:
          case WorkWaitPath::kRefused:
            break;
        }
      } catch (...) {
      }
    }
    pool_->Give(done_);
  }
  void wait() override {
    nn::internal::CudaDeviceScope on_device(device_);
    switch (Plan(/*destructor=*/false)) {
      case WorkWaitPath::kStream:
        TANDEM_CHECK_CUDA(StreamWaitEvent(nn::internal::ThreadStream(device_), done_, 0),
                          device_);
        break;
      case WorkWaitPath::kHost:
        TANDEM_CHECK_CUDA(WaitOnHost(), device_);
        break;
      case WorkWaitPath::kNone:
      case WorkWaitPath::kRefused:
        Fail("Work::wait on ", device_.ToString(), ": the collective was recorded in a CUDA "
             "graph capture that has ended (capture #", capture_,
             nn::CudaGraph::CaptureId() == 0
                 ? std::string("; no capture runs now")
                 : absl::StrCat("; capture #", nn::CudaGraph::CaptureId(), " runs now"),
             "); wait for it inside the captured step (a replay runs it in order on the stream "
             "that launches the graph)");
    }
    waited_ = true;
  }
  // The event after the collective on the communication stream; an error other
  // than "not ready" (an aborted communicator's broken stream) counts as
  // finished, for wait() or the next checked call to report. A captured
  // handle: true, without a query (see above); an event recorded in a capture
  // all the same (cudaErrorCapturedEvent) is answered alike, the error cleared.
  // Asked inside a capture on this thread (an eager handle, in the captured
  // step), the query runs in relaxed capture mode: in the capture's
  // thread-local mode CUDA refuses it and invalidates the capture.
  bool is_completed() const override {
    if (capture_ != 0) return true;
    std::optional<nn::internal::RelaxedCaptureMode> relaxed;
    if (nn::CudaGraph::CaptureId() != 0) relaxed.emplace();
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaErrorNotReady || q == cudaErrorCapturedEvent) {
      cudaGetLastError();  // not for the next kernel's launch check to report
      return q == cudaErrorCapturedEvent;
    }
    return true;
  }

 private:
  // Where this wait is asked for (internal/work_wait.h). The device is current.
  WorkWaitPath Plan(bool destructor) const {
    WorkWaitSite site{.made_in = capture_, .capture_now = nn::CudaGraph::CaptureId()};
    site.streams_gone = nn::internal::ThreadStreamsGone();
    if (!site.streams_gone && capture_ == 0 && site.capture_now != 0) {
      // The thread captures; is it its stream of this device (a capture of
      // another GPU leaves this stream eager; a thread without a stream on
      // this device cannot be capturing there, and none is made here)?
      if (cudaStream_t mine = nn::internal::CudaThreadStreamIfAny(device_)) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        TANDEM_CHECK_CUDA(cudaStreamIsCapturing(mine, &status), device_);
        site.stream_captures = status != cudaStreamCaptureStatusNone;
      }
    }
    return PlanWorkWait(site, destructor);
  }

  // The host waits until done_ has completed; returns cudaSuccess, or the CUDA
  // error its query returned (cleared from the thread's last error); never
  // "not ready" (WaitForEventOnHost, internal/work_wait.h). Polls through
  // nn::internal::WaitUntil: the thread's interrupt check (spawn's stop) may
  // end it by throwing. The queries run in relaxed capture mode: a
  // thread that captures in thread-local mode may not make potentially unsafe
  // calls, and CUDA forbids a query only of an event last recorded in a capture,
  // which done_ is not (an eager handle's).
  cudaError_t WaitOnHost() const {
    nn::internal::RelaxedCaptureMode relaxed;
    nn::internal::CountCudaCall(nn::internal::CudaCall::kHostWait);
    return WaitForEventOnHost(
        [&] {
          const cudaError_t q = cudaEventQuery(done_);
          // "not ready" is no error; a failure is returned, not left
          if (q != cudaSuccess) cudaGetLastError();
          return q;
        },
        [](const auto& ready) { nn::internal::WaitUntil(ready); }, cudaSuccess,
        cudaErrorNotReady);
  }

  cudaEvent_t done_;
  nn::Device device_;
  std::shared_ptr<EventPool> pool_;
  const uint64_t capture_;  // CudaGraph::CaptureId() when made; 0: eager
  bool waited_ = false;
};

}  // namespace

std::shared_ptr<Work> MakeNcclWork(cudaEvent_t done, nn::Device device,
                                   std::shared_ptr<EventPool> pool, uint64_t capture) {
  return std::make_shared<NcclWork>(done, device, std::move(pool), capture);
}

}  // namespace tandem::dist::internal
