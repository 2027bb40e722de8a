// CUDA kernels of dropout: one thread per element, the mask from the same
// Philox counter as the CPU kernel (DropoutKeeps). Thread's stream, no sync.
// Under CUDA graph capture the forward kernel reads the draw's offset from
// device memory that a pre-replay hook rewrites (see dropout.cc).
// bfloat16 tensors are __nv_bfloat16 in the kernels, scaled in float and
// rounded once; the mask does not depend on the dtype.
#include <cuda_bf16.h>

#include <type_traits>

#include "nn/cuda/bf16.cuh"
#include "nn/cuda/context.h"
#include "nn/ops/internal/dropout_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

using ::tandem::nn::internal::DevPtr;
using ::tandem::nn::internal::DeviceCompute;
using ::tandem::nn::internal::DeviceType;
using ::tandem::nn::internal::LoadDev;
using ::tandem::nn::internal::StoreDev;

// x * scale in the compute type, stored in D (rounded once for bfloat16).
template <typename D> __device__ __forceinline__ D Scaled(D x, DeviceCompute<D> scale) {
  return StoreDev<D>(LoadDev(x) * scale);
}
template <typename D> __device__ __forceinline__ D Zero() { return StoreDev<D>(DeviceCompute<D>(0)); }

template <typename T>
__global__ void DropoutForwardKernel(const T* x, T* y, uint8_t* mask, int64_t n, float p,
                                     DeviceCompute<T> scale, uint64_t seed, uint64_t stream,
                                     uint64_t offset, const uint64_t* offset_on_device) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (offset_on_device != nullptr) offset = *offset_on_device;
  const bool keep = DropoutKeeps(seed, stream, offset, static_cast<uint64_t>(i), p);
  mask[i] = keep ? 1 : 0;
  y[i] = keep ? Scaled(x[i], scale) : Zero<T>();
}

__global__ void WriteOffsetKernel(uint64_t* dst, uint64_t offset) { *dst = offset; }

template <typename T>
__global__ void DropoutBackwardKernel(const T* gy, const uint8_t* mask, T* gx, int64_t n,
                                      DeviceCompute<T> scale) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) gx[i] = mask[i] ? Scaled(gy[i], scale) : Zero<T>();
}

}  // namespace

void DropoutForwardCuda(const Tensor& x, const Tensor& y, const Tensor& mask, float p,
                        double scale, uint64_t seed, uint64_t stream_id, uint64_t offset,
                        const uint64_t* offset_on_device) {
  const int64_t n = x.numel();
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOATING(x.dtype(), "dropout", [&]<typename T>() {
    using D = DeviceType<T>;
    DropoutForwardKernel<D><<<Blocks(n), kThreads, 0, stream>>>(
        DevPtr<T>(x), DevPtr<T>(y),
        mask.data<uint8_t>(), n, p, static_cast<DeviceCompute<D>>(scale), seed, stream_id, offset,
        offset_on_device);
  });
  TANDEM_CHECK_LAUNCH("DropoutForwardKernel", x.device());
}

void DropoutWriteOffsetCuda(uint64_t* dst, uint64_t offset, Device device) {
  WriteOffsetKernel<<<1, 1, 0, nn::internal::ThreadStream(device)>>>(dst, offset);
  TANDEM_CHECK_LAUNCH("WriteOffsetKernel", device);
}

void DropoutBackwardCuda(const Tensor& gy, const Tensor& mask, const Tensor& gx, double scale) {
  const int64_t n = gy.numel();
  cudaStream_t stream = nn::internal::ThreadStream(gy.device());
  TANDEM_DISPATCH_FLOATING(gy.dtype(), "dropout_backward", [&]<typename T>() {
    using D = DeviceType<T>;
    DropoutBackwardKernel<D><<<Blocks(n), kThreads, 0, stream>>>(
        DevPtr<T>(gy), mask.data<uint8_t>(), DevPtr<T>(gx), n, static_cast<DeviceCompute<D>>(scale));
  });
  TANDEM_CHECK_LAUNCH("DropoutBackwardKernel", gy.device());
}

}  // namespace tandem::nn::ops::internal
