// The calling thread's CUDA stream and the status check used by every CUDA file
// of nn. Internal to nn (includes the CUDA runtime header).
#ifndef TANDEM_NN_CUDA_CONTEXT_H_
#define TANDEM_NN_CUDA_CONTEXT_H_

#include <cuda_runtime_api.h>

#include "nn/device.h"

namespace tandem::nn::internal {

// The calling thread's compute stream on `device` (non-blocking, created on first
// use, destroyed when the thread ends). Every op enqueues its work here.
cudaStream_t ThreadStream(Device device);

// Throws tandem::Error naming `call`, the device and CUDA's message unless OK.
void CheckCuda(cudaError_t status, const char* call, Device device);

}  // namespace tandem::nn::internal

// Checks a CUDA call, naming the expression, the device and CUDA's message.
#define TANDEM_CHECK_CUDA(expr, device) ::tandem::nn::internal::CheckCuda((expr), #expr, (device))
// After a kernel launch: reports a bad launch configuration at once.
#define TANDEM_CHECK_LAUNCH(name, device) \
  ::tandem::nn::internal::CheckCuda(cudaGetLastError(), name, (device))

#endif  // TANDEM_NN_CUDA_CONTEXT_H_
