// Losses and metrics: argument checks, device dispatch and autograd wiring.
#include "nn/ops/loss.h"

#include <cmath>

#include "nn/autograd.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/loss_kernels.h"
#include "nn/ops/reduce.h"

namespace tandem::nn {
namespace {

// logits (N, C) float, labels (N) int64, on one device.
void CheckClassification(const Tensor& logits, const Tensor& labels, const char* op,
                         const char* logits_name = "logits") {
  CheckDefined(logits, op, logits_name);
  CheckDefined(labels, op, "labels");
  CheckDim(logits, 2, op, logits_name);
  CheckFloating(logits, op);
  TANDEM_CHECK(labels.dtype() == kInt64, op, ": labels must be int64, got ", labels.ToString(),
               "; pass the class indices in [0, ", logits.size(1), ") as int64 (labels.to(kInt64))");
  TANDEM_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0), op, ": labels of shape ",
               ShapeToString(labels.shape()), " do not match ", logits_name, " of shape ",
               ShapeToString(logits.shape()), " (expected (", logits.size(0), "))");
  CheckSameDevice(logits, labels, op);
}

// A Reduction outside the enum (a cast from a bad integer) is an error, not UB.
void CheckReduction(Reduction reduction, const char* op) {
  TANDEM_CHECK(reduction == Reduction::kNone || reduction == Reduction::kMean ||
                   reduction == Reduction::kSum,
               op, ": unknown reduction ", static_cast<int>(reduction),
               " (expected kNone, kMean or kSum)");
}

// pred and target of one shape (no broadcasting: (N, 1) against (N) would silently
// become (N, N)), dtype and device: a mismatch is named by the loss, not by the
// elementwise op inside it.
void CheckSameShape(const Tensor& pred, const Tensor& target, const char* op, const char* a,
                    const char* b) {
  CheckDefined(pred, op, a);
  CheckDefined(target, op, b);
  CheckSameDevice(pred, target, op);
  CheckSameDType(pred, target, op);
  TANDEM_CHECK(pred.shape() == target.shape(), op, ": ", a, " of shape ",
               ShapeToString(pred.shape()), " and ", b, " of shape ",
               ShapeToString(target.shape()), " differ");
}

// The class weight of a classification loss: (C), the input's dtype (float32 for
// a bfloat16 weight under autocast, as the input) and device, not requiring grad
// (PyTorch does not differentiate it either). Undefined when not given.
Tensor ClassWeight(const std::optional<Tensor>& weight_in, const Tensor& input, const char* op) {
  if (!weight_in.has_value()) return Tensor();
  const Tensor weight = ops::internal::AutocastFloat32(*weight_in);
  CheckDefined(weight, op, "weight");
  TANDEM_CHECK(weight.dim() == 1 && weight.size(0) == input.size(1), op, ": weight of shape ",
               ShapeToString(weight.shape()), " must be (", input.size(1), "), one per class");
  TANDEM_CHECK(weight.dtype() == input.dtype(), op, ": weight of dtype ",
               DTypeName(weight.dtype()), " does not match the input's ", DTypeName(input.dtype()));
  TANDEM_CHECK(weight.device() == input.device(), op, ": weight on ", weight.device().ToString(),
               " but the input on ", input.device().ToString());
  TANDEM_CHECK(!weight.requires_grad(), op,
               ": weight requires grad; class weights are constants (detach it)");
  return weight;
}

Tensor Reduce(const Tensor& per_element, Reduction reduction) {
  if (reduction == Reduction::kNone) return per_element;
  return reduction == Reduction::kSum ? sum(per_element) : mean(per_element);
}

}  // namespace

std::string_view ReductionName(Reduction reduction) {
  switch (reduction) {
    case Reduction::kNone: return "none";
    case Reduction::kMean: return "mean";
    case Reduction::kSum: return "sum";
  }
  return "unknown";
}

Tensor mse_loss(const Tensor& pred_in, const Tensor& target_in, Reduction reduction) {
  // Under autocast a bfloat16 input becomes float32 (precision-sensitive reduction).
  const Tensor pred = ops::internal::AutocastFloat32(pred_in);
  const Tensor target = ops::internal::AutocastFloat32(target_in);
  CheckSameShape(pred, target, "mse_loss", "pred", "target");
  CheckReduction(reduction, "mse_loss");
  Tensor diff = sub(pred, target);
  return Reduce(mul(diff, diff), reduction);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& labels, Reduction reduction) {
  return cross_entropy(logits, labels, CrossEntropyOptions{.reduction = reduction});
}

Tensor cross_entropy(const Tensor& logits_in, const Tensor& labels,
                     const CrossEntropyOptions& options) {
  const Tensor logits = ops::internal::AutocastFloat32(logits_in);
  const Reduction reduction = options.reduction;
  CheckClassification(logits, labels, "cross_entropy");
  CheckReduction(reduction, "cross_entropy");
  TANDEM_CHECK(logits.size(0) > 0 && logits.size(1) > 0,
               "cross_entropy: logits of shape ", ShapeToString(logits.shape()), " are empty");
  const double eps = options.label_smoothing;
  TANDEM_CHECK(eps >= 0 && eps <= 1, "cross_entropy: label_smoothing ", eps,
               " is outside [0, 1]");
  const ops::internal::ClassLossOptions kernel_options{
      .weight = ClassWeight(options.weight, logits, "cross_entropy"),
      .ignore_index = options.ignore_index,
      .label_smoothing = eps};
  const TensorOptions tensor_options{.dtype = logits.dtype(), .device = logits.device()};
  // The N log-sum-exps, then the mean's denominator and the sum of the class weights.
  Tensor lse = empty({logits.size(0) + 2}, tensor_options);
  // kNone: one loss per sample; otherwise 0-dim.
  Tensor loss = reduction == Reduction::kNone ? empty({logits.size(0)}, tensor_options)
                                              : empty({}, tensor_options);
  TANDEM_ON_DEVICE(logits, ops::internal::CrossEntropyForward, logits, labels, kernel_options,
                   lse, loss, reduction);
  return autograd::Record("cross_entropy", {logits}, loss,
                          [logits = logits.detach(), labels, kernel_options, lse,
                           reduction](const Tensor& g) {
    Tensor dlogits = empty_like(logits);
    TANDEM_ON_DEVICE(logits, ops::internal::CrossEntropyBackward, logits, labels, kernel_options,
                     lse, g, dlogits, reduction);
    return std::vector<Tensor>{dlogits};
  });
}

Tensor nll_loss(const Tensor& log_probs, const Tensor& labels, Reduction reduction) {
  return nll_loss(log_probs, labels, NllLossOptions{.reduction = reduction});
}

Tensor nll_loss(const Tensor& log_probs_in, const Tensor& labels, const NllLossOptions& options) {
  const Tensor log_probs = ops::internal::AutocastFloat32(log_probs_in);
  const Reduction reduction = options.reduction;
  CheckClassification(log_probs, labels, "nll_loss", "log_probs");
  CheckReduction(reduction, "nll_loss");
  TANDEM_CHECK(log_probs.size(0) > 0 && log_probs.size(1) > 0, "nll_loss: log_probs of shape ",
               ShapeToString(log_probs.shape()), " are empty");
  const ops::internal::ClassLossOptions kernel_options{
      .weight = ClassWeight(options.weight, log_probs, "nll_loss"),
      .ignore_index = options.ignore_index};
  const TensorOptions tensor_options{.dtype = log_probs.dtype(), .device = log_probs.device()};
  Tensor loss = reduction == Reduction::kNone ? empty({log_probs.size(0)}, tensor_options)
                                              : empty({}, tensor_options);
  // kMean's denominator, for backward.
  Tensor total_weight = reduction == Reduction::kMean ? empty({}, tensor_options) : Tensor();
  TANDEM_ON_DEVICE(log_probs, ops::internal::NllLossForward, log_probs, labels, kernel_options,
                   loss, total_weight, reduction);
  return autograd::Record("nll_loss", {log_probs}, loss,
                          [shape = log_probs.shape(), tensor_options, labels, kernel_options,
                           total_weight, reduction](const Tensor& g) {
    Tensor dlog_probs = empty(shape, tensor_options);
    TANDEM_ON_DEVICE(g, ops::internal::NllLossBackward, labels, kernel_options, total_weight, g,
                     dlog_probs, reduction);
    return std::vector<Tensor>{dlog_probs};
  });
}

Tensor accuracy(const Tensor& logits_in, const Tensor& labels) {
  const Tensor logits = ops::internal::AutocastFloat32(logits_in);
  CheckClassification(logits, labels, "accuracy");
  TANDEM_CHECK(logits.size(1) > 0, "accuracy: logits of shape ", ShapeToString(logits.shape()),
               " have no classes");
  Tensor out = empty({}, {.dtype = kFloat32, .device = logits.device()});
  TANDEM_ON_DEVICE(logits, ops::internal::Accuracy, logits, labels, out);
  return out;
}

Tensor l1_loss(const Tensor& pred_in, const Tensor& target_in, Reduction reduction) {
  const Tensor pred = ops::internal::AutocastFloat32(pred_in);
  const Tensor target = ops::internal::AutocastFloat32(target_in);
  CheckSameShape(pred, target, "l1_loss", "pred", "target");
  CheckReduction(reduction, "l1_loss");
  return Reduce(abs(sub(pred, target)), reduction);
}

Tensor smooth_l1_loss(const Tensor& pred_in, const Tensor& target_in, Reduction reduction,
                      double beta) {
  const Tensor pred = ops::internal::AutocastFloat32(pred_in);
  const Tensor target = ops::internal::AutocastFloat32(target_in);
  CheckSameShape(pred, target, "smooth_l1_loss", "pred", "target");
  CheckReduction(reduction, "smooth_l1_loss");
  TANDEM_CHECK(beta >= 0 && std::isfinite(beta), "smooth_l1_loss: beta ", beta,
               " must be finite and >= 0");
  if (beta == 0) return l1_loss(pred, target, reduction);  // PyTorch's special case
  using ops::internal::BinaryOp;
  using ops::internal::UnaryOp;
  const Tensor diff = sub(pred, target);
  Tensor per = empty_like(diff);
  TANDEM_ON_DEVICE(diff, ops::internal::Unary, UnaryOp::kSmoothL1, diff, per, beta, 0.0);
  per = autograd::Record("smooth_l1_loss", {diff}, per, [d = diff.detach(), beta](const Tensor& g) {
    Tensor dd = empty_like(d);
    const auto plan = ops::internal::PlanBroadcast(g.shape(), d.shape(), "smooth_l1_loss_backward");
    TANDEM_ON_DEVICE(d, ops::internal::Binary, BinaryOp::kSmoothL1Backward, g, d, dd, plan, beta,
                     0.0);
    return std::vector<Tensor>{dd};
  });
  return Reduce(per, reduction);
}

Tensor binary_cross_entropy_with_logits(const Tensor& logits_in, const Tensor& target_in,
                                        const std::optional<Tensor>& pos_weight_in,
                                        Reduction reduction) {
  const char* op = "binary_cross_entropy_with_logits";
  const Tensor logits = ops::internal::AutocastFloat32(logits_in);
  const Tensor target = ops::internal::AutocastFloat32(target_in);
  CheckSameShape(logits, target, op, "logits", "target");
  CheckReduction(reduction, op);
  // (1 - t) x + w softplus(-x), w = 1 + (pos_weight - 1) t: softplus(-x) = log(1 + exp(-x))
  // = log1p(exp(-|x|)) + max(-x, 0), never exp of a large positive number.
  Tensor log_weight;
  if (pos_weight_in.has_value()) {
    const Tensor pos_weight = ops::internal::AutocastFloat32(*pos_weight_in);
    CheckDefined(pos_weight, op, "pos_weight");
    CheckSameDevice(pos_weight, target, op);
    CheckSameDType(pos_weight, target, op);
    const auto plan = ops::internal::PlanBroadcast(
        pos_weight.shape(), target.shape(), "binary_cross_entropy_with_logits: pos_weight and target");
    TANDEM_CHECK(plan.out_shape == target.shape(), op, ": pos_weight of shape ",
                 ShapeToString(pos_weight.shape()), " does not broadcast to target of shape ",
                 ShapeToString(target.shape()));
    log_weight = add_scalar(mul(add_scalar(pos_weight, -1.0), target), 1.0);
  }
  Tensor per = mul(rsub_scalar(target, 1.0), logits);
  Tensor soft = softplus(neg(logits));
  per = add(per, log_weight.defined() ? mul(log_weight, soft) : soft);
  return Reduce(per, reduction);
}

}  // namespace tandem::nn
