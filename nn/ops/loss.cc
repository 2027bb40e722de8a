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

}  // namespace

Tensor mse_loss(const Tensor& pred_in, const Tensor& target_in) {
  // Under autocast a bfloat16 input becomes float32 (precision-sensitive reduction).
  const Tensor pred = ops::internal::AutocastFloat32(pred_in);
  const Tensor target = ops::internal::AutocastFloat32(target_in);
  CheckDefined(pred, "mse_loss", "pred");
  CheckDefined(target, "mse_loss", "target");
  // No broadcasting: (N, 1) against (N) would silently become (N, N).
  TANDEM_CHECK(pred.shape() == target.shape(), "mse_loss: pred of shape ",
               ShapeToString(pred.shape()), " and target of shape ",
               ShapeToString(target.shape()), " differ");
  Tensor diff = sub(pred, target);
  return mean(mul(diff, diff));
}

Tensor cross_entropy(const Tensor& logits_in, const Tensor& labels) {
  const Tensor logits = ops::internal::AutocastFloat32(logits_in);
  CheckClassification(logits, labels, "cross_entropy");
  TANDEM_CHECK(logits.size(0) > 0 && logits.size(1) > 0,
               "cross_entropy: logits of shape ", ShapeToString(logits.shape()), " are empty");
  const TensorOptions options{.dtype = logits.dtype(), .device = logits.device()};
  Tensor lse = empty({logits.size(0)}, options);
  Tensor loss = empty({}, options);
  TANDEM_ON_DEVICE(logits, ops::internal::CrossEntropyForward, logits, labels, lse, loss);
  return autograd::Record("cross_entropy", {logits}, loss,
                          [logits = logits.detach(), labels, lse](const Tensor& g) {
    Tensor dlogits = empty_like(logits);
    TANDEM_ON_DEVICE(logits, ops::internal::CrossEntropyBackward, logits, labels, lse, g,
                     dlogits);
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
