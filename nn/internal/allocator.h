// Allocation hooks used by CUDA graph capture (nn/cuda/graph.cc). Internal to nn.
#ifndef TANDEM_NN_INTERNAL_ALLOCATOR_H_
#define TANDEM_NN_INTERNAL_ALLOCATOR_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "nn/device.h"
#include "nn/internal/stream_uses.h"

struct CUstream_st;

namespace tandem::nn {
class Allocator;
}

namespace tandem::nn::internal {

// Pool memory whose Storage died while a capture ran on the thread, with the
// stream its free was to be ordered on (null: none given).
struct DeferredCudaFree {
  void* ptr;
  Device device;
  CUstream_st* stream;
};
using DeferredCudaFrees = std::vector<DeferredCudaFree>;

// While `frees` is set on a thread, the default CUDA pool allocator appends the
// memory it is asked to free on that thread to `frees` instead of calling
// cudaFreeAsync (which, on a capturing stream, would be an error for memory the
// graph did not allocate); the capture's owner frees them once capture has
// ended. Returns the previous list; nullptr clears.
DeferredCudaFrees* SetThreadDeferredCudaFrees(DeferredCudaFrees* frees);

// The calling thread's stream for `device` if it has made one, else null
// (never makes one: for destructors).
CUstream_st* CudaThreadStreamIfAny(Device device) noexcept;

// A Storage's free of `ptr` (`bytes` of `device`, from `allocator`, owned by
// stream `owner`, used by `users`), for every free but the common one (the
// owner is the calling thread's stream and no other stream used the memory):
// `owner` waits for every user, then the memory is freed through the
// allocator on `owner` (FreeOnStream). At once, unless a CUDA graph capture
// runs on `owner` now (CudaGraph, on another thread or this one): that work
// would be recorded in the capture (the waits invalidate it; a free of memory
// the graph did not allocate too), so it is handed to the capture and done by
// the capturing thread once the capture has ended, with the pool memory kept
// by the graph (which may read it at every replay). A user stream (of
// `device` or of another GPU) that another thread captures is waited for
// through the event recorded on it before its capture began (an event
// recorded there would join `owner` to that capture); the locks of every
// device involved are held meanwhile (CaptureRegistry::RunAfterUsersOrQueue).
// Never throws (out of memory for the hand-over: the memory is
// leaked rather than freed into a capture).
void FreeOnOwnerUnlessCaptured(std::shared_ptr<Allocator> allocator, void* ptr, int64_t bytes,
                               Device device, CUstream_st* owner,
                               std::vector<StreamRef> users) noexcept;

// A Storage's first use on `stream` (of `device`), which is not `owner`:
// `stream` waits for the work enqueued on `owner` so far, through an event
// recorded there (CudaStreamWait). While a capture runs on `owner` (another
// thread's), that record would join `stream` to the capture: `stream` waits
// instead for the event the capture recorded on `owner` just before it began
// (all of the owner's eager work; the captured work runs only at replays).
// Throws tandem::Error if CUDA fails.
void WaitForOwner(CUstream_st* stream, CUstream_st* owner, Device device);

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_ALLOCATOR_H_
