// Kernel interface of the pool family, shared by the CPU file and the CUDA files
// (cuDNN for float32 / float64, our own kernels for bfloat16). Internal to nn.
// dtypes: float32, float64, bfloat16; bfloat16 compares and sums in float32 and
// rounds each result once.
#ifndef TANDEM_NN_OPS_INTERNAL_POOL_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_POOL_KERNELS_H_

#include <cstdint>

#include "nn/ops/pool.h"
#include "nn/random.h"  // TANDEM_HOST_DEVICE
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// Sizes of one pooling call with the stride resolved (never 0), checked by pool.cc.
struct Pool2dGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0;  // x: (n, c, h, w)
  int64_t kh = 0, kw = 0, sh = 0, sw = 0, ph = 0, pw = 0;
  int64_t oh = 0, ow = 0;              // y: (n, c, oh, ow)
};

// y = window maxima; indices (int64, y's shape) = the position iy * w + ix of each
// maximum in its (h, w) plane, the first one in row-major window order on ties.
// The CUDA version takes an undefined `indices` for float32 / float64 (cuDNN
// recomputes from x and y) and fills them as the CPU does for bfloat16.
void MaxPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                         const Tensor& indices);
// dx (overwritten) = dy routed to each window's maximum (CPU and CUDA bfloat16:
// through `indices`; CUDA float32 / float64: cuDNN from x and y).
void MaxPool2dBackwardCpu(const Tensor& x, const Tensor& y, const Tensor& indices,
                          const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);
// The pooling half of conv2d_relu_max_pool2d's fused CPU path (float32, and
// bfloat16 below): x is the relu'd convolution output in channels-last order
// (n, h, w, c), windows tile it (no padding, kernel == stride; MaxPoolTilesChannelsLast). Forward
// writes y (n, c, oh, ow) in our NCHW order, each the first maximum in row-major
// window order as MaxPool2dForwardCpu picks it, and `where` (n, oh, ow, c): the
// window position i * kw + j of that maximum, or kMaxPoolNoGradient where y is
// not > 0 (relu's gradient there is 0). Backward writes dx (n, h, w, c), the
// channels-last gradient of the convolution's output: 0 + dy at each kept
// position, 0 elsewhere, the bits of max_pool2d's and relu's backward in turn.
inline constexpr uint8_t kMaxPoolNoGradient = 0xFF;
bool MaxPoolTilesChannelsLast(const Pool2dGeometry& g);
// bfloat16 (the fused path under autocast): the same selects on the values
// widened to float32; every stored value is a bfloat16 input or zero (exact).
void MaxPool2dReluChannelsLastForwardCpu(const float* x, const Pool2dGeometry& g, float* y,
                                         uint8_t* where);
void MaxPool2dReluChannelsLastForwardCpu(const BFloat16* x, const Pool2dGeometry& g, BFloat16* y,
                                         uint8_t* where);
void MaxPool2dReluChannelsLastBackwardCpu(const float* dy, const uint8_t* where,
                                          const Pool2dGeometry& g, float* dx);
void MaxPool2dReluChannelsLastBackwardCpu(const BFloat16* dy, const uint8_t* where,
                                          const Pool2dGeometry& g, BFloat16* dx);
// The checks of max_pool2d / avg_pool2d on an input of shape x_shape (N, C, H, W)
// (pool.cc): the geometry, or an error naming `op` and the bad value.
Pool2dGeometry Pool2dGeometryOf(const Shape& x_shape, const Pool2dParams& params, const char* op);

// y = window sums / (kh * kw): padding counts as zeros in the divisor.
void AvgPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y);
void AvgPool2dBackwardCpu(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);

// Adaptive average pooling (n, c, h, w and oh, ow of the geometry; kernel, stride
// and padding unused). Output index o of `out` outputs over `in` inputs reads
// inputs [AdaptiveStart, AdaptiveEnd); input i is read by the outputs
// [AdaptiveFirstOutput, AdaptiveLastOutput) (a superset: check the window).
TANDEM_HOST_DEVICE int64_t AdaptiveStart(int64_t o, int64_t in, int64_t out) {
  return (o * in) / out;
}
TANDEM_HOST_DEVICE int64_t AdaptiveEnd(int64_t o, int64_t in, int64_t out) {
  return ((o + 1) * in + out - 1) / out;
}
TANDEM_HOST_DEVICE int64_t AdaptiveFirstOutput(int64_t i, int64_t in, int64_t out) {
  return (i * out) / in;
}
TANDEM_HOST_DEVICE int64_t AdaptiveLastOutput(int64_t i, int64_t in, int64_t out) {
  const int64_t last = ((i + 1) * out + in - 1) / in;
  return last < out ? last : out;
}
// y (n, c, oh, ow) = window means; dx (overwritten) = for each x element, the sum
// over the windows holding it of dy / window size, in increasing (oy, ox).
void AdaptiveAvgPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y);
void AdaptiveAvgPool2dBackwardCpu(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);

// The float32 CPU implementation of max_pool2d / avg_pool2d (float64 and
// bfloat16 always run pool_cpu.cc's loops). kAuto: ResolveCpuPoolPath's choice
// per op (max: kOwn, float32 avg: kDnnl), by measurement (docs/benchmarks.md); kOwn: pool_cpu.cc's loops;
// kDnnl: oneDNN on our plain NCHW tensors; kDnnlBlocked / kDnnlNhwc: oneDNN in
// nChw16c (nChw8c without AVX-512) / NHWC, reordered from and to ours inside
// each call. Process-wide, atomic; for tests and benchmarks that compare them.
// The oneDNN paths need a build with oneDNN (TANDEM_WITH_DNNL): elsewhere
// asking for them is an error at the next pooling.
enum class CpuPoolPath { kAuto, kOwn, kDnnl, kDnnlBlocked, kDnnlNhwc };
void SetCpuPoolPath(CpuPoolPath path);
CpuPoolPath GetCpuPoolPath();
// The implementation (never kAuto) a float32 CPU max (`max`) or average
// pooling of shape g runs on now.
CpuPoolPath ResolveCpuPoolPath(const Pool2dGeometry& g, bool max);
// True when tandem is built with oneDNN (the oneDNN paths can be asked for).
bool CpuPoolDnnlBuilt();

// pool_dnnl.cc: float32, `path` one of the oneDNN paths, the contracts of the
// Cpu kernels above, except that max pooling keeps oneDNN's workspace (returned
// by the forward, a uint8 buffer) for the backward instead of int64 indices;
// backward takes the same g and path as the forward that made the workspace.
// Max pooling ignores NaN (ours keeps a NaN that comes first in its window).
Tensor MaxPool2dForwardDnnl(const Tensor& x, const Pool2dGeometry& g, CpuPoolPath path,
                            const Tensor& y);
void MaxPool2dBackwardDnnl(const Tensor& workspace, const Tensor& dy, const Pool2dGeometry& g,
                           CpuPoolPath path, const Tensor& dx);
void AvgPool2dForwardDnnl(const Tensor& x, const Pool2dGeometry& g, CpuPoolPath path,
                          const Tensor& y);
void AvgPool2dBackwardDnnl(const Tensor& dy, const Pool2dGeometry& g, CpuPoolPath path,
                           const Tensor& dx);
// How many primitives pool_dnnl.cc's cache holds on the calling thread.
size_t Pool2dDnnlCacheSize();

#if TANDEM_WITH_CUDA
// pool_adaptive_cuda.cu: float32, float64 and bfloat16, the CPU's arithmetic.
void AdaptiveAvgPool2dForwardCuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y);
void AdaptiveAvgPool2dBackwardCuda(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);
void MaxPool2dForwardCuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                          const Tensor& indices);
void MaxPool2dBackwardCuda(const Tensor& x, const Tensor& y, const Tensor& indices,
                           const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);
void AvgPool2dForwardCuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y);
void AvgPool2dBackwardCuda(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);
// The bfloat16 kernels behind the four above (pool_bf16_cuda.cu), same contracts.
void MaxPool2dForwardBFloat16Cuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                                  const Tensor& indices);
void MaxPool2dBackwardBFloat16Cuda(const Tensor& indices, const Tensor& dy,
                                   const Pool2dGeometry& g, const Tensor& dx);
void AvgPool2dForwardBFloat16Cuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y);
void AvgPool2dBackwardBFloat16Cuda(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_POOL_KERNELS_H_
