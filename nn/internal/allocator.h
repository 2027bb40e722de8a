// Allocation hooks used by CUDA graph capture (nn/cuda/graph.cc). Internal to nn.
#ifndef TANDEM_NN_INTERNAL_ALLOCATOR_H_
#define TANDEM_NN_INTERNAL_ALLOCATOR_H_

#include <utility>
#include <vector>

#include "nn/device.h"

struct CUstream_st;

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

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_ALLOCATOR_H_
