// Kernel interface of the loss family, shared by the CPU and CUDA files.
// logits: (N, C) contiguous float; labels: (N) int64.
#ifndef TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_

#include <cstdint>

#include "nn/ops/loss.h"  // Reduction
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// The options of a classification loss as its kernels take them (checked by
// loss.cc): weight (C) of the input's dtype and device, or undefined for 1 per
// class; the ignored label; eps in [0, 1] (cross_entropy only).
struct ClassLossOptions {
  Tensor weight;
  int64_t ignore_index = -100;
  double label_smoothing = 0;
};

// Fused log-softmax + NLL, with w[c] = weight[c] (1 without weight) and eps the
// label smoothing: lse[i] = logsumexp(logits[i, :]) (saved for backward),
//   l[i] = (1 - eps) w[y] (lse[i] - logits[i, y]) + eps / C sum_c w[c] (lse[i] - logits[i, c])
// with y = labels[i]; l[i] = 0 where y == ignore_index. loss = l (kNone, shape (N)),
// sum_i l[i] / W (kMean, 0-dim, W = sum of w[y] over the rows not ignored) or
// sum_i l[i] (kSum, 0-dim). lse has N + 2 elements: after the N rows (0 where
// ignored), lse[N] = W (written for kMean) and lse[N + 1] = sum_c w[c] (written
// when eps > 0), both for backward, so the default path allocates nothing more.
// A label outside [0, C) that is not ignore_index throws (CPU) or is a deferred
// device error (CUDA, see loss_cuda.cu).
void CrossEntropyForwardCpu(const Tensor& logits, const Tensor& labels,
                            const ClassLossOptions& options, const Tensor& lse,
                            const Tensor& loss, Reduction reduction);
// dlogits[i, c] = s_i * (p (a w[y] + eps / C sum_k w[k]) - a w[y] [c == y] - eps / C w[c])
// with p = exp(logits[i, c] - lse[i]), a = 1 - eps, and, for the upstream gradient g
// (read on the device, no sync): s_i = g / W (kMean, g 0-dim), g (kSum, g 0-dim)
// or g[i] (kNone, g of shape (N)); 0 on ignored rows. Without weight and smoothing
// that is s_i * (p - [c == y]).
void CrossEntropyBackwardCpu(const Tensor& logits, const Tensor& labels,
                             const ClassLossOptions& options, const Tensor& lse, const Tensor& g,
                             const Tensor& dlogits, Reduction reduction);
// nll_loss on log-probabilities: l[i] = -w[y] log_probs[i, y] (0 where ignored),
// reduced as above; kMean writes W to total_weight (0-dim, log_probs' dtype; left
// undefined by the caller otherwise). A bad label as cross_entropy's. Backward:
// dlog_probs is zero but for -s_i w[y] at [i, y], s_i as in CrossEntropyBackward.
void NllLossForwardCpu(const Tensor& log_probs, const Tensor& labels,
                       const ClassLossOptions& options, const Tensor& loss,
                       const Tensor& total_weight, Reduction reduction);
void NllLossBackwardCpu(const Tensor& labels, const ClassLossOptions& options,
                        const Tensor& total_weight, const Tensor& g, const Tensor& dlog_probs,
                        Reduction reduction);
// out (0-dim float32) = fraction of rows whose first argmax equals the label.
void AccuracyCpu(const Tensor& logits, const Tensor& labels, const Tensor& out);
#if TANDEM_WITH_CUDA
void CrossEntropyForwardCuda(const Tensor& logits, const Tensor& labels,
                             const ClassLossOptions& options, const Tensor& lse,
                             const Tensor& loss, Reduction reduction);
void CrossEntropyBackwardCuda(const Tensor& logits, const Tensor& labels,
                              const ClassLossOptions& options, const Tensor& lse, const Tensor& g,
                              const Tensor& dlogits, Reduction reduction);
void NllLossForwardCuda(const Tensor& log_probs, const Tensor& labels,
                        const ClassLossOptions& options, const Tensor& loss,
                        const Tensor& total_weight, Reduction reduction);
void NllLossBackwardCuda(const Tensor& labels, const ClassLossOptions& options,
                         const Tensor& total_weight, const Tensor& g, const Tensor& dlog_probs,
                         Reduction reduction);
void AccuracyCuda(const Tensor& logits, const Tensor& labels, const Tensor& out);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_LOSS_KERNELS_H_
