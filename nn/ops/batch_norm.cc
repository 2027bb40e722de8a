// batch_norm2d: argument checks, running-statistics update, device dispatch and
// autograd wiring.
#include "nn/ops/batch_norm.h"

#include "nn/autograd.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/batch_norm_kernels.h"
#include "nn/ops/internal/dispatch.h"

namespace tandem::nn {
namespace {

constexpr const char* kOp = "batch_norm2d";

// A per-channel tensor (weight, bias, running stats): undefined is allowed where
// `optional`; otherwise (C), x's dtype and device.
void CheckChannelTensor(const Tensor& t, const Tensor& x, const char* what, bool optional) {
  if (!t.defined()) {
    TANDEM_CHECK(optional, kOp, ": ", what, " is an undefined tensor");
    return;
  }
  TANDEM_CHECK(t.dim() == 1 && t.size(0) == x.size(1), kOp, ": ", what, " must have shape (",
               x.size(1), ") for x of shape ", ShapeToString(x.shape()), ", got ",
               ShapeToString(t.shape()));
  CheckSameDevice(t, x, kOp);
  CheckSameDType(t, x, kOp);
}

}  // namespace

Tensor batch_norm2d(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in,
                    const Tensor& running_mean, const Tensor& running_var, bool training,
                    double momentum, double eps) {
  // Under autocast bfloat16 x, weight, bias become float32. The running statistics
  // are not cast: they are updated in place, and a cast copy would take the update.
  const Tensor x = ops::internal::AutocastFloat32(x_in);
  const Tensor weight = ops::internal::AutocastFloat32(weight_in);
  const Tensor bias = ops::internal::AutocastFloat32(bias_in);
  CheckDefined(x, kOp, "x");
  CheckDim(x, 4, kOp, "x");
  CheckFloating(x, kOp);
  CheckChannelTensor(weight, x, "weight", /*optional=*/true);
  CheckChannelTensor(bias, x, "bias", /*optional=*/true);
  CheckChannelTensor(running_mean, x, "running_mean", /*optional=*/training);
  CheckChannelTensor(running_var, x, "running_var", /*optional=*/training);
  TANDEM_CHECK(running_mean.defined() == running_var.defined(), kOp,
               ": running_mean and running_var must be both defined or both undefined");
  TANDEM_CHECK(eps > 0, kOp, ": eps must be positive, got ", eps);
  const ops::internal::BatchNormShape s{x.size(0), x.size(1), x.size(2) * x.size(3)};
  const int64_t m = s.n * s.hw;
  const TensorOptions channel_options{.dtype = x.dtype(), .device = x.device()};

  Tensor mean, var;  // the statistics this call normalises with
  if (training) {
    TANDEM_CHECK(m > 1, kOp, ": training needs more than one value per channel, got x of shape ",
                 ShapeToString(x.shape()));
    mean = empty({s.c}, channel_options);
    var = empty({s.c}, channel_options);
    TANDEM_ON_DEVICE(x, ops::internal::BatchNormStats, x, mean, var, s);
    if (running_mean.defined()) {
      // Buffers, not parameters: updated in place, never recorded.
      // Tensor is a handle: copies share the buffers' storage.
      NoGradGuard no_grad;
      Tensor rm = running_mean, rv = running_var;
      rm.mul_(1.0 - momentum).add_(mean, momentum);
      const double unbias = static_cast<double>(m) / static_cast<double>(m - 1);
      rv.mul_(1.0 - momentum).add_(var, momentum * unbias);
    }
  } else {
    // Copies: a later training step updates the running stats in place, and this
    // call's backward must still see the values it normalised with.
    NoGradGuard no_grad;
    mean = running_mean.clone();
    var = running_var.clone();
  }
  Tensor y = empty_like(x);
  if (x.numel() > 0) {
    TANDEM_ON_DEVICE(x, ops::internal::BatchNormForward, x, mean, var, weight, bias, y, eps, s);
  }
  const bool need_weight_grad = weight.defined() && weight.requires_grad();
  const bool need_bias_grad = bias.defined() && bias.requires_grad();
  const bool need_input_grad = x.requires_grad();
  return autograd::Record(
      kOp, {x, weight, bias}, y,
      [x = x.detach(), w = weight.defined() ? weight.detach() : Tensor(), mean, var, eps, s,
       training, need_weight_grad, need_bias_grad, need_input_grad](const Tensor& dy) {
        const TensorOptions options{.dtype = x.dtype(), .device = x.device()};
        Tensor sum_dy = empty({s.c}, options);
        Tensor sum_dy_xhat = empty({s.c}, options);
        TANDEM_ON_DEVICE(x, ops::internal::BatchNormBackwardReduce, dy, x, mean, var, sum_dy,
                         sum_dy_xhat, eps, s);
        Tensor dx;
        if (need_input_grad) {
          dx = empty_like(x);
          if (x.numel() > 0) {
            TANDEM_ON_DEVICE(x, ops::internal::BatchNormBackwardInput, dy, x, mean, var, w,
                             sum_dy, sum_dy_xhat, dx, eps, training, s);
          }
        }
        return std::vector<Tensor>{dx, need_weight_grad ? sum_dy_xhat : Tensor(),
                                   need_bias_grad ? sum_dy : Tensor()};
      });
}

}  // namespace tandem::nn
