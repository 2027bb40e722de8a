// The calling thread's CUDA stream and the status check used by every CUDA file
// of nn. Internal to nn (includes the CUDA runtime header).
#ifndef TANDEM_NN_CUDA_CONTEXT_H_
#define TANDEM_NN_CUDA_CONTEXT_H_

#include <cuda_runtime_api.h>

#include "nn/device.h"

namespace tandem::nn::internal {

// The calling thread's compute stream on `device` (non-blocking), taken on first
// use from a process-wide pool of spare streams or created with `device` current
// (the calling thread's current device is restored). When the thread ends the
// stream goes back to the pool, never destroyed: storages name their owning
// stream (Storage::stream()) and may outlive the thread. Every op enqueues its
// work here. Cheap when called again for the same device (a one-entry cache).
cudaStream_t ThreadStream(Device device);

// Throws tandem::Error naming `call`, the device and CUDA's message unless OK.
void CheckCuda(cudaError_t status, const char* call, Device device);

// Makes `device` the CUDA runtime's current device until destruction, then
// restores the previous one (the runtime's, not nn's thread device: unlike
// DeviceGuard it leaves current_device() alone). Throws if either call fails.
// Every nn function that needs a device current for a call (creating a stream,
// an event or a handle, copying pool memory) uses it, so a thread's current
// device never changes behind its back.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(Device device) : device_(device) {
    CheckCuda(cudaGetDevice(&previous_), "cudaGetDevice", device);
    if (previous_ != device.index) CheckCuda(cudaSetDevice(device.index), "cudaSetDevice", device);
  }
  ~CudaDeviceScope() {
    if (previous_ != device_.index) cudaSetDevice(previous_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  Device device_;
  int previous_ = 0;
};

}  // namespace tandem::nn::internal

// Checks a CUDA call, naming the expression, the device and CUDA's message.
#define TANDEM_CHECK_CUDA(expr, device) ::tandem::nn::internal::CheckCuda((expr), #expr, (device))
// After a kernel launch: reports a bad launch configuration at once.
#define TANDEM_CHECK_LAUNCH(name, device) \
  ::tandem::nn::internal::CheckCuda(cudaGetLastError(), name, (device))

#endif  // TANDEM_NN_CUDA_CONTEXT_H_
