// CUDA kernels of the softmax family. Softmax over the last dim (inner == 1):
// one block per row, block reductions for the max and the sum. Over another dim:
// one thread per (outer, inner) column. Fixed reduction order; thread's stream.
#include "nn/cuda/context.h"
#include "nn/ops/internal/elementwise_kernels.h"  // MathExp, MathLog
#include "nn/ops/internal/softmax_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

template <typename T>
__global__ void SoftmaxRowKernel(const T* x, T* y, int64_t rows, int64_t size, bool log) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* px = x + r * size;
    T* py = y + r * size;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t d = threadIdx.x; d < size; d += blockDim.x) m = px[d] > m ? px[d] : m;
    m = BlockMax(m);
    T total = T(0);
    for (int64_t d = threadIdx.x; d < size; d += blockDim.x) total += MathExp(px[d] - m);
    total = BlockSum(total);
    if (log) {
      const T log_total = MathLog(total);
      for (int64_t d = threadIdx.x; d < size; d += blockDim.x) py[d] = px[d] - m - log_total;
    } else {
      const T inv_total = T(1) / total;
      for (int64_t d = threadIdx.x; d < size; d += blockDim.x) py[d] = MathExp(px[d] - m) * inv_total;
    }
  }
}

template <typename T>
__global__ void SoftmaxColumnKernel(const T* x, T* y, int64_t outer, int64_t size, int64_t inner,
                                    bool log) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= outer * inner) return;
  const int64_t base = (k / inner) * size * inner + k % inner;
  T m = x[base];
  for (int64_t d = 1; d < size; ++d) m = x[base + d * inner] > m ? x[base + d * inner] : m;
  T total = T(0);
  for (int64_t d = 0; d < size; ++d) total += MathExp(x[base + d * inner] - m);
  const T log_total = MathLog(total), inv_total = T(1) / total;
  for (int64_t d = 0; d < size; ++d) {
    const int64_t j = base + d * inner;
    y[j] = log ? x[j] - m - log_total : MathExp(x[j] - m) * inv_total;
  }
}

template <typename T>
__global__ void SoftmaxBackwardRowKernel(const T* gy, const T* y, T* gx, int64_t rows,
                                         int64_t size, bool log) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* pg = gy + r * size;
    const T* py = y + r * size;
    T* pgx = gx + r * size;
    T dot = T(0);
    for (int64_t d = threadIdx.x; d < size; d += blockDim.x) dot += log ? pg[d] : pg[d] * py[d];
    dot = BlockSum(dot);
    for (int64_t d = threadIdx.x; d < size; d += blockDim.x) {
      pgx[d] = log ? pg[d] - MathExp(py[d]) * dot : py[d] * (pg[d] - dot);
    }
  }
}

template <typename T>
__global__ void SoftmaxBackwardColumnKernel(const T* gy, const T* y, T* gx, int64_t outer,
                                            int64_t size, int64_t inner, bool log) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= outer * inner) return;
  const int64_t base = (k / inner) * size * inner + k % inner;
  T dot = T(0);
  for (int64_t d = 0; d < size; ++d) {
    const int64_t j = base + d * inner;
    dot += log ? gy[j] : gy[j] * y[j];
  }
  for (int64_t d = 0; d < size; ++d) {
    const int64_t j = base + d * inner;
    gx[j] = log ? gy[j] - MathExp(y[j]) * dot : y[j] * (gy[j] - dot);
  }
}

}  // namespace

void SoftmaxForwardCuda(const Tensor& x, const Tensor& y, DimSplit split, bool log) {
  if (x.numel() == 0) return;  // a 0-block launch is an error
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), log ? "log_softmax" : "softmax", [&]<typename T>() {
    if (split.inner == 1) {
      const int64_t grid = split.outer < kMaxGrid ? split.outer : kMaxGrid;
      SoftmaxRowKernel<T><<<grid, kThreads, 0, stream>>>(x.data<T>(), y.data<T>(), split.outer,
                                                         split.size, log);
    } else {
      SoftmaxColumnKernel<T><<<Blocks(split.outer * split.inner), kThreads, 0, stream>>>(
          x.data<T>(), y.data<T>(), split.outer, split.size, split.inner, log);
    }
  });
  TANDEM_CHECK_LAUNCH("SoftmaxKernel", x.device());
}

void SoftmaxBackwardCuda(const Tensor& gy, const Tensor& y, const Tensor& gx, DimSplit split,
                         bool log) {
  if (y.numel() == 0) return;  // a 0-block launch is an error
  cudaStream_t stream = nn::internal::ThreadStream(y.device());
  TANDEM_DISPATCH_FLOAT(y.dtype(), log ? "log_softmax_backward" : "softmax_backward",
                        [&]<typename T>() {
    if (split.inner == 1) {
      const int64_t grid = split.outer < kMaxGrid ? split.outer : kMaxGrid;
      SoftmaxBackwardRowKernel<T><<<grid, kThreads, 0, stream>>>(
          gy.data<T>(), y.data<T>(), gx.data<T>(), split.outer, split.size, log);
    } else {
      SoftmaxBackwardColumnKernel<T><<<Blocks(split.outer * split.inner), kThreads, 0, stream>>>(
          gy.data<T>(), y.data<T>(), gx.data<T>(), split.outer, split.size, split.inner, log);
    }
  });
  TANDEM_CHECK_LAUNCH("SoftmaxBackwardKernel", y.device());
}

}  // namespace tandem::nn::ops::internal
