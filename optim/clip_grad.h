// Gradient clipping by global norm (PyTorch's torch.nn.utils.clip_grad_norm_).
#ifndef TANDEM_OPTIM_CLIP_GRAD_H_
#define TANDEM_OPTIM_CLIP_GRAD_H_

#include <vector>

#include "nn/tensor.h"

namespace tandem::optim {

// total = 2-norm of all defined gradients of `params` taken together; every
// gradient is then scaled IN PLACE by min(1, max_norm / (total + 1e-6)).
// Returns total as a 0-dim tensor of the gradients' dtype and device; on CUDA
// everything is enqueued on the calling thread's stream with no host
// synchronisation (read it with item() when needed). Parameters without a
// gradient are skipped; with none at all the result is 0 (on the CPU).
// Gradients on several devices (as PyTorch's): each device's gradients are
// reduced and scaled by kernels on that device (made current for them), the
// total is combined from the devices' norms (each in the gradients' dtype) in
// float64 on the device of the first gradient (made current for it) and
// returned there. Throws tandem::Error when the gradients differ in dtype.
nn::Tensor clip_grad_norm_(const std::vector<nn::Tensor>& params, double max_norm);

}  // namespace tandem::optim

#endif  // TANDEM_OPTIM_CLIP_GRAD_H_
