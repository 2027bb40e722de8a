// SGD: options, validation and the per-step scalars.
#include "optim/sgd.h"

#include "optim/internal/fused_kernels.h"

namespace tandem::optim {

SGD::SGD(std::vector<nn::Tensor> params, SGDOptions options) : Optimizer("SGD", {"momentum_buffer"}) {
  Add(std::move(params), options);
}

SGD::SGD(std::vector<ParamGroup<SGDOptions>> groups) : Optimizer("SGD", {"momentum_buffer"}) {
  for (auto& group : groups) Add(std::move(group.params), group.options);
}

void SGD::Add(std::vector<nn::Tensor> params, const SGDOptions& o) {
  TANDEM_CHECK(o.momentum >= 0, "SGD: momentum must be >= 0 but is ", o.momentum);
  TANDEM_CHECK(o.weight_decay >= 0, "SGD: weight_decay must be >= 0 but is ", o.weight_decay);
  TANDEM_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
               "SGD: nesterov needs momentum > 0 and dampening == 0 but momentum is ", o.momentum,
               " and dampening ", o.dampening);
  AddGroup(std::move(params), {{"lr", o.lr},
                               {"momentum", o.momentum},
                               {"dampening", o.dampening},
                               {"weight_decay", o.weight_decay},
                               {"nesterov", o.nesterov ? 1.0 : 0.0}});
}

SGDOptions SGD::options(int64_t group) const {
  return {.lr = hyper(group, "lr"),
          .momentum = hyper(group, "momentum"),
          .dampening = hyper(group, "dampening"),
          .weight_decay = hyper(group, "weight_decay"),
          .nesterov = hyper(group, "nesterov") != 0};
}

bool SGD::UsesBuffer(const Group& group, int) const { return group.hyper.at("momentum") != 0; }

void SGD::step() {
  for (int64_t g = 0; g < num_groups(); ++g) UpdateGroup(g, internal::Algorithm::kSgd);
}

internal::UpdateScalars SGD::ScalarsFor(int64_t group, int64_t step) const {
  const SGDOptions o = options(group);
  return internal::UpdateScalars{.lr = o.lr,
                                 .weight_decay = o.weight_decay,
                                 .momentum = o.momentum,
                                 .dampening = o.dampening,
                                 .nesterov = o.nesterov,
                                 .first_step = step == 1};
}

}  // namespace tandem::optim
