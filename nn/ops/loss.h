// Losses and metrics. CPU: loss_cpu.cc; CUDA: loss_cuda.cu (cross_entropy is one
// fused softmax + NLL kernel forward and one backward; nll_loss one kernel each way).
// mse_loss, l1_loss, smooth_l1_loss and binary_cross_entropy_with_logits are
// composed of elementwise ops and reductions (each step its own kernel and output).
#ifndef TANDEM_NN_OPS_LOSS_H_
#define TANDEM_NN_OPS_LOSS_H_

#include <optional>
#include <string_view>

#include "nn/tensor.h"

namespace tandem::nn {

// How a loss combines its per-element (mse_loss) or per-sample (cross_entropy)
// terms, as PyTorch's `reduction=`: kNone keeps them (no reduction), kMean
// averages them into a 0-dim tensor (the default), kSum adds them into one.
enum class Reduction { kNone, kMean, kSum };
std::string_view ReductionName(Reduction reduction);  // "none", "mean", "sum"

// (pred - target)^2 per element, reduced by `reduction`: kNone -> pred's shape,
// kMean / kSum -> 0-dim. pred, target: same shapes (no broadcasting).
Tensor mse_loss(const Tensor& pred, const Tensor& target, Reduction reduction = Reduction::kMean);

// |pred - target| per element, reduced as mse_loss (same shapes, no broadcasting).
Tensor l1_loss(const Tensor& pred, const Tensor& target, Reduction reduction = Reduction::kMean);

// Huber-style loss of d = pred - target per element, as PyTorch's smooth_l1_loss:
// 0.5 d^2 / beta where |d| < beta, |d| - 0.5 beta elsewhere; beta >= 0 (0 is l1_loss).
Tensor smooth_l1_loss(const Tensor& pred, const Tensor& target,
                      Reduction reduction = Reduction::kMean, double beta = 1.0);

// Sigmoid + binary cross-entropy in one numerically stable form, as PyTorch's
// binary_cross_entropy_with_logits: per element, with w = 1 + (pos_weight - 1) * target,
//   (1 - target) * logits + w * log(1 + exp(-logits))   (log1p(exp(-|x|)) + max(-x, 0)).
// logits, target: same shapes, float (target may hold soft labels in [0, 1]);
// pos_weight: broadcastable to target (one weight per class, the last dim), optional.
// Differentiable in logits, target and pos_weight (PyTorch 1.13 refuses a pos_weight
// that requires grad).
Tensor binary_cross_entropy_with_logits(const Tensor& logits, const Tensor& target,
                                        const std::optional<Tensor>& pos_weight = std::nullopt,
                                        Reduction reduction = Reduction::kMean);

// The options of cross_entropy, as PyTorch 1.13's F.cross_entropy (Paddle's
// CrossEntropyLoss has the same three). Every call without options is the default.
//  - weight: (C) float of the logits' dtype and device, one weight per class; the
//    loss of sample i is scaled by weight[labels[i]] and kMean divides by the sum of
//    weight[labels[i]] over the samples not ignored. Not differentiable: a weight
//    that requires grad is refused (as PyTorch's nll_loss refuses it). Under
//    autocast a bfloat16 weight is cast to float32, as the logits are.
//  - ignore_index: a label equal to it gives its sample a loss of 0 and a gradient
//    of 0 and leaves it out of kMean's denominator; it may name a class in [0, C).
//    Any other label outside [0, C) is an error naming it.
//  - label_smoothing in [0, 1]: the target becomes (1 - eps) one_hot + eps / C
//    uniform. With weight, as PyTorch: per sample
//      (1 - eps) w[y] (lse - x[y]) + eps / C * sum_c w[c] (lse - x[c]),
//    and kMean divides the sum by the same sum of weight[labels[i]].
// kMean over a batch whose samples are all ignored is 0 / 0 = NaN, as PyTorch's
// (the gradient is 0); kSum gives 0.
struct CrossEntropyOptions {
  Reduction reduction = Reduction::kMean;
  std::optional<Tensor> weight;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};

// The options of nll_loss, as PyTorch 1.13's F.nll_loss: weight and ignore_index
// as in CrossEntropyOptions (no label smoothing).
struct NllLossOptions {
  Reduction reduction = Reduction::kMean;
  std::optional<Tensor> weight;
  int64_t ignore_index = -100;
};

// logits: (N, C) float; labels: (N) int64 in [0, C) or ignore_index (-100 unless
// given). The per-sample loss -log_softmax(logits)[i, labels[i]] (with the options
// above: weighted, smoothed), reduced by `reduction`: kNone -> (N), kMean / kSum ->
// 0-dim. A label out of range is an error naming it (checked on the host for CPU
// tensors; on CUDA a deferred device error, see loss_cuda.cu). A bad weight (not
// (C), another dtype or device, requiring grad) or label_smoothing outside [0, 1]
// is an error naming it.
Tensor cross_entropy(const Tensor& logits, const Tensor& labels,
                     const CrossEntropyOptions& options);
Tensor cross_entropy(const Tensor& logits, const Tensor& labels,
                     Reduction reduction = Reduction::kMean);

// log_probs: (N, C) float (log_softmax's output); labels: (N) int64 in [0, C) or
// ignore_index. The per-sample loss -weight[labels[i]] * log_probs[i, labels[i]],
// reduced by `reduction` as cross_entropy (nll_loss(log_softmax(x), y) is
// cross_entropy(x, y)); a bad label or weight as there.
Tensor nll_loss(const Tensor& log_probs, const Tensor& labels, const NllLossOptions& options);
Tensor nll_loss(const Tensor& log_probs, const Tensor& labels,
                Reduction reduction = Reduction::kMean);

// Fraction of rows whose argmax equals the label -> 0-dim float32 (no host sync
// on CUDA until item()). Not differentiable.
Tensor accuracy(const Tensor& logits, const Tensor& labels);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_LOSS_H_
