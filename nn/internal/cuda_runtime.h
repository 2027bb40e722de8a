// The CUDA runtime services the core needs (memory, copies, the thread's stream,
// pinned host memory). Implemented in nn/cuda/runtime.cc and
// nn/cuda/pinned_allocator.cc, compiled only when TANDEM_WITH_CUDA; callers guard
// with #if TANDEM_WITH_CUDA. Internal to nn: no other folder includes this.
// Free of CUDA headers (tensor.cc includes it): streams are passed as
// CUstream_st*, which is what cudaStream_t is.
#ifndef TANDEM_NN_INTERNAL_CUDA_RUNTIME_H_
#define TANDEM_NN_INTERNAL_CUDA_RUNTIME_H_

#include <cstdint>
#include <string>
#include <memory>

#include "nn/device.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace tandem::nn {
class Allocator;
}

namespace tandem::nn::internal {

// The calling thread's stream for `device` (ThreadStream in nn/cuda/context.h).
CUstream_st* CudaThreadStream(Device device);
// Stream-ordered allocation on the calling thread's stream for `device`
// (cudaMallocAsync from the device's default pool, kept cached). The storage
// that gets it records that stream as its owner (Storage::stream()).
void* CudaAllocate(int64_t bytes, Device device);
// Stream-ordered free on `stream`, the memory's owning stream (of `device`),
// from any thread; the calling thread's CUDA device is left as it was. Must not
// throw: a failing free is reported by the next checked call.
void CudaFree(void* ptr, Device device, CUstream_st* stream) noexcept;
// Makes `waiter` (a stream of any device) wait for the work enqueued so far on
// `producer` (a stream of CUDA device `producer_device`), through an event of
// the calling thread; no host wait. Throws tandem::Error if CUDA fails.
void CudaStreamWait(CUstream_st* waiter, CUstream_st* producer, Device producer_device);
// The same for destructors: failures are left for the next checked call.
void CudaStreamWaitNoThrow(CUstream_st* waiter, CUstream_st* producer,
                           Device producer_device) noexcept;
// Copies `bytes` between any two of host / device memory, ordered on the thread's
// stream of the CUDA side (the destination's for device to device), with that
// device current for the call (a copy of stream-ordered pool memory fails when
// another device is current) and the caller's device restored.
//  - device -> device on two devices: cudaMemcpyPeerAsync on the destination's
//    stream after it has waited for the source device's stream of this thread
//    (which Tensor::data_ptr() has ordered after the source's owner); the
//    caller records the destination stream on the source storage
//    (Storage::RecordStream) so that its free waits for the copy. Pool memory
//    needs no cudaMemPoolSetAccess for this: peer copies go through the copy
//    engines (staged by the driver where the GPUs have no peer path), and
//    where cudaDeviceCanAccessPeer says yes, the destination is granted read
//    access to the source's pool once, so they go direct.
//  - host -> device: returns without waiting for the device. From pinned memory
//    (PinnedHostAllocator) the copy reads `src` asynchronously: the block is
//    recorded as in use (RecordPinnedUse) and the caller must not write to it
//    until the stream has passed the copy. From pageable memory the bytes are
//    first copied on the host into a pinned staging block from the cache, so the
//    driver never sees pageable memory and `src` may be reused at once.
//  - device -> host: returns when the data is in `dst` (the stream is
//    synchronised, through a pinned staging block for pageable `dst`), then
//    raises any deferred device error of the device (see device_error.h).
// While the stream is being captured into a CUDA graph the copy is a plain
// cudaMemcpyAsync of the given pointers (a copy to the host then fails the
// capture, as any host synchronisation does).
void CudaCopy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes);
// Fills `bytes` of device memory with zeros on the thread's stream.
void CudaMemsetZero(void* dst, Device device, int64_t bytes);
// Number of visible devices; 0 when there is no driver or no device.
int CudaDeviceCount();
// The device's UUID as nvidia-smi prints it ("GPU-8f2d...", "MIG-..." for a MIG
// instance is not distinguished: "GPU-" always); "" if CUDA cannot say.
std::string CudaDeviceUuid(int index);
// Selects `device` for the calling thread (cudaSetDevice).
void CudaSetDevice(int index);
// The calling thread's CUDA runtime device (cudaGetDevice), for tests.
int CudaGetDevice();
// Waits for the calling thread's stream on `device`, then raises any deferred
// device error of `device` (tandem::Error).
void CudaSynchronize(Device device);

// --- Pinned host memory (nn/cuda/pinned_allocator.cc) ---------------------------
// The process-wide caching allocator of pinned (page-locked) host memory, an
// Allocator for Device::CPU() storages. Blocks come from cudaHostAlloc (portable:
// usable with every device), rounded up to a power of two of at least 512 bytes,
// and are cached when freed and handed out again for a request of the same size
// class; they are never returned to the driver while the process runs (except
// that when cudaHostAlloc runs out, cached blocks no copy is using are released
// and the allocation retried once). A freed block that a copy may still be
// reading or writing (RecordPinnedUse) is not handed out again until every event
// recorded on it has completed: Allocate polls with cudaEventQuery, never
// blocks, and takes a new block when no cached one is ready. Thread-safe.
// Allocate throws tandem::Error when no CUDA device is usable.
const std::shared_ptr<Allocator>& PinnedHostAllocator();
// True when `ptr` lies inside a block that PinnedHostAllocator has handed out
// and that is not freed.
bool IsPinnedHostPointer(const void* ptr);
// Records an event on `stream` (of `device`) after the work enqueued so far: the
// pinned block containing `ptr` is not reused before that event completes, even
// if it is freed first. Throws tandem::Error if `ptr` is not in a live block.
void RecordPinnedUse(const void* ptr, Device device, CUstream_st* stream);
// Counters of the cache, for tests and diagnostics.
struct PinnedCacheStats {
  int64_t blocks = 0;          // cudaHostAlloc'd blocks held
  int64_t bytes = 0;           // their total size
  int64_t cached_blocks = 0;   // of which free (in the cache)
  int64_t pending_blocks = 0;  // of which free but waiting for a recorded use
};
PinnedCacheStats GetPinnedCacheStats();

// For thread-locals holding device memory that a CUDA graph captured on the
// thread reads at every replay (the thread's cuBLASLt workspace,
// clip_grad_norm_'s pointer tables): their destructors call this first, so
// that at the thread's exit the graphs it captured are released (CudaGraph: a
// later Replay() from another thread throws, naming the exited thread) before
// that memory goes. CudaGraph also calls it from a thread-local made at the end
// of the thread's first capture (destroyed before those the step made
// earlier). Releases each graph once; nothing when the thread captured none.
// Never throws.
void ReleaseThreadGraphs() noexcept;

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_CUDA_RUNTIME_H_
