// Batch normalisation over (N, H, W) per channel. CPU: batch_norm_cpu.cc;
// CUDA: batch_norm_cuda.cu.
#ifndef TANDEM_NN_OPS_BATCH_NORM_H_
#define TANDEM_NN_OPS_BATCH_NORM_H_

#include "nn/tensor.h"

namespace tandem::nn {

// x: (N, C, H, W); weight, bias, running_mean, running_var: (C).
// training: normalises with the batch mean and biased variance, and updates the
// running statistics in place: r = (1 - momentum) r + momentum * batch_stat (the
// running variance uses the unbiased batch variance, as PyTorch does).
// Not training: normalises with the running statistics.
Tensor batch_norm2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                    const Tensor& running_mean, const Tensor& running_var, bool training,
                    double momentum = 0.1, double eps = 1e-5);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_BATCH_NORM_H_
