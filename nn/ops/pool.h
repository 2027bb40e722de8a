// 2-D pooling. CPU: pool_cpu.cc (float32 optionally on oneDNN, pool_dnnl.cc,
// chosen per op by measurement: max on our loops, float32 avg on oneDNN NCHW;
// CpuPoolPath in internal/pool_kernels.h); CUDA:
// cuDNN (pool_cuda.cc); adaptive average pooling: our own kernels (pool_cpu.cc,
// pool_adaptive_cuda.cu).
#ifndef TANDEM_NN_OPS_POOL_H_
#define TANDEM_NN_OPS_POOL_H_

#include <array>

#include "nn/tensor.h"

namespace tandem::nn {

struct Pool2dParams {
  std::array<int64_t, 2> kernel{2, 2};
  std::array<int64_t, 2> stride{0, 0};   // 0 means equal to kernel
  std::array<int64_t, 2> padding{0, 0};  // max: -inf padding; avg: zeros, counted in the divisor
};

// x: (N, C, H, W) -> (N, C, OH, OW), OH = (H + 2 ph - KH) / sh + 1.
// dtypes: float32, float64, bfloat16 (bfloat16 in, bfloat16 out: compares and
// sums in float32, each result rounded once; also under nn::AutocastGuard).
// Gradient of a tie goes to the first maximum in row-major window order on the
// CPU and for bfloat16 on CUDA; for float32 / float64 on CUDA, cuDNN's
// deterministic max pooling chooses (untested for ties).
Tensor max_pool2d(const Tensor& x, const Pool2dParams& params = {});
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& params = {});

// x: (N, C, H, W) -> (N, C, OH, OW) for output_size (OH, OW), each >= 1: output
// cell (oy, ox) is the mean of rows [floor(oy H / OH), ceil((oy + 1) H / OH)) and
// columns [floor(ox W / OW), ceil((ox + 1) W / OW)) (PyTorch's
// adaptive_avg_pool2d; windows may overlap when OH does not divide H). (1, 1) is
// the global average of each plane. H and W >= 1. dtypes: float32, float64,
// bfloat16 (sums in float32, each result rounded once). Deterministic on both
// devices: backward gathers each dx element's contributions in a fixed order.
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_POOL_H_
