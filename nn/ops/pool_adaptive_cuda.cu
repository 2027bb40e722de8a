// CUDA kernels of adaptive average pooling (cuDNN has none): one thread per
// output element forward, one per input element backward (a gather in the CPU
// kernel's order: no atomics, deterministic). float32, float64 and bfloat16
// (loaded as float, each result rounded once); int64 indices; on the thread's
// stream, no host sync.
#include "nn/cuda/bf16.cuh"
#include "nn/cuda/context.h"
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

using ::tandem::nn::internal::DevPtr;
using ::tandem::nn::internal::DeviceCompute;
using ::tandem::nn::internal::DeviceType;
using ::tandem::nn::internal::LoadDev;
using ::tandem::nn::internal::StoreDev;

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

// y[p, oy, ox] = mean of x[p] over the window of (oy, ox); p = n * C + c.
template <typename D>
__global__ void AdaptiveAvgForwardKernel(const D* x, D* y, int64_t numel, int64_t h, int64_t w,
                                         int64_t oh, int64_t ow) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= numel) return;
  const int64_t ox = i % ow, oy = (i / ow) % oh, p = i / (ow * oh);
  const int64_t y0 = AdaptiveStart(oy, h, oh), y1 = AdaptiveEnd(oy, h, oh);
  const int64_t x0 = AdaptiveStart(ox, w, ow), x1 = AdaptiveEnd(ox, w, ow);
  using C = DeviceCompute<D>;
  const D* plane = x + p * h * w;
  C sum = C(0);
  for (int64_t iy = y0; iy < y1; ++iy) {
    for (int64_t ix = x0; ix < x1; ++ix) sum += LoadDev(plane[iy * w + ix]);
  }
  y[i] = StoreDev<D>(sum / static_cast<C>((y1 - y0) * (x1 - x0)));
}

// dx[p, iy, ix] = sum over the windows holding (iy, ix) of dy / window size.
template <typename D>
__global__ void AdaptiveAvgBackwardKernel(const D* dy, D* dx, int64_t numel, int64_t h, int64_t w,
                                          int64_t oh, int64_t ow) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= numel) return;
  const int64_t ix = i % w, iy = (i / w) % h, p = i / (w * h);
  const int64_t oy0 = AdaptiveFirstOutput(iy, h, oh), oy1 = AdaptiveLastOutput(iy, h, oh);
  const int64_t ox0 = AdaptiveFirstOutput(ix, w, ow), ox1 = AdaptiveLastOutput(ix, w, ow);
  using C = DeviceCompute<D>;
  const D* dplane = dy + p * oh * ow;
  C sum = C(0);
  for (int64_t oy = oy0; oy < oy1; ++oy) {
    const int64_t y0 = AdaptiveStart(oy, h, oh), y1 = AdaptiveEnd(oy, h, oh);
    if (iy < y0 || iy >= y1) continue;
    for (int64_t ox = ox0; ox < ox1; ++ox) {
      const int64_t x0 = AdaptiveStart(ox, w, ow), x1 = AdaptiveEnd(ox, w, ow);
      if (ix < x0 || ix >= x1) continue;
      sum += LoadDev(dplane[oy * ow + ox]) / static_cast<C>((y1 - y0) * (x1 - x0));
    }
  }
  dx[i] = StoreDev<D>(sum);
}

}  // namespace

void AdaptiveAvgPool2dForwardCuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  const int64_t numel = y.numel();
  if (numel == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOATING(x.dtype(), "adaptive_avg_pool2d", [&]<typename T>() {
    using D = DeviceType<T>;
    AdaptiveAvgForwardKernel<D><<<Blocks(numel), kThreads, 0, stream>>>(
        DevPtr<T>(x), DevPtr<T>(y), numel, g.h, g.w, g.oh, g.ow);
  });
  TANDEM_CHECK_LAUNCH("AdaptiveAvgForwardKernel", x.device());
}

void AdaptiveAvgPool2dBackwardCuda(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t numel = dx.numel();
  if (numel == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(dy.device());
  TANDEM_DISPATCH_FLOATING(dy.dtype(), "adaptive_avg_pool2d_backward", [&]<typename T>() {
    using D = DeviceType<T>;
    AdaptiveAvgBackwardKernel<D><<<Blocks(numel), kThreads, 0, stream>>>(
        DevPtr<T>(dy), DevPtr<T>(dx), numel, g.h, g.w, g.oh, g.ow);
  });
  TANDEM_CHECK_LAUNCH("AdaptiveAvgBackwardKernel", dy.device());
}

}  // namespace tandem::nn::ops::internal
