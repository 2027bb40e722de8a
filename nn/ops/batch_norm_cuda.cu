// CUDA kernels of batch_norm2d. Per-channel statistics and gradient sums: one
// block per channel, fixed-order block reductions (deterministic). Elementwise
// normalisation and input gradient: one thread per element. Thread's stream.
#include "nn/cuda/context.h"
#include "nn/ops/internal/batch_norm_kernels.h"
#include "nn/ops/internal/reduce_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }
int64_t ChannelGrid(int64_t c) { return c < kMaxGrid ? c : kMaxGrid; }

template <typename T> __device__ __forceinline__ T InvStd(T var, T eps) {
  if constexpr (sizeof(T) == 4) { return ::rsqrtf(var + eps); } else { return ::rsqrt(var + eps); }
}

// Index in x of the j-th element (in (n, hw) order) of channel c.
__device__ __forceinline__ int64_t ChannelIndex(int64_t j, int64_t c, BatchNormShape s) {
  return ((j / s.hw) * s.c + c) * s.hw + j % s.hw;
}

template <typename T>
__global__ void StatsKernel(const T* x, T* mean, T* var, BatchNormShape s) {
  const int64_t m = s.n * s.hw;
  for (int64_t c = blockIdx.x; c < s.c; c += gridDim.x) {
    T total = T(0);
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) total += x[ChannelIndex(j, c, s)];
    const T mu = BlockSum(total) / static_cast<T>(m);
    T squares = T(0);
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
      const T d = x[ChannelIndex(j, c, s)] - mu;
      squares += d * d;
    }
    squares = BlockSum(squares);
    if (threadIdx.x == 0) {
      mean[c] = mu;
      var[c] = squares / static_cast<T>(m);
    }
  }
}

template <typename T>
__global__ void ForwardKernel(const T* x, const T* mean, const T* var, const T* weight,
                              const T* bias, T* y, T eps, BatchNormShape s) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= s.n * s.c * s.hw) return;
  const int64_t c = (k / s.hw) % s.c;
  const T w = weight ? weight[c] : T(1);
  const T b = bias ? bias[c] : T(0);
  y[k] = (x[k] - mean[c]) * InvStd(var[c], eps) * w + b;
}

template <typename T>
__global__ void BackwardReduceKernel(const T* dy, const T* x, const T* mean, const T* var,
                                     T* sum_dy, T* sum_dy_xhat, T eps, BatchNormShape s) {
  const int64_t m = s.n * s.hw;
  for (int64_t c = blockIdx.x; c < s.c; c += gridDim.x) {
    const T mu = mean[c], invstd = InvStd(var[c], eps);
    T a = T(0), b = T(0);
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
      const int64_t k = ChannelIndex(j, c, s);
      a += dy[k];
      b += dy[k] * (x[k] - mu) * invstd;
    }
    a = BlockSum(a);
    b = BlockSum(b);
    if (threadIdx.x == 0) {
      sum_dy[c] = a;
      sum_dy_xhat[c] = b;
    }
  }
}

template <typename T>
__global__ void BackwardInputKernel(const T* dy, const T* x, const T* mean, const T* var,
                                    const T* weight, const T* sum_dy, const T* sum_dy_xhat, T* dx,
                                    T eps, bool training, BatchNormShape s) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= s.n * s.c * s.hw) return;
  const int64_t c = (k / s.hw) % s.c;
  const T invstd = InvStd(var[c], eps);
  const T w = weight ? weight[c] : T(1);
  if (!training) {
    dx[k] = dy[k] * w * invstd;
    return;
  }
  const T m = static_cast<T>(s.n * s.hw);
  const T xhat = (x[k] - mean[c]) * invstd;
  dx[k] = w * invstd / m * (m * dy[k] - sum_dy[c] - xhat * sum_dy_xhat[c]);
}

template <typename T> const T* OrNull(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

}  // namespace

void BatchNormStatsCuda(const Tensor& x, const Tensor& mean, const Tensor& var, BatchNormShape s) {
  if (s.c == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d", [&]<typename T>() {
    StatsKernel<T><<<ChannelGrid(s.c), kThreads, 0, stream>>>(x.data<T>(), mean.data<T>(),
                                                              var.data<T>(), s);
  });
  TANDEM_CHECK_LAUNCH("BatchNormStatsKernel", x.device());
}

void BatchNormForwardCuda(const Tensor& x, const Tensor& mean, const Tensor& var,
                          const Tensor& weight, const Tensor& bias, const Tensor& y, double eps,
                          BatchNormShape s) {
  const int64_t n = x.numel();
  if (n == 0) return;  // a 0-block launch is an error
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d", [&]<typename T>() {
    ForwardKernel<T><<<Blocks(n), kThreads, 0, stream>>>(
        x.data<T>(), mean.data<T>(), var.data<T>(), OrNull<T>(weight), OrNull<T>(bias),
        y.data<T>(), static_cast<T>(eps), s);
  });
  TANDEM_CHECK_LAUNCH("BatchNormForwardKernel", x.device());
}

void BatchNormBackwardReduceCuda(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                 const Tensor& var, const Tensor& sum_dy,
                                 const Tensor& sum_dy_xhat, double eps, BatchNormShape s) {
  if (s.c == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d_backward", [&]<typename T>() {
    BackwardReduceKernel<T><<<ChannelGrid(s.c), kThreads, 0, stream>>>(
        dy.data<T>(), x.data<T>(), mean.data<T>(), var.data<T>(), sum_dy.data<T>(),
        sum_dy_xhat.data<T>(), static_cast<T>(eps), s);
  });
  TANDEM_CHECK_LAUNCH("BatchNormBackwardReduceKernel", x.device());
}

void BatchNormBackwardInputCuda(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& weight, const Tensor& sum_dy,
                                const Tensor& sum_dy_xhat, const Tensor& dx, double eps,
                                bool training, BatchNormShape s) {
  const int64_t n = x.numel();
  if (n == 0) return;  // a 0-block launch is an error
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d_backward", [&]<typename T>() {
    BackwardInputKernel<T><<<Blocks(n), kThreads, 0, stream>>>(
        dy.data<T>(), x.data<T>(), mean.data<T>(), var.data<T>(), OrNull<T>(weight),
        sum_dy.data<T>(), sum_dy_xhat.data<T>(), dx.data<T>(), static_cast<T>(eps), training, s);
  });
  TANDEM_CHECK_LAUNCH("BatchNormBackwardInputKernel", x.device());
}

}  // namespace tandem::nn::ops::internal
