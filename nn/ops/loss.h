// Losses and metrics. CPU: loss_cpu.cc; CUDA: loss_cuda.cu (cross_entropy is one
// fused softmax + NLL kernel forward and one backward).
#ifndef TANDEM_NN_OPS_LOSS_H_
#define TANDEM_NN_OPS_LOSS_H_

#include "nn/tensor.h"

namespace tandem::nn {

// Mean over all elements of (pred - target)^2; same shapes -> 0-dim.
Tensor mse_loss(const Tensor& pred, const Tensor& target);

// logits: (N, C) float; labels: (N) int64 in [0, C) -> 0-dim mean of
// -log_softmax(logits)[i, labels[i]]. A label out of range is an error naming it
// (checked on the host for CPU tensors; CUDA kernels trap it without a sync).
Tensor cross_entropy(const Tensor& logits, const Tensor& labels);

// Fraction of rows whose argmax equals the label -> 0-dim float32 (no host sync
// on CUDA until item()). Not differentiable.
Tensor accuracy(const Tensor& logits, const Tensor& labels);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_LOSS_H_
