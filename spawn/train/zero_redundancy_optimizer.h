// dist::ZeroRedundancyOptimizer: any tandem optimizer with its state sharded
// over the ranks (ZeRO stage 1; PyTorch's ZeroRedundancyOptimizer, DeepSpeed
// ZeRO-1, Paddle's group-sharded "os" level).
//
//   dist::DataParallel dp(net, ctx);
//   dist::ZeroRedundancyOptimizer zero(dp, [](std::vector<nn::Tensor> shard) {
//     return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.lr = 1e-3});
//   });
//   loss.backward();   // each bucket reduce-scattered: this rank gets its shard's mean
//   zero.step();       // the wrapped Adam updates the shards, then all-gather
//   zero.zero_grad();
//
// Sharding follows DataParallel's buckets: bucket b's flat buffer (padded to a
// multiple of the world size N by DataParallel) splits into N equal blocks and
// rank r owns block r of every bucket. The wrapped optimizer sees one flat
// parameter per bucket, (numel_b / N,), a copy of the parameters' values in
// that block, whose gradient IS block r of the bucket's gradient buffer: the
// constructor installs a comm hook (DataParallel::register_comm_hook) that
// reduce-scatters each bucket in place, asynchronously, during backward
// (Communicator::reduce_scatter_async, kAvg), so no gradient is copied. So the
// optimizer state (Adam's two moments, momentum, Adagrad's sums) is 1/N per
// rank. step() runs the wrapped optimizer on the shards, then all-gathers each
// bucket's updated block from every rank into the bucket's gradient buffer
// (spent by then) and copies the values into the model's parameters, so every
// rank ends with the same model and the gradients are zero. Per rank this
// keeps the parameters, the gradient buckets, 1/N of the state and a 1/N copy
// of the parameters (the shards the wrapped optimizer updates).
//
// Results: every elementwise optimizer (SGD with or without momentum and
// Nesterov, Adam, AdamW, Adagrad) gives the parameters of the unsharded
// optimizer after DataParallel's all-reduce: the reduce-scatter adds the ranks
// in the all-reduce's order (in-process and across processes), so with the
// same gradients the update is the same per element, bit for bit where the
// optimizer's CPU loop gives every element the same operations (tested; see
// tests/spawn/train/zero_redundancy_optimizer_test.cc). Gradient clipping
// across shards (clip_grad_norm_) sums the squares in another order than
// optim::clip_grad_norm_: equal to 1e-6 relative, not bit for bit.
//
// Checkpoints: state_dict() gathers the shards into the wrapped optimizer's
// own unsharded layout over DataParallel's parameters (the dict an unsharded
// optimizer of the same type would save), and load_state_dict() takes such a
// dict and keeps this rank's blocks: a checkpoint resumes on any number of
// ranks, with or without sharding. Consolidated() builds that unsharded
// optimizer (for dist::TrainingState, whose writer reads one optimizer on
// rank 0); LoadFrom() takes one back. Both gather or hold the whole state on
// every rank while they run.
//
// Comm hooks: with DataParallelOptions::comm_hook = Bf16CompressHook() or
// Fp16CompressHook(), each bucket's reduce-scatter is compressed the same way:
// the bucket cast to bfloat16 / float16, this rank's block of the sum (added
// as the hook's all-reduce adds it) cast back and divided by the world size, so
// the gradients carry the hook's rounding (its bounds: comm_hooks.h) and the
// wire half the bytes; the all-gather of the parameters stays in their dtype.
// AllReduceHook() changes nothing. Any other hook is refused (naming both).
//
// Uneven inputs (DataParallel::join()): with ZeRO every rank owns the update
// of its shard, so a rank whose data ran out cannot stop stepping. Each bucket's
// reduce-scatter runs as DataParallel's comm hook, on the gradients scaled to
// the rank's share of the step's samples (a joined rank's bucket is zero), and
// the join records step() and clip_grad_norm_() with a replay function
// (spawn/train/join.h): a joined rank, answering each step the others still
// run, gets its shard of the reduced gradient from the replayed reduce-scatter,
// runs the wrapped optimizer on its shard (its moments, momentum and step count
// advance exactly as an active rank's would) and takes part in the all-gathers,
// so every rank holds the same parameters after every step: those of one rank
// training on each step's union of batches with the unsharded optimizer
// (tests/spawn/train/join_zero_hooks_test.cc). This is recording rather than
// a JoinState that knows optimizers: the join stays a list of the step's
// collectives in order, and each class says how its own are answered. The
// optimizer must be made before the join guard (so that it outlives the guard,
// whose end runs the replays); made inside, it throws. state_dict(),
// Consolidated() and the other collectives are not joinable inside a step:
// the join's error, on every rank.
//
// Construction is a collective: every rank checks that all ranks have the same
// buckets (count and sizes; a difference throws tandem::Error naming the bucket
// and both sizes on every rank). It throws when the model has no trainable
// parameter, when the factory returns no optimizer or one whose parameters
// are not the shards it was given, and when DataParallel already has a comm
// hook other than the built-in ones. Only gradients of parameters with requires_grad are sharded (as
// DataParallel buckets only those).
//
// Thread-safety: belongs to its rank's thread, like DataParallel; the
// DataParallel must outlive it, and it must outlive the last backward pass
// of that DataParallel.
#ifndef TANDEM_SPAWN_TRAIN_ZERO_REDUNDANCY_OPTIMIZER_H_
#define TANDEM_SPAWN_TRAIN_ZERO_REDUNDANCY_OPTIMIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nn/tensor.h"
#include "optim/optimizer.h"
#include "spawn/train/data_parallel.h"

namespace tandem::dist {

// Makes the wrapped optimizer over the given parameters (one group).
using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<nn::Tensor> params)>;

class ZeroRedundancyOptimizer {
 public:
  ZeroRedundancyOptimizer(DataParallel& dp, OptimizerFactory make_optimizer);
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // A collective: updates this rank's shards, all-gathers every bucket's
  // parameters into the bucket's gradient buffer (no buffer of its own) and
  // copies them into the model's. The gradients are zero afterwards. Joinable
  // (see the file comment).
  void step();
  // Zeroes every gradient bucket of the DataParallel (the model's gradients).
  void zero_grad();

  // The wrapped optimizer, over this rank's shards: lr, hyper-parameters and
  // learning-rate schedules (optim::LRScheduler) work on it as usual.
  optim::Optimizer& optimizer() { return *optimizer_; }
  double lr() const { return optimizer_->lr(); }
  void set_lr(double lr) { optimizer_->set_lr(lr); }

  // A collective: the 2-norm of every gradient of the model taken together
  // (the squares of this rank's shards, summed over the ranks), and each
  // shard's gradient scaled by min(1, max_norm / (norm + 1e-6)), as
  // optim::clip_grad_norm_ does unsharded. Call it after backward, before
  // step(); reads the norm on the host (a synchronisation on CUDA). Joinable.
  double clip_grad_norm_(double max_norm);

  // A collective: the wrapped optimizer's state in its unsharded layout over
  // DataParallel's parameters (module order): "state.0.<i>.<buffer>" of each
  // parameter's shape, "state.0.<i>.step", the group's hyper-parameters.
  optim::StateDict state_dict();
  // Takes such a dict (from any number of ranks, or from an unsharded
  // optimizer of the same type) and keeps this rank's blocks. On error
  // (naming the key) nothing changes. Every rank calls it with the same dict.
  absl::Status load_state_dict(const optim::StateDict& dict);
  // A collective: a new unsharded optimizer (make_optimizer over the model's
  // trainable parameters) holding state_dict().
  std::unique_ptr<optim::Optimizer> Consolidated();
  // An unsharded optimizer without state, for loading a checkpoint into
  // before LoadFrom (not a collective).
  std::unique_ptr<optim::Optimizer> MakeUnsharded() const;
  // load_state_dict(unsharded.state_dict()), then the shards' values from the
  // model's parameters (which a checkpoint loaded too).
  absl::Status LoadFrom(const optim::Optimizer& unsharded);
  // Reloads this rank's shard values from the model's parameters: after they
  // changed outside step() (a loaded model).
  void RefreshShards();

  // Bytes of the wrapped optimizer's state on this rank (0 before the first step).
  int64_t state_bytes() const;
  int num_shards() const { return static_cast<int>(shards_.size()); }

 private:
  struct Shard {
    GradBucket bucket;       // the DataParallel bucket it shards
    int64_t block = 0;       // elements per rank: bucket numel / world size
    nn::Tensor param;        // (block,) this rank's block of the bucket's parameters
    nn::Tensor grad;         // (block,) the same block of the bucket's gradient buffer
    std::vector<int> index;  // per bucket parameter: its index in the model's trainable parameters
  };

  void CheckSameBucketsOnEveryRank();
  // step() and clip_grad_norm_() without the join's record.
  void StepShards();
  double ClipShards(double max_norm);
  BucketReduction ReduceScatter(GradBucket& bucket);
  // Copies block [lo, hi) of the bucket's flat parameter values (model -> flat or back).
  void CopyBlockFromParams(Shard& s, nn::Tensor& flat_block, int64_t lo) const;

  DataParallel& dp_;
  Communicator& comm_;
  OptimizerFactory make_optimizer_;
  std::vector<nn::Tensor> trainable_;  // the model's parameters with requires_grad, module order
  std::vector<Shard> shards_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  // The DataParallel's compress hook's wire dtype: the reduce-scatter's.
  std::optional<nn::DType> wire_;
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_TRAIN_ZERO_REDUNDANCY_OPTIMIZER_H_
