// Kernel interface of the dropout family, shared by the CPU and CUDA files.
#ifndef TANDEM_NN_OPS_INTERNAL_DROPOUT_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_DROPOUT_KERNELS_H_

#include <cstdint>

#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// Whether element `index` of a draw at `offset` survives: the same function on
// host and device, so CPU and GPU masks are identical bit for bit.
TANDEM_HOST_DEVICE bool DropoutKeeps(uint64_t seed, uint64_t stream, uint64_t offset,
                                     uint64_t index, float p) {
  return UniformFromBits(PhiloxAt(seed, stream, offset, index).out[0]) >= p;
}

// mask (uint8, x's shape) = DropoutKeeps(i); y = x * mask * scale.
void DropoutForwardCpu(const Tensor& x, const Tensor& y, const Tensor& mask, float p,
                       double scale, uint64_t seed, uint64_t stream, uint64_t offset);
// gx = gy * mask * scale.
void DropoutBackwardCpu(const Tensor& gy, const Tensor& mask, const Tensor& gx, double scale);
#if TANDEM_WITH_CUDA
// offset_on_device: null in an eager call; under CUDA graph capture, device
// memory holding the draw's offset (rewritten before every replay), read by the
// kernel instead of `offset`.
void DropoutForwardCuda(const Tensor& x, const Tensor& y, const Tensor& mask, float p,
                        double scale, uint64_t seed, uint64_t stream, uint64_t offset,
                        const uint64_t* offset_on_device = nullptr);
// Writes `offset` to `dst` (device memory) on the thread's stream for `device`.
void DropoutWriteOffsetCuda(uint64_t* dst, uint64_t offset, Device device);
void DropoutBackwardCuda(const Tensor& gy, const Tensor& mask, const Tensor& gx, double scale);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_DROPOUT_KERNELS_H_
