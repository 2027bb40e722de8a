// Adagrad: PyTorch's torch.optim.Adagrad algorithm. For each parameter p with
// gradient g at step t (t = 1, 2, ...):
//   g += weight_decay * p
//   clr = lr / (1 + (t - 1) * lr_decay)
//   sum += g * g
//   p -= clr * g / (sqrt(sum) + eps)
#ifndef TANDEM_OPTIM_ADAGRAD_H_
#define TANDEM_OPTIM_ADAGRAD_H_

#include <vector>

#include "optim/optimizer.h"

namespace tandem::optim {

struct AdagradOptions {
  double lr = 1e-2;
  double lr_decay = 0;
  double weight_decay = 0;
  double initial_accumulator_value = 0;
  double eps = 1e-10;
};

// State per parameter: "sum" (starts at initial_accumulator_value). Hyper-parameters:
// lr, lr_decay, weight_decay, initial_accumulator_value, eps.
class Adagrad : public Optimizer {
 public:
  // Throws tandem::Error on invalid options (negative lr, lr_decay, ...).
  explicit Adagrad(std::vector<nn::Tensor> params, AdagradOptions options = {});
  explicit Adagrad(std::vector<ParamGroup<AdagradOptions>> groups);
  void step() override;
  AdagradOptions options(int64_t group) const;

 private:
  void Add(std::vector<nn::Tensor> params, const AdagradOptions& options);
  bool UsesBuffer(const Group&, int) const override { return true; }
  double InitialBufferValue(const Group& group, int buffer) const override;
  internal::UpdateScalars ScalarsFor(int64_t group, int64_t step) const override;
};

}  // namespace tandem::optim

#endif  // TANDEM_OPTIM_ADAGRAD_H_
