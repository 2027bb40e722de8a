// bfloat16 kernels of the pool family (float32 / float64 go through cuDNN,
// pool_cuda.cc). They follow the CPU kernels (pool_cpu.cc) step for step:
// compares and sums in float32 in the same order, one rounding per result, the
// first maximum in row-major window order on ties, argmax indices kept for
// backward. Backward gathers: one thread per input element sums, in output
// order, the windows that route to it, so no atomics and the same bits as the
// CPU. int64 indices, on the thread's stream.
#include "nn/cuda/bf16.cuh"
#include "nn/cuda/context.h"
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

// A bfloat16 tensor's data as the kernel-side type.
__nv_bfloat16* Bf16(const Tensor& t) { return ::tandem::nn::internal::DevPtr<BFloat16>(t); }

// The outputs [lo, hi] along one axis whose window covers input position i
// (window o spans o * stride - pad .. o * stride - pad + kernel - 1); empty when lo > hi.
struct Covering {
  int64_t lo, hi;
};
__device__ Covering CoveringOutputs(int64_t i, int64_t kernel, int64_t stride, int64_t pad,
                                    int64_t outputs) {
  const int64_t first = i + pad - kernel + 1;  // smallest o * stride that still covers i
  const int64_t lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const int64_t last = (i + pad) / stride;  // largest o whose window starts at or before i
  const int64_t hi = last < outputs - 1 ? last : outputs - 1;
  return {lo, hi};
}

// One thread per output element.
__global__ void MaxForwardKernel(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t* indices,
                                 int64_t numel, Pool2dGeometry g) {
  const int64_t out = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (out >= numel) return;
  const int64_t ox = out % g.ow, oy = (out / g.ow) % g.oh, p = out / (g.ow * g.oh);
  const __nv_bfloat16* plane = x + p * g.h * g.w;
  int64_t best = -1;
  float best_value = 0.0f;
  for (int64_t i = 0; i < g.kh; ++i) {
    const int64_t iy = oy * g.sh - g.ph + i;
    if (iy < 0 || iy >= g.h) continue;
    for (int64_t j = 0; j < g.kw; ++j) {
      const int64_t ix = ox * g.sw - g.pw + j;
      if (ix < 0 || ix >= g.w) continue;
      const float v = __bfloat162float(plane[iy * g.w + ix]);
      if (best < 0 || v > best_value) {  // strict: the first maximum wins ties
        best = iy * g.w + ix;
        best_value = v;
      }
    }
  }
  y[out] = __float2bfloat16_rn(best_value);  // exact: the value came from x
  indices[out] = best;
}

// One thread per input element: the sum of dy over the windows whose argmax it is.
__global__ void MaxBackwardKernel(const int64_t* indices, const __nv_bfloat16* dy,
                                  __nv_bfloat16* dx, int64_t numel, Pool2dGeometry g) {
  const int64_t in = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (in >= numel) return;
  const int64_t pos = in % (g.h * g.w), p = in / (g.h * g.w);
  const int64_t iy = pos / g.w, ix = pos % g.w;
  const Covering rows = CoveringOutputs(iy, g.kh, g.sh, g.ph, g.oh);
  const Covering cols = CoveringOutputs(ix, g.kw, g.sw, g.pw, g.ow);
  const int64_t base = p * g.oh * g.ow;
  float sum = 0.0f;
  for (int64_t oy = rows.lo; oy <= rows.hi; ++oy) {
    for (int64_t ox = cols.lo; ox <= cols.hi; ++ox) {
      const int64_t k = base + oy * g.ow + ox;
      if (indices[k] == pos) sum += __bfloat162float(dy[k]);
    }
  }
  dx[in] = __float2bfloat16_rn(sum);
}

// One thread per output element; padding counts in the divisor (scale = 1 / (kh kw)).
__global__ void AvgForwardKernel(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t numel,
                                 Pool2dGeometry g, float scale) {
  const int64_t out = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (out >= numel) return;
  const int64_t ox = out % g.ow, oy = (out / g.ow) % g.oh, p = out / (g.ow * g.oh);
  const __nv_bfloat16* plane = x + p * g.h * g.w;
  float sum = 0.0f;
  for (int64_t i = 0; i < g.kh; ++i) {
    const int64_t iy = oy * g.sh - g.ph + i;
    if (iy < 0 || iy >= g.h) continue;
    for (int64_t j = 0; j < g.kw; ++j) {
      const int64_t ix = ox * g.sw - g.pw + j;
      if (ix >= 0 && ix < g.w) sum += __bfloat162float(plane[iy * g.w + ix]);
    }
  }
  y[out] = __float2bfloat16_rn(__fmul_rn(sum, scale));
}

// One thread per input element: the sum of dy * scale over the windows covering it.
__global__ void AvgBackwardKernel(const __nv_bfloat16* dy, __nv_bfloat16* dx, int64_t numel,
                                  Pool2dGeometry g, float scale) {
  const int64_t in = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (in >= numel) return;
  const int64_t pos = in % (g.h * g.w), p = in / (g.h * g.w);
  const int64_t iy = pos / g.w, ix = pos % g.w;
  const Covering rows = CoveringOutputs(iy, g.kh, g.sh, g.ph, g.oh);
  const Covering cols = CoveringOutputs(ix, g.kw, g.sw, g.pw, g.ow);
  const int64_t base = p * g.oh * g.ow;
  float sum = 0.0f;
  for (int64_t oy = rows.lo; oy <= rows.hi; ++oy) {
    for (int64_t ox = cols.lo; ox <= cols.hi; ++ox) {
      // __fmul_rn: no contraction into an FMA, so the sum matches the CPU's bits.
      sum += __fmul_rn(__bfloat162float(dy[base + oy * g.ow + ox]), scale);
    }
  }
  dx[in] = __float2bfloat16_rn(sum);
}

// 1 / (kh kw) as the CPU computes it (float32 division on the host).
float AvgScale(const Pool2dGeometry& g) { return 1.0f / static_cast<float>(g.kh * g.kw); }

}  // namespace

void MaxPool2dForwardBFloat16Cuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                                  const Tensor& indices) {
  TANDEM_CHECK(indices.defined() && indices.dtype() == kInt64 && indices.numel() == y.numel(),
               "max_pool2d (bfloat16, CUDA): needs int64 indices shaped like y ",
               ShapeToString(y.shape()));
  const int64_t numel = y.numel();
  if (numel == 0) return;
  MaxForwardKernel<<<Blocks(numel), kThreads, 0, nn::internal::ThreadStream(x.device())>>>(
      Bf16(x), Bf16(y), indices.data<int64_t>(), numel, g);
  TANDEM_CHECK_LAUNCH("max_pool2d MaxForwardKernel (bfloat16)", x.device());
}

void MaxPool2dBackwardBFloat16Cuda(const Tensor& indices, const Tensor& dy,
                                   const Pool2dGeometry& g, const Tensor& dx) {
  TANDEM_CHECK(indices.defined() && indices.dtype() == kInt64 && indices.numel() == dy.numel(),
               "max_pool2d backward (bfloat16, CUDA): needs the forward's int64 indices shaped "
               "like dy ",
               ShapeToString(dy.shape()));
  const int64_t numel = dx.numel();
  if (numel == 0) return;
  MaxBackwardKernel<<<Blocks(numel), kThreads, 0, nn::internal::ThreadStream(dy.device())>>>(
      indices.data<int64_t>(), Bf16(dy), Bf16(dx), numel, g);
  TANDEM_CHECK_LAUNCH("max_pool2d MaxBackwardKernel (bfloat16)", dy.device());
}

void AvgPool2dForwardBFloat16Cuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  const int64_t numel = y.numel();
  if (numel == 0) return;
  AvgForwardKernel<<<Blocks(numel), kThreads, 0, nn::internal::ThreadStream(x.device())>>>(
      Bf16(x), Bf16(y), numel, g, AvgScale(g));
  TANDEM_CHECK_LAUNCH("avg_pool2d AvgForwardKernel (bfloat16)", x.device());
}

void AvgPool2dBackwardBFloat16Cuda(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t numel = dx.numel();
  if (numel == 0) return;
  AvgBackwardKernel<<<Blocks(numel), kThreads, 0, nn::internal::ThreadStream(dy.device())>>>(
      Bf16(dy), Bf16(dx), numel, g, AvgScale(g));
  TANDEM_CHECK_LAUNCH("avg_pool2d AvgBackwardKernel (bfloat16)", dy.device());
}

}  // namespace tandem::nn::ops::internal
