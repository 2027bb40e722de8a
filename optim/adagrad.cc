// Adagrad: options, validation and the per-step scalars.
#include "optim/adagrad.h"

#include "optim/internal/fused_kernels.h"

namespace tandem::optim {

Adagrad::Adagrad(std::vector<nn::Tensor> params, AdagradOptions options)
    : Optimizer("Adagrad", {"sum"}) {
  Add(std::move(params), options);
}

Adagrad::Adagrad(std::vector<ParamGroup<AdagradOptions>> groups) : Optimizer("Adagrad", {"sum"}) {
  for (auto& group : groups) Add(std::move(group.params), group.options);
}

void Adagrad::Add(std::vector<nn::Tensor> params, const AdagradOptions& o) {
  TANDEM_CHECK(o.lr_decay >= 0, "Adagrad: lr_decay must be >= 0 but is ", o.lr_decay);
  TANDEM_CHECK(o.weight_decay >= 0, "Adagrad: weight_decay must be >= 0 but is ", o.weight_decay);
  TANDEM_CHECK(o.initial_accumulator_value >= 0,
               "Adagrad: initial_accumulator_value must be >= 0 but is ",
               o.initial_accumulator_value);
  TANDEM_CHECK(o.eps >= 0, "Adagrad: eps must be >= 0 but is ", o.eps);
  AddGroup(std::move(params), {{"lr", o.lr},
                               {"lr_decay", o.lr_decay},
                               {"weight_decay", o.weight_decay},
                               {"initial_accumulator_value", o.initial_accumulator_value},
                               {"eps", o.eps}});
}

AdagradOptions Adagrad::options(int64_t group) const {
  return {.lr = hyper(group, "lr"),
          .lr_decay = hyper(group, "lr_decay"),
          .weight_decay = hyper(group, "weight_decay"),
          .initial_accumulator_value = hyper(group, "initial_accumulator_value"),
          .eps = hyper(group, "eps")};
}

double Adagrad::InitialBufferValue(const Group& group, int) const {
  return group.hyper.at("initial_accumulator_value");
}

void Adagrad::step() {
  for (int64_t g = 0; g < num_groups(); ++g) UpdateGroup(g, internal::Algorithm::kAdagrad);
}

internal::UpdateScalars Adagrad::ScalarsFor(int64_t group, int64_t step) const {
  const AdagradOptions o = options(group);
  return internal::UpdateScalars{
      .lr = o.lr,
      .weight_decay = o.weight_decay,
      .clr = o.lr / (1 + static_cast<double>(step - 1) * o.lr_decay),
      .eps = o.eps};
}

}  // namespace tandem::optim
