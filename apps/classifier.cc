// The data-parallel classifier training loop of train_mnist and train_cifar10:
// progress output, evaluation, metrics rows, per-epoch checkpoints and resume
// (see common.h).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "apps/common.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "nn/autocast.h"
#include "nn/error.h"
#include "nn/graph.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/safetensors.h"
#include "optim/lr_scheduler.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/checkpoint_manager.h"
#include "spawn/train/zero_redundancy_optimizer.h"
#include "spawn/signals.h"

namespace tandem::apps {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// "1:05" or "1:02:03".
std::string FormatDuration(double seconds) {
  const int64_t s = seconds > 0 && std::isfinite(seconds) ? static_cast<int64_t>(seconds + 0.5) : 0;
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

// The first n examples of a dataset (--train_limit / --test_limit).
class PrefixDataset : public data::Dataset {
 public:
  PrefixDataset(std::shared_ptr<const data::Dataset> base, int64_t n)
      : base_(std::move(base)), n_(std::min(n, base_->size())) {}
  int64_t size() const override { return n_; }
  data::Example get(int64_t index) const override {
    TANDEM_CHECK(index >= 0 && index < n_, "PrefixDataset: index ", index, " out of range [0, ",
                 n_, ")");
    return base_->get(index);
  }

 private:
  std::shared_ptr<const data::Dataset> base_;
  int64_t n_;
};

// The end of an epoch, every rank: each rank's median step time, median busy
// time (the step minus its time in collectives: the ranks of a data-parallel
// step wait for each other, so their step times are alike and the busy time is
// what tells a slow rank) and time in collectives, gathered; rank 0 logs them,
// the share of the gradients' all-reduce that ran behind backward, and the
// slowest rank by busy time when it is more than 10% slower than the median rank.
void LogStragglers(dist::Context& ctx, int epoch, std::vector<double> step_ms,
                   std::vector<double> busy_ms, double waited_s,
                   const dist::DataParallel::OverlapStats& now,
                   const dist::DataParallel::OverlapStats& before) {
  auto median_of = [](std::vector<double>& v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  nn::Tensor mine = nn::from_vector<double>(
      {median_of(step_ms), median_of(busy_ms), waited_s, now.comm_s - before.comm_s,
       now.hidden_s - before.hidden_s},
      {5}, {.dtype = nn::kFloat64, .device = ctx.device()});
  const std::vector<double> all = ctx.communicator().all_gather(mine).to_vector<double>();
  if (ctx.rank() != 0) return;
  constexpr int kFields = 5;
  const int world = ctx.world_size();
  std::string ranks;
  double comm = 0, hidden = 0;
  std::vector<double> busy;
  // GPU ranks: collectives return once queued, so busy time is host time and
  // says nothing about a slow device.
  const bool gpu = ctx.device().is_cuda();
  for (int r = 0; r < world; ++r) {
    const double* f = &all[kFields * r];
    if (gpu) {
      absl::StrAppendFormat(&ranks, "%srank %d %.1f ms/step", r ? "; " : "", r, f[0]);
    } else {
      absl::StrAppendFormat(&ranks, "%srank %d %.1f ms/step (%.1f ms busy), %.2f s in collectives",
                            r ? "; " : "", r, f[0], f[1], f[2]);
    }
    comm += f[3];
    hidden += f[4];
    busy.push_back(f[1]);
  }
  // The median rank (the mean of the middle two for an even count).
  std::vector<double> sorted = busy;
  std::sort(sorted.begin(), sorted.end());
  const double mid = world % 2 ? sorted[world / 2] : (sorted[world / 2 - 1] + sorted[world / 2]) / 2;
  const int slowest = static_cast<int>(std::max_element(busy.begin(), busy.end()) - busy.begin());
  std::string straggler = gpu ? "stragglers not measured on GPU ranks (host time)"
                              : "no straggler (every rank's busy time within 10% of the median)";
  if (!gpu && world > 1 && mid > 0 && busy[slowest] > 1.1 * mid) {
    straggler = absl::StrFormat("straggler: rank %d, busy %.0f%% longer than the median rank",
                                slowest, (busy[slowest] / mid - 1) * 100);
  }
  ctx.log().Info("epoch {} ranks: {}; gradient all-reduce hidden under backward: {}; {}", epoch,
                 ranks,
                 gpu ? std::string("not measured on GPU ranks (device time)")
                 : comm > 0 ? absl::StrFormat("%.0f%% of %.2f s", 100 * hidden / comm, comm)
                            : std::string("none (no reduction timed)"),
                 straggler);
}

// Rows of --metrics (rank 0 only).
class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, bool append) : path_(path) {
    if (path.empty()) return;
    jsonl_ = absl::EndsWith(path, ".jsonl");
    const bool fresh = !append || !std::filesystem::exists(path) ||
                       std::filesystem::file_size(path) == 0;
    out_.open(path, fresh ? std::ios::trunc : std::ios::app);
    TANDEM_CHECK(out_.good(), "--metrics: cannot open \"", path, "\" for writing");
    if (fresh && !jsonl_) out_ << "dataset,epoch,step,loss,accuracy,samples_per_s,wall_s,lr\n";
    out_.flush();
  }
  void Row(const std::string& dataset, int epoch, int64_t step, double loss, double accuracy,
           double samples_per_s, double wall_s, double lr) {
    if (path_.empty()) return;
    if (jsonl_) {
      out_ << absl::StrFormat(
          "{\"dataset\": \"%s\", \"epoch\": %d, \"step\": %d, \"loss\": %.6f, \"accuracy\": %.6f, "
          "\"samples_per_s\": %.1f, \"wall_s\": %.3f, \"lr\": %.6g}\n",
          dataset, epoch, step, loss, accuracy, samples_per_s, wall_s, lr);
    } else {
      out_ << absl::StrFormat("%s,%d,%d,%.6f,%.6f,%.1f,%.3f,%.6g\n", dataset, epoch, step, loss,
                              accuracy, samples_per_s, wall_s, lr);
    }
    out_.flush();
    TANDEM_CHECK(out_.good(), "--metrics: writing \"", path_, "\" failed");
  }

 private:
  std::string path_;
  bool jsonl_ = false;
  std::ofstream out_;
};

// Rank 0's console progress: a bar redrawn in place on a terminal, plain log
// lines every --log_every steps otherwise.
class Progress {
 public:
  Progress(const dist::Context& ctx, const RunFlags& flags)
      : ctx_(ctx), flags_(flags), tty_(ctx.rank() == 0 && ::isatty(STDERR_FILENO)) {}
  bool tty() const { return tty_; }

  // After step `k` (1-based) of `total` in epoch `epoch` (1-based).
  void Update(int epoch, int64_t k, int64_t total, double loss, double samples_per_s,
              double eta_s) {
    if (ctx_.rank() != 0) return;
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(kWidth * k / std::max<int64_t>(total, 1));
      std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
      std::cerr << absl::StrFormat("\r\033[Kepoch %d/%d [%s] %d/%d loss %.4f %.0f samples/s ETA %s",
                                   epoch, flags_.epochs, bar, k, total, loss, samples_per_s,
                                   FormatDuration(eta_s))
                << std::flush;
    } else {
      ctx_.log().Info("epoch {}/{} step {}/{} loss {} {} samples/s ETA {}", epoch, flags_.epochs,
                      k, total, absl::StrFormat("%.4f", loss),
                      absl::StrFormat("%.0f", samples_per_s), FormatDuration(eta_s));
    }
  }
  // Clears the bar before a log line.
  void Clear() {
    if (tty_) std::cerr << "\r\033[K" << std::flush;
  }

 private:
  const dist::Context& ctx_;
  const RunFlags& flags_;
  bool tty_;
};

// Test accuracy: each rank evaluates its shard of the test set, every image
// exactly once over the ranks (DistributedTail::kUneven, in order); correct and
// total counts are summed over the ranks.
double Evaluate(dist::Context& ctx, nn::Module& model, const data::Dataset& test,
                const data::Transform* batch_transform, bool bf16) {
  nn::NoGradGuard no_grad;
  model.eval();
  // 100 images a batch: the activations of 500 (LeNet: 31 MB per conv output,
  // kept in the host allocator's cache afterwards) raised train_mnist's peak RSS
  // from 130 MB to 290 MB per rank, for no faster evaluation.
  constexpr int64_t kBatch = 100;
  data::DistributedBatchSampler shard({.dataset_size = test.size(),
                                       .batch_size = kBatch,
                                       .num_replicas = ctx.world_size(),
                                       .rank = ctx.rank(),
                                       .shuffle = false,
                                       .tail = data::DistributedTail::kUneven});
  // Summed on the device: one host read per evaluation, not one per batch.
  nn::Tensor correct = nn::zeros({}, {.device = ctx.device()});
  int64_t seen = 0;
  while (std::optional<std::vector<int64_t>> indices = shard.next()) {
    std::vector<data::Example> examples;
    for (int64_t j : *indices) examples.push_back(test.get(j));
    seen += static_cast<int64_t>(indices->size());
    data::Batch batch = data::Collate(examples, *indices);
    if (batch_transform != nullptr) {
      nn::Generator unused{};
      batch.data = (*batch_transform)(batch.data, unused);
    }
    nn::Tensor logits;
    {
      nn::AutocastGuard autocast(bf16 ? nn::kBFloat16 : nn::kFloat32);
      logits = model.forward(batch.data.to(ctx.device())).to(nn::kFloat32);
    }
    correct.add_(nn::accuracy(logits, batch.target.to(ctx.device())) *
                 static_cast<double>(indices->size()));
  }
  model.train();
  nn::Tensor counts = nn::from_vector<double>({std::round(correct.item()), static_cast<double>(seen)},
                                              {2}, {.device = ctx.device()});
  ctx.communicator().all_reduce(counts, dist::ReduceOp::kSum);
  const std::vector<double> total = counts.to_vector<double>();
  return total[1] > 0 ? total[0] / total[1] : 0.0;
}

// Where a run starts: zeros, or what the newest checkpoint says.
struct Progression {
  int epoch = 0;  // epochs finished
  int64_t step = 0;
  double best_accuracy = 0;
  double elapsed_s = 0;  // wall time of the earlier parts of the run
  // A checkpoint written mid-epoch: steps done in epoch `epoch` and the sum of
  // their losses (for the epoch's mean loss); 0 at an epoch end.
  int64_t epoch_step = 0;
  double epoch_loss_sum = 0;
};

template <typename T>
T ExtraOr(const dist::TrainingState& state, const std::string& key, const std::string& path) {
  absl::StatusOr<T> value = dist::ExtraValue<T>(state.extra, key, path);
  TANDEM_CHECK(value.ok(), "--resume: ", value.status().ToString());
  return *value;
}

// The app entries of a checkpoint (dist::CheckpointManager writes the rest:
// model, optimizer, sampler position, step, every rank's generator).
// epoch_loss_sums: every rank's sum of its losses in the epoch so far (each
// rank restores its own, so the epoch's mean loss continues bit for bit).
void SetExtra(dist::TrainingState& state, const RunFlags& flags, const ClassifierData& data,
              const Progression& at, int64_t epoch_step,
              const std::vector<float>& epoch_loss_sums, double elapsed_s) {
  state.extra.clear();  // no entry of an earlier save stays
  state.extra["program"] = flags.program;
  state.extra["dataset"] = data.name;
  state.extra["epoch"] = int64_t{at.epoch};
  state.extra["epoch_step"] = epoch_step;
  for (size_t r = 0; r < epoch_loss_sums.size(); ++r) {
    state.extra[absl::StrCat("epoch_loss_sum.", r)] = static_cast<double>(epoch_loss_sums[r]);
  }
  state.extra["best_accuracy"] = at.best_accuracy;
  state.extra["elapsed_s"] = elapsed_s;
}

// Every rank: loads the newest checkpoint that loads (older ones when the
// newest is damaged) into the model, the optimizer and the loader; the file
// must have been written by this program.
std::optional<Progression> LoadRunCheckpoint(dist::Context& ctx, const RunFlags& flags,
                                             dist::CheckpointManager& checkpoints,
                                             nn::Module& model, optim::Optimizer& optimizer,
                                             data::DataLoader& loader) {
  Progression at;
  dist::TrainingState state{.model = &model, .optimizer = &optimizer, .loader = &loader,
                            .step = &at.step};
  const absl::StatusOr<std::string> path =
      checkpoints.Restore(state, {.expect = {{"program", flags.program}}});
  dist::ThrowIfError(path.status(), "--resume: ");
  if (path->empty()) {
    ctx.log().Info("--resume: no checkpoint in {}; starting from the beginning",
                   flags.checkpoint_dir);
    return std::nullopt;
  }
  at.epoch = static_cast<int>(ExtraOr<int64_t>(state, "epoch", *path));
  at.best_accuracy = ExtraOr<double>(state, "best_accuracy", *path);
  at.elapsed_s = ExtraOr<double>(state, "elapsed_s", *path);
  if (state.extra.contains("epoch_step")) {  // files of earlier versions: epoch ends only
    at.epoch_step = ExtraOr<int64_t>(state, "epoch_step", *path);
    // Absent when the file comes from another number of ranks (not bit for bit then).
    const std::string key = absl::StrCat("epoch_loss_sum.", ctx.rank());
    if (state.extra.contains(key)) at.epoch_loss_sum = ExtraOr<double>(state, key, *path);
  }
  if (ctx.rank() == 0) {
    ctx.log().Info("resumed from {}: {} epoch(s) done{}, step {}, best test accuracy {}", *path,
                   at.epoch,
                   at.epoch_step > 0
                       ? absl::StrCat(" and ", at.epoch_step, " step(s) of epoch ", at.epoch + 1)
                       : std::string(),
                   at.step, absl::StrFormat("%.4f", at.best_accuracy));
  }
  return at;
}

// One rank's training run: what TrainClassifier sets up, in this order (model,
// DataParallel, optimizer, loader, checkpoints, schedule, resume, outputs), and
// what its epochs carry on; destroyed in the reverse order.
struct ClassifierRun {
  ClassifierRun(dist::Context& ctx, const RunFlags& flags, const ClassifierData& data,
                dist::TraceRecorder* trace)
      : ctx(ctx), flags(flags), data(data), trace(trace) {}

  dist::Context& ctx;
  const RunFlags& flags;
  const ClassifierData& data;
  dist::TraceRecorder* trace;
  const Clock::time_point start = Clock::now();
  std::shared_ptr<nn::Module> model;
  std::optional<dist::DataParallel> dp;
  std::unique_ptr<optim::Optimizer> optimizer;  // null with --zero
  // --zero: the sharded optimizer (after dp: it goes first) and, while a
  // checkpoint is taken, its state gathered into an unsharded optimizer.
  std::optional<dist::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> consolidated;
  // The optimizer whose lr the schedule sets and the reports read.
  optim::Optimizer& optim() { return zero ? zero->optimizer() : *optimizer; }
  std::optional<nn::CrossEntropyLoss> loss_fn;
  std::optional<data::DataLoader> loader;
  std::optional<dist::CheckpointManager> checkpoints;
  // --lr_schedule=cosine (null: a constant lr). Its position is the global step:
  // a resumed run takes it from the checkpoint's step (the file holds no
  // "sched." entries), as the lr of every step always was.
  std::unique_ptr<optim::LRScheduler> schedule;
  Progression at;
  dist::TrainingState state;
  int64_t steps_per_epoch = 0;
  int64_t global_batch = 0;
  std::optional<MetricsWriter> metrics;
  std::optional<Progress> progress;
  int64_t redraw_every = 0;
  std::unique_ptr<dist::SummaryWriter> tensorboard;
  bool tb_on = false;
  int slow_ms = 0;  // --test_slow_rank: this rank's sleep in every step
  TrainResult result;
  double train_seconds = 0;
  int64_t trained_samples = 0;
  // --cuda_graph: the training step captured after the first full batch's eager
  // step (after any --resume: nothing loads into the optimizer later), its static
  // input and label tensors, and the loss tensor each replay rewrites. Last, so
  // the graph goes before the optimizer, DataParallel and model it replays.
  nn::Tensor static_data, static_target, graph_loss;
  std::unique_ptr<nn::CudaGraph> graph;
};

// Where one epoch stands between its steps.
struct EpochRun {
  int epoch = 0;  // 0-based
  Clock::time_point start;
  nn::Tensor loss_sum;    // the epoch's losses so far (this rank)
  nn::Tensor window_sum;  // the losses since the last progress line
  int64_t window = 0;
  int64_t k = 0;        // steps done in the epoch
  int64_t first_k = 0;  // where this process started it (a mid-epoch resume: > 0)
  // The epoch's straggler and overlap summary (every rank takes part).
  std::vector<double> step_ms, busy_ms;  // busy: the step minus its time in collectives
  double waited_at_start = 0;
  dist::DataParallel::OverlapStats overlap_at_start;
  // --tensorboard_dir: the losses and time of the current window of steps.
  nn::Tensor tb_sum;
  int64_t tb_window = 0;
  Clock::time_point tb_window_start;
};

// Moves the schedule to global step `step` and sets the optimizer's lr to its
// value there: one step() per training step, a jump to the checkpoint's step
// after --resume.
void ScheduleAt(optim::LRScheduler& schedule, int64_t step) {
  if (schedule.last_epoch() + 1 == step) {
    schedule.step();
  } else if (schedule.last_epoch() != step) {
    std::map<std::string, double> position = schedule.state_dict();
    position["last_epoch"] = static_cast<double>(step);
    dist::ThrowIfError(schedule.load_state_dict(position), "the learning-rate schedule: ");
  }
}

// The model (every rank the same), DataParallel, the optimizer, the loader of
// this rank's shard and the checkpoint manager.
void BuildModelAndData(ClassifierRun& run,
                       const std::function<std::shared_ptr<nn::Module>()>& make_model) {
  const RunFlags& flags = run.flags;
  run.ctx.set_trace(run.trace);
  run.model = make_model();
  if (!flags.init_from.empty()) {
    dist::ThrowIfError(nn::LoadSafetensors(flags.init_from, *run.model).status(), "--init_from: ");
  }
  dist::CommHook comm_hook;  // empty: DataParallel's own all-reduce
  if (flags.comm_hook == "bf16") comm_hook = dist::Bf16CompressHook();
  if (flags.comm_hook == "fp16") comm_hook = dist::Fp16CompressHook();
  run.dp.emplace(*run.model, run.ctx,
                 dist::DataParallelOptions{.comm_hook = std::move(comm_hook)});
  if (flags.zero) {
    run.zero.emplace(*run.dp, [name = flags.optimizer, lr = flags.lr](std::vector<nn::Tensor> p) {
      return MakeOptimizer(name, std::move(p), lr);
    });
  } else {
    run.optimizer = MakeOptimizer(flags.optimizer, run.model->parameters(), flags.lr);
  }
  run.loss_fn.emplace();
  auto sampler = std::make_shared<data::DistributedBatchSampler>(
      run.data.train->size(), flags.batch_size, run.ctx.world_size(), run.ctx.rank(),
      /*shuffle=*/true, /*drop_last=*/false, flags.seed);
  run.loader.emplace(run.data.train, sampler,
                     data::DataLoaderOptions{.num_workers = flags.num_workers,
                                             .prefetch = std::max(2, 2 * flags.num_workers),
                                             .device = run.ctx.device(),
                                             .batch_transform = run.data.batch_transform});
  if (!flags.checkpoint_dir.empty()) run.checkpoints.emplace(run.ctx, CheckpointOptions(flags));
}

// The steps of an epoch, the learning-rate schedule over all of them (built on
// the optimizer's lr before a checkpoint loads into it), and --resume.
void ScheduleAndResume(ClassifierRun& run) {
  const RunFlags& flags = run.flags;
  // Optimizer steps: --grad_accum_steps micro-batches each (the last one may have fewer).
  const int64_t k = flags.grad_accum_steps;
  run.steps_per_epoch = (run.loader->num_batches() + k - 1) / k;
  if (flags.max_steps_per_epoch > 0) {
    run.steps_per_epoch = std::min(run.steps_per_epoch, flags.max_steps_per_epoch);
  }
  if (flags.lr_schedule == "cosine") {
    const int64_t total_steps = std::max<int64_t>(run.steps_per_epoch * flags.epochs, 1);
    run.schedule = std::make_unique<optim::CosineAnnealingLR>(run.optim(), total_steps);
  }
  if (flags.resume) {
    // --zero: the file holds the unsharded state; each rank keeps its shards of it.
    std::unique_ptr<optim::Optimizer> unsharded = run.zero ? run.zero->MakeUnsharded() : nullptr;
    if (std::optional<Progression> loaded =
            LoadRunCheckpoint(run.ctx, flags, *run.checkpoints, *run.model,
                              run.zero ? *unsharded : *run.optimizer, *run.loader)) {
      run.at = *loaded;
      if (run.zero) dist::ThrowIfError(run.zero->LoadFrom(*unsharded), "--resume: ");
    }
  }
  run.state = {.model = run.model.get(), .optimizer = run.optimizer.get(),
               .loader = &*run.loader, .step = &run.at.step};
}

// Rank 0's metrics rows, progress and TensorBoard file, and the test hook of a
// slow rank (--test_slow_rank).
void OpenOutputs(ClassifierRun& run) {
  dist::Context& ctx = run.ctx;
  const RunFlags& flags = run.flags;
  run.global_batch = int64_t{flags.batch_size} * ctx.world_size() * flags.grad_accum_steps;
  run.metrics.emplace(ctx.rank() == 0 ? flags.metrics : "", flags.resume);
  run.progress.emplace(ctx, flags);
  run.redraw_every = run.progress->tty() ? 5 : flags.log_every;
  // --tensorboard_dir: rank 0 writes; every rank takes part in the step-time
  // gather every log_every steps (the flag is the same on every rank).
  run.tensorboard = OpenTensorBoard(ctx, flags);
  // A resumed run repeats the steps after its checkpoint: TensorBoard drops the
  // earlier file's events from here on.
  if (run.tensorboard && flags.resume && run.at.step > 0) {
    run.tensorboard->AddSessionStart(run.at.step);
  }
  run.tb_on = !flags.tensorboard_dir.empty();
  if (flags.test_slow_rank == ctx.rank()) run.slow_ms = flags.test_slow_ms;
  run.result.best_accuracy = run.at.best_accuracy;
}

// Epoch `epoch` from its start, or (resume_mid_epoch) from the step of the
// checkpoint, where the loader already stands.
EpochRun StartEpoch(ClassifierRun& run, int epoch, bool resume_mid_epoch) {
  dist::Context& ctx = run.ctx;
  if (!resume_mid_epoch) run.loader->set_state({.epoch = epoch, .position = 0});
  run.loader->start_epoch();
  EpochRun e;
  e.epoch = epoch;
  e.start = Clock::now();
  e.loss_sum = nn::zeros({1}, {.device = ctx.device()});
  e.window_sum = nn::zeros({1}, {.device = ctx.device()});
  if (resume_mid_epoch) {
    e.k = run.at.epoch_step;
    e.loss_sum = nn::from_vector<float>({static_cast<float>(run.at.epoch_loss_sum)}, {1},
                                        {.device = ctx.device()});
  }
  e.first_k = e.k;
  e.step_ms.reserve(static_cast<size_t>(run.steps_per_epoch - e.k));  // no allocation in a step
  e.busy_ms.reserve(static_cast<size_t>(run.steps_per_epoch - e.k));
  e.waited_at_start = ctx.communicator().waited_seconds();
  e.overlap_at_start = run.dp->overlap_stats();
  e.tb_sum = nn::zeros({1}, {.device = ctx.device()});
  e.tb_window_start = Clock::now();
  return e;
}

// The micro-batches of step e.k: --grad_accum_steps, fewer in the epoch's last
// step when the epoch's batches do not divide by it.
int64_t MicroBatchesOf(const ClassifierRun& run, const EpochRun& e) {
  const int64_t k = run.flags.grad_accum_steps;
  return std::min<int64_t>(k, run.loader->num_batches() - e.k * k);
}

// Forward (under --bf16's autocast) and backward of one micro-batch, its loss
// divided by the step's micro-batch count (the gradients then sum to those of
// one batch of all of them); returns the undivided loss.
nn::Tensor ForwardBackward(ClassifierRun& run, const data::Batch& batch, int64_t micro) {
  nn::Tensor loss;
  {
    dist::TraceSpan span(run.ctx, "forward");
    nn::AutocastGuard autocast(run.flags.bf16 ? nn::kBFloat16 : nn::kFloat32);
    loss = (*run.loss_fn)((*run.dp)(batch.data), batch.target);
  }
  {
    dist::TraceSpan span(run.ctx, "backward");
    (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
  }
  return loss;
}

// --cuda_graph: records one training step (zero_grad, forward and loss,
// backward with DataParallel's bucket all-reduces, optimizer step) on static
// tensors shaped like `batch`, after the eager step on it. Nothing runs.
void CaptureStep(ClassifierRun& run, const data::Batch& batch) {
  run.static_data = nn::empty_like(batch.data);
  run.static_target = nn::empty_like(batch.target);
  run.graph = std::make_unique<nn::CudaGraph>(run.ctx.device());
  data::Batch captured{.data = run.static_data, .target = run.static_target};
  run.graph->Capture([&] {
    run.optimizer->zero_grad();
    run.graph_loss = ForwardBackward(run, captured, 1).detach();
    run.optimizer->step();
  });
  if (run.ctx.rank() == 0) {
    run.progress->Clear();
    run.ctx.log().Info("--cuda_graph: training step captured ({} nodes) on batches of {}; "
                       "replayed for every full batch from here on",
                       run.graph->num_nodes(), batch.data.size(0));
  }
}

// --cuda_graph (one micro-batch a step, no --zero: ValidateOrExit refuses the
// others): a full batch once the step is captured is copied into the static
// tensors and replayed; the first full batch runs eagerly and then the step is
// captured; a partial batch (the epoch's last, when the shard does not divide)
// runs eagerly through the same model and optimizer. The loss returned after a
// replay is the graph's loss tensor, rewritten by the next replay: the caller
// adds it to its sums (on the stream) before that.
std::optional<nn::Tensor> TrainOnBatchGraphed(ClassifierRun& run) {
  std::optional<data::Batch> batch;
  {
    dist::TraceSpan span(run.ctx, "data");
    batch = run.loader->next();
  }
  if (!batch) return std::nullopt;
  const bool full = batch->data.size(0) == run.flags.batch_size;
  if (run.graph && full && batch->data.shape() == run.static_data.shape()) {
    run.static_data.copy_(batch->data);
    run.static_target.copy_(batch->target);
    run.graph->Replay();
    return run.graph_loss;
  }
  run.optimizer->zero_grad();
  const nn::Tensor loss = ForwardBackward(run, *batch, 1).detach();
  {
    dist::TraceSpan span(run.ctx, "optimizer");
    run.optimizer->step();
  }
  if (!run.graph && full) CaptureStep(run, *batch);
  return loss;
}

// One optimizer step at the schedule's lr of the global step: its micro-batches
// (all but the last under DataParallel::no_sync(), so the gradients are reduced
// once), then the update. Returns the mean loss of the micro-batches, nullopt
// when the loader has no batch left.
std::optional<nn::Tensor> TrainOnBatches(ClassifierRun& run, const EpochRun& e) {
  if (run.schedule) ScheduleAt(*run.schedule, run.at.step);
  // The lr is set before a replay too: the optimizer's pre-replay hook uploads it.
  if (run.flags.cuda_graph) return TrainOnBatchGraphed(run);
  const int64_t micro = MicroBatchesOf(run, e);
  nn::Tensor loss_sum;
  for (int64_t i = 0; i < micro; ++i) {
    std::optional<data::Batch> batch;
    {
      dist::TraceSpan span(run.ctx, "data");
      batch = run.loader->next();
    }
    if (!batch && i == 0) return std::nullopt;
    // The step's count comes from the loader's, so only a loader that lies ends early.
    TANDEM_CHECK(batch.has_value(), "--grad_accum_steps: the loader ran out after ", i, " of ",
                 micro, " micro-batches of step ", run.at.step);
    if (i == 0) run.zero ? run.zero->zero_grad() : run.optimizer->zero_grad();
    std::optional<dist::DataParallel::NoSyncGuard> no_sync;
    if (i + 1 < micro) no_sync.emplace(&*run.dp);
    const nn::Tensor loss = ForwardBackward(run, *batch, micro);
    loss_sum = i == 0 ? loss.detach() : loss_sum + loss.detach();
  }
  {
    dist::TraceSpan span(run.ctx, "optimizer");
    run.zero ? run.zero->step() : run.optimizer->step();
  }
  return micro > 1 ? loss_sum / static_cast<double>(micro) : loss_sum;
}

// Adds the step's loss to the epoch's sum, the progress window and the
// TensorBoard window.
void AccumulateLoss(const ClassifierRun& run, EpochRun& e, const nn::Tensor& loss) {
  nn::NoGradGuard no_grad;
  nn::Tensor value = loss.detach().reshape({1});
  e.loss_sum.add_(value);
  e.window_sum.add_(value);
  ++e.window;
  if (run.tb_on) {
    e.tb_sum.add_(value);
    ++e.tb_window;
  }
}

// --tensorboard_dir, every --log_every steps and at the epoch's end: every rank's
// mean loss and step time over the window, gathered; rank 0 writes them.
void LogTensorBoardWindow(ClassifierRun& run, EpochRun& e) {
  dist::Context& ctx = run.ctx;
  const double step_ms = SecondsSince(e.tb_window_start) * 1e3 / static_cast<double>(e.tb_window);
  nn::Tensor mine = nn::from_vector<double>(
      {static_cast<double>(e.tb_sum.item()) / static_cast<double>(e.tb_window), step_ms}, {2},
      {.dtype = nn::kFloat64, .device = ctx.device()});
  const std::vector<double> all = ctx.communicator().all_gather(mine).to_vector<double>();
  if (run.tensorboard) {
    const int64_t step = run.at.step;
    double loss_mean = 0;
    for (int r = 0; r < ctx.world_size(); ++r) loss_mean += all[2 * r] / ctx.world_size();
    run.tensorboard->AddScalar("train/loss", loss_mean, step);
    run.tensorboard->AddScalar("train/learning_rate", run.optim().lr(), step);
    run.tensorboard->AddScalar("train/samples_per_s",
                               static_cast<double>(e.tb_window * run.global_batch) /
                                   std::max(SecondsSince(e.tb_window_start), 1e-9),
                               step);
    for (int r = 0; r < ctx.world_size(); ++r) {
      run.tensorboard->AddScalar(absl::StrCat("step_time_ms/rank_", r), all[2 * r + 1], step);
    }
  }
  e.tb_sum.zero_();
  e.tb_window = 0;
  e.tb_window_start = Clock::now();
}

// Rank 0: the progress bar or line after step e.k of the epoch, with the mean
// loss since the last one.
void ShowProgress(ClassifierRun& run, EpochRun& e) {
  const int64_t done = e.k + 1;
  const double elapsed = SecondsSince(e.start);
  const double rate = static_cast<double>(done * run.global_batch) / std::max(elapsed, 1e-9);
  const double eta = elapsed / static_cast<double>(done) *
                     static_cast<double>(run.steps_per_epoch - done);
  run.progress->Update(e.epoch + 1, done, run.steps_per_epoch, e.window_sum.item() / e.window,
                       rate, eta);
  e.window_sum.zero_();
  e.window = 0;
}

// --zero, every rank before a save: the state gathered into an unsharded
// optimizer for the file (it resumes with or without --zero, on any rank count).
void GatherShardedState(ClassifierRun& run, dist::TrainingState& state) {
  if (!run.zero) return;
  run.consolidated = run.zero->Consolidated();
  state.optimizer = run.consolidated.get();
}

// Periodic checkpoints and stop signals, every rank after every step: a save
// when one is due or a stop asks for it (then StoppedError after it); without
// --checkpoint_dir a stop signal throws StoppedError at once.
void CheckpointOrStop(ClassifierRun& run, const EpochRun& e) {
  dist::Context& ctx = run.ctx;
  if (run.checkpoints) {
    dist::TraceSpan span(ctx, "checkpoint");
    const absl::Status saved =
        run.checkpoints->AtStepBoundary(run.state, [&](dist::TrainingState& s) {
          run.progress->Clear();
          GatherShardedState(run, s);
          SetExtra(s, run.flags, run.data, run.at, e.k + 1,
                   ctx.communicator().all_gather(e.loss_sum).to_vector<float>(),
                   run.at.elapsed_s + SecondsSince(run.start));
        });
    run.consolidated.reset();
    dist::ThrowIfError(saved, "saving a checkpoint: ");
  } else if (ctx.AtStepBoundary(run.at.step).stop) {
    run.progress->Clear();
    throw dist::StoppedError(
        absl::StrCat("stopped at step ", run.at.step, " (stop signal; no --checkpoint_dir)"),
        run.at.step);
  }
}

enum class StepEnd { kNext, kNoBatch, kStopAtStep };

// Step e.k of the epoch (global step run.at.step): the batch, the training
// step, the loss windows and their outputs, checkpoints and stops.
StepEnd TrainStep(ClassifierRun& run, EpochRun& e) {
  dist::Context& ctx = run.ctx;
  ctx.check_stop();
  const Clock::time_point step_start = Clock::now();
  const double waited_before_step = ctx.communicator().waited_seconds();
  if (run.trace != nullptr) run.trace->BeginStep(ctx.rank(), run.at.step);
  const std::optional<nn::Tensor> step_loss = TrainOnBatches(run, e);
  if (!step_loss) return StepEnd::kNoBatch;
  const nn::Tensor& loss = *step_loss;
  if (run.slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(run.slow_ms));
  ++run.at.step;
  AccumulateLoss(run, e, loss);
  const bool epoch_end = e.k + 1 == run.steps_per_epoch;
  if (run.tb_on && ((e.k + 1) % run.flags.log_every == 0 || epoch_end)) {
    LogTensorBoardWindow(run, e);
  }
  if (ctx.rank() == 0 && ((e.k + 1) % run.redraw_every == 0 || epoch_end)) ShowProgress(run, e);
  CheckpointOrStop(run, e);
  e.step_ms.push_back(SecondsSince(step_start) * 1e3);
  e.busy_ms.push_back(e.step_ms.back() -
                      (ctx.communicator().waited_seconds() - waited_before_step) * 1e3);
  if (run.flags.stop_at_step > 0 && run.at.step == run.flags.stop_at_step) {
    // Every rank is here after the same step, with no collective in flight:
    // returning (not throwing) ends the run as a finished one, in every process.
    run.progress->Clear();
    run.result.stopped_at_step = run.at.step;
    return StepEnd::kStopAtStep;
  }
  return StepEnd::kNext;
}

// The end of an epoch's outputs: rank 0's log line, the metrics row and the
// TensorBoard scalars.
void ReportEpoch(ClassifierRun& run, const EpochRun& e, double epoch_loss, double accuracy,
                 double rate, double wall_s) {
  dist::Context& ctx = run.ctx;
  run.progress->Clear();
  if (ctx.rank() == 0) {
    ctx.log().Info("{} epoch {}/{}: step {} train loss {} test accuracy {} ({} samples/s, "
                   "epoch {}, total {})",
                   run.data.name, e.epoch + 1, run.flags.epochs, run.at.step,
                   absl::StrFormat("%.4f", epoch_loss), absl::StrFormat("%.4f", accuracy),
                   absl::StrFormat("%.0f", rate), FormatDuration(SecondsSince(e.start)),
                   FormatDuration(wall_s));
  }
  run.metrics->Row(run.data.name, e.epoch + 1, run.at.step, epoch_loss, accuracy, rate, wall_s,
                   run.optim().lr());
  if (run.tensorboard) {
    run.tensorboard->AddScalar("epoch/train_loss", epoch_loss, run.at.step);
    run.tensorboard->AddScalar("epoch/test_accuracy", accuracy, run.at.step);
    run.tensorboard->AddScalar("epoch/samples_per_s", rate, run.at.step);
    dist::ThrowIfError(run.tensorboard->Flush(), "--tensorboard_dir: ");
  }
}

// After the epoch's last step: the mean training loss over every rank, the
// straggler summary, evaluation, the reports and the epoch's checkpoint.
void FinishEpoch(ClassifierRun& run, EpochRun& e) {
  dist::Context& ctx = run.ctx;
  const double epoch_train_s = SecondsSince(e.start);
  run.train_seconds += epoch_train_s;
  run.trained_samples += (e.k - e.first_k) * run.global_batch;
  // The epoch's mean training loss over every rank (all ranks ran k steps).
  e.loss_sum.mul_(1.0 / static_cast<double>(std::max<int64_t>(e.k, 1)));
  ctx.communicator().all_reduce(e.loss_sum, dist::ReduceOp::kAvg);
  const double epoch_loss = e.loss_sum.item();
  LogStragglers(ctx, e.epoch + 1, e.step_ms, e.busy_ms,
                ctx.communicator().waited_seconds() - e.waited_at_start,
                run.dp->overlap_stats(), e.overlap_at_start);
  double accuracy = 0;
  {
    dist::TraceSpan span(ctx, "evaluate");
    accuracy = Evaluate(ctx, *run.model, *run.data.test, run.data.batch_transform.get(),
                        run.flags.bf16);
  }
  run.at.epoch = e.epoch + 1;
  run.at.best_accuracy = std::max(run.at.best_accuracy, accuracy);
  const double rate =
      static_cast<double>((e.k - e.first_k) * run.global_batch) / std::max(epoch_train_s, 1e-9);
  const double wall_s = run.at.elapsed_s + SecondsSince(run.start);
  ReportEpoch(run, e, epoch_loss, accuracy, rate, wall_s);
  run.result.final_accuracy = accuracy;
  run.result.final_loss = epoch_loss;
  if (run.checkpoints) {
    // The next epoch starts at its beginning: that is the position the file holds.
    run.loader->set_state({.epoch = run.at.epoch, .position = 0});
    SetExtra(run.state, run.flags, run.data, run.at, 0, {}, wall_s);
    GatherShardedState(run, run.state);
    const absl::Status saved = run.checkpoints->Save(run.state);
    run.consolidated.reset();
    dist::ThrowIfError(saved, "saving the checkpoint: ");
  }
  ++run.result.epochs_done;
}

// One epoch; false when --stop_at_step ended it (no metrics row or checkpoint
// of a partial epoch).
bool RunEpoch(ClassifierRun& run, int epoch, bool resume_mid_epoch) {
  EpochRun e = StartEpoch(run, epoch, resume_mid_epoch);
  for (; e.k < run.steps_per_epoch; ++e.k) {
    const StepEnd end = TrainStep(run, e);
    if (end == StepEnd::kNoBatch) break;
    if (end == StepEnd::kStopAtStep) return false;
  }
  FinishEpoch(run, e);
  return true;
}

// --epochs=0: the test accuracy of --init_from's weights, nothing trained.
void EvaluateOnly(ClassifierRun& run) {
  dist::TraceSpan span(run.ctx, "evaluate");
  const double accuracy = Evaluate(run.ctx, *run.model, *run.data.test,
                                   run.data.batch_transform.get(), run.flags.bf16);
  run.at.best_accuracy = accuracy;
  run.result.final_accuracy = accuracy;
  run.result.evaluated_only = true;
}

// After the last epoch (or --stop_at_step): the checkpoint write in flight, the
// --save_safetensors file, the --trace file, and what the run did.
TrainResult FinishRun(ClassifierRun& run) {
  dist::Context& ctx = run.ctx;
  if (ctx.rank() == 0) {
    int64_t state_bytes = 0;
    if (run.zero) {
      state_bytes = run.zero->state_bytes();
    } else {
      for (const auto& [key, t] : run.optimizer->state_dict().tensors) state_bytes += t.nbytes();
    }
    ctx.log().Info("optimizer state: {} bytes on rank 0 ({})", state_bytes,
                   run.zero ? absl::StrCat("sharded over ", ctx.world_size(), " ranks")
                            : std::string("unsharded"));
  }
  if (run.checkpoints) {
    const absl::Status written = run.checkpoints->Finish();
    dist::ThrowIfError(written, "saving the checkpoint: ");
  }
  if (!run.flags.save_safetensors.empty() && ctx.rank() == 0 && run.result.stopped_at_step == 0) {
    dist::ThrowIfError(nn::SaveSafetensors(run.flags.save_safetensors, *run.model,
                                           {{"format", "pt"},
                                            {"program", run.flags.program},
                                            {"step", absl::StrCat(run.at.step)}}),
                       "--save_safetensors: ");
    ctx.log().Info("model written to {}", run.flags.save_safetensors);
  }
  if (run.trace != nullptr) {
    dist::ThrowIfError(dist::WriteTrace(ctx, *run.trace, run.flags.trace), "");
    if (ctx.rank() == 0) {
      ctx.log().Info("trace of steps {} written to {}", run.flags.trace_steps, run.flags.trace);
    }
  }
  TrainResult result = run.result;
  result.best_accuracy = run.at.best_accuracy;
  result.steps = run.at.step;
  result.seconds = SecondsSince(run.start);
  result.samples_per_s =
      static_cast<double>(run.trained_samples) / std::max(run.train_seconds, 1e-9);
  result.world_size = ctx.world_size();
  result.process_index = ctx.process_index();
  return result;
}

TrainResult TrainClassifierImpl(dist::Context& ctx, const RunFlags& flags,
                                const ClassifierData& data,
                                const std::function<std::shared_ptr<nn::Module>()>& make_model,
                                dist::TraceRecorder* trace) {
  ClassifierRun run(ctx, flags, data, trace);
  BuildModelAndData(run, make_model);
  ScheduleAndResume(run);
  OpenOutputs(run);
  // A mid-epoch checkpoint: its epoch continues where the loader stands.
  bool resume_mid_epoch = run.at.epoch_step > 0;
  if (flags.epochs == 0) EvaluateOnly(run);
  for (int epoch = run.at.epoch; epoch < flags.epochs; ++epoch) {
    if (!RunEpoch(run, epoch, resume_mid_epoch)) break;
    resume_mid_epoch = false;
  }
  return FinishRun(run);
}

}  // namespace

TrainResult TrainClassifier(dist::Context& ctx, const RunFlags& flags, const ClassifierData& data,
                            const std::function<std::shared_ptr<nn::Module>()>& make_model,
                            dist::TraceRecorder* trace) {
  try {
    return TrainClassifierImpl(ctx, flags, data, make_model, trace);
  } catch (const dist::StoppedError&) {
    // The agreed stop (a stop signal): every rank throws here at the same step,
    // after the save, and collectives still work: the trace of the steps so far.
    if (trace != nullptr) {
      const absl::Status written = dist::WriteTrace(ctx, *trace, flags.trace);
      if (ctx.rank() == 0) {
        if (written.ok()) {
          ctx.log().Info("trace of the steps run written to {}", flags.trace);
        } else {
          ctx.log().Warning("--trace: {}", written.message());
        }
      }
    }
    throw;
  }
}

int RunClassifier(const RunFlags& flags, const ClassifierData& full_data,
                  const std::function<std::shared_ptr<nn::Module>()>& make_model,
                  const std::vector<std::string>& extra_rows) {
  ClassifierData data = full_data;
  if (flags.train_limit > 0) data.train = std::make_shared<PrefixDataset>(data.train, flags.train_limit);
  if (flags.test_limit > 0) data.test = std::make_shared<PrefixDataset>(data.test, flags.test_limit);
  if (!flags.checkpoint_dir.empty()) {
    CreateDirectoryOrExit(flags, "--checkpoint_dir", flags.checkpoint_dir);
  }
  std::vector<std::string> rows = {
      absl::StrCat("dataset=", data.name, " (", data.train->size(), " train, ", data.test->size(),
                   " test examples)"),
      absl::StrCat("batch=", flags.batch_size, " per rank, ", flags.batch_size * flags.world_size(),
                   " global",
                   flags.grad_accum_steps > 1
                       ? absl::StrCat(", ", flags.grad_accum_steps, " micro-batches per step (",
                                      int64_t{flags.batch_size} * flags.world_size() *
                                          flags.grad_accum_steps,
                                      " samples)")
                       : std::string()),
      absl::StrCat("optimizer=", flags.optimizer, ", lr ", flags.lr, " (", flags.lr_schedule,
                   " schedule)"),
      absl::StrCat("epochs=", flags.epochs,
                   flags.max_steps_per_epoch > 0
                       ? absl::StrCat(" (at most ", flags.max_steps_per_epoch, " steps each)")
                       : std::string())};
  rows.insert(rows.end(), extra_rows.begin(), extra_rows.end());
  PrintEnvironment(flags, rows);
  // --trace: one recorder for this process's ranks (each its own track).
  std::optional<dist::TraceRecorder> trace;
  if (!flags.trace.empty()) trace.emplace(flags.trace_window);
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::vector<TrainResult>> results = dist::spawn(
      [&](dist::Context& ctx) {
        return TrainClassifier(ctx, flags, data, make_model, trace ? &*trace : nullptr);
      },
      flags.nprocs, flags.gpus, MakeSpawnOptions(flags));
  if (!results.ok()) return ExitStatusOf(flags, results.status());
  const TrainResult& r = results->front();
  // Every rank of every process stopped at the same step: each process says so.
  if (r.stopped_at_step > 0) return StoppedAtStepExit(flags, r.stopped_at_step);
  if (r.process_index != 0) return kExitOk;  // several processes: the first one reports
  if (r.evaluated_only) {
    std::cout << absl::StrFormat("summary: %s, %d rank(s), evaluated %s (--epochs=0, nothing "
                                 "trained): test accuracy %.2f%% on %d examples\n",
                                 data.name, r.world_size, flags.init_from,
                                 100 * r.final_accuracy, data.test->size())
              << std::flush;
    return kExitOk;
  }
  if (r.epochs_done == 0) {
    std::cout << absl::StrFormat("summary: %s: nothing left to train (the checkpoint is at "
                                 "or past --epochs=%d); best test accuracy %.2f%%\n",
                                 data.name, flags.epochs, 100 * r.best_accuracy)
              << std::flush;
    return kExitOk;
  }
  std::cout << absl::StrFormat(
                   "summary: %s, %d rank(s), %d epoch(s) run (%d steps in all): best test "
                   "accuracy %.2f%%, final %.2f%%, final train loss %.4f, time %s (%.1f s), "
                   "%.0f samples/s\n",
                   data.name, r.world_size, r.epochs_done, r.steps, 100 * r.best_accuracy,
                   100 * r.final_accuracy, r.final_loss, FormatDuration(SecondsSince(start)),
                   SecondsSince(start), r.samples_per_s)
            << std::flush;
  return kExitOk;
}

}  // namespace tandem::apps
