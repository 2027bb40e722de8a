// CUDA kernels of the loss family. cross_entropy: one fused kernel computes, per
// row, the log-sum-exp (saved) and the weighted, smoothed NLL term (0 for an
// ignored label); kMean is one single-block kernel (sum of the losses over the
// sum of the target weights, fixed order, the denominator saved for backward;
// past 8192 rows after a many-block pass of partial sums),
// kSum the reduce family's deterministic two-pass sum, kNone keeps the per-row
// losses. Backward: one elementwise kernel. nll_loss: one thread per row forward,
// per element backward, reduced and checked as cross_entropy. No host sync:
// the upstream gradient is read on the device, and a bad target is a deferred
// device error (nn/internal/device_error.h): the kernel reports the first one,
// gives that sample a NaN loss (so the mean is NaN) and goes on; the host raises
// it at its next synchronisation with the device (item(), a copy to the host,
// nn::Synchronize). A trap would kill the CUDA context.
#include <algorithm>
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

// One block per row (grid-strided). weight: (C) or nullptr (1 per class);
// row_weight: nullptr unless kMean, then w[y] per row (0 where ignored) for the
// mean's denominator. With smoothing > 0, block 0 first writes sum_c w[c] to
// lse[n + 1] for backward. Every branch below is uniform across the block (it
// depends on the row and the kernel's arguments alone), so every thread reaches
// the block reductions.
template <typename T>
__global__ void CrossEntropyForwardKernel(const T* logits, const int64_t* labels, const T* weight,
                                          int64_t ignore_index, T smoothing, T* lse, T* row_loss,
                                          T* row_weight, int64_t n, int64_t c,
                                          nn::internal::DeviceErrorWord* error) {
  if (smoothing > T(0) && blockIdx.x == 0) {
    T weight_sum = static_cast<T>(c);
    if (weight != nullptr) {
      weight_sum = T(0);
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) weight_sum += weight[j];
      weight_sum = BlockSum(weight_sum);
    }
    if (threadIdx.x == 0) lse[n + 1] = weight_sum;
  }
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t label = labels[i];
    if (label == ignore_index) {  // no loss, no weight, no gradient
      if (threadIdx.x == 0) {
        lse[i] = T(0);
        row_loss[i] = T(0);
        if (row_weight != nullptr) row_weight[i] = T(0);
      }
      continue;
    }
    if (label < 0 || label >= c) {
      if (threadIdx.x == 0) {
        nn::internal::ReportDeviceError(error, nn::internal::kDeviceErrorCrossEntropyTarget,
                                        static_cast<long long>(label), static_cast<long long>(i),
                                        static_cast<long long>(c));
        lse[i] = std::numeric_limits<T>::quiet_NaN();
        row_loss[i] = std::numeric_limits<T>::quiet_NaN();
        if (row_weight != nullptr) row_weight[i] = T(0);
      }
      continue;
    }
    const T* row = logits + i * c;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) m = row[j] > m ? row[j] : m;
    m = BlockMax(m);
    T total = T(0);
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) total += MathExp(row[j] - m);
    total = BlockSum(total);  // every thread gets it, so every thread knows lse
    const T row_lse = m + MathLog(total);
    T smooth = T(0);  // sum_c w[c] (lse - logits[i, c]): the uniform part of the target
    if (smoothing > T(0)) {
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
        smooth += (weight != nullptr ? weight[j] : T(1)) * (row_lse - row[j]);
      }
      smooth = BlockSum(smooth);
    }
    if (threadIdx.x == 0) {
      const T w = weight != nullptr ? weight[label] : T(1);
      T l = w * (row_lse - row[label]);
      if (smoothing > T(0)) l = (T(1) - smoothing) * l + smoothing / static_cast<T>(c) * smooth;
      lse[i] = row_lse;
      row_loss[i] = l;
      if (row_weight != nullptr) row_weight[i] = w;
    }
  }
}

// kMean past kOneBlockMeanRows rows, first pass: block b sums its strided share
// of the losses into partial[b] and of the weights into partial[gridDim.x + b].
template <typename T>
__global__ void WeightedPartialKernel(const T* row_loss, const T* row_weight, int64_t n,
                                      T* partial) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  T l = T(0), w = T(0);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    l += row_loss[i];
    w += row_weight[i];
  }
  l = BlockSum(l);
  w = BlockSum(w);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = l;
    partial[gridDim.x + blockIdx.x] = w;
  }
}

// kMean of a classification loss, one block (fixed order, no atomics): loss =
// sum(row_loss) / sum(row_weight), the denominator kept in *total_weight for
// backward (over the rows, or over WeightedPartialKernel's partial sums). 0 / 0 =
// NaN when every row is ignored, as PyTorch's.
template <typename T>
__global__ void WeightedMeanKernel(const T* row_loss, const T* row_weight, int64_t n, T* loss,
                                   T* total_weight) {
  T l = T(0), w = T(0);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    l += row_loss[i];
    w += row_weight[i];
  }
  l = BlockSum(l);
  w = BlockSum(w);
  if (threadIdx.x == 0) {
    *loss = l / w;
    *total_weight = w;
  }
}

// The upstream gradient's scale per row: g / W (kMean), g (kSum), g[i] (kNone).
template <typename T>
__device__ T RowScale(const T* g, int64_t i, const T* total_weight, Reduction reduction) {
  return reduction == Reduction::kMean ? *g / *total_weight
         : reduction == Reduction::kSum ? *g
                                        : g[i];
}

// One thread per element (loss_kernels.h has the formula). lse[n] is the mean's
// denominator, lse[n + 1] the sum of the class weights (read only when smoothing > 0).
template <typename T>
__global__ void CrossEntropyBackwardKernel(const T* logits, const int64_t* labels, const T* lse,
                                           const T* g, const T* weight, int64_t ignore_index,
                                           T smoothing, T* dlogits, int64_t n, int64_t c,
                                           Reduction reduction) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= n * c) return;
  const int64_t i = k / c, j = k % c;
  const int64_t label = labels[i];
  if (label == ignore_index) {
    dlogits[k] = T(0);
    return;
  }
  const T p = MathExp(logits[k] - lse[i]);
  const T scale = RowScale(g, i, lse + n, reduction);
  if (weight == nullptr && smoothing == T(0)) {
    dlogits[k] = scale * (j == label ? p - T(1) : p);
    return;
  }
  if (label < 0 || label >= c) {  // reported by the forward kernel; its loss is NaN
    dlogits[k] = std::numeric_limits<T>::quiet_NaN();
    return;
  }
  const T spread = smoothing / static_cast<T>(c);
  const T spread_all = smoothing > T(0) ? spread * lse[n + 1] : T(0);
  const T on = (T(1) - smoothing) * (weight != nullptr ? weight[label] : T(1));
  const T w = weight != nullptr ? weight[j] : T(1);
  dlogits[k] = scale * (p * (on + spread_all) - (j == label ? on : T(0)) - spread * w);
}

// One thread per row: -w[y] log_probs[i, y]; a bad label is reported and gives NaN.
template <typename T>
__global__ void NllLossForwardKernel(const T* log_probs, const int64_t* labels, const T* weight,
                                     int64_t ignore_index, T* row_loss, T* row_weight, int64_t n,
                                     int64_t c, nn::internal::DeviceErrorWord* error) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int64_t label = labels[i];
  if (label == ignore_index) {
    row_loss[i] = T(0);
    if (row_weight != nullptr) row_weight[i] = T(0);
    return;
  }
  if (label < 0 || label >= c) {
    nn::internal::ReportDeviceError(error, nn::internal::kDeviceErrorNllLossTarget,
                                    static_cast<long long>(label), static_cast<long long>(i),
                                    static_cast<long long>(c));
    row_loss[i] = std::numeric_limits<T>::quiet_NaN();
    if (row_weight != nullptr) row_weight[i] = T(0);
    return;
  }
  const T w = weight != nullptr ? weight[label] : T(1);
  row_loss[i] = -(w * log_probs[i * c + label]);
  if (row_weight != nullptr) row_weight[i] = w;
}

// One thread per element of dlog_probs: -scale w[y] at the label, 0 elsewhere (an
// ignored row, and a bad label, already reported by the forward kernel, leave
// their row zero).
template <typename T>
__global__ void NllLossBackwardKernel(const int64_t* labels, const T* g, const T* weight,
                                      int64_t ignore_index, const T* total_weight, T* dlog_probs,
                                      int64_t n, int64_t c, Reduction reduction) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= n * c) return;
  const int64_t i = k / c, j = k % c;
  const int64_t label = labels[i];
  if (label == ignore_index || j != label) {
    dlog_probs[k] = T(0);
    return;
  }
  const T w = weight != nullptr ? weight[label] : T(1);
  dlog_probs[k] = -(RowScale(g, i, total_weight, reduction) * w);
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

// kMean over at most this many rows is WeightedMeanKernel alone. One block's loads
// are bound by their latency (estimated, not measured: tens of GB/s, so a million
// rows would take ~100 us, more than the loss kernel itself), so more rows take
// WeightedPartialKernel's many-block pass first, as the reduce family's sum does.
constexpr int64_t kOneBlockMeanRows = 8192;
// The blocks of that first pass (0: none), a function of n alone (fixed order).
int64_t MeanPartialBlocks(int64_t n) {
  return n <= kOneBlockMeanRows ? 0 : std::min<int64_t>(Blocks(n), 1024);
}

// The per-row buffers of a forward kernel: kNone writes the losses straight into
// `loss` (N); kMean gets one buffer, the N losses, the N weights, then the two
// partial sums of each first-pass block; kSum the losses alone.
struct RowBuffers {
  Tensor storage;
  int64_t n;
  bool weights;      // kMean: storage holds the row weights after the losses
  int64_t partials;  // kMean: MeanPartialBlocks(n), their sums after the weights
  template <typename T> T* loss() const { return storage.data<T>(); }
  template <typename T> T* weight() const { return weights ? storage.data<T>() + n : nullptr; }
};

RowBuffers MakeRowBuffers(const Tensor& input, const Tensor& loss, Reduction reduction) {
  const int64_t n = input.size(0);
  if (reduction == Reduction::kNone) return {loss, n, false, 0};
  const bool weights = reduction == Reduction::kMean;
  const int64_t partials = weights ? MeanPartialBlocks(n) : 0;
  return {empty({weights ? 2 * n + 2 * partials : n},
                {.dtype = input.dtype(), .device = input.device()}),
          n, weights, partials};
}

// kMean: WeightedMeanKernel (after WeightedPartialKernel for many rows); kSum: the
// reduce family's deterministic sum.
void ReduceRows(const RowBuffers& rows, const Tensor& loss, void* total_weight,
                Reduction reduction, cudaStream_t stream, const char* op) {
  if (reduction == Reduction::kNone) return;
  if (reduction == Reduction::kSum) {
    SumAllCuda(rows.storage, loss, 1.0);  // storage: the n losses alone
    return;
  }
  TANDEM_DISPATCH_FLOAT(loss.dtype(), op, [&]<typename T>() {
    const T* row_loss = rows.loss<T>();
    const T* row_weight = rows.weight<T>();
    int64_t count = rows.n;
    if (rows.partials > 0) {
      T* partial = rows.storage.data<T>() + 2 * rows.n;
      WeightedPartialKernel<T><<<rows.partials, kThreads, 0, stream>>>(row_loss, row_weight,
                                                                       rows.n, partial);
      TANDEM_CHECK_LAUNCH("WeightedPartialKernel", loss.device());
      row_loss = partial;
      row_weight = partial + rows.partials;
      count = rows.partials;
    }
    WeightedMeanKernel<T><<<1, 1024, 0, stream>>>(row_loss, row_weight, count, loss.data<T>(),
                                                   static_cast<T*>(total_weight));
  });
  TANDEM_CHECK_LAUNCH("WeightedMeanKernel", loss.device());
}

template <typename T>
const T* WeightData(const ClassLossOptions& options) {
  return options.weight.defined() ? options.weight.data<T>() : nullptr;
}

}  // namespace

void CrossEntropyForwardCuda(const Tensor& logits, const Tensor& labels,
                             const ClassLossOptions& options, const Tensor& lse,
                             const Tensor& loss, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(logits.device());
  const RowBuffers rows = MakeRowBuffers(logits, loss, reduction);
  nn::internal::DeviceErrorWord* error = nn::internal::DeviceErrorSlot(logits.device());
  void* total_weight = nullptr;
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&]<typename T>() {
    CrossEntropyForwardKernel<T><<<n < kMaxGrid ? n : kMaxGrid, RowThreads(c), 0, stream>>>(
        logits.data<T>(), labels.data<int64_t>(), WeightData<T>(options), options.ignore_index,
        static_cast<T>(options.label_smoothing), lse.data<T>(), rows.loss<T>(), rows.weight<T>(),
        n, c, error);
    total_weight = lse.data<T>() + n;
  });
  TANDEM_CHECK_LAUNCH("CrossEntropyForwardKernel", logits.device());
  ReduceRows(rows, loss, total_weight, reduction, stream, "cross_entropy");
}

void CrossEntropyBackwardCuda(const Tensor& logits, const Tensor& labels,
                              const ClassLossOptions& options, const Tensor& lse, const Tensor& g,
                              const Tensor& dlogits, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(logits.device());
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy_backward", [&]<typename T>() {
    CrossEntropyBackwardKernel<T><<<Blocks(n * c), kThreads, 0, stream>>>(
        logits.data<T>(), labels.data<int64_t>(), lse.data<T>(), g.data<T>(),
        WeightData<T>(options), options.ignore_index, static_cast<T>(options.label_smoothing),
        dlogits.data<T>(), n, c, reduction);
  });
  TANDEM_CHECK_LAUNCH("CrossEntropyBackwardKernel", logits.device());
}

void NllLossForwardCuda(const Tensor& log_probs, const Tensor& labels,
                        const ClassLossOptions& options, const Tensor& loss,
                        const Tensor& total_weight, Reduction reduction) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(log_probs.device());
  const RowBuffers rows = MakeRowBuffers(log_probs, loss, reduction);
  nn::internal::DeviceErrorWord* error = nn::internal::DeviceErrorSlot(log_probs.device());
  void* total_weight_data = nullptr;
  TANDEM_DISPATCH_FLOAT(log_probs.dtype(), "nll_loss", [&]<typename T>() {
    NllLossForwardKernel<T><<<Blocks(n), kThreads, 0, stream>>>(
        log_probs.data<T>(), labels.data<int64_t>(), WeightData<T>(options), options.ignore_index,
        rows.loss<T>(), rows.weight<T>(), n, c, error);
    if (total_weight.defined()) total_weight_data = total_weight.data<T>();
  });
  TANDEM_CHECK_LAUNCH("NllLossForwardKernel", log_probs.device());
  ReduceRows(rows, loss, total_weight_data, reduction, stream, "nll_loss");
}

void NllLossBackwardCuda(const Tensor& labels, const ClassLossOptions& options,
                         const Tensor& total_weight, const Tensor& g, const Tensor& dlog_probs,
                         Reduction reduction) {
  const int64_t n = dlog_probs.size(0), c = dlog_probs.size(1);
  cudaStream_t stream = nn::internal::ThreadStream(dlog_probs.device());
  TANDEM_DISPATCH_FLOAT(dlog_probs.dtype(), "nll_loss_backward", [&]<typename T>() {
    NllLossBackwardKernel<T><<<Blocks(n * c), kThreads, 0, stream>>>(
        labels.data<int64_t>(), g.data<T>(), WeightData<T>(options), options.ignore_index,
        total_weight.defined() ? total_weight.data<T>() : nullptr, dlog_probs.data<T>(), n, c,
        reduction);
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
