// dist::SyncBatchNorm2d and dist::ConvertSyncBatchNorm: batch normalisation whose
// training statistics are those of the global batch, every rank's slice together
// (PyTorch's SyncBatchNorm / convert_sync_batchnorm, Paddle's SyncBatchNorm).
//
//   Net net;                               // a module with nn::BatchNorm2d members
//   dist::ConvertSyncBatchNorm(net);       // every BatchNorm2d now synchronised
//   dist::DataParallel dp(net, ctx);
//
// A synchronised layer is an nn::BatchNorm2d with a reducer (nn/ops/batch_norm.h)
// installed: names, parameters, buffers, eval mode and the checkpoint format stay
// those of BatchNorm2d, and a model that holds its BatchNorms as typed members
// (`bn1` in a block) is converted through the same objects.
//
// Collectives, on the communicator of the calling rank (the thread's spawn
// Context, or the one given in SyncBatchNormOptions), in training mode only:
//   forward:  one all_gather of (count, mean, M2) per channel, float64; every
//             rank combines the slices in rank order with Chan's parallel formula
//             (M2 = sum M2_r + sum n_r (mean_r - mean)^2), so no E[x^2] - E[x]^2
//             cancellation and unequal slices weigh by their counts;
//   backward: one all_reduce (sum) of (sum dy, sum dy * xhat) per channel, float64,
//             when x needs a gradient.
// The first training forward of each layer also all_gathers its channel count,
// so that ranks whose layers differ get one error naming both counts on every
// rank instead of a hang. Every rank must run the same layers in the same order
// (as DataParallel's model check ensures). A world of one runs exactly as
// nn::BatchNorm2d, with no collective.
//
// Gradients: dx is the gradient of the sum of every rank's loss; weight and bias
// get this rank's share, which DataParallel's average turns into the gradient of
// the mean loss. So N ranks x batch B with SyncBatchNorm train as one rank x batch
// N*B with BatchNorm (tests/spawn/train/sync_batch_norm_test.cc).
//
// Inside DataParallel::join() (convert before making the DataParallel) a rank
// whose data ran out answers these collectives with a count of 0 and zero sums,
// and the gradient sums are weighted by each rank's share of the step's samples.
//
// Errors: tandem::Error for mismatched layers or no communicator; the
// communicator's CancelledError when the run stops.
//
// Thread-safety: a layer belongs to its rank's thread, like any module.
#ifndef TANDEM_SPAWN_TRAIN_SYNC_BATCH_NORM_H_
#define TANDEM_SPAWN_TRAIN_SYNC_BATCH_NORM_H_

#include <cstdint>
#include <memory>

#include "nn/layers.h"
#include "nn/module.h"
#include "nn/ops/batch_norm.h"
#include "spawn/comm/communicator.h"
#include "spawn/train/join.h"

namespace tandem::dist {

struct SyncBatchNormOptions {
  // The ranks to synchronise over; null: the communicator of the spawn Context of
  // the thread that runs the layer (dist::current()), looked up at each call.
  Communicator* communicator = nullptr;
};

// nn::BatchNormReducer over a communicator (see the file comment).
class SyncBatchNormReducer : public nn::BatchNormReducer {
 public:
  explicit SyncBatchNormReducer(SyncBatchNormOptions options = {}) : options_(options) {}
  bool Combines() override;
  nn::Tensor CombineStatistics(const nn::Tensor& stats) override;
  nn::Tensor ReduceGradientSums(const nn::Tensor& sums) override;
  // DataParallel points its layers at its join state (null: none), so that its
  // join() records their collectives and weighs their gradient sums.
  void set_join(internal::JoinState* join) { join_ = join; }
  // DataParallelOptions::global_batch_size: DataParallel points its layers at
  // this rank's weight in the current forward, its rows n times N / G (1 with
  // even shares: the bits of no weighing), so that the gradient sums are
  // weighted in proportion to each rank's rows as the parameters' gradients
  // are (null: none).
  void set_row_weight(const double* weight) { row_weight_ = weight; }

 private:
  Communicator& comm() const;
  // First call: every rank's channel count must match (one all_gather).
  void CheckSameChannels(Communicator& comm, int64_t channels);

  bool Joining() const { return join_ != nullptr && join_->joining(); }

  SyncBatchNormOptions options_;
  bool checked_ = false;
  internal::JoinState* join_ = nullptr;
  const double* row_weight_ = nullptr;
};

// nn::BatchNorm2d whose training statistics span the ranks: the same constructor,
// parameters, buffers and names.
class SyncBatchNorm2dImpl : public nn::BatchNorm2dImpl {
 public:
  explicit SyncBatchNorm2dImpl(int64_t num_features, double eps = 1e-5, double momentum = 0.1,
                               SyncBatchNormOptions options = {});
};
TANDEM_MODULE(SyncBatchNorm2d);

// Installs a SyncBatchNormReducer in every nn::BatchNorm2d of `module` (itself
// and every descendant, with or without a reducer before). Returns how many.
// Not a collective; the layers check each other at their first training forward.
int ConvertSyncBatchNorm(nn::Module& module, SyncBatchNormOptions options = {});

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_TRAIN_SYNC_BATCH_NORM_H_
