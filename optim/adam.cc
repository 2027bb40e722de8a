// Adam and AdamW: options, validation and the per-step scalars (bias
// corrections computed on the host from the step count).
#include "optim/adam.h"

#include <cmath>

#include "optim/internal/fused_kernels.h"

namespace tandem::optim {
namespace {

AdamOptions ToAdam(const AdamWOptions& o) {
  return {.lr = o.lr, .betas = o.betas, .eps = o.eps, .weight_decay = o.weight_decay,
          .amsgrad = o.amsgrad};
}

}  // namespace

Adam::Adam(const char* name, bool decoupled_weight_decay)
    : Optimizer(name, {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
      decoupled_weight_decay_(decoupled_weight_decay) {}

Adam::Adam(std::vector<nn::Tensor> params, AdamOptions options) : Adam("Adam", false) {
  Add(std::move(params), options);
}

Adam::Adam(std::vector<ParamGroup<AdamOptions>> groups) : Adam("Adam", false) {
  for (auto& group : groups) Add(std::move(group.params), group.options);
}

AdamW::AdamW(std::vector<nn::Tensor> params, AdamWOptions options) : Adam("AdamW", true) {
  Add(std::move(params), ToAdam(options));
}

AdamW::AdamW(std::vector<ParamGroup<AdamWOptions>> groups) : Adam("AdamW", true) {
  for (auto& group : groups) Add(std::move(group.params), ToAdam(group.options));
}

void Adam::Add(std::vector<nn::Tensor> params, const AdamOptions& o) {
  const auto [beta1, beta2] = o.betas;
  TANDEM_CHECK(beta1 >= 0 && beta1 < 1, name_, ": beta1 must be in [0, 1) but is ", beta1);
  TANDEM_CHECK(beta2 >= 0 && beta2 < 1, name_, ": beta2 must be in [0, 1) but is ", beta2);
  TANDEM_CHECK(o.eps >= 0, name_, ": eps must be >= 0 but is ", o.eps);
  TANDEM_CHECK(o.weight_decay >= 0, name_, ": weight_decay must be >= 0 but is ", o.weight_decay);
  AddGroup(std::move(params), {{"lr", o.lr},
                               {"beta1", beta1},
                               {"beta2", beta2},
                               {"eps", o.eps},
                               {"weight_decay", o.weight_decay},
                               {"amsgrad", o.amsgrad ? 1.0 : 0.0}});
}

AdamOptions Adam::options(int64_t group) const {
  return {.lr = hyper(group, "lr"),
          .betas = {hyper(group, "beta1"), hyper(group, "beta2")},
          .eps = hyper(group, "eps"),
          .weight_decay = hyper(group, "weight_decay"),
          .amsgrad = hyper(group, "amsgrad") != 0};
}

AdamWOptions AdamW::options(int64_t group) const {
  const AdamOptions o = Adam::options(group);
  return {.lr = o.lr, .betas = o.betas, .eps = o.eps, .weight_decay = o.weight_decay,
          .amsgrad = o.amsgrad};
}

bool Adam::UsesBuffer(const Group& group, int buffer) const {
  return buffer < 2 || group.hyper.at("amsgrad") != 0;
}

void Adam::step() {
  for (int64_t g = 0; g < num_groups(); ++g) UpdateGroup(g, internal::Algorithm::kAdam);
}

internal::UpdateScalars Adam::ScalarsFor(int64_t group, int64_t step) const {
  const AdamOptions o = Adam::options(group);
  const double t = static_cast<double>(step);
  const double bias_correction1 = 1 - std::pow(o.betas.first, t);
  const double bias_correction2 = 1 - std::pow(o.betas.second, t);
  return internal::UpdateScalars{
      .lr = o.lr,
      .weight_decay = decoupled_weight_decay_ ? 0.0 : o.weight_decay,
      .decay_factor = decoupled_weight_decay_ ? 1 - o.lr * o.weight_decay : 1.0,
      .beta1 = o.betas.first,
      .beta2 = o.betas.second,
      .eps = o.eps,
      .step_size = o.lr / bias_correction1,
      .bias_correction2_sqrt = std::sqrt(bias_correction2),
      .amsgrad = o.amsgrad};
}

}  // namespace tandem::optim
