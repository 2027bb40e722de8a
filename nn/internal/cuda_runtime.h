// The CUDA runtime services the core needs (memory, copies, the thread's stream).
// Implemented in nn/cuda/runtime.cc, compiled only when TANDEM_WITH_CUDA; callers
// guard with #if TANDEM_WITH_CUDA. Internal to nn: no other folder includes this.
#ifndef TANDEM_NN_INTERNAL_CUDA_RUNTIME_H_
#define TANDEM_NN_INTERNAL_CUDA_RUNTIME_H_

#include <cstdint>

#include "nn/device.h"

namespace tandem::nn::internal {

// Stream-ordered allocation on the calling thread's stream for `device`
// (cudaMallocAsync from the device's default pool, kept cached).
void* CudaAllocate(int64_t bytes, Device device);
void CudaFree(void* ptr, Device device);
// Copies `bytes` between any two of host / device memory, ordered on the thread's
// stream. A copy to the host returns when the data is there.
void CudaCopy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes);
// Fills `bytes` of device memory with zeros on the thread's stream.
void CudaMemsetZero(void* dst, Device device, int64_t bytes);
// Number of visible devices; 0 when there is no driver or no device.
int CudaDeviceCount();
// Selects `device` for the calling thread (cudaSetDevice).
void CudaSetDevice(int index);

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_CUDA_RUNTIME_H_
