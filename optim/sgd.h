// SGD with momentum, dampening, Nesterov momentum and L2 weight decay: PyTorch's
// torch.optim.SGD algorithm. For each parameter p with gradient g:
//   g += weight_decay * p
//   if momentum != 0: buf = g at the first step, else momentum * buf + (1 - dampening) * g
//                     g = nesterov ? g + momentum * buf : buf
//   p -= lr * g
#ifndef TANDEM_OPTIM_SGD_H_
#define TANDEM_OPTIM_SGD_H_

#include <vector>

#include "optim/optimizer.h"

namespace tandem::optim {

struct SGDOptions {
  double lr = 1e-3;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0
};

// State per parameter: "momentum_buffer" (when momentum != 0). Hyper-parameters:
// lr, momentum, dampening, weight_decay, nesterov (0 or 1).
class SGD : public Optimizer {
 public:
  // Throws tandem::Error on invalid options (negative lr, nesterov without momentum, ...).
  explicit SGD(std::vector<nn::Tensor> params, SGDOptions options = {});
  explicit SGD(std::vector<ParamGroup<SGDOptions>> groups);
  void step() override;
  SGDOptions options(int64_t group) const;

 private:
  void Add(std::vector<nn::Tensor> params, const SGDOptions& options);
  bool UsesBuffer(const Group& group, int buffer) const override;
  internal::UpdateScalars ScalarsFor(int64_t group, int64_t step) const override;
};

}  // namespace tandem::optim

#endif  // TANDEM_OPTIM_SGD_H_
