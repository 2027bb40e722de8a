// The calling thread's CUDA stream and the status check used by every CUDA file
// of nn. Internal to nn (includes the CUDA runtime header).
#ifndef TANDEM_NN_CUDA_CONTEXT_H_
#define TANDEM_NN_CUDA_CONTEXT_H_

#include <cuda_runtime_api.h>

#include <new>  // std::nothrow_t

#include "nn/cuda/internal/call_counter.h"
#include "nn/device.h"

namespace tandem::nn::internal {

// The calling thread's compute stream on `device` (non-blocking), taken on first
// use from a process-wide pool of spare streams or created with `device` current
// (the calling thread's current device is restored). When the thread ends the
// stream goes back to the pool, never destroyed: storages name their owning
// stream (Storage::stream()) and may outlive the thread. Every op enqueues its
// work here. Cheap when called again for the same device (a one-entry cache).
// Throws tandem::Error once the thread's streams have been given back (from a
// destructor of a thread_local destroyed after them at the thread's exit).
cudaStream_t ThreadStream(Device device);
// True once the calling thread's streams have been given back at its exit:
// ThreadStream then throws. For destructors of thread_locals destroyed after
// them (made before the thread's first stream), which must order their work
// some other way (a host wait).
bool ThreadStreamsGone() noexcept;

// Throws tandem::Error naming `call`, the device and CUDA's message unless OK.
void CheckCuda(cudaError_t status, const char* call, Device device);

// Makes `device` the CUDA runtime's current device until destruction, then
// restores the device the thread had (the runtime's, not nn's thread device:
// unlike DeviceGuard it leaves current_device() alone). Every nn function that
// needs a device current for a call (creating a stream, an event or a handle,
// copying or freeing pool memory) uses it, so a thread's current device never
// changes behind its back. One exception, so that nn never creates a context
// the thread did not ask for: a thread that had no CUDA context at all (it never
// selected or used a device, and the runtime's default, GPU 0, was never
// initialised) keeps `device` current afterwards instead of being sent to GPU 0
// (cudaSetDevice makes a context, hundreds of MB, and fails where GPU 0 is
// exclusive to another process). Cheap when `device` is already current (one
// cudaGetDevice). Throws tandem::Error if selecting `device` fails; the
// std::nothrow form never throws (for destructors: a failure is left for the
// next checked call). Only the device found at construction is restored: code
// inside the scope that selects devices itself needs a scope of its own.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(Device device);
  CudaDeviceScope(Device device, std::nothrow_t) noexcept;
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int previous_ = -1;  // the device to restore; -1: nothing to restore
};

}  // namespace tandem::nn::internal

// Checks a CUDA call, naming the expression, the device and CUDA's message.
#define TANDEM_CHECK_CUDA(expr, device) ::tandem::nn::internal::CheckCuda((expr), #expr, (device))
// After a kernel launch: reports a bad launch configuration at once, and counts
// the launch (nn/cuda/internal/call_counter.h).
#define TANDEM_CHECK_LAUNCH(name, device)                                                   \
  (::tandem::nn::internal::CountCudaCall(::tandem::nn::internal::CudaCall::kKernelLaunch), \
   ::tandem::nn::internal::CheckCuda(cudaGetLastError(), name, (device)))

#endif  // TANDEM_NN_CUDA_CONTEXT_H_
