// Kernel interface of the loss family, shared by the CPU and CUDA files.
// logits: (N, C) contiguous float; labels: (N) int64.
#ifndef TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_

#include <cstdint>

#include "nn/ops/loss.h"  // Reduction
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// Fused log-softmax + NLL: lse[i] = logsumexp(logits[i, :]) (saved for backward),
// l[i] = lse[i] - logits[i, labels[i]]; loss = l (kNone, shape (N)), mean_i l[i]
// (kMean, 0-dim) or sum_i l[i] (kSum, 0-dim). A label outside [0, C) throws (CPU)
// or is a deferred device error (CUDA, see loss_cuda.cu).
void CrossEntropyForwardCpu(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                            const Tensor& loss, Reduction reduction);
// dlogits[i, c] = s_i * (exp(logits[i, c] - lse[i]) - [c == labels[i]]) with, for
// the upstream gradient g (read on the device, no sync): s_i = g / N (kMean, g
// 0-dim), g (kSum, g 0-dim) or g[i] (kNone, g of shape (N)).
void CrossEntropyBackwardCpu(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                             const Tensor& g, const Tensor& dlogits, Reduction reduction);
// nll_loss on log-probabilities: l[i] = -log_probs[i, labels[i]], reduced as above
// (a label outside [0, C) as cross_entropy's). Backward: dlog_probs is zero but for
// -s_i at [i, labels[i]], s_i as in CrossEntropyBackward.
void NllLossForwardCpu(const Tensor& log_probs, const Tensor& labels, const Tensor& loss,
                       Reduction reduction);
void NllLossBackwardCpu(const Tensor& labels, const Tensor& g, const Tensor& dlog_probs,
                        Reduction reduction);
// out (0-dim float32) = fraction of rows whose first argmax equals the label.
void AccuracyCpu(const Tensor& logits, const Tensor& labels, const Tensor& out);
#if TANDEM_WITH_CUDA
void CrossEntropyForwardCuda(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                             const Tensor& loss, Reduction reduction);
void CrossEntropyBackwardCuda(const Tensor& logits, const Tensor& labels, const Tensor& lse,
                              const Tensor& g, const Tensor& dlogits, Reduction reduction);
void NllLossForwardCuda(const Tensor& log_probs, const Tensor& labels, const Tensor& loss,
                        Reduction reduction);
void NllLossBackwardCuda(const Tensor& labels, const Tensor& g, const Tensor& dlog_probs,
                         Reduction reduction);
void AccuracyCuda(const Tensor& logits, const Tensor& labels, const Tensor& out);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_
