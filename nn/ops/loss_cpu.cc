// CPU kernels of the loss family. Row sums in double.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "nn/ops/internal/loss_kernels.h"

namespace tandem::nn::ops::internal {

namespace {

// Every label in [0, C) or ignore_index, else an error naming it, its row and C.
void CheckLabels(const int64_t* labels, int64_t n, int64_t c, int64_t ignore_index,
                 const char* op, const char* input, const Shape& shape) {
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_CHECK(labels[i] == ignore_index || (labels[i] >= 0 && labels[i] < c), op, ": label ",
                 labels[i], " at row ", i, " is out of range for ", c, " classes (", input,
                 " of shape ", ShapeToString(shape), "; ignore_index ", ignore_index, ")");
  }
}

// The upstream gradient's scale for kMean (g / W, W the total weight) and kSum
// (g), both 0-dim; kNone reads g[i] per row. Taken once, before the row loop (the
// compiler cannot hoist it: the output may alias g as far as it knows).
template <typename T>
T UniformScale(const T* g, T total_weight, Reduction reduction) {
  if (reduction == Reduction::kNone) return T(0);
  return reduction == Reduction::kMean ? g[0] / total_weight : g[0];
}

// The rows of CrossEntropyForwardCpu. kPlain (no weight, no smoothing) is the
// default path, compiled without the options' branches.
template <typename T, bool kPlain>
void CrossEntropyRows(const T* px, const int64_t* pl, int64_t n, int64_t c,
                      const ClassLossOptions& options, T* plse, T* ploss, Reduction reduction) {
  const T* pw = options.weight.defined() ? options.weight.host_data<T>() : nullptr;
  const double eps = options.label_smoothing;
  double total = 0, total_weight = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (pl[i] == options.ignore_index) {
      plse[i] = T(0);
      if (reduction == Reduction::kNone) ploss[i] = T(0);
      continue;
    }
    const T* row = px + i * c;
    T max_value = row[0];
    for (int64_t j = 1; j < c; ++j) max_value = std::max(max_value, row[j]);
    double sum_exp = 0;
    for (int64_t j = 0; j < c; ++j) sum_exp += std::exp(static_cast<double>(row[j] - max_value));
    const double row_lse = static_cast<double>(max_value) + std::log(sum_exp);
    plse[i] = static_cast<T>(row_lse);
    double row_loss = row_lse - static_cast<double>(row[pl[i]]);
    double w = 1.0;
    if constexpr (!kPlain) {
      if (pw != nullptr) w = static_cast<double>(pw[pl[i]]);
      row_loss *= w;
      if (eps > 0) {  // the uniform part of the smoothed target
        double smooth = 0;
        for (int64_t j = 0; j < c; ++j) {
          smooth += (pw != nullptr ? static_cast<double>(pw[j]) : 1.0) *
                    (row_lse - static_cast<double>(row[j]));
        }
        row_loss = (1 - eps) * row_loss + eps / static_cast<double>(c) * smooth;
      }
    }
    if (reduction == Reduction::kNone) ploss[i] = static_cast<T>(row_loss);
    total += row_loss;
    total_weight += w;
  }
  // 0 / 0 = NaN when every row is ignored, as PyTorch's mean.
  if (reduction == Reduction::kMean) *ploss = static_cast<T>(total / total_weight);
  if (reduction == Reduction::kSum) *ploss = static_cast<T>(total);
  plse[n] = static_cast<T>(total_weight);
  if (eps > 0) {
    const double weight_sum =
        pw != nullptr ? std::accumulate(pw, pw + c, 0.0) : static_cast<double>(c);
    plse[n + 1] = static_cast<T>(weight_sum);
  }
}

}  // namespace

void CrossEntropyForwardCpu(const Tensor& logits, const Tensor& labels,
                            const ClassLossOptions& options, const Tensor& lse,
                            const Tensor& loss, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  CheckLabels(pl, n, c, options.ignore_index, "cross_entropy", "logits", logits.shape());
  const bool plain = !options.weight.defined() && options.label_smoothing == 0;
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy", [&]<typename T>() {
    const T* px = logits.host_data<T>();
    T* plse = lse.host_data<T>();
    T* ploss = loss.host_data<T>();
    if (plain) {
      CrossEntropyRows<T, true>(px, pl, n, c, options, plse, ploss, reduction);
    } else {
      CrossEntropyRows<T, false>(px, pl, n, c, options, plse, ploss, reduction);
    }
  });
}

void CrossEntropyBackwardCpu(const Tensor& logits, const Tensor& labels,
                             const ClassLossOptions& options, const Tensor& lse, const Tensor& g,
                             const Tensor& dlogits, Reduction reduction) {
  const int64_t n = logits.size(0), c = logits.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  const int64_t ignore = options.ignore_index;
  TANDEM_DISPATCH_FLOAT(logits.dtype(), "cross_entropy_backward", [&]<typename T>() {
    const T* px = logits.host_data<T>();
    const T* plse = lse.host_data<T>();
    const T* pw = options.weight.defined() ? options.weight.host_data<T>() : nullptr;
    const T eps = static_cast<T>(options.label_smoothing);
    const bool plain = pw == nullptr && options.label_smoothing == 0;
    // eps / C per class and the sum of the class weights (lse[N + 1], when eps > 0).
    const T spread = eps / static_cast<T>(c);
    const T spread_all = options.label_smoothing > 0 ? spread * plse[n + 1] : T(0);
    T* pd = dlogits.host_data<T>();
    const T* pg = g.host_data<T>();
    const T uniform_scale = UniformScale(pg, plse[n], reduction);
    for (int64_t i = 0; i < n; ++i) {
      T* drow = pd + i * c;
      if (pl[i] == ignore) {
        std::fill(drow, drow + c, T(0));
        continue;
      }
      const T scale = reduction == Reduction::kNone ? pg[i] : uniform_scale;
      const T* row = px + i * c;
      if (plain) {
        for (int64_t j = 0; j < c; ++j) {
          const T p = static_cast<T>(std::exp(static_cast<double>(row[j] - plse[i])));
          drow[j] = scale * (j == pl[i] ? p - T(1) : p);
        }
        continue;
      }
      const T on = (T(1) - eps) * (pw != nullptr ? pw[pl[i]] : T(1));
      for (int64_t j = 0; j < c; ++j) {
        const T p = static_cast<T>(std::exp(static_cast<double>(row[j] - plse[i])));
        const T w = pw != nullptr ? pw[j] : T(1);
        drow[j] = scale * (p * (on + spread_all) - (j == pl[i] ? on : T(0)) - spread * w);
      }
    }
  });
}

void NllLossForwardCpu(const Tensor& log_probs, const Tensor& labels,
                       const ClassLossOptions& options, const Tensor& loss,
                       const Tensor& total_weight, Reduction reduction) {
  const int64_t n = log_probs.size(0), c = log_probs.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  const int64_t ignore = options.ignore_index;
  CheckLabels(pl, n, c, ignore, "nll_loss", "log_probs", log_probs.shape());
  TANDEM_DISPATCH_FLOAT(log_probs.dtype(), "nll_loss", [&]<typename T>() {
    const T* px = log_probs.host_data<T>();
    const T* pw = options.weight.defined() ? options.weight.host_data<T>() : nullptr;
    T* ploss = loss.host_data<T>();
    double total = 0, weight_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (pl[i] == ignore) {
        if (reduction == Reduction::kNone) ploss[i] = T(0);
        continue;
      }
      const T w = pw != nullptr ? pw[pl[i]] : T(1);
      const T row_loss = -(w * px[i * c + pl[i]]);
      if (reduction == Reduction::kNone) ploss[i] = row_loss;
      total += static_cast<double>(row_loss);
      weight_sum += static_cast<double>(w);
    }
    if (reduction == Reduction::kMean) {
      *ploss = static_cast<T>(total / weight_sum);  // NaN when every row is ignored
      *total_weight.host_data<T>() = static_cast<T>(weight_sum);
    }
    if (reduction == Reduction::kSum) *ploss = static_cast<T>(total);
  });
}

void NllLossBackwardCpu(const Tensor& labels, const ClassLossOptions& options,
                        const Tensor& total_weight, const Tensor& g, const Tensor& dlog_probs,
                        Reduction reduction) {
  const int64_t n = dlog_probs.size(0), c = dlog_probs.size(1);
  const int64_t* pl = labels.host_data<int64_t>();
  TANDEM_DISPATCH_FLOAT(dlog_probs.dtype(), "nll_loss_backward", [&]<typename T>() {
    T* pd = dlog_probs.host_data<T>();
    const T* pg = g.host_data<T>();
    const T* pw = options.weight.defined() ? options.weight.host_data<T>() : nullptr;
    const T mean_weight = reduction == Reduction::kMean ? *total_weight.host_data<T>() : T(1);
    const T uniform_scale = UniformScale(pg, mean_weight, reduction);
    std::fill(pd, pd + n * c, T(0));
    for (int64_t i = 0; i < n; ++i) {
      if (pl[i] == options.ignore_index) continue;
      const T w = pw != nullptr ? pw[pl[i]] : T(1);
      pd[i * c + pl[i]] = -((reduction == Reduction::kNone ? pg[i] : uniform_scale) * w);
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
