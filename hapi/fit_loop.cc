// One rank's fit (internal/fit_loop.h says the steps; model.h the contract).
#include "hapi/internal/fit_loop.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nn/autocast.h"
#include "nn/error.h"
#include "nn/graph.h"
#include "nn/ops/elementwise.h"
#include "optim/clip_grad.h"
#include "spawn/comm/communicator.h"
#include "spawn/observe/trace.h"
#include "spawn/signals.h"
#include "spawn/train/sync_batch_norm.h"
#include "spawn/train/zero_redundancy_optimizer.h"

namespace tandem::hapi::internal {
namespace {

// Every rank takes rank 0's optimizer state (tensors and scalars): after an
// epoch of uneven data, a rank that joined early did not step its own optimizer
// in the steps it answered, and rank 0 ran every step (kUneven gives it the most
// batches). Every rank has stepped before (a join needs a step on every rank),
// so all hold the same entries.
void TakeRankZerosOptimizerState(dist::Context& ctx, optim::Optimizer& optimizer) {
  nn::NoGradGuard no_grad;
  optim::StateDict st = optimizer.state_dict();
  for (auto& [name, t] : st.tensors) {
    nn::Tensor copy = t.detach().clone();
    ctx.communicator().broadcast(copy, 0);
    t = copy;
  }
  if (!st.scalars.empty()) {
    std::vector<double> values;
    for (const auto& [key, v] : st.scalars) values.push_back(v);
    nn::Tensor t = nn::from_vector(values, {static_cast<int64_t>(values.size())},
                                   {.dtype = nn::kFloat64})
                       .to(ctx.device());
    ctx.communicator().broadcast(t, 0);
    values = t.to_vector<double>();
    size_t i = 0;
    for (auto& [key, v] : st.scalars) v = values[i++];
  }
  absl::Status loaded = optimizer.load_state_dict(st);
  TANDEM_CHECK(loaded.ok(), "fit: uneven data: rank 0's optimizer state: ", loaded.message());
}

// The training sampler: kWrapGlobalBatch (or kUneven with uneven), this rank's
// share of the global batch after a world shrink.
data::DistributedOptions TrainSamplerOptions(const dist::Context& ctx, int64_t examples,
                                             const FitOptions& options,
                                             const RankBatch& rank_batch) {
  data::DistributedOptions so = SamplerOptions(ctx, examples, rank_batch.rows);
  if (rank_batch.uneven_shares) {
    so.batch_size = 0;  // from the global batch: this rank's share
    so.global_batch_size = rank_batch.global;
  }
  so.shuffle = options.shuffle;
  so.drop_last = options.drop_last;
  so.seed = options.seed;
  if (options.uneven) so.tail = data::DistributedTail::kUneven;
  return so;
}

}  // namespace

bool SnapshotsOn(const dist::Context& ctx, const FitOptions& options) {
  // In-process restarts (FitOptions::snapshot_every_steps): snapshots only in
  // a run that keeps them (a restart policy).
  const bool on = options.snapshot_every_steps > 0 && ctx.attempt_info().snapshots != nullptr;
  TANDEM_CHECK(!on || !options.uneven, "fit: uneven = true with snapshot_every_steps = ",
               options.snapshot_every_steps, " under a restart policy (SpawnOptions::restart): ",
               "the state of a join (the ranks that have joined, the steps they answer) is not ",
               "snapshotted; set snapshot_every_steps = 0 (a restart then starts the fit again)");
  return on;
}

void PrepareForTraining(dist::Context& ctx, Model::RankRun& run, const FitOptions& options,
                        const RankBatch& rank_batch, const OptimizerFactory& make_optimizer,
                        const optim::StateDict* kept_state) {
  nn::Module& network = *run.network;
  network.train();
  if (options.sync_batch_norm) dist::ConvertSyncBatchNorm(network);
  dist::DataParallelOptions dp_options = options.data_parallel;
  // Uneven shares are weighed by DataParallel's global_batch_size, or inside
  // join() (uneven) by the rows the join counts.
  if (rank_batch.uneven_shares && !options.uneven) dp_options.global_batch_size = rank_batch.global;
  run.dp = std::make_unique<dist::DataParallel>(network, ctx, dp_options);
  if (options.zero) {
    run.zero = std::make_unique<dist::ZeroRedundancyOptimizer>(*run.dp, make_optimizer);
    if (kept_state != nullptr) {
      absl::Status st = run.zero->load_state_dict(*kept_state);
      TANDEM_CHECK(st.ok(), "hapi::Model: the kept optimizer state does not fit: ", st.message());
    }
  } else {
    run.optimizer = make_optimizer(run.dp->parameters());
    TANDEM_CHECK(run.optimizer != nullptr, "hapi::Model: the optimizer factory returned null");
    if (kept_state != nullptr) {
      absl::Status st = run.optimizer->load_state_dict(*kept_state);
      TANDEM_CHECK(st.ok(), "hapi::Model: the kept optimizer state does not fit: ", st.message());
    }
  }
  TANDEM_CHECK(!options.cuda_graph || ctx.device().is_cuda(),
               "fit: cuda_graph needs a CUDA rank; this rank runs on ", ctx.device().ToString());
}

void OptimizerStep(dist::Context& ctx, Model::RankRun& run, double clip_grad_norm) {
  dist::TraceSpan span(ctx, "optimizer");
  if (clip_grad_norm > 0) {
    // The reduced gradients: the same norm on every rank.
    if (run.zero != nullptr) {
      run.zero->clip_grad_norm_(clip_grad_norm);
    } else {
      optim::clip_grad_norm_(run.dp->parameters(), clip_grad_norm);
    }
  }
  if (run.zero != nullptr) {
    run.zero->step();
    run.zero->zero_grad();
  } else {
    run.optimizer->step();
    run.optimizer->zero_grad();
  }
}

nn::Tensor ForwardBackward(dist::Context& ctx, dist::DataParallel& dp, const LossFunction& loss_fn,
                           const nn::Tensor& data, const nn::Tensor& target, int64_t group,
                           bool bf16, const char* call) {
  nn::Tensor loss;
  {
    dist::TraceSpan span(ctx, "forward");
    std::optional<nn::AutocastGuard> autocast;
    if (bf16) autocast.emplace(nn::kBFloat16);
    loss = loss_fn(dp(data), target);
  }
  TANDEM_CHECK(loss.numel() == 1, "hapi::Model::", call, ": the loss function returned shape ",
               nn::ShapeToString(loss.shape()), "; it must return one value (a mean)");
  {
    dist::TraceSpan span(ctx, "backward");
    (group > 1 ? loss * (1.0 / static_cast<double>(group)) : loss).backward();
  }
  return loss.detach();
}

// --- Setting up ----------------------------------------------------------------------

FitLoop::FitLoop(dist::Context& ctx, Model::RankRun& run, const LossFunction& loss,
                 const std::shared_ptr<const data::Dataset>& train, const FitOptions& options,
                 const RankBatch& rank_batch, bool snapshots_on)
    : ctx_(ctx),
      run_(run),
      loss_(loss),
      options_(options),
      rank_batch_(rank_batch),
      snapshots_on_(snapshots_on),
      attempt_(ctx.attempt_info()),
      loss_share_(static_cast<double>(rank_batch.rows * ctx.world_size()) /
                  static_cast<double>(rank_batch.global)),
      network_(*run.network),
      dp_(*run.dp),
      zero_(run.zero.get()),
      accum_(options.grad_accum_steps),
      examples_(train->size()) {
  sampler_ = std::make_shared<data::DistributedBatchSampler>(
      TrainSamplerOptions(ctx, examples_, options, rank_batch));
  loader_.emplace(train, sampler_,
                  LoaderOptions(ctx, options.num_workers, options.batch_transform));
  // Only drop_last drops every batch (a kUneven rank without a batch answers
  // the others' steps under join()); kWrapGlobalBatch gives every rank the same count.
  TANDEM_CHECK(loader_->num_batches() > 0 || options.uneven || options.epochs == 0,
               "fit: no step per epoch: drop_last with ", examples_,
               " examples and a global batch of ", rank_batch.global, " rows over ",
               ctx.world_size(), " rank", ctx.world_size() == 1 ? "" : "s");
  // This rank's batches per epoch: all of them, or max_steps_per_epoch steps' worth.
  batches_ = options.max_steps_per_epoch > 0
                 ? std::min<int64_t>(loader_->num_batches(), options.max_steps_per_epoch * accum_)
                 : loader_->num_batches();
  // uneven: the job's micro-batches are the one-rank run's (every rank's k-th
  // batch is its share of global batch k), so each rank adds its share of the
  // one-rank loss of each (OneRankShare); the epoch's loss is then the ranks'
  // sum over the job's step count, as one rank's.
  const int64_t global_batch = rank_batch.global;
  global_batches_ =
      options.uneven ? std::min<int64_t>((examples_ + global_batch - 1) / global_batch,
                                         options.max_steps_per_epoch > 0
                                             ? options.max_steps_per_epoch * accum_
                                             : INT64_MAX)
                     : 0;
  global_steps_ = (global_batches_ + accum_ - 1) / accum_;

  state_.ctx = &ctx;
  state_.network = &network_;
  // The optimizer callbacks see (lr schedules): with zero the wrapped one.
  state_.optimizer = zero_ != nullptr ? &zero_->optimizer() : run.optimizer.get();
  state_.data_parallel = &dp_;
  state_.zero = zero_;
  state_.epochs = options.epochs;
  state_.steps_per_epoch = (batches_ + accum_ - 1) / accum_;
  state_.has_eval_data = options.eval_data != nullptr;
  callbacks_ = MakeCallbacks(options.callbacks, options.log_freq);

  saved_ = {.model = &network_, .optimizer = run.optimizer.get(), .loader = &*loader_,
            .step = &state_.step};
  snap_ = {.model = &network_, .optimizer = run.optimizer.get(), .loader = &*loader_,
           .step = &state_.step};
}

double FitLoop::OneRankShare(int64_t at_batch, int64_t rows) const {
  // The batch's mean loss times its rows over the global batch's rows, over
  // the one-rank step's micro-batch count.
  const int64_t global_batch = rank_batch_.global;
  const int64_t global_rows =
      at_batch < examples_ / global_batch ? global_batch : examples_ % global_batch;
  const int64_t group = std::min<int64_t>(accum_, global_batches_ - at_batch / accum_ * accum_);
  return static_cast<double>(rows) / static_cast<double>(global_rows) /
         static_cast<double>(group);
}

// --- The run -------------------------------------------------------------------------

History FitLoop::Run() {
  Start();
  for (int epoch = at_.epoch; epoch < options_.epochs && !ended_; ++epoch) {
    if (!TrainEpoch(epoch)) break;
  }
  Finish();
  return std::move(history_);
}

void FitLoop::Start() {
  if (!options_.checkpoint.dir.empty()) {
    checkpoints_.emplace(ctx_, options_.checkpoint);
    if (options_.resume && !(snapshots_on_ && attempt_.resume_step.has_value()))
      ResumeFromCheckpoint();
  }
  if (snapshots_on_ && attempt_.resume_step.has_value()) RestoreSnapshot();
  first_step_ = at_.from_snapshot ? -1 : state_.step;
  Call("on_train_begin", [&](Callback& c) { c.on_train_begin(state_); });
}

void FitLoop::ResumeFromCheckpoint() {
  std::unique_ptr<optim::Optimizer> unsharded = zero_ ? zero_->MakeUnsharded() : nullptr;
  if (zero_) saved_.optimizer = unsharded.get();
  at_ = Restore(ctx_, *checkpoints_, saved_, options_, rank_batch_.global);
  if (zero_) {
    if (at_.restored) dist::ThrowIfError(zero_->LoadFrom(*unsharded), "fit: resume: ");
    saved_.optimizer = nullptr;
  }
  if (!at_.restored) return;
  if (!at_.resumed_inside_epoch) last_end_save_step_ = state_.step;
  ResumeInfo info{.path = at_.path, .epoch = at_.epoch, .epoch_steps = at_.epoch_steps,
                  .step = state_.step, .extra = saved_.extra};
  Call("on_checkpoint_load", [&](Callback& c) { c.on_checkpoint_load(state_, info); });
}

void FitLoop::RestoreSnapshot() {
  const std::string name =
      absl::StrCat("snapshot of step ", *attempt_.resume_step, " (rank ", ctx_.rank(), ")");
  std::unique_ptr<optim::Optimizer> unsharded = zero_ ? zero_->MakeUnsharded() : nullptr;
  if (zero_) snap_.optimizer = unsharded.get();
  absl::StatusOr<bool> restored = dist::RestoreSnapshot(ctx_, snap_);
  dist::ThrowIfError(restored.status(), "fit: restart: ");
  if (zero_) {
    dist::ThrowIfError(zero_->LoadFrom(*unsharded), "fit: restart: ");
    snap_.optimizer = nullptr;  // each snapshot gathers its own
  }
  absl::StatusOr<SnapshotEntries> entries = ReadSnapshotEntries(snap_.extra, name);
  dist::ThrowIfError(entries.status(), "fit: restart: ");
  TANDEM_CHECK(entries->global_batch == rank_batch_.global, "fit: restart: the ", name,
               " was taken with a global batch of ", entries->global_batch,
               " rows; this attempt's is ", rank_batch_.global, " (", ctx_.world_size(),
               " ranks, this one's share ", rank_batch_.rows,
               "), so the loader's position would point ",
               "elsewhere in the epoch (inside a rank's function, size batch_size from ",
               "attempt_info().first_world_size: fit keeps the global batch itself)");
  at_ = std::move(entries->at);
  state_.stop_training = entries->stop_training;
  history_ = std::move(entries->history);
  history_.restored_snapshot_step = state_.step;
  if (ctx_.rank() == 0)
    ctx_.log().Info("fit: attempt {} resumes from the {}: epoch {}, step {} ({} of the epoch)",
                    ctx_.attempt(), name, at_.epoch + 1, state_.step, at_.epoch_steps);
  ResumeInfo info{.path = at_.path, .epoch = at_.epoch, .epoch_steps = at_.epoch_steps,
                  .step = state_.step, .extra = snap_.extra, .snapshot = true};
  Call("on_checkpoint_load", [&](Callback& c) { c.on_checkpoint_load(state_, info); });
}

// --- One epoch -----------------------------------------------------------------------

bool FitLoop::TrainEpoch(int index) {
  Epoch epoch = BeginEpoch(index);
  {
    // uneven: ranks with fewer batches answer the others' steps at finish().
    std::optional<dist::DataParallel::JoinGuard> join;
    if (options_.uneven) join.emplace(&dp_);
    RunSteps(epoch);
    if (join) FinishJoin(join);
  }
  if (ended_) return false;
  return EndEpoch(epoch);
}

FitLoop::Epoch FitLoop::BeginEpoch(int index) {
  state_.epoch = index;
  Epoch epoch;
  epoch.index = index;
  epoch.resumed = at_.resumed_inside_epoch && index == at_.epoch;
  if (!epoch.resumed) sampler_->set_epoch(index);  // a restored loader continues its epoch
  loader_->start_epoch();
  epoch.steps = epoch.resumed ? at_.epoch_steps : 0;
  state_.epoch_steps = epoch.steps;
  Call("on_epoch_begin", [&](Callback& c) { c.on_epoch_begin(state_); });
  // After a snapshot: this rank's sum so far, so the sum continues in the same order.
  epoch.loss = nn::full({}, epoch.resumed && at_.from_snapshot ? at_.rank_epoch_loss : 0.0,
                        {.dtype = nn::kFloat64, .device = ctx_.device()});
  return epoch;
}

void FitLoop::RunSteps(Epoch& epoch) {
  for (int64_t first = epoch.steps * accum_; first < batches_; first += accum_) {
    const int64_t group = std::min<int64_t>(accum_, batches_ - first);
    Call("on_train_batch_begin", [&](Callback& c) { c.on_train_batch_begin(state_); });
    const StepLoss loss = RunStep(first, group);
    ++state_.step;
    ++epoch.steps;
    state_.epoch_steps = epoch.steps;
    state_.batch_loss = loss.step;
    // The epoch's loss is the mean over the ranks' step losses; uneven shares
    // (a world shrink) weigh each by its rows, so it stays the mean over
    // samples; uneven data adds this rank's share of the one-rank step loss.
    epoch.loss = epoch.loss + (options_.uneven             ? loss.share_of_one_rank
                               : rank_batch_.uneven_shares ? loss.step * loss_share_
                                                           : loss.step);
    Call("on_train_batch_end", [&](Callback& c) { c.on_train_batch_end(state_); });
    ctx_.check_stop();
    AtStepBoundary(epoch);
    if (state_.end_fit) {
      ended_ = true;
      history_.ended_at_step = state_.step;
      return;
    }
  }
}

FitLoop::StepLoss FitLoop::RunStep(int64_t first, int64_t group) {
  StepLoss out;
  if (options_.cuda_graph) {
    out.step = GraphedStep(first);
    return out;
  }
  for (int64_t micro = 0; micro < group; ++micro) {
    data::Batch batch = NextBatch(first + micro);
    std::optional<dist::DataParallel::NoSyncGuard> no_sync;
    if (micro + 1 < group) no_sync.emplace(&dp_);
    const nn::Tensor loss = ForwardBackward(batch, group).to(nn::kFloat64);
    const nn::Tensor part = group > 1 ? loss * (1.0 / static_cast<double>(group)) : loss;
    out.step = out.step.defined() ? out.step + part : part;
    if (options_.uneven) {
      const nn::Tensor share = loss * OneRankShare(first + micro, batch.data.size(0));
      out.share_of_one_rank =
          out.share_of_one_rank.defined() ? out.share_of_one_rank + share : share;
    }
  }
  OptimizerStep();
  return out;
}

void FitLoop::AtStepBoundary(const Epoch& epoch) {
  if (options_.uneven) {
    // No step agreement inside a join (see FitOptions::uneven).
  } else if (checkpoints_) {
    dist::TraceSpan span(ctx_, "checkpoint");
    absl::Status st = checkpoints_->AtStepBoundary(saved_, [&](dist::TrainingState& s) {
      // Collectives are allowed here: every rank saves at the same step.
      const double here = SumOverRanks(ctx_, {epoch.loss.item()})[0];
      PrepareSave(s, epoch.index, epoch.steps, here + (epoch.resumed ? at_.epoch_loss_sum : 0.0));
    });
    consolidated_.reset();
    dist::ThrowIfError(st, "fit: saving a checkpoint: ");
  } else if (ctx_.AtStepBoundary(state_.step).stop) {
    throw dist::StoppedError(
        absl::StrCat("fit: stopped at step ", state_.step, " (stop signal; no checkpoint.dir)"),
        state_.step);
  }
  if (snapshots_on_ && !state_.end_fit && state_.step % options_.snapshot_every_steps == 0)
    TakeSnapshot(epoch);
}

void FitLoop::FinishJoin(std::optional<dist::DataParallel::JoinGuard>& join) {
  dist::ThrowIfError(join->finish(), "fit: uneven data: ");
  join.reset();
  // With zero every rank's shard saw every step; a plain optimizer did not.
  if (zero_ == nullptr) TakeRankZerosOptimizerState(ctx_, *run_.optimizer);
  // The job's step count: the most steps any rank ran (the others answered them).
  state_.step = static_cast<int64_t>(MaxOverRanks(ctx_, static_cast<double>(state_.step)));
}

// --- The epoch's end -----------------------------------------------------------------

bool FitLoop::EndEpoch(const Epoch& epoch) {
  logs_.clear();
  // Without uneven every rank made the same number of steps (kWrapGlobalBatch);
  // rank 0 adds what the ranks had summed before a resume.
  const double before = epoch.resumed && ctx_.rank() == 0 ? at_.epoch_loss_sum : 0.0;
  std::vector<double> total =
      SumOverRanks(ctx_, {epoch.loss.item() + before, static_cast<double>(epoch.steps)});
  // uneven: the ranks ran different step counts; the job ran the one-rank run's.
  const double job_steps = options_.uneven ? static_cast<double>(global_steps_) : total[1];
  logs_["loss"] = job_steps > 0 ? total[0] / job_steps : 0.0;
  const bool last = epoch.index + 1 == options_.epochs;
  state_.evaluated =
      options_.eval_data != nullptr && ((epoch.index + 1) % options_.eval_freq == 0 || last);
  if (state_.evaluated) {
    Logs eval = EvaluateAtEpochEnd();
    logs_.insert(eval.begin(), eval.end());
  }
  Call("on_epoch_end", [&](Callback& c) { c.on_epoch_end(state_, logs_); });
  history_.epochs.push_back(logs_);
  if (checkpoints_ && options_.checkpoint_each_epoch) {
    // The file holds the next epoch's start.
    loader_->set_state({.epoch = epoch.index + 1, .position = 0});
    PrepareSave(saved_, epoch.index + 1, -1, 0.0);
    absl::Status st = checkpoints_->Save(saved_);
    consolidated_.reset();
    dist::ThrowIfError(st, "fit: saving the epoch's checkpoint: ");
  }
  // One rank's stop (EarlyStopping) stops every rank at this epoch's end.
  std::vector<double> stop = SumOverRanks(ctx_, {state_.stop_training ? 1.0 : 0.0});
  return !(stop[0] > 0);
}

Logs FitLoop::EvaluateAtEpochEnd() {
  Call("on_eval_begin", [&](Callback& c) { c.on_eval_begin(state_); });
  Logs eval;
  {
    dist::TraceSpan span(ctx_, "evaluate");
    eval = EvaluateOnRank(ctx_, network_, loss_, run_.metrics, options_.eval_data,
                          options_.eval_batch_size > 0 ? options_.eval_batch_size
                                                       : options_.batch_size,
                          options_.num_workers, options_.bf16, options_.batch_transform);
  }
  Call("on_eval_end", [&](Callback& c) { c.on_eval_end(state_, eval); });
  return eval;
}

void FitLoop::Finish() {
  if (checkpoints_) {
    if (!ended_ && state_.step != first_step_ && last_end_save_step_ != state_.step) {
      // The end of a fit that trained, so that a resume after it has nothing
      // left to do.
      PrepareSave(saved_, std::max(state_.epoch + 1, at_.epoch), -1, 0.0);
      absl::Status st = checkpoints_->Save(saved_);
      consolidated_.reset();
      dist::ThrowIfError(st, "fit: saving the final checkpoint: ");
    }
    dist::ThrowIfError(checkpoints_->Finish(), "fit: checkpoint: ");
  }
  Call("on_train_end", [&](Callback& c) { c.on_train_end(state_, logs_); });
  history_.steps = state_.step;
  if (zero_ != nullptr) run_.gathered_state = zero_->state_dict();  // a collective: every rank
}

// --- Checkpoints and snapshots ---------------------------------------------------------

void FitLoop::PrepareSave(dist::TrainingState& s, int64_t epoch, int64_t epoch_steps,
                          double loss_sum) {
  if (zero_ != nullptr) {
    consolidated_ = zero_->Consolidated();
    s.optimizer = consolidated_.get();
  }
  s.extra.clear();
  s.extra[kEpochKey] = epoch;
  s.extra[kEpochStepsKey] = epoch_steps;
  s.extra[kEpochLossKey] = loss_sum;
  s.extra[kGlobalBatchKey] = rank_batch_.global;  // what the loader's position counts
  Call("on_checkpoint_save", [&](Callback& c) { c.on_checkpoint_save(state_, s.extra); });
  if (epoch_steps < 0) last_end_save_step_ = state_.step;
}

void FitLoop::TakeSnapshot(const Epoch& epoch) {
  dist::TraceSpan span(ctx_, "snapshot");
  if (zero_ != nullptr) {
    consolidated_ = zero_->Consolidated();
    snap_.optimizer = consolidated_.get();
  }
  ++history_.snapshots;
  snap_.extra.clear();
  PutSnapshotEntries(snap_.extra, epoch.index, epoch.steps, epoch.loss.item(),
                     state_.stop_training, history_, rank_batch_.global);
  state_.saving_snapshot = true;
  Call("on_checkpoint_save", [&](Callback& c) { c.on_checkpoint_save(state_, snap_.extra); });
  state_.saving_snapshot = false;
  absl::Status st = dist::SaveSnapshot(ctx_, snap_);
  consolidated_.reset();
  if (zero_ != nullptr) snap_.optimizer = nullptr;
  dist::ThrowIfError(st, "fit: snapshot: ");
}

// --- A step's pieces -----------------------------------------------------------------

data::Batch FitLoop::NextBatch(int64_t at_batch) {
  std::optional<data::Batch> batch;
  {
    dist::TraceSpan span(ctx_, "data");
    batch = loader_->next();
  }
  TANDEM_CHECK(batch.has_value(), "hapi::Model::fit: the loader ended early at batch ", at_batch,
               " of ", batches_);
  return std::move(*batch);
}

// cuda_graph: a full batch once the step is captured is copied into the
// static tensors and replayed; the first full batch runs eagerly, then the
// step is captured; a partial batch runs eagerly. The loss after a replay is
// the graph's tensor, which the next replay rewrites: converted (a copy on
// the stream) before that.
nn::Tensor FitLoop::GraphedStep(int64_t at_batch) {
  data::Batch batch = NextBatch(at_batch);
  const bool full = batch.data.size(0) == rank_batch_.rows;
  if (run_.graph && full && batch.data.shape() == run_.static_data.shape()) {
    run_.static_data.copy_(batch.data);
    run_.static_target.copy_(batch.target);
    run_.graph->Replay();
    return run_.graph_loss.to(nn::kFloat64);
  }
  run_.optimizer->zero_grad();  // a replay leaves its gradients
  nn::Tensor loss = ForwardBackward(batch, 1);
  OptimizerStep();
  if (!run_.graph && full) {
    run_.static_data = nn::empty_like(batch.data);
    run_.static_target = nn::empty_like(batch.target);
    run_.graph = std::make_unique<nn::CudaGraph>(ctx_.device());
    data::Batch captured{.data = run_.static_data, .target = run_.static_target};
    run_.graph->Capture([&] {
      run_.optimizer->zero_grad();
      run_.graph_loss = ForwardBackward(captured, 1);
      run_.optimizer->step();
    });
    if (ctx_.rank() == 0)
      ctx_.log().Info("fit: cuda_graph: training step captured ({} nodes) on batches of {}; "
                      "replayed for every full batch from here on",
                      run_.graph->num_nodes(), batch.data.size(0));
  }
  return loss.to(nn::kFloat64);
}

}  // namespace tandem::hapi::internal
