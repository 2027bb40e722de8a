#include "hapi/model.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "hapi/internal/fit_state.h"
#include "hapi/internal/host_state.h"
#include "nn/autocast.h"
#include "nn/error.h"
#include "nn/graph.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "nn/status_macros.h"
#include "optim/clip_grad.h"
#include "spawn/comm/communicator.h"
#include "spawn/observe/trace.h"
#include "spawn/signals.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/sync_batch_norm.h"
#include "spawn/train/zero_redundancy_optimizer.h"

namespace tandem::hapi {

using internal::CheckRestartOptions;
using internal::HostCopy;
using internal::HostState;
using internal::FitPosition;
using internal::kEpochKey;
using internal::kEpochLossKey;
using internal::kEpochStepsKey;
using internal::kGlobalBatchKey;
using internal::PutSnapshotEntries;
using internal::RankBatch;
using internal::RankBatchOf;
using internal::ReadSnapshotEntries;
using internal::Restore;
using internal::SnapshotEntries;

struct Model::RankRun {
  std::shared_ptr<nn::Module> network;
  std::unique_ptr<dist::DataParallel> dp;
  // FitOptions::zero: the sharded optimizer (optimizer stays null).
  std::unique_ptr<dist::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::vector<std::unique_ptr<Metric>> metrics;
  // With zero: the unsharded state gathered on every rank at the end of fit
  // (a collective), for Keep.
  std::optional<optim::StateDict> gathered_state;
  // FitOptions::cuda_graph: the captured step, its static input and target and
  // the loss each replay rewrites. Last: the graph goes before what it replays.
  nn::Tensor static_data, static_target, graph_loss;
  std::unique_ptr<nn::CudaGraph> graph;
};

namespace {

// Runs one hook of every callback; an exception names the callback and the hook
// (a cancellation, another rank's failure reaching this one, passes unchanged).
template <typename Hook>
void CallEach(std::vector<std::unique_ptr<Callback>>& callbacks, const char* hook, Hook&& call) {
  for (auto& cb : callbacks) {
    try {
      call(*cb);
    } catch (const dist::CancelledError&) {
      throw;
    } catch (const std::exception& e) {
      Fail("callback ", cb->name(), " failed in ", hook, ": ", e.what());
    }
  }
}

std::vector<std::unique_ptr<Callback>> MakeCallbacks(const std::vector<CallbackFactory>& factories,
                                                     int64_t log_freq) {
  std::vector<std::unique_ptr<Callback>> out;
  if (log_freq > 0) out.push_back(std::make_unique<ProgressLogger>(log_freq));
  for (const auto& make : factories) {
    TANDEM_CHECK(static_cast<bool>(make), "hapi: an empty CallbackFactory");
    out.push_back(make());
    TANDEM_CHECK(out.back() != nullptr, "hapi: a CallbackFactory returned no callback");
  }
  return out;
}


int LocalRank(const dist::Context& ctx) {
  return ctx.local_rank() < 0 ? ctx.rank() : ctx.local_rank();
}

data::DistributedOptions SamplerOptions(const dist::Context& ctx, int64_t size, int64_t batch) {
  data::DistributedOptions o;
  o.dataset_size = size;
  o.batch_size = batch;
  o.num_replicas = ctx.world_size();
  o.rank = ctx.rank();
  return o;
}

// Sums every rank's `values` (one float64 all_reduce on the rank's device).
std::vector<double> SumOverRanks(dist::Context& ctx, const std::vector<double>& values) {
  nn::Tensor t = nn::from_vector(values, {static_cast<int64_t>(values.size())},
                                 {.dtype = nn::kFloat64})
                     .to(ctx.device());
  ctx.communicator().all_reduce(t, dist::ReduceOp::kSum);
  return t.to_vector<double>();
}

// The largest of every rank's `value`.
double MaxOverRanks(dist::Context& ctx, double value) {
  nn::Tensor t = nn::from_vector<double>({value}, {1}, {.dtype = nn::kFloat64}).to(ctx.device());
  ctx.communicator().all_reduce(t, dist::ReduceOp::kMax);
  return t.to_vector<double>()[0];
}

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

absl::Status CheckDataset(const char* call, const std::shared_ptr<const data::Dataset>& d,
                          const char* what) {
  if (d == nullptr) return absl::InvalidArgumentError(absl::StrCat(call, ": ", what, " is null"));
  if (d->size() == 0)
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", what, " is empty (0 examples)"));
  return absl::OkStatus();
}

absl::Status CheckFitOptions(const FitOptions& o) {
  auto bad = [](const char* name, auto value, const char* why) {
    return absl::InvalidArgumentError(absl::StrCat("fit: ", name, " = ", value, ": ", why));
  };
  if (o.epochs < 0) return bad("epochs", o.epochs, "must be >= 0");
  if (o.batch_size < 1) return bad("batch_size", o.batch_size, "must be >= 1");
  if (o.eval_batch_size < 0) return bad("eval_batch_size", o.eval_batch_size, "must be >= 0");
  if (o.eval_freq < 1) return bad("eval_freq", o.eval_freq, "must be >= 1");
  if (o.grad_accum_steps < 1) return bad("grad_accum_steps", o.grad_accum_steps, "must be >= 1");
  if (o.num_workers < 0) return bad("num_workers", o.num_workers, "must be >= 0");
  if (o.log_freq < 0) return bad("log_freq", o.log_freq, "must be >= 0");
  if (o.max_steps_per_epoch < 0)
    return bad("max_steps_per_epoch", o.max_steps_per_epoch, "must be >= 0");
  if (o.snapshot_every_steps < 0)
    return bad("snapshot_every_steps", o.snapshot_every_steps, "must be >= 0");
  if (!(o.clip_grad_norm >= 0))
    return bad("clip_grad_norm", o.clip_grad_norm, "must be >= 0 (0: no clipping)");
  if (o.uneven && o.drop_last)
    return absl::InvalidArgumentError(
        "fit: uneven = true with drop_last = true: uneven data keeps every sample");
  if (o.cuda_graph && (o.grad_accum_steps > 1 || o.zero || o.uneven))
    return absl::InvalidArgumentError(
        "fit: cuda_graph with grad_accum_steps > 1, zero or uneven: the captured step holds "
        "one synchronised micro-batch and the unsharded optimizer");
  if (o.cuda_graph && o.clip_grad_norm > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "fit: cuda_graph with clip_grad_norm = ", o.clip_grad_norm,
        ": the captured step does not clip"));
  if (o.uneven && !o.checkpoint.dir.empty())
    return absl::InvalidArgumentError(
        "fit: uneven = true with checkpoint.dir: a rank that has joined cannot take part in "
        "a checkpoint's step agreement");
  if (o.resume && o.checkpoint.dir.empty())
    return absl::InvalidArgumentError("fit: resume needs checkpoint.dir");
  if (!o.checkpoint.dir.empty()) {
    absl::Status st = dist::CheckpointManager::Validate(o.checkpoint);
    if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("fit: checkpoint: ", st.message()));
  }
  if (o.eval_data != nullptr) return CheckDataset("fit", o.eval_data, "eval_data");
  return absl::OkStatus();
}

absl::Status CheckEvalOptions(const char* call, const EvalOptions& o) {
  if (o.batch_size < 1)
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": batch_size = ", o.batch_size, ": must be >= 1"));
  if (o.num_workers < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": num_workers = ", o.num_workers, ": must be >= 0"));
  return absl::OkStatus();
}

data::DataLoaderOptions LoaderOptions(const dist::Context& ctx, int num_workers,
                                      std::shared_ptr<const data::Transform> transform) {
  data::DataLoaderOptions o;
  o.num_workers = num_workers;
  o.prefetch = std::max(2, 2 * num_workers);
  o.device = ctx.device();
  o.pin_memory = ctx.device().is_cuda();
  o.batch_transform = std::move(transform);
  return o;
}

// Evaluation on this rank's kUneven share, reduced over the ranks.
Logs EvaluateOnRank(dist::Context& ctx, nn::Module& network, const LossFunction& loss,
                    std::vector<std::unique_ptr<Metric>>& metrics,
                    std::shared_ptr<const data::Dataset> dataset, int64_t batch_size,
                    int num_workers, bool bf16, std::shared_ptr<const data::Transform> transform) {
  data::DistributedOptions so = SamplerOptions(ctx, dataset->size(), batch_size);
  so.shuffle = false;
  so.tail = data::DistributedTail::kUneven;
  auto sampler = std::make_shared<data::DistributedBatchSampler>(so);
  data::DataLoader loader(std::move(dataset), sampler,
                          LoaderOptions(ctx, num_workers, std::move(transform)));
  const bool was_training = network.is_training();
  network.eval();
  nn::NoGradGuard no_grad;
  for (auto& m : metrics) m->reset();
  // Loss: sum over batches of (batch mean * rows), on the device until the reduction.
  nn::Tensor loss_sum = nn::zeros({}, {.dtype = nn::kFloat64, .device = ctx.device()});
  double rows = 0;
  while (auto batch = loader.next()) {
    nn::Tensor out;
    nn::Tensor batch_loss;
    {
      std::optional<nn::AutocastGuard> autocast;
      if (bf16) autocast.emplace(nn::kBFloat16);
      out = network(batch->data);
      if (loss) batch_loss = loss(out, batch->target);
    }
    const auto n = static_cast<double>(batch->data.size(0));
    if (loss) loss_sum = loss_sum + batch_loss.detach().to(nn::kFloat64) * n;
    rows += n;
    for (auto& m : metrics) m->update(out, batch->target);
  }
  network.train(was_training);
  std::vector<double> sums = {loss_sum.item(), rows};
  for (auto& m : metrics) sums.insert(sums.end(), m->sums().begin(), m->sums().end());
  sums = SumOverRanks(ctx, sums);
  Logs logs;
  if (loss) logs["eval_loss"] = sums[0] / sums[1];
  size_t at = 2;
  for (auto& m : metrics) {
    const size_t k = m->sums().size();
    m->set_sums(std::vector<double>(sums.begin() + at, sums.begin() + at + k));
    at += k;
    logs["eval_" + m->name()] = m->value();
  }
  return logs;
}

}  // namespace

namespace internal {

nn::Tensor HostCopy(const nn::Tensor& t) {
  nn::NoGradGuard no_grad;
  return t.device().is_cpu() ? t.detach().clone() : t.to(nn::Device::CPU());
}

// Host copies of the module's parameters and buffers.
nn::StateDict HostState(const nn::Module& module) {
  nn::StateDict host;
  for (const auto& [name, t] : module.state_dict()) host.emplace_back(name, HostCopy(t));
  return host;
}

}  // namespace internal

LossFunction CrossEntropy() {
  return [](const nn::Tensor& output, const nn::Tensor& target) {
    // Paddle's labels of shape (N, 1), as Accuracy takes them. Labels of another
    // N stay as they are, so that the error names the shape they came in.
    if (output.dim() == 2 && target.dim() == 2 && target.size(1) == 1 &&
        target.size(0) == output.size(0)) {
      return nn::cross_entropy(output, target.reshape({target.size(0)}));
    }
    return nn::cross_entropy(output, target);
  };
}

LossFunction MeanSquaredError() {
  return [](const nn::Tensor& output, const nn::Tensor& target) {
    return nn::mse_loss(output, target);
  };
}

Model::Model(NetworkFactory network, LaunchOptions launch)
    : network_(std::move(network)), launch_(std::move(launch)) {
  TANDEM_CHECK(static_cast<bool>(network_), "hapi::Model: the network factory is empty");
}

Model::~Model() = default;

void Model::prepare(OptimizerFactory optimizer, LossFunction loss,
                    std::vector<MetricFactory> metrics) {
  TANDEM_CHECK(static_cast<bool>(optimizer), "hapi::Model::prepare: the optimizer factory is empty");
  TANDEM_CHECK(static_cast<bool>(loss), "hapi::Model::prepare: the loss function is empty");
  for (const auto& m : metrics)
    TANDEM_CHECK(static_cast<bool>(m), "hapi::Model::prepare: an empty metric factory");
  optimizer_ = std::move(optimizer);
  loss_ = std::move(loss);
  metrics_ = std::move(metrics);
  // A new optimizer starts fresh, except with the state load() read before any
  // prepare(): the next fit checks it against this optimizer.
  if (unchecked_optimizer_file_.empty()) have_optimizer_state_ = false;
}

absl::Status Model::CheckPrepared(const char* call) const {
  if (!optimizer_ || !loss_)
    return absl::FailedPreconditionError(
        absl::StrCat("hapi::Model::", call, ": call prepare(optimizer, loss, metrics) first"));
  return absl::OkStatus();
}

absl::Status Model::RunOnRanks(const std::function<absl::Status(dist::Context&)>& body) {
  if (dist::Context* ctx = dist::current_or_null()) {
    spawned_ = false;
    return body(*ctx);
  }
  spawned_ = true;
  return dist::spawn([&](dist::Context& ctx) { return body(ctx); }, launch_.nprocs, launch_.gpus,
                     launch_.spawn);
}

std::unique_ptr<Model::RankRun> Model::Build(dist::Context& ctx, bool wrapped_by_data_parallel) {
  auto run = std::make_unique<RankRun>();
  run->network = network_();
  TANDEM_CHECK(run->network != nullptr, "hapi::Model: the network factory returned null");
  run->network->to(ctx.device());
  if (have_weights_) {
    absl::Status st = run->network->load_state_dict(weights_);
    TANDEM_CHECK(st.ok(), "hapi::Model: the kept weights do not fit the network: ", st.message());
  } else if (!wrapped_by_data_parallel) {
    // A fresh network: every rank takes rank 0's initial weights, as
    // DataParallel's construction does for fit, so evaluate() and predict()
    // before any fit agree too.
    nn::NoGradGuard no_grad;
    for (auto& [name, t] : run->network->state_dict()) {
      nn::Tensor data = t.detach();
      ctx.communicator().broadcast(data, 0);
    }
  }
  for (const auto& make : metrics_) {
    run->metrics.push_back(make());
    TANDEM_CHECK(run->metrics.back() != nullptr, "hapi::Model: a metric factory returned null");
  }
  return run;
}

void Model::Keep(dist::Context& ctx, RankRun& run) {
  // Spawned from main, every rank thread gets here: local rank 0 keeps
  // (DataParallel holds every rank's weights equal). Inside a rank's function
  // the Model is that rank's own.
  if (spawned_ && LocalRank(ctx) != 0) return;
  weights_ = HostState(*run.network);
  have_weights_ = true;
  if (run.gathered_state.has_value() || run.optimizer != nullptr) {
    optim::StateDict st = run.gathered_state.has_value() ? std::move(*run.gathered_state)
                                                          : run.optimizer->state_dict();
    for (auto& [name, t] : st.tensors) t = HostCopy(t);
    optimizer_state_ = std::move(st);
    have_optimizer_state_ = true;
    optimizer_type_ = run.zero != nullptr ? run.zero->optimizer().name() : run.optimizer->name();
  }
}

absl::StatusOr<History> Model::fit(std::shared_ptr<const data::Dataset> train,
                                   FitOptions options) {
  RETURN_IF_ERROR(CheckPrepared("fit"));
  RETURN_IF_ERROR(CheckDataset("fit", train, "the training data"));
  RETURN_IF_ERROR(CheckFitOptions(options));
  if (dist::current_or_null() == nullptr) RETURN_IF_ERROR(CheckRestartOptions(options, launch_));
  RETURN_IF_ERROR(CheckPendingOptimizerState());
  History history;
  absl::Status status = RunOnRanks([&](dist::Context& ctx) -> absl::Status {
    History h = FitOnRank(ctx, train, options);
    if (!spawned_ || LocalRank(ctx) == 0) history = std::move(h);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return history;
}


History Model::FitOnRank(dist::Context& ctx, const std::shared_ptr<const data::Dataset>& train,
                         const FitOptions& options) {
  // In-process restarts (FitOptions::snapshot_every_steps): snapshots only in
  // a run that keeps them (a restart policy).
  const dist::AttemptInfo& attempt = ctx.attempt_info();
  const bool snapshots_on = options.snapshot_every_steps > 0 && attempt.snapshots != nullptr;
  TANDEM_CHECK(!snapshots_on || !options.uneven, "fit: uneven = true with snapshot_every_steps = ",
               options.snapshot_every_steps, " under a restart policy (SpawnOptions::restart): ",
               "the state of a join (the ranks that have joined, the steps they answer) is not ",
               "snapshotted; set snapshot_every_steps = 0 (a restart then starts the fit again)");
  const RankBatch rank_batch = RankBatchOf(ctx, options);
  const int64_t batch_size = rank_batch.rows;
  const int64_t global_batch = rank_batch.global;
  const double loss_share = static_cast<double>(rank_batch.rows * ctx.world_size()) /
                            static_cast<double>(global_batch);
  std::unique_ptr<RankRun> run = Build(ctx, /*wrapped_by_data_parallel=*/true);
  nn::Module& network = *run->network;
  network.train();
  if (options.sync_batch_norm) dist::ConvertSyncBatchNorm(network);
  dist::DataParallelOptions dp_options = options.data_parallel;
  // Uneven shares are weighed by DataParallel's global_batch_size, or inside
  // join() (uneven) by the rows the join counts.
  if (rank_batch.uneven_shares && !options.uneven) dp_options.global_batch_size = global_batch;
  run->dp = std::make_unique<dist::DataParallel>(network, ctx, dp_options);
  dist::DataParallel& dp = *run->dp;
  dist::ZeroRedundancyOptimizer* zero = nullptr;
  if (options.zero) {
    run->zero = std::make_unique<dist::ZeroRedundancyOptimizer>(dp, optimizer_);
    zero = run->zero.get();
    if (have_optimizer_state_) {
      absl::Status st = zero->load_state_dict(optimizer_state_);
      TANDEM_CHECK(st.ok(), "hapi::Model: the kept optimizer state does not fit: ", st.message());
    }
  } else {
    run->optimizer = optimizer_(dp.parameters());
    TANDEM_CHECK(run->optimizer != nullptr, "hapi::Model: the optimizer factory returned null");
    if (have_optimizer_state_) {
      absl::Status st = run->optimizer->load_state_dict(optimizer_state_);
      TANDEM_CHECK(st.ok(), "hapi::Model: the kept optimizer state does not fit: ", st.message());
    }
  }
  // The optimizer callbacks see (lr schedules): with zero the wrapped one.
  optim::Optimizer& optimizer = zero != nullptr ? zero->optimizer() : *run->optimizer;
  TANDEM_CHECK(!options.cuda_graph || ctx.device().is_cuda(),
               "fit: cuda_graph needs a CUDA rank; this rank runs on ", ctx.device().ToString());

  data::DistributedOptions so = SamplerOptions(ctx, train->size(), batch_size);
  if (rank_batch.uneven_shares) {
    so.batch_size = 0;  // from the global batch: this rank's share
    so.global_batch_size = global_batch;
  }
  so.shuffle = options.shuffle;
  so.drop_last = options.drop_last;
  so.seed = options.seed;
  if (options.uneven) so.tail = data::DistributedTail::kUneven;
  auto sampler = std::make_shared<data::DistributedBatchSampler>(so);
  data::DataLoader loader(train, sampler,
                          LoaderOptions(ctx, options.num_workers, options.batch_transform));
  // Only drop_last drops every batch (a kUneven rank without a batch answers
  // the others' steps under join()); kWrapGlobalBatch gives every rank the same count.
  TANDEM_CHECK(loader.num_batches() > 0 || options.uneven || options.epochs == 0,
               "fit: no step per epoch: drop_last with ", train->size(),
               " examples and a global batch of ", global_batch, " rows over ", ctx.world_size(),
               " rank", ctx.world_size() == 1 ? "" : "s");
  const int accum = options.grad_accum_steps;
  // This rank's batches per epoch: all of them, or max_steps_per_epoch steps' worth.
  const int64_t batches =
      options.max_steps_per_epoch > 0
          ? std::min<int64_t>(loader.num_batches(), options.max_steps_per_epoch * accum)
          : loader.num_batches();

  // uneven: the job's micro-batches are the one-rank run's (every rank's k-th
  // batch is its share of global batch k), so each rank adds its share of the
  // one-rank loss of each: the batch's mean loss times its rows over the global
  // batch's rows, over the one-rank step's micro-batch count; the epoch's loss
  // is then the ranks' sum over the job's step count, as one rank's.
  const int64_t examples = train->size();
  const int64_t global_batches =
      options.uneven ? std::min<int64_t>((examples + global_batch - 1) / global_batch,
                                         options.max_steps_per_epoch > 0
                                             ? options.max_steps_per_epoch * accum
                                             : INT64_MAX)
                     : 0;
  const int64_t global_steps = (global_batches + accum - 1) / accum;
  auto one_rank_share = [&](int64_t at_batch, int64_t rows) {
    const int64_t global_rows =
        at_batch < examples / global_batch ? global_batch : examples % global_batch;
    const int64_t group = std::min<int64_t>(accum, global_batches - at_batch / accum * accum);
    return static_cast<double>(rows) / static_cast<double>(global_rows) /
           static_cast<double>(group);
  };

  RunState state;
  state.ctx = &ctx;
  state.network = &network;
  state.optimizer = &optimizer;
  state.data_parallel = &dp;
  state.zero = zero;
  state.epochs = options.epochs;
  state.steps_per_epoch = (batches + accum - 1) / accum;
  state.has_eval_data = options.eval_data != nullptr;
  std::vector<std::unique_ptr<Callback>> callbacks =
      MakeCallbacks(options.callbacks, options.log_freq);

  std::optional<dist::CheckpointManager> checkpoints;
  // With zero the files hold the unsharded optimizer: one gathered for each save
  // (a collective, at the save's agreed step), one loaded and sharded on resume.
  dist::TrainingState saved{.model = &network, .optimizer = run->optimizer.get(),
                            .loader = &loader, .step = &state.step};
  std::unique_ptr<optim::Optimizer> consolidated;
  // The step of the last save made at an epoch's end (-1 steps in it): a final
  // save at that step would repeat it.
  int64_t last_end_save_step = -1;
  // Every rank, at the same step: the gathered optimizer (zero), fit's entries
  // (epoch, steps done in it or -1 at its end, the loss summed so far) and the
  // callbacks'.
  auto prepare_save = [&](dist::TrainingState& s, int64_t epoch, int64_t epoch_steps,
                          double loss_sum) {
    if (zero != nullptr) {
      consolidated = zero->Consolidated();
      s.optimizer = consolidated.get();
    }
    s.extra.clear();
    s.extra[kEpochKey] = epoch;
    s.extra[kEpochStepsKey] = epoch_steps;
    s.extra[kEpochLossKey] = loss_sum;
    s.extra[kGlobalBatchKey] = global_batch;  // what the loader's position counts
    CallEach(callbacks, "on_checkpoint_save", [&](Callback& c) { c.on_checkpoint_save(state, s.extra); });
    if (epoch_steps < 0) last_end_save_step = state.step;
  };
  History history;
  FitPosition at;
  // A restart's snapshot, when this attempt has one, rather than a checkpoint.
  dist::TrainingState snap{.model = &network, .optimizer = run->optimizer.get(),
                           .loader = &loader, .step = &state.step};
  const bool from_snapshot = snapshots_on && attempt.resume_step.has_value();
  if (!options.checkpoint.dir.empty()) {
    checkpoints.emplace(ctx, options.checkpoint);
    if (options.resume && !from_snapshot) {
      std::unique_ptr<optim::Optimizer> unsharded = zero ? zero->MakeUnsharded() : nullptr;
      if (zero) saved.optimizer = unsharded.get();
      at = Restore(ctx, *checkpoints, saved, options, global_batch);
      if (zero) {
        if (at.restored) dist::ThrowIfError(zero->LoadFrom(*unsharded), "fit: resume: ");
        saved.optimizer = nullptr;
      }
      if (at.restored) {
        if (!at.resumed_inside_epoch) last_end_save_step = state.step;
        ResumeInfo info{.path = at.path, .epoch = at.epoch, .epoch_steps = at.epoch_steps,
                        .step = state.step, .extra = saved.extra};
        CallEach(callbacks, "on_checkpoint_load", [&](Callback& c) { c.on_checkpoint_load(state, info); });
      }
    }
  }
  if (from_snapshot) {
    const std::string name =
        absl::StrCat("snapshot of step ", *attempt.resume_step, " (rank ", ctx.rank(), ")");
    std::unique_ptr<optim::Optimizer> unsharded = zero ? zero->MakeUnsharded() : nullptr;
    if (zero) snap.optimizer = unsharded.get();
    absl::StatusOr<bool> restored = dist::RestoreSnapshot(ctx, snap);
    dist::ThrowIfError(restored.status(), "fit: restart: ");
    if (zero) {
      dist::ThrowIfError(zero->LoadFrom(*unsharded), "fit: restart: ");
      snap.optimizer = nullptr;  // each snapshot gathers its own
    }
    absl::StatusOr<SnapshotEntries> entries = ReadSnapshotEntries(snap.extra, name);
    dist::ThrowIfError(entries.status(), "fit: restart: ");
    TANDEM_CHECK(entries->global_batch == global_batch, "fit: restart: the ", name,
                 " was taken with a global batch of ", entries->global_batch,
                 " rows; this attempt's is ", global_batch, " (", ctx.world_size(),
                 " ranks, this one's share ", batch_size, "), so the loader's position would point ",
                 "elsewhere in the epoch (inside a rank's function, size batch_size from ",
                 "attempt_info().first_world_size: fit keeps the global batch itself)");
    at = std::move(entries->at);
    state.stop_training = entries->stop_training;
    history = std::move(entries->history);
    history.restored_snapshot_step = state.step;
    if (ctx.rank() == 0)
      ctx.log().Info("fit: attempt {} resumes from the {}: epoch {}, step {} ({} of the epoch)",
                     ctx.attempt(), name, at.epoch + 1, state.step, at.epoch_steps);
    ResumeInfo info{.path = at.path, .epoch = at.epoch, .epoch_steps = at.epoch_steps,
                    .step = state.step, .extra = snap.extra, .snapshot = true};
    CallEach(callbacks, "on_checkpoint_load", [&](Callback& c) { c.on_checkpoint_load(state, info); });
  }
  // Every rank at the same step (a multiple of snapshot_every_steps): this
  // rank's snapshot, fit's entries and the callbacks' (with zero the gathered
  // optimizer: a collective).
  auto take_snapshot = [&](int epoch, int64_t epoch_steps, const nn::Tensor& epoch_loss) {
    dist::TraceSpan span(ctx, "snapshot");
    if (zero != nullptr) {
      consolidated = zero->Consolidated();
      snap.optimizer = consolidated.get();
    }
    ++history.snapshots;
    snap.extra.clear();
    PutSnapshotEntries(snap.extra, epoch, epoch_steps, epoch_loss.item(), state.stop_training,
                       history, global_batch);
    state.saving_snapshot = true;
    CallEach(callbacks, "on_checkpoint_save", [&](Callback& c) { c.on_checkpoint_save(state, snap.extra); });
    state.saving_snapshot = false;
    absl::Status st = dist::SaveSnapshot(ctx, snap);
    consolidated.reset();
    if (zero != nullptr) snap.optimizer = nullptr;
    dist::ThrowIfError(st, "fit: snapshot: ");
  };
  auto optimizer_step = [&] {
    dist::TraceSpan span(ctx, "optimizer");
    if (options.clip_grad_norm > 0) {
      // The reduced gradients: the same norm on every rank.
      if (zero != nullptr) {
        zero->clip_grad_norm_(options.clip_grad_norm);
      } else {
        optim::clip_grad_norm_(dp.parameters(), options.clip_grad_norm);
      }
    }
    if (zero != nullptr) {
      zero->step();
      zero->zero_grad();
    } else {
      run->optimizer->step();
      run->optimizer->zero_grad();
    }
  };
  auto next_batch = [&](int64_t at_batch) {
    std::optional<data::Batch> batch;
    {
      dist::TraceSpan span(ctx, "data");
      batch = loader.next();
    }
    TANDEM_CHECK(batch.has_value(), "hapi::Model::fit: the loader ended early at batch ", at_batch,
                 " of ", batches);
    return std::move(*batch);
  };
  // Forward and loss (under bf16's autocast), backward of loss / group; returns
  // the undivided loss, detached.
  auto forward_backward = [&](const data::Batch& batch, int64_t group) {
    nn::Tensor loss;
    {
      dist::TraceSpan span(ctx, "forward");
      std::optional<nn::AutocastGuard> autocast;
      if (options.bf16) autocast.emplace(nn::kBFloat16);
      loss = loss_(dp(batch.data), batch.target);
    }
    TANDEM_CHECK(loss.numel() == 1, "hapi::Model::fit: the loss function returned shape ",
                 nn::ShapeToString(loss.shape()), "; it must return one value (a mean)");
    {
      dist::TraceSpan span(ctx, "backward");
      (group > 1 ? loss * (1.0 / static_cast<double>(group)) : loss).backward();
    }
    return loss.detach();
  };
  // cuda_graph: a full batch once the step is captured is copied into the
  // static tensors and replayed; the first full batch runs eagerly, then the
  // step is captured; a partial batch runs eagerly. The loss after a replay is
  // the graph's tensor, which the next replay rewrites: converted (a copy on
  // the stream) before that.
  auto graphed_step = [&](int64_t at_batch) {
    data::Batch batch = next_batch(at_batch);
    const bool full = batch.data.size(0) == batch_size;
    if (run->graph && full && batch.data.shape() == run->static_data.shape()) {
      run->static_data.copy_(batch.data);
      run->static_target.copy_(batch.target);
      run->graph->Replay();
      return run->graph_loss.to(nn::kFloat64);
    }
    run->optimizer->zero_grad();  // a replay leaves its gradients
    nn::Tensor loss = forward_backward(batch, 1);
    optimizer_step();
    if (!run->graph && full) {
      run->static_data = nn::empty_like(batch.data);
      run->static_target = nn::empty_like(batch.target);
      run->graph = std::make_unique<nn::CudaGraph>(ctx.device());
      data::Batch captured{.data = run->static_data, .target = run->static_target};
      run->graph->Capture([&] {
        run->optimizer->zero_grad();
        run->graph_loss = forward_backward(captured, 1);
        run->optimizer->step();
      });
      if (ctx.rank() == 0)
        ctx.log().Info("fit: cuda_graph: training step captured ({} nodes) on batches of {}; "
                       "replayed for every full batch from here on",
                       run->graph->num_nodes(), batch.data.size(0));
    }
    return loss.to(nn::kFloat64);
  };

  Logs logs;
  bool ended = false;
  // After a resume: the checkpoint's; after a snapshot (taken after a step of
  // this fit): none, so the final checkpoint is saved.
  const int64_t first_step = at.from_snapshot ? -1 : state.step;
  CallEach(callbacks, "on_train_begin", [&](Callback& c) { c.on_train_begin(state); });
  for (int epoch = at.epoch; epoch < options.epochs && !ended; ++epoch) {
    state.epoch = epoch;
    const bool resumed = at.resumed_inside_epoch && epoch == at.epoch;
    if (!resumed) sampler->set_epoch(epoch);  // a restored loader continues its epoch
    loader.start_epoch();
    int64_t steps = resumed ? at.epoch_steps : 0;
    state.epoch_steps = steps;
    CallEach(callbacks, "on_epoch_begin", [&](Callback& c) { c.on_epoch_begin(state); });
    // After a snapshot: this rank's sum so far, so the sum continues in the same order.
    nn::Tensor epoch_loss =
        nn::full({}, resumed && at.from_snapshot ? at.rank_epoch_loss : 0.0,
                 {.dtype = nn::kFloat64, .device = ctx.device()});
    // uneven: ranks with fewer batches answer the others' steps at finish().
    std::optional<dist::DataParallel::JoinGuard> join;
    if (options.uneven) join.emplace(&dp);
    for (int64_t first = steps * accum; first < batches; first += accum) {
      const int64_t group = std::min<int64_t>(accum, batches - first);
      CallEach(callbacks, "on_train_batch_begin", [&](Callback& c) { c.on_train_batch_begin(state); });
      nn::Tensor step_loss;
      nn::Tensor share_of_one_rank_loss;  // uneven
      if (options.cuda_graph) {
        step_loss = graphed_step(first);
      } else {
        for (int64_t micro = 0; micro < group; ++micro) {
          data::Batch batch = next_batch(first + micro);
          std::optional<dist::DataParallel::NoSyncGuard> no_sync;
          if (micro + 1 < group) no_sync.emplace(&dp);
          const nn::Tensor loss = forward_backward(batch, group).to(nn::kFloat64);
          const nn::Tensor part = group > 1 ? loss * (1.0 / static_cast<double>(group)) : loss;
          step_loss = step_loss.defined() ? step_loss + part : part;
          if (options.uneven) {
            const nn::Tensor share = loss * one_rank_share(first + micro, batch.data.size(0));
            share_of_one_rank_loss =
                share_of_one_rank_loss.defined() ? share_of_one_rank_loss + share : share;
          }
        }
        optimizer_step();
      }
      ++state.step;
      ++steps;
      state.epoch_steps = steps;
      state.batch_loss = step_loss;
      // The epoch's loss is the mean over the ranks' step losses; uneven shares
      // (a world shrink) weigh each by its rows, so it stays the mean over
      // samples; uneven data adds this rank's share of the one-rank step loss.
      epoch_loss = epoch_loss + (options.uneven             ? share_of_one_rank_loss
                                 : rank_batch.uneven_shares ? step_loss * loss_share
                                                            : step_loss);
      CallEach(callbacks, "on_train_batch_end", [&](Callback& c) { c.on_train_batch_end(state); });
      ctx.check_stop();
      if (options.uneven) {
        // No step agreement inside a join (see FitOptions::uneven).
      } else if (checkpoints) {
        dist::TraceSpan span(ctx, "checkpoint");
        absl::Status st = checkpoints->AtStepBoundary(saved, [&](dist::TrainingState& s) {
          // Collectives are allowed here: every rank saves at the same step.
          const double here = SumOverRanks(ctx, {epoch_loss.item()})[0];
          prepare_save(s, epoch, steps, here + (resumed ? at.epoch_loss_sum : 0.0));
        });
        consolidated.reset();
        dist::ThrowIfError(st, "fit: saving a checkpoint: ");
      } else if (ctx.AtStepBoundary(state.step).stop) {
        throw dist::StoppedError(
            absl::StrCat("fit: stopped at step ", state.step, " (stop signal; no checkpoint.dir)"),
            state.step);
      }
      if (snapshots_on && !state.end_fit && state.step % options.snapshot_every_steps == 0)
        take_snapshot(epoch, steps, epoch_loss);
      if (state.end_fit) {
        ended = true;
        history.ended_at_step = state.step;
        break;
      }
    }
    if (join) {
      dist::ThrowIfError(join->finish(), "fit: uneven data: ");
      join.reset();
      // With zero every rank's shard saw every step; a plain optimizer did not.
      if (zero == nullptr) TakeRankZerosOptimizerState(ctx, *run->optimizer);
      // The job's step count: the most steps any rank ran (the others answered them).
      state.step = static_cast<int64_t>(MaxOverRanks(ctx, static_cast<double>(state.step)));
    }
    if (ended) break;
    logs.clear();
    // Without uneven every rank made the same number of steps (kWrapGlobalBatch);
    // rank 0 adds what the ranks had summed before a resume.
    const double before = resumed && ctx.rank() == 0 ? at.epoch_loss_sum : 0.0;
    std::vector<double> total =
        SumOverRanks(ctx, {epoch_loss.item() + before, static_cast<double>(steps)});
    // uneven: the ranks ran different step counts; the job ran the one-rank run's.
    const double job_steps = options.uneven ? static_cast<double>(global_steps) : total[1];
    logs["loss"] = job_steps > 0 ? total[0] / job_steps : 0.0;
    const bool last = epoch + 1 == options.epochs;
    state.evaluated =
        options.eval_data != nullptr && ((epoch + 1) % options.eval_freq == 0 || last);
    if (state.evaluated) {
      CallEach(callbacks, "on_eval_begin", [&](Callback& c) { c.on_eval_begin(state); });
      Logs eval;
      {
        dist::TraceSpan span(ctx, "evaluate");
        eval = EvaluateOnRank(ctx, network, loss_, run->metrics, options.eval_data,
                              options.eval_batch_size > 0 ? options.eval_batch_size
                                                          : options.batch_size,
                              options.num_workers, options.bf16, options.batch_transform);
      }
      CallEach(callbacks, "on_eval_end", [&](Callback& c) { c.on_eval_end(state, eval); });
      logs.insert(eval.begin(), eval.end());
    }
    CallEach(callbacks, "on_epoch_end", [&](Callback& c) { c.on_epoch_end(state, logs); });
    history.epochs.push_back(logs);
    if (checkpoints && options.checkpoint_each_epoch) {
      // The file holds the next epoch's start.
      loader.set_state({.epoch = epoch + 1, .position = 0});
      prepare_save(saved, epoch + 1, -1, 0.0);
      absl::Status st = checkpoints->Save(saved);
      consolidated.reset();
      dist::ThrowIfError(st, "fit: saving the epoch's checkpoint: ");
    }
    // One rank's stop (EarlyStopping) stops every rank at this epoch's end.
    std::vector<double> stop = SumOverRanks(ctx, {state.stop_training ? 1.0 : 0.0});
    if (stop[0] > 0) break;
  }
  if (checkpoints) {
    if (!ended && state.step != first_step && last_end_save_step != state.step) {
      // The end of a fit that trained, so that a resume after it has nothing
      // left to do.
      prepare_save(saved, std::max(state.epoch + 1, at.epoch), -1, 0.0);
      absl::Status st = checkpoints->Save(saved);
      consolidated.reset();
      dist::ThrowIfError(st, "fit: saving the final checkpoint: ");
    }
    dist::ThrowIfError(checkpoints->Finish(), "fit: checkpoint: ");
  }
  CallEach(callbacks, "on_train_end", [&](Callback& c) { c.on_train_end(state, logs); });
  history.steps = state.step;
  if (zero != nullptr) run->gathered_state = zero->state_dict();  // a collective: every rank
  Keep(ctx, *run);
  return history;
}

absl::StatusOr<Logs> Model::evaluate(std::shared_ptr<const data::Dataset> data,
                                     EvalOptions options) {
  RETURN_IF_ERROR(CheckPrepared("evaluate"));
  RETURN_IF_ERROR(CheckDataset("evaluate", data, "the data"));
  RETURN_IF_ERROR(CheckEvalOptions("evaluate", options));
  Logs result;
  absl::Status status = RunOnRanks([&](dist::Context& ctx) -> absl::Status {
    std::unique_ptr<RankRun> run = Build(ctx, /*wrapped_by_data_parallel=*/false);
    std::vector<std::unique_ptr<Callback>> callbacks = MakeCallbacks(options.callbacks, 0);
    RunState state;
    state.ctx = &ctx;
    state.network = run->network.get();
    CallEach(callbacks, "on_eval_begin", [&](Callback& c) { c.on_eval_begin(state); });
    Logs logs = EvaluateOnRank(ctx, *run->network, loss_, run->metrics, data, options.batch_size,
                               options.num_workers, options.bf16, options.batch_transform);
    CallEach(callbacks, "on_eval_end", [&](Callback& c) { c.on_eval_end(state, logs); });
    if (!have_weights_) Keep(ctx, *run);
    if (!spawned_ || LocalRank(ctx) == 0) result = std::move(logs);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<nn::Tensor> Model::predict(std::shared_ptr<const data::Dataset> data,
                                          EvalOptions options) {
  RETURN_IF_ERROR(CheckDataset("predict", data, "the data"));
  RETURN_IF_ERROR(CheckEvalOptions("predict", options));
  nn::Tensor result;
  absl::Status status = RunOnRanks([&](dist::Context& ctx) -> absl::Status {
    nn::Tensor all = PredictOnRank(ctx, data, options);
    if (!spawned_ || LocalRank(ctx) == 0) result = std::move(all);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

nn::Tensor Model::PredictOnRank(dist::Context& ctx,
                                const std::shared_ptr<const data::Dataset>& dataset,
                                const EvalOptions& options) {
  std::unique_ptr<RankRun> run = Build(ctx, /*wrapped_by_data_parallel=*/false);
  nn::Module& network = *run->network;
  network.eval();
  nn::NoGradGuard no_grad;
  const int world = ctx.world_size();
  data::DistributedOptions so = SamplerOptions(ctx, dataset->size(), options.batch_size);
  so.shuffle = false;
  so.tail = data::DistributedTail::kUneven;
  // Every rank's dataset indices, from the samplers' (host-only) plans.
  std::vector<std::vector<int64_t>> indices(static_cast<size_t>(world));
  int64_t max_rows = 0;
  for (int r = 0; r < world; ++r) {
    data::DistributedOptions other = so;
    other.rank = r;
    data::DistributedBatchSampler plan(other);
    while (auto b = plan.next()) indices[r].insert(indices[r].end(), b->begin(), b->end());
    max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(indices[r].size()));
  }
  data::DataLoader loader(dataset, std::make_shared<data::DistributedBatchSampler>(so),
                          LoaderOptions(ctx, options.num_workers, options.batch_transform));
  std::vector<nn::Tensor> outputs;
  while (auto batch = loader.next()) {
    std::optional<nn::AutocastGuard> autocast;
    if (options.bf16) autocast.emplace(nn::kBFloat16);
    outputs.push_back(network(batch->data).to(nn::kFloat32).to(nn::Device::CPU()));
  }
  // The output's shape per example, from rank 0 (kUneven gives rank 0 the most rows).
  std::vector<int64_t> shape_code(9, 0);
  if (!outputs.empty()) {
    const nn::Shape& s = outputs.front().shape();
    TANDEM_CHECK(s.size() >= 1 && s.size() <= 8, "hapi::Model::predict: output shape ",
                 nn::ShapeToString(s), " has ", s.size(), " dims; 1 to 8 are supported");
    shape_code[0] = static_cast<int64_t>(s.size());
    for (size_t d = 1; d < s.size(); ++d) shape_code[d] = s[d];
  }
  nn::Tensor code = nn::from_vector(shape_code, {9}, {.dtype = nn::kInt64}).to(ctx.device());
  ctx.communicator().broadcast(code, 0);
  shape_code = code.to_vector<int64_t>();
  nn::Shape example_shape;
  int64_t per_example = 1;
  for (int64_t d = 1; d < shape_code[0]; ++d) {
    example_shape.push_back(shape_code[d]);
    per_example *= shape_code[d];
  }
  // This rank's rows, padded to max_rows, gathered from every rank.
  std::vector<float> mine(static_cast<size_t>(max_rows * per_example), 0.0f);
  size_t at = 0;
  for (const nn::Tensor& o : outputs) {
    TANDEM_CHECK(o.numel() == o.size(0) * per_example, "hapi::Model::predict: output shape ",
                 nn::ShapeToString(o.shape()), " differs between batches or ranks");
    const std::vector<float> v = o.to_vector<float>();
    std::copy(v.begin(), v.end(), mine.begin() + static_cast<std::ptrdiff_t>(at));
    at += v.size();
  }
  nn::Tensor gathered = ctx.communicator().all_gather(
      nn::from_vector(mine, {static_cast<int64_t>(mine.size())}, {.dtype = nn::kFloat32})
          .to(ctx.device()));
  const std::vector<float> all = gathered.to_vector<float>();
  const int64_t n = dataset->size();
  std::vector<float> ordered(static_cast<size_t>(n * per_example));
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < indices[r].size(); ++i) {
      const auto src = all.begin() + (static_cast<int64_t>(r) * max_rows + static_cast<int64_t>(i)) *
                                         per_example;
      std::copy(src, src + per_example,
                ordered.begin() + indices[r][i] * per_example);
    }
  }
  nn::Shape shape = {n};
  shape.insert(shape.end(), example_shape.begin(), example_shape.end());
  return nn::from_vector(ordered, shape, {.dtype = nn::kFloat32});
}

absl::Status Model::Materialize() {
  if (have_weights_) return absl::OkStatus();
  std::shared_ptr<nn::Module> net = network_();
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  weights_ = HostState(*net);
  have_weights_ = true;
  return absl::OkStatus();
}

absl::StatusOr<nn::StateDict> Model::state_dict() {
  RETURN_IF_ERROR(Materialize());
  return weights_;
}

absl::StatusOr<ModelSummary> Model::summary(const nn::Shape& input_shape) {
  const nn::Generator generator = nn::thread_generator();
  std::shared_ptr<nn::Module> net;
  try {
    net = network_();
  } catch (const std::exception& e) {
    nn::thread_generator() = generator;
    return absl::InvalidArgumentError(
        absl::StrCat("hapi::Model::summary: the network factory threw: ", e.what()));
  }
  nn::thread_generator() = generator;
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  return Summary(*net, input_shape);
}

}  // namespace tandem::hapi
