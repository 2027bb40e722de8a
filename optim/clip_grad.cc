// clip_grad_norm_: collects the gradients and dispatches to the device's kernels.
#include "optim/clip_grad.h"

#include "nn/ops/internal/dispatch.h"
#include "optim/internal/fused_kernels.h"

namespace tandem::optim {

nn::Tensor clip_grad_norm_(const std::vector<nn::Tensor>& params, double max_norm) {
  std::vector<nn::Tensor> grads;
  for (const nn::Tensor& p : params) {
    if (!p.defined()) continue;
    nn::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (!grads.empty()) {
      TANDEM_CHECK(g.device() == grads.front().device() && g.dtype() == grads.front().dtype(),
                   "clip_grad_norm_: gradient ", g.ToString(), " differs in device or dtype from ",
                   grads.front().ToString());
    }
    grads.push_back(std::move(g));
  }
  if (grads.empty()) return nn::scalar_tensor(0.0, {.device = nn::Device::CPU()});
  nn::NoGradGuard no_grad;
  return TANDEM_ON_DEVICE(grads.front(), internal::ClipGradNorm, grads, max_norm);
}

}  // namespace tandem::optim
