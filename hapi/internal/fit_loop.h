// Internal to hapi (model.cc): one rank's fit, in the steps a reader follows.
// Model::FitOnRank builds the rank's network (Model::Build), then
//   PrepareForTraining  DataParallel around it and the optimizer (plain or
//                       ZeRO-sharded) with the state the Model kept;
//   FitLoop             the sampler and loader, the callbacks, and Run():
//     Start             checkpoints opened, a resume or a restart's snapshot
//                       restored, on_train_begin;
//     TrainEpoch        each epoch: its steps (RunStep, then AtStepBoundary:
//                       checkpoint, stop signal, snapshot, end_fit) and, unless
//                       end_fit ended the fit, EndEpoch (the epoch's loss,
//                       the evaluation, on_epoch_end, the epoch's checkpoint,
//                       the ranks' agreement to stop);
//     Finish            the final checkpoint, on_train_end, the history.
// Model::FitOnRank then keeps the weights and optimizer state (Model::Keep).
// Not installed for other folders' use.
#ifndef TANDEM_HAPI_INTERNAL_FIT_LOOP_H_
#define TANDEM_HAPI_INTERNAL_FIT_LOOP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "hapi/callbacks.h"
#include "hapi/internal/fit_state.h"
#include "hapi/internal/on_rank.h"
#include "hapi/model.h"
#include "nn/tensor.h"
#include "optim/optimizer.h"
#include "spawn/context.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/checkpoint_manager.h"

namespace tandem::hapi::internal {

// Whether this fit stores in-process snapshots: snapshot_every_steps under a
// run that keeps them (a restart policy). Throws for uneven with snapshots.
bool SnapshotsOn(const dist::Context& ctx, const FitOptions& options);

// Puts the network of `run` (built by Model::Build) in training mode, converts
// its BatchNorms (sync_batch_norm), wraps it in DataParallel and makes the
// optimizer over it, plain or ZeRO-sharded, loaded with `kept_state` when there
// is one. Throws on a kept state that does not fit and on cuda_graph off a CUDA rank.
void PrepareForTraining(dist::Context& ctx, Model::RankRun& run, const FitOptions& options,
                        const RankBatch& rank_batch, const OptimizerFactory& make_optimizer,
                        const optim::StateDict* kept_state);

// A training step's pieces, fit's and Model::train_batch's (one code path).
// Forward of `data` through `dp` and the loss against `target` (under bf16's
// autocast), backward of loss / group (DataParallel reduces the gradients,
// unless under no_sync); returns the undivided loss, detached. Throws when
// the loss is not one value, naming `call`.
nn::Tensor ForwardBackward(dist::Context& ctx, dist::DataParallel& dp, const LossFunction& loss,
                           const nn::Tensor& data, const nn::Tensor& target, int64_t group,
                           bool bf16, const char* call);
// The optimizer step of `run` (plain or ZeRO-sharded) after clipping the
// reduced gradients to a global 2-norm of clip_grad_norm (0: no clipping),
// then zero_grad.
void OptimizerStep(dist::Context& ctx, Model::RankRun& run, double clip_grad_norm);

// One rank's fit over `train` with `run` prepared for training. Every rank
// runs its own; they meet in the same collectives in the same order.
class FitLoop {
 public:
  FitLoop(dist::Context& ctx, Model::RankRun& run, const LossFunction& loss,
          const std::shared_ptr<const data::Dataset>& train, const FitOptions& options,
          const RankBatch& rank_batch, bool snapshots_on);
  FitLoop(const FitLoop&) = delete;
  FitLoop& operator=(const FitLoop&) = delete;

  // Trains the epochs left and returns the history; with zero, leaves the
  // unsharded optimizer state gathered in run.gathered_state.
  History Run();

 private:
  // Where the current epoch stands on this rank.
  struct Epoch {
    int index = 0;
    bool resumed = false;  // continues the epoch a checkpoint or snapshot stopped inside
    int64_t steps = 0;     // optimizer steps done in it (with those before the resume)
    nn::Tensor loss;       // this rank's sum of its step losses (float64, on the device)
  };

  // Before the first epoch: the checkpoint manager, a resume or a snapshot.
  void Start();
  void ResumeFromCheckpoint();
  void RestoreSnapshot();
  // One epoch; false when the fit ends with it (end_fit or an agreed stop).
  bool TrainEpoch(int index);
  Epoch BeginEpoch(int index);
  // The epoch's steps; sets ended_ when a callback ended the fit.
  void RunSteps(Epoch& epoch);
  // One optimizer step over the micro-batches [first, first + group): its
  // loss, and with uneven this rank's share of the one-rank step's loss.
  struct StepLoss {
    nn::Tensor step;
    nn::Tensor share_of_one_rank;
  };
  StepLoss RunStep(int64_t first, int64_t group);
  // After a step: a checkpoint or a stop at the agreed step, a snapshot.
  void AtStepBoundary(const Epoch& epoch);
  // Uneven data: the join's end, rank 0's optimizer state, the job's step count.
  void FinishJoin(std::optional<dist::DataParallel::JoinGuard>& join);
  // The epoch's logs, evaluation and callbacks; false when the ranks stop here.
  bool EndEpoch(const Epoch& epoch);
  Logs EvaluateAtEpochEnd();
  // After the last epoch: the final checkpoint, on_train_end, the step count.
  void Finish();

  // Every rank at the same step: the gathered optimizer (zero), fit's entries
  // (epoch, steps done in it or -1 at its end, the loss summed so far) and the
  // callbacks'.
  void PrepareSave(dist::TrainingState& s, int64_t epoch, int64_t epoch_steps, double loss_sum);
  // Every rank at the same step (a multiple of snapshot_every_steps): this
  // rank's snapshot, fit's entries and the callbacks' (with zero the gathered
  // optimizer: a collective).
  void TakeSnapshot(const Epoch& epoch);

  void OptimizerStep() { internal::OptimizerStep(ctx_, run_, options_.clip_grad_norm); }
  data::Batch NextBatch(int64_t at_batch);
  nn::Tensor ForwardBackward(const data::Batch& batch, int64_t group) {
    return internal::ForwardBackward(ctx_, dp_, loss_, batch.data, batch.target, group,
                                     options_.bf16, "fit");
  }
  nn::Tensor GraphedStep(int64_t at_batch);
  // uneven: this rank's share of the one-rank loss of micro-batch `at_batch`
  // with `rows` rows.
  double OneRankShare(int64_t at_batch, int64_t rows) const;

  template <typename Hook>
  void Call(const char* hook, Hook&& call) {
    CallEach(callbacks_, hook, call);
  }

  dist::Context& ctx_;
  Model::RankRun& run_;
  const LossFunction& loss_;
  const FitOptions& options_;
  const RankBatch rank_batch_;
  const bool snapshots_on_;
  const dist::AttemptInfo& attempt_;
  // The rows each rank's step loss stands for, over its even share (a world
  // shrink's uneven shares weigh the epoch's loss by them).
  const double loss_share_;
  nn::Module& network_;
  dist::DataParallel& dp_;
  dist::ZeroRedundancyOptimizer* zero_;  // FitOptions::zero
  std::shared_ptr<data::DistributedBatchSampler> sampler_;
  std::optional<data::DataLoader> loader_;
  const int accum_;       // grad_accum_steps
  int64_t batches_ = 0;   // this rank's loader batches per epoch
  // uneven: the examples, and the one-rank run's micro-batches and steps per epoch.
  int64_t examples_ = 0;
  int64_t global_batches_ = 0;
  int64_t global_steps_ = 0;
  RunState state_;
  std::vector<std::unique_ptr<Callback>> callbacks_;

  std::optional<dist::CheckpointManager> checkpoints_;
  // With zero the files hold the unsharded optimizer: one gathered for each
  // save (a collective, at the save's agreed step), one loaded and sharded on resume.
  dist::TrainingState saved_;
  std::unique_ptr<optim::Optimizer> consolidated_;
  // The step of the last save made at an epoch's end (-1 steps in it): a final
  // save at that step would repeat it.
  int64_t last_end_save_step_ = -1;
  // A restart's snapshot, when this attempt has one, rather than a checkpoint.
  dist::TrainingState snap_;
  History history_;
  FitPosition at_;
  // After a resume: the checkpoint's step; after a snapshot (taken after a
  // step of this fit): -1, so the final checkpoint is saved.
  int64_t first_step_ = 0;
  Logs logs_;           // the last finished epoch's
  bool ended_ = false;  // a callback's end_fit ended the fit
};

}  // namespace tandem::hapi::internal

#endif  // TANDEM_HAPI_INTERNAL_FIT_LOOP_H_
