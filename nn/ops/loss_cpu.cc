// CPU kernels of the loss family. Row sums in double.
#include <algorithm>
#include <cmath>

#include "nn/ops/internal/loss_kernels.h"

namespace tandem::nn::ops::internal {

void CrossEntropyForwardCpu(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                            const Tensor& loss, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_CHECK(pl[i] >= 0 && pl[i] < c, "cross_entropy: label ", pl[i], " at row ", i,
                 " is out of range for ", c, " classes (logits of shape ",
                 ShapeToString(logits.shape()), ")");
  }
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&]<typename T>() {
    const T* px = logits.host_data<T>();
    T* plse = lse.host_data<T>();
    T* ploss = loss.host_data<T>();
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* row = px + i * c;
      T max_value = row[0];
      for (int64_t j = 1; j < c; ++j) max_value = std::max(max_value, row[j]);
      double sum_exp = 0;
      for (int64_t j = 0; j < c; ++j) sum_exp += std::exp(static_cast<double>(row[j] - max_value));
      const double row_lse = static_cast<double>(max_value) + std::log(sum_exp);
      plse[i] = static_cast<T>(row_lse);
      const double row_loss = row_lse - static_cast<double>(row[pl[i]]);
      if (reduction == Reduction::kNone) ploss[i] = static_cast<T>(row_loss);
      total += row_loss;
    }
    if (reduction == Reduction::kMean) *ploss = static_cast<T>(total / static_cast<double>(n));
    if (reduction == Reduction::kSum) *ploss = static_cast<T>(total);
  });
}

void CrossEntropyBackwardCpu(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                             const Tensor& g, const Tensor& dlogits, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy_backward", [&]<typename T>() {
    const T* px = logits.host_data<T>();
    const T* plse = lse.host_data<T>();
    T* pd = dlogits.host_data<T>();
    const T* pg = g.host_data<T>();
    // kMean and kSum: one 0-dim upstream gradient; kNone: one per row.
    const T uniform_scale = reduction == Reduction::kMean ? pg[0] / static_cast<T>(n) : pg[0];
    for (int64_t i = 0; i < n; ++i) {
      const T scale = reduction == Reduction::kNone ? pg[i] : uniform_scale;
      for (int64_t j = 0; j < c; ++j) {
        const T p = static_cast<T>(std::exp(static_cast<double>(px[i * c + j] - plse[i])));
        pd[i * c + j] = scale * (j == pl[i] ? p - T(1) : p);
      }
    }
  });
}

void NllLossForwardCpu(const Tensor& log_probs, const Tensor& labels, const Tensor& loss,
                       Reduction reduction) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_CHECK(pl[i] >= 0 && pl[i] < c, "nll_loss: label ", pl[i], " at row ", i,
                 " is out of range for ", c, " classes (log_probs of shape ",
                 ShapeToString(log_probs.shape()), ")");
  }
  TANDEM_DISPATCH_FLOAT(log_probs.dtype(), "nll_loss", [&]<typename T>() {
    const T* px = log_probs.host_data<T>();
    T* ploss = loss.host_data<T>();
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T row_loss = -px[i * c + pl[i]];
      if (reduction == Reduction::kNone) ploss[i] = row_loss;
      total += static_cast<double>(row_loss);
    }
    if (reduction == Reduction::kMean) *ploss = static_cast<T>(total / static_cast<double>(n));
    if (reduction == Reduction::kSum) *ploss = static_cast<T>(total);
  });
}

void NllLossBackwardCpu(const Tensor& labels, const Tensor& g, const Tensor& dlog_probs,
                        Reduction reduction) {
  const int64_t n = dlog_probs.size(0), c = dlog_probs.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  TANDEM_DISPATCH_FLOAT(dlog_probs.dtype(), "nll_loss_backward", [&]<typename T>() {
    T* pd = dlog_probs.host_data<T>();
    const T* pg = g.host_data<T>();
    const T uniform_scale = reduction == Reduction::kMean ? pg[0] / static_cast<T>(n) : pg[0];
    std::fill(pd, pd + n * c, T(0));
    for (int64_t i = 0; i < n; ++i) {
      pd[i * c + pl[i]] = -(reduction == Reduction::kNone ? pg[i] : uniform_scale);
    }
  });
}

void AccuracyCpu(const Tensor& logits, const Tensor& labels, const Tensor& out) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "accuracy", [&]<typename T>() {
    const T* px = logits.host_data<T>();
    int64_t hits = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* row = px + i * c;
      int64_t best = 0;
      for (int64_t j = 1; j < c; ++j) {
        if (row[j] > row[best]) best = j;
      }
      hits += best == pl[i] ? 1 : 0;
    }
    // No rows: 0/0 = NaN, as a mean over nothing.
    *out.host_data<float>() = static_cast<float>(static_cast<double>(hits) / static_cast<double>(n));
  });
}

}  // namespace tandem::nn::ops::internal
