// batch_norm2d: argument checks, running-statistics update, device dispatch and
// autograd wiring.
#include "nn/ops/batch_norm.h"

#include "nn/autograd.h"
#include "nn/ops/elementwise.h"
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

// The running statistics with a reducer: r = (1 - momentum) r + momentum * the
// combined statistic, the variance unbiased with the combined count. In place,
// never recorded, as batch_norm2d's own update.
void UpdateRunning(const Tensor& running_mean, const Tensor& running_var, const Tensor& mean,
                   const Tensor& unbiased_var, double momentum) {
  NoGradGuard no_grad;
  Tensor rm = running_mean, rv = running_var;
  rm.mul_(1.0 - momentum).add_(mean, momentum);
  rv.mul_(1.0 - momentum).add_(unbiased_var, momentum);
}

// Training with a reducer: this worker's (count, mean, M2) per channel, combined
// over the workers in float64 (the reducer adds M2s with Chan's parallel
// formula: no E[x^2] - E[x]^2 cancellation). Sets `mean` and `var` (biased) to
// the combined statistics in x's dtype and `count` to the combined count
// (float64, (C)); updates the running statistics.
void CombinedStatistics(BatchNormReducer& reducer, const Tensor& x, const Tensor& local_mean,
                        const Tensor& local_var, int64_t m, const Tensor& running_mean,
                        const Tensor& running_var, double momentum, Tensor& mean, Tensor& var,
                        Tensor& count) {
  NoGradGuard no_grad;
  const int64_t c = x.size(1);
  Tensor stats = empty({3, c}, {.dtype = kFloat64, .device = x.device()});
  stats[0].fill_(static_cast<double>(m));
  stats[1].copy_(local_mean);
  stats[2].copy_(local_var);
  stats[2].mul_(static_cast<double>(m));  // M2 = m * biased variance
  const Tensor all = reducer.CombineStatistics(stats);
  TANDEM_CHECK(all.dtype() == kFloat64 && all.shape() == stats.shape(), kOp,
               ": the reducer returned statistics of shape ", ShapeToString(all.shape()), " ",
               DTypeName(all.dtype()), ", expected ", ShapeToString(stats.shape()), " float64");
  count = all[0];
  if (x.device().is_cpu()) {
    const double total = count.to_vector<double>()[0];
    TANDEM_CHECK(total > 1, kOp, ": training needs more than one value per channel over all ",
                 "workers, got ", total, " (x of shape ", ShapeToString(x.shape()), " here)");
  }
  mean = all[1].to(x.dtype());
  var = div(all[2], count).to(x.dtype());
  if (running_mean.defined()) {
    UpdateRunning(running_mean, running_var, mean,
                  div(all[2], add_scalar(count, -1.0)).to(x.dtype()), momentum);
  }
}

// Backward with a reducer: this worker's (sum dy, sum dy*xhat) summed over the
// workers in float64, times m / count, in x's dtype.
void ScaledGlobalSums(BatchNormReducer& reducer, const Tensor& sum_dy, const Tensor& sum_dy_xhat,
                      const Tensor& count, ops::internal::BatchNormShape s, Tensor& out_sum_dy,
                      Tensor& out_sum_dy_xhat) {
  NoGradGuard no_grad;
  Tensor sums = empty({2, s.c}, {.dtype = kFloat64, .device = sum_dy.device()});
  sums[0].copy_(sum_dy);
  sums[1].copy_(sum_dy_xhat);
  const Tensor all = reducer.ReduceGradientSums(sums);
  TANDEM_CHECK(all.dtype() == kFloat64 && all.shape() == sums.shape(), kOp,
               ": the reducer returned gradient sums of shape ", ShapeToString(all.shape()), " ",
               DTypeName(all.dtype()), ", expected ", ShapeToString(sums.shape()), " float64");
  const Tensor scale = rdiv_scalar(count, static_cast<double>(s.n * s.hw));  // m / count
  out_sum_dy = mul(all[0], scale).to(sum_dy.dtype());
  out_sum_dy_xhat = mul(all[1], scale).to(sum_dy.dtype());
}

}  // namespace

Tensor batch_norm2d(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in,
                    const Tensor& running_mean, const Tensor& running_var, bool training,
                    double momentum, double eps,
                    const std::shared_ptr<BatchNormReducer>& reducer_in) {
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

  // Only a reducer with workers to combine with changes anything.
  const std::shared_ptr<BatchNormReducer> reducer =
      training && reducer_in != nullptr && reducer_in->Combines() ? reducer_in : nullptr;
  Tensor mean, var;  // the statistics this call normalises with
  Tensor count;      // with a reducer: the combined count per channel (float64)
  if (training) {
    TANDEM_CHECK(m > (reducer ? 0 : 1), kOp, ": training needs more than one value per channel",
                 reducer ? " (here, one per worker)" : "", ", got x of shape ",
                 ShapeToString(x.shape()));
    mean = empty({s.c}, channel_options);
    var = empty({s.c}, channel_options);
    TANDEM_ON_DEVICE(x, ops::internal::BatchNormStats, x, mean, var, s);
    if (reducer) {
      CombinedStatistics(*reducer, x, Tensor(mean), Tensor(var), m, running_mean, running_var,
                         momentum, mean, var, count);
    } else if (running_mean.defined()) {
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
       training, need_weight_grad, need_bias_grad, need_input_grad, reducer,
       count](const Tensor& dy) {
        const TensorOptions options{.dtype = x.dtype(), .device = x.device()};
        Tensor sum_dy = empty({s.c}, options);
        Tensor sum_dy_xhat = empty({s.c}, options);
        TANDEM_ON_DEVICE(x, ops::internal::BatchNormBackwardReduce, dy, x, mean, var, sum_dy,
                         sum_dy_xhat, eps, s);
        Tensor dx;
        if (need_input_grad) {
          // dx needs the sums over the whole batch; the kernel divides them by
          // this worker's m, so they arrive scaled by m / (combined count).
          Tensor dx_sum_dy = sum_dy, dx_sum_dy_xhat = sum_dy_xhat;
          if (reducer) {
            ScaledGlobalSums(*reducer, sum_dy, sum_dy_xhat, count, s, dx_sum_dy, dx_sum_dy_xhat);
          }
          dx = empty_like(x);
          if (x.numel() > 0) {
            TANDEM_ON_DEVICE(x, ops::internal::BatchNormBackwardInput, dy, x, mean, var, w,
                             dx_sum_dy, dx_sum_dy_xhat, dx, eps, training, s);
          }
        }
        return std::vector<Tensor>{dx, need_weight_grad ? sum_dy_xhat : Tensor(),
                                   need_bias_grad ? sum_dy : Tensor()};
      });
}

}  // namespace tandem::nn
