// bfloat16 bias kernels of the conv family (the convolutions themselves are
// cuDNN's, conv_cuda.cc). Arithmetic in float32, one rounding to bfloat16 per
// result, int64 indices, on the thread's stream.
#include "nn/cuda/bf16.cuh"
#include "nn/cuda/context.h"
#include "nn/ops/internal/conv_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

// A bfloat16 tensor's data as the kernel-side type.
__nv_bfloat16* Bf16(const Tensor& t) { return ::tandem::nn::internal::DevPtr<BFloat16>(t); }

// y[i] += bias[channel of i]; y is (n, o, plane) with plane = oh * ow.
__global__ void BiasAddKernel(const __nv_bfloat16* bias, __nv_bfloat16* y, int64_t numel,
                              int64_t o, int64_t plane) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= numel) return;
  const int64_t c = (i / plane) % o;
  y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + __bfloat162float(bias[c]));
}

// One block per channel c: db[c] = sum over (n, plane) of dy, each thread a
// strided partial sum, then a tree in shared memory (fixed order: deterministic).
__global__ void BiasGradKernel(const __nv_bfloat16* dy, __nv_bfloat16* db, int64_t n, int64_t o,
                               int64_t plane) {
  __shared__ float partial[kThreads];
  const int64_t c = blockIdx.x;
  const int64_t count = n * plane;
  float acc = 0.0f;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    const int64_t b = k / plane, s = k - b * plane;
    acc += __bfloat162float(dy[(b * o + c) * plane + s]);
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int step = kThreads / 2; step > 0; step /= 2) {
    if (static_cast<int>(threadIdx.x) < step) partial[threadIdx.x] += partial[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[c] = __float2bfloat16_rn(partial[0]);
}

}  // namespace

void ConvBiasAddBFloat16Cuda(const Tensor& bias, const Conv2dGeometry& g, const Tensor& y) {
  const int64_t numel = y.numel();
  if (numel == 0) return;
  BiasAddKernel<<<Blocks(numel), kThreads, 0, nn::internal::ThreadStream(y.device())>>>(
      Bf16(bias), Bf16(y), numel, g.o, g.oh * g.ow);
  TANDEM_CHECK_LAUNCH("conv2d BiasAddKernel (bfloat16)", y.device());
}

void ConvBiasGradBFloat16Cuda(const Tensor& dy, const Tensor& dbias) {
  const int64_t o = dy.size(1);
  if (o == 0) return;
  BiasGradKernel<<<o, kThreads, 0, nn::internal::ThreadStream(dy.device())>>>(
      Bf16(dy), Bf16(dbias), dy.size(0), o, dy.size(2) * dy.size(3));
  TANDEM_CHECK_LAUNCH("conv2d BiasGradKernel (bfloat16)", dy.device());
}

}  // namespace tandem::nn::ops::internal
