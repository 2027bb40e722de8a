// Losses and metrics: argument checks, device dispatch and autograd wiring.
#include "nn/ops/loss.h"

#include "nn/autograd.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/loss_kernels.h"
#include "nn/ops/reduce.h"

namespace tandem::nn {
namespace {

// logits (N, C) float, labels (N) int64, on one device.
void CheckClassification(const Tensor& logits, const Tensor& labels, const char* op) {
  CheckDefined(logits, op, "logits");
  CheckDefined(labels, op, "labels");
  CheckDim(logits, 2, op, "logits");
  CheckFloating(logits, op);
  TANDEM_CHECK(labels.dtype() == kInt64, op, ": labels must be int64, got ", labels.ToString());
  TANDEM_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0), op, ": labels of shape ",
               ShapeToString(labels.shape()), " do not match logits of shape ",
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
  CheckDefined(pred, "mse_loss", "pred");
  CheckDefined(target, "mse_loss", "target");
  // No broadcasting: (N, 1) against (N) would silently become (N, N).
  TANDEM_CHECK(pred.shape() == target.shape(), "mse_loss: pred of shape ",
               ShapeToString(pred.shape()), " and target of shape ",
               ShapeToString(target.shape()), " differ");
  CheckReduction(reduction, "mse_loss");
  Tensor diff = sub(pred, target);
  Tensor squared = mul(diff, diff);
  if (reduction == Reduction::kNone) return squared;
  return reduction == Reduction::kSum ? sum(squared) : mean(squared);
}

Tensor cross_entropy(const Tensor& logits_in, const Tensor& labels, Reduction reduction) {
  const Tensor logits = ops::internal::AutocastFloat32(logits_in);
  CheckClassification(logits, labels, "cross_entropy");
  CheckReduction(reduction, "cross_entropy");
  TANDEM_CHECK(logits.size(0) > 0 && logits.size(1) > 0,
               "cross_entropy: logits of shape ", ShapeToString(logits.shape()), " are empty");
  const TensorOptions options{.dtype = logits.dtype(), .device = logits.device()};
  Tensor lse = empty({logits.size(0)}, options);
  // kNone: one loss per sample; otherwise 0-dim.
  Tensor loss = reduction == Reduction::kNone ? empty({logits.size(0)}, options)
                                              : empty({}, options);
  TANDEM_ON_DEVICE(logits, ops::internal::CrossEntropyForward, logits, labels, lse, loss,
                   reduction);
  return autograd::Record("cross_entropy", {logits}, loss,
                          [logits = logits.detach(), labels, lse, reduction](const Tensor& g) {
    Tensor dlogits = empty_like(logits);
    TANDEM_ON_DEVICE(logits, ops::internal::CrossEntropyBackward, logits, labels, lse, g,
                     dlogits, reduction);
    return std::vector<Tensor>{dlogits};
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

}  // namespace tandem::nn
