// Adam and AdamW: PyTorch's torch.optim.Adam / torch.optim.AdamW algorithms.
// For each parameter p with gradient g at step t (t = 1, 2, ...):
//   Adam:  g += weight_decay * p              (L2 penalty in the gradient)
//   AdamW: p *= 1 - lr * weight_decay         (decoupled decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   v_hat = amsgrad ? (v_max = max(v_max, v)) : v
//   p -= lr / (1 - beta1^t) * m / (sqrt(v_hat) / sqrt(1 - beta2^t) + eps)
#ifndef TANDEM_OPTIM_ADAM_H_
#define TANDEM_OPTIM_ADAM_H_

#include <utility>
#include <vector>

#include "optim/optimizer.h"

namespace tandem::optim {

struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0;
  bool amsgrad = false;
};

struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
};

// State per parameter: "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad only).
// Hyper-parameters: lr, beta1, beta2, eps, weight_decay, amsgrad (0 or 1).
class Adam : public Optimizer {
 public:
  // Throws tandem::Error on invalid options (betas outside [0, 1), negative eps, ...).
  explicit Adam(std::vector<nn::Tensor> params, AdamOptions options = {});
  explicit Adam(std::vector<ParamGroup<AdamOptions>> groups);
  void step() override;
  AdamOptions options(int64_t group) const;

 protected:
  Adam(const char* name, bool decoupled_weight_decay);
  void Add(std::vector<nn::Tensor> params, const AdamOptions& options);

 private:
  bool UsesBuffer(const Group& group, int buffer) const override;
  internal::UpdateScalars ScalarsFor(int64_t group, int64_t step) const override;
  bool decoupled_weight_decay_;
};

// Adam with decoupled weight decay (Loshchilov & Hutter).
class AdamW : public Adam {
 public:
  explicit AdamW(std::vector<nn::Tensor> params, AdamWOptions options = {});
  explicit AdamW(std::vector<ParamGroup<AdamWOptions>> groups);
  AdamWOptions options(int64_t group) const;
};

}  // namespace tandem::optim

#endif  // TANDEM_OPTIM_ADAM_H_
