// Kernel interface of the loss family, shared by the CPU and CUDA files.
// logits: (N, C) contiguous float; labels: (N) int64.
#ifndef TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_

#include <cstdint>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// Fused log-softmax + NLL: lse[i] = logsumexp(logits[i, :]) (saved for backward),
// loss (0-dim) = mean_i (lse[i] - logits[i, labels[i]]). A label outside [0, C)
// throws (CPU) or traps the kernel after printing it (CUDA).
void CrossEntropyForwardCpu(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                            const Tensor& loss);
// dlogits[i, c] = g / N * (exp(logits[i, c] - lse[i]) - [c == labels[i]]), with g the
// 0-dim upstream gradient (read on the device, no sync).
void CrossEntropyBackwardCpu(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                             const Tensor& g, const Tensor& dlogits);
// out (0-dim float32) = fraction of rows whose first argmax equals the label.
void AccuracyCpu(const Tensor& logits, const Tensor& labels, const Tensor& out);
#if TANDEM_WITH_CUDA
void CrossEntropyForwardCuda(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                             const Tensor& loss);
void CrossEntropyBackwardCuda(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                              const Tensor& g, const Tensor& dlogits);
void AccuracyCuda(const Tensor& logits, const Tensor& labels, const Tensor& out);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_
