// Batch normalisation over (N, H, W) per channel. CPU: batch_norm_cpu.cc;
// CUDA: batch_norm_cuda.cu.
#ifndef TANDEM_NN_OPS_BATCH_NORM_H_
#define TANDEM_NN_OPS_BATCH_NORM_H_

#include <memory>

#include "nn/tensor.h"

namespace tandem::nn {

// Combines the training-mode statistics of workers that each hold a slice of one
// batch, so that batch_norm2d normalises with the statistics of the whole batch
// (data parallelism: spawn/train/sync_batch_norm.h implements it over a
// communicator; nn knows nothing of ranks). Each call is a collective: every
// worker makes the same calls in the same order. Called on the thread that runs
// batch_norm2d's forward or backward.
class BatchNormReducer {
 public:
  virtual ~BatchNormReducer() = default;
  // False when there is nothing to combine with (a single worker):
  // batch_norm2d then runs exactly as without a reducer.
  virtual bool Combines() = 0;
  // stats: (3, C) float64 on x's device: this worker's element count per channel
  // (N*H*W in every column), mean and M2 (sum of squared deviations from that
  // mean). Returns (3, C) float64: the same for the union of every worker's slice.
  virtual Tensor CombineStatistics(const Tensor& stats) = 0;
  // sums: (2, C) float64: this worker's sum of dy and of dy * xhat per channel
  // (xhat normalised with the combined statistics). Returns their sums over
  // every worker.
  virtual Tensor ReduceGradientSums(const Tensor& sums) = 0;
};

// x: (N, C, H, W); weight, bias, running_mean, running_var: (C).
// training: normalises with the batch mean and biased variance, and updates the
// running statistics in place: r = (1 - momentum) r + momentum * batch_stat (the
// running variance uses the unbiased batch variance, as PyTorch does).
// Not training: normalises with the running statistics.
// reducer (training only; ignored when null or when it does not Combine()): the
// mean and variance are those of every worker's slice together (the running
// variance unbiased with the combined count), and backward reduces its two
// per-channel sums over the workers for dx; weight and bias get this worker's
// own share of their gradients (data parallelism then averages them). x needs
// at least one value per channel, the combined batch more than one (checked for
// CPU tensors; on a GPU a combined count of one gives a NaN running variance,
// as an unchecked division by count - 1 would).
Tensor batch_norm2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                    const Tensor& running_mean, const Tensor& running_var, bool training,
                    double momentum = 0.1, double eps = 1e-5,
                    const std::shared_ptr<BatchNormReducer>& reducer = nullptr);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_BATCH_NORM_H_
