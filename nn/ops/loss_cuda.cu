// CUDA kernels of the loss family (nll_loss: one thread per row forward, per
// element backward, reduced and checked as cross_entropy). cross_entropy: one fused kernel computes, per
// row, the log-sum-exp (saved) and the NLL term; a deterministic two-pass sum
// (reduce family) takes the mean or the sum (reduction kNone keeps the per-row
// losses). Backward: one elementwise kernel. No host sync:
// the upstream gradient is read on the device, and a bad target is a deferred
// device error (nn/internal/device_error.h): the kernel reports the first one,
// gives that sample a NaN loss (so the mean is NaN) and goes on; the host raises
// it at its next synchronisation with the device (item(), a copy to the host,
// nn::Synchronize). A trap would kill the CUDA context.
#include <limits>

#include "nn/cuda/context.h"
#include "nn/internal/device_error.h"
#include "nn/ops/internal/elementwise_kernels.h"  // MathExp, MathLog
#include "nn/ops/internal/loss_kernels.h"
#include "nn/ops/internal/reduce_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }
// A warp for small rows, a full block for wide ones (a function of c alone, so
// the reduction order is fixed).
int RowThreads(int64_t c) { return c <= 32 ? 32 : (c <= 128 ? 128 : kThreads); }

template <typename T>
__global__ void CrossEntropyForwardKernel(const T* logits, const int64_t* labels, T* lse,
                                          T* row_loss, int64_t n, int64_t c,
                                          nn::internal::DeviceErrorWord* error) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t label = labels[i];
    if (label < 0 || label >= c) {
      // The branch is uniform across the block (one row per block iteration).
      if (threadIdx.x == 0) {
        nn::internal::ReportDeviceError(error, nn::internal::kDeviceErrorCrossEntropyTarget,
                                        static_cast<long long>(label), static_cast<long long>(i),
                                        static_cast<long long>(c));
        lse[i] = std::numeric_limits<T>::quiet_NaN();
        row_loss[i] = std::numeric_limits<T>::quiet_NaN();
      }
      continue;
    }
    const T* row = logits + i * c;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) m = row[j] > m ? row[j] : m;
    m = BlockMax(m);
    T total = T(0);
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) total += MathExp(row[j] - m);
    total = BlockSum(total);
    if (threadIdx.x == 0) {
      const T row_lse = m + MathLog(total);
      lse[i] = row_lse;
      row_loss[i] = row_lse - row[label];
    }
  }
}

// The upstream gradient's scale per row: g / N (kMean), g (kSum), g[i] (kNone).
template <typename T>
__global__ void CrossEntropyBackwardKernel(const T* logits, const int64_t* labels, const T* lse,
                                           const T* g, T* dlogits, int64_t n, int64_t c,
                                           Reduction reduction) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= n * c) return;
  const int64_t i = k / c, j = k % c;
  const T p = MathExp(logits[k] - lse[i]);
  const T scale = reduction == Reduction::kMean ? *g / static_cast<T>(n)
                  : reduction == Reduction::kSum ? *g
                                                 : g[i];
  dlogits[k] = scale * (j == labels[i] ? p - T(1) : p);
}

// One thread per row: -log_probs[i, label]; a bad label is reported and gives NaN.
template <typename T>
__global__ void NllLossForwardKernel(const T* log_probs, const int64_t* labels, T* row_loss,
                                     int64_t n, int64_t c, nn::internal::DeviceErrorWord* error) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t label = labels[i];
  if (label < 0 || label >= c) {
    nn::internal::ReportDeviceError(error, nn::internal::kDeviceErrorNllLossTarget,
                                    static_cast<long long>(label), static_cast<long long>(i),
                                    static_cast<long long>(c));
    row_loss[i] = std::numeric_limits<T>::quiet_NaN();
    return;
  }
  row_loss[i] = -log_probs[i * c + label];
}

// One thread per element of dlog_probs: -scale at the label, 0 elsewhere (a bad
// label, already reported by the forward kernel, leaves its row zero).
template <typename T>
__global__ void NllLossBackwardKernel(const int64_t* labels, const T* g, T* dlog_probs, int64_t n,
                                      int64_t c, Reduction reduction) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= n * c) return;
  const int64_t i = k / c, j = k % c;
  const T scale = reduction == Reduction::kMean ? *g / static_cast<T>(n)
                  : reduction == Reduction::kSum ? *g
                                                 : g[i];
  dlog_probs[k] = j == labels[i] ? -scale : T(0);
}

template <typename T>
__global__ void AccuracyRowKernel(const T* logits, const int64_t* labels, float* hits, int64_t n,
                                  int64_t c) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const T* row = logits + i * c;
  int64_t best = 0;
  for (int64_t j = 1; j < c; ++j) {
    if (row[j] > row[best]) best = j;
  }
  hits[i] = best == labels[i] ? 1.0f : 0.0f;
}

}  // namespace

void CrossEntropyForwardCuda(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                             const Tensor& loss, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(logits.device());
  // kNone: the kernel writes the per-sample losses straight into `loss` (N).
  Tensor row_loss = reduction == Reduction::kNone
                        ? loss
                        : empty({n}, {.dtype = logits.dtype(), .device = logits.device()});
  nn::internal::DeviceErrorWord* error = nn::internal::DeviceErrorSlot(logits.device());
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&]<typename T>() {
    CrossEntropyForwardKernel<T><<<n < kMaxGrid ? n : kMaxGrid, RowThreads(c), 0, stream>>>(
        logits.data<T>(), labels.data<int64_t>(), lse.data<T>(), row_loss.data<T>(), n, c, error);
  });
  TANDEM_CHECK_LAUNCH("CrossEntropyForwardKernel", logits.device());
  if (reduction == Reduction::kNone) return;
  SumAllCuda(row_loss, loss, reduction == Reduction::kMean ? 1.0 / static_cast<double>(n) : 1.0);
}

void CrossEntropyBackwardCuda(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                              const Tensor& g, const Tensor& dlogits, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(logits.device());
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy_backward", [&]<typename T>() {
    CrossEntropyBackwardKernel<T><<<Blocks(n * c), kThreads, 0, stream>>>(
        logits.data<T>(), labels.data<int64_t>(), lse.data<T>(), g.data<T>(), dlogits.data<T>(),
        n, c, reduction);
  });
  TANDEM_CHECK_LAUNCH("CrossEntropyBackwardKernel", logits.device());
}

void NllLossForwardCuda(const Tensor& log_probs, const Tensor& labels, const Tensor& loss,
                        Reduction reduction) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(log_probs.device());
  Tensor row_loss = reduction == Reduction::kNone
                        ? loss
                        : empty({n}, {.dtype = log_probs.dtype(), .device = log_probs.device()});
  nn::internal::DeviceErrorWord* error = nn::internal::DeviceErrorSlot(log_probs.device());
  TANDEM_DISPATCH_FLOAT(log_probs.dtype(), "nll_loss", [&]<typename T>() {
    NllLossForwardKernel<T><<<Blocks(n), kThreads, 0, stream>>>(
        log_probs.data<T>(), labels.data<int64_t>(), row_loss.data<T>(), n, c, error);
  });
  TANDEM_CHECK_LAUNCH("NllLossForwardKernel", log_probs.device());
  if (reduction == Reduction::kNone) return;
  SumAllCuda(row_loss, loss, reduction == Reduction::kMean ? 1.0 / static_cast<double>(n) : 1.0);
}

void NllLossBackwardCuda(const Tensor& labels, const Tensor& g, const Tensor& dlog_probs,
                         Reduction reduction) {
  const int64_t n = dlog_probs.size(0), c = dlog_probs.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(dlog_probs.device());
  TANDEM_DISPATCH_FLOAT(dlog_probs.dtype(), "nll_loss_backward", [&]<typename T>() {
    NllLossBackwardKernel<T><<<Blocks(n * c), kThreads, 0, stream>>>(
        labels.data<int64_t>(), g.data<T>(), dlog_probs.data<T>(), n, c, reduction);
  });
  TANDEM_CHECK_LAUNCH("NllLossBackwardKernel", dlog_probs.device());
}

void AccuracyCuda(const Tensor& logits, const Tensor& labels, const Tensor& out) {
  const int64_t n = logits.size(0), c = logits.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(logits.device());
  Tensor hits = empty({n}, {.dtype = kFloat32, .device = logits.device()});
  if (n > 0) {
    TANDEM_DISPATCH_FLOAT(logits.dtype(), "accuracy", [&]<typename T>() {
      AccuracyRowKernel<T><<<Blocks(n), kThreads, 0, stream>>>(
          logits.data<T>(), labels.data<int64_t>(), hits.data<float>(), n, c);
    });
    TANDEM_CHECK_LAUNCH("AccuracyRowKernel", logits.device());
  }
  // Counts up to 2^24 are exact in float32; 0 rows give 0 * inf = NaN, as on the CPU.
  SumAllCuda(hits, out, 1.0 / static_cast<double>(n));
}

}  // namespace tandem::nn::ops::internal
