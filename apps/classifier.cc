// The data-parallel classifier training loop of train_mnist and train_cifar10:
// progress output, evaluation, metrics rows, per-epoch checkpoints and resume
// (see common.h).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "apps/common.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "nn/autocast.h"
#include "nn/error.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/checkpoint_manager.h"
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

// Test accuracy: each rank evaluates the contiguous shard [n r / W, n (r+1) / W)
// of the test set; correct and total counts are summed over the ranks.
double Evaluate(dist::Context& ctx, nn::Module& model, const data::Dataset& test,
                const data::Transform* batch_transform, bool bf16) {
  nn::NoGradGuard no_grad;
  model.eval();
  const int64_t n = test.size();
  const int64_t begin = n * ctx.rank() / ctx.world_size();
  const int64_t end = n * (ctx.rank() + 1) / ctx.world_size();
  // 100 images a batch: the activations of 500 (LeNet: 31 MB per conv output,
  // kept in the host allocator's cache afterwards) raised train_mnist's peak RSS
  // from 130 MB to 290 MB per rank, for no faster evaluation.
  constexpr int64_t kBatch = 100;
  // Summed on the device: one host read per evaluation, not one per batch.
  nn::Tensor correct = nn::zeros({}, {.device = ctx.device()});
  for (int64_t i = begin; i < end; i += kBatch) {
    std::vector<data::Example> examples;
    std::vector<int64_t> indices;
    for (int64_t j = i; j < std::min(end, i + kBatch); ++j) {
      examples.push_back(test.get(j));
      indices.push_back(j);
    }
    data::Batch batch = data::Collate(examples, indices);
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
                 static_cast<double>(indices.size()));
  }
  model.train();
  nn::Tensor counts = nn::from_vector<double>({std::round(correct.item()), static_cast<double>(end - begin)},
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

}  // namespace

namespace {
TrainResult TrainClassifierImpl(dist::Context& ctx, const RunFlags& flags,
                                const ClassifierData& data,
                                const std::function<std::shared_ptr<nn::Module>()>& make_model,
                                dist::TraceRecorder* trace);
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

namespace {
TrainResult TrainClassifierImpl(dist::Context& ctx, const RunFlags& flags,
                                const ClassifierData& data,
                                const std::function<std::shared_ptr<nn::Module>()>& make_model,
                                dist::TraceRecorder* trace) {
  const Clock::time_point start = Clock::now();
  ctx.set_trace(trace);
  std::shared_ptr<nn::Module> model = make_model();
  dist::DataParallel dp(*model, ctx);
  std::unique_ptr<optim::Optimizer> optimizer =
      MakeOptimizer(flags.optimizer, model->parameters(), flags.lr);
  nn::CrossEntropyLoss loss_fn;

  auto sampler = std::make_shared<data::DistributedBatchSampler>(
      data.train->size(), flags.batch_size, ctx.world_size(), ctx.rank(), /*shuffle=*/true,
      /*drop_last=*/false, flags.seed);
  data::DataLoader loader(data.train, sampler,
                          {.num_workers = flags.num_workers,
                           .prefetch = std::max(2, 2 * flags.num_workers),
                           .device = ctx.device(),
                           .batch_transform = data.batch_transform});
  std::optional<dist::CheckpointManager> checkpoints;
  if (!flags.checkpoint_dir.empty()) checkpoints.emplace(ctx, CheckpointOptions(flags));
  Progression at;
  if (flags.resume) {
    if (std::optional<Progression> loaded =
            LoadRunCheckpoint(ctx, flags, *checkpoints, *model, *optimizer, loader)) {
      at = *loaded;
    }
  }
  dist::TrainingState state{.model = model.get(), .optimizer = optimizer.get(),
                            .loader = &loader, .step = &at.step};
  int64_t steps_per_epoch = loader.num_batches();
  if (flags.max_steps_per_epoch > 0) {
    steps_per_epoch = std::min(steps_per_epoch, flags.max_steps_per_epoch);
  }
  const bool cosine = flags.lr_schedule == "cosine";
  const int64_t total_steps = std::max<int64_t>(steps_per_epoch * flags.epochs, 1);
  const int64_t global_batch = int64_t{flags.batch_size} * ctx.world_size();
  MetricsWriter metrics(ctx.rank() == 0 ? flags.metrics : "", flags.resume);
  Progress progress(ctx, flags);
  const int64_t redraw_every = progress.tty() ? 5 : flags.log_every;
  // --tensorboard_dir: rank 0 writes; every rank takes part in the step-time
  // gather every log_every steps (the flag is the same on every rank).
  std::unique_ptr<dist::SummaryWriter> tensorboard = OpenTensorBoard(ctx, flags);
  // A resumed run repeats the steps after its checkpoint: TensorBoard drops the
  // earlier file's events from here on.
  if (tensorboard && flags.resume && at.step > 0) tensorboard->AddSessionStart(at.step);
  const bool tb_on = !flags.tensorboard_dir.empty();
  // For the test of the straggler report: TANDEM_TEST_SLOW_RANK=R:MS makes rank R
  // sleep MS milliseconds in every step.
  int slow_ms = 0;
  if (const char* slow = std::getenv("TANDEM_TEST_SLOW_RANK")) {
    const std::vector<std::string> parts = absl::StrSplit(slow, ':');
    int rank = -1;
    if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &rank) && rank == ctx.rank()) {
      (void)absl::SimpleAtoi(parts[1], &slow_ms);
    }
  }

  TrainResult result;
  result.best_accuracy = at.best_accuracy;
  double train_seconds = 0;
  int64_t trained_samples = 0;
  // A mid-epoch checkpoint: the loader already stands at its position.
  bool resume_mid_epoch = at.epoch_step > 0;
  for (int epoch = at.epoch; epoch < flags.epochs; ++epoch) {
    if (!resume_mid_epoch) loader.set_state({.epoch = epoch, .position = 0});
    loader.start_epoch();
    const Clock::time_point epoch_start = Clock::now();
    nn::Tensor loss_sum = nn::zeros({1}, {.device = ctx.device()});
    nn::Tensor window_sum = nn::zeros({1}, {.device = ctx.device()});
    int64_t window = 0;
    int64_t k = 0;
    if (resume_mid_epoch) {
      k = at.epoch_step;
      loss_sum = nn::from_vector<float>({static_cast<float>(at.epoch_loss_sum)}, {1},
                                        {.device = ctx.device()});
      resume_mid_epoch = false;
    }
    const int64_t first_k = k;
    // The epoch's straggler and overlap summary (every rank takes part).
    std::vector<double> step_ms, busy_ms;  // busy: the step minus its time in collectives
    step_ms.reserve(static_cast<size_t>(steps_per_epoch - k));  // no allocation in a step
    busy_ms.reserve(static_cast<size_t>(steps_per_epoch - k));
    const double waited_at_start = ctx.communicator().waited_seconds();
    const dist::DataParallel::OverlapStats overlap_at_start = dp.overlap_stats();
    nn::Tensor tb_sum = nn::zeros({1}, {.device = ctx.device()});
    int64_t tb_window = 0;
    Clock::time_point tb_window_start = Clock::now();
    for (; k < steps_per_epoch; ++k) {
      ctx.check_stop();
      const Clock::time_point step_start = Clock::now();
      const double waited_before_step = ctx.communicator().waited_seconds();
      if (trace != nullptr) trace->BeginStep(ctx.rank(), at.step);
      std::optional<data::Batch> batch;
      {
        dist::TraceSpan span(ctx, "data");
        batch = loader.next();
      }
      if (!batch) break;
      if (cosine) {
        optimizer->set_lr(flags.lr * 0.5 *
                          (1 + std::cos(M_PI * static_cast<double>(at.step) /
                                        static_cast<double>(total_steps))));
      }
      nn::Tensor loss;
      {
        dist::TraceSpan span(ctx, "forward");
        nn::AutocastGuard autocast(flags.bf16 ? nn::kBFloat16 : nn::kFloat32);
        loss = loss_fn(dp(batch->data), batch->target);
      }
      {
        dist::TraceSpan span(ctx, "backward");
        optimizer->zero_grad();
        loss.backward();
      }
      {
        dist::TraceSpan span(ctx, "optimizer");
        optimizer->step();
      }
      if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
      ++at.step;
      {
        nn::NoGradGuard no_grad;
        nn::Tensor value = loss.detach().reshape({1});
        loss_sum.add_(value);
        window_sum.add_(value);
        ++window;
        if (tb_on) {
          tb_sum.add_(value);
          ++tb_window;
        }
      }
      if (tb_on && ((k + 1) % flags.log_every == 0 || k + 1 == steps_per_epoch)) {
        // Every rank: its mean loss and step time over the window, gathered.
        const double step_ms = SecondsSince(tb_window_start) * 1e3 / static_cast<double>(tb_window);
        nn::Tensor mine = nn::from_vector<double>(
            {static_cast<double>(tb_sum.item()) / static_cast<double>(tb_window), step_ms}, {2},
            {.dtype = nn::kFloat64, .device = ctx.device()});
        const std::vector<double> all = ctx.communicator().all_gather(mine).to_vector<double>();
        if (tensorboard) {
          double loss_mean = 0;
          for (int r = 0; r < ctx.world_size(); ++r) loss_mean += all[2 * r] / ctx.world_size();
          tensorboard->AddScalar("train/loss", loss_mean, at.step);
          tensorboard->AddScalar("train/learning_rate", optimizer->lr(), at.step);
          tensorboard->AddScalar(
              "train/samples_per_s",
              static_cast<double>(tb_window * global_batch) / std::max(SecondsSince(tb_window_start), 1e-9),
              at.step);
          for (int r = 0; r < ctx.world_size(); ++r) {
            tensorboard->AddScalar(absl::StrCat("step_time_ms/rank_", r), all[2 * r + 1], at.step);
          }
        }
        tb_sum.zero_();
        tb_window = 0;
        tb_window_start = Clock::now();
      }
      if (ctx.rank() == 0 && ((k + 1) % redraw_every == 0 || k + 1 == steps_per_epoch)) {
        const double elapsed = SecondsSince(epoch_start);
        const double rate = static_cast<double>((k + 1) * global_batch) / std::max(elapsed, 1e-9);
        const double eta = elapsed / static_cast<double>(k + 1) *
                           static_cast<double>(steps_per_epoch - k - 1);
        progress.Update(epoch + 1, k + 1, steps_per_epoch, window_sum.item() / window, rate, eta);
        window_sum.zero_();
        window = 0;
      }
      // Periodic checkpoints and stop signals: every rank, every step.
      if (checkpoints) {
        dist::TraceSpan span(ctx, "checkpoint");
        const absl::Status saved = checkpoints->AtStepBoundary(state, [&](dist::TrainingState& s) {
          progress.Clear();
          SetExtra(s, flags, data, at, k + 1,
                   ctx.communicator().all_gather(loss_sum).to_vector<float>(),
                   at.elapsed_s + SecondsSince(start));
        });
        dist::ThrowIfError(saved, "saving a checkpoint: ");
      } else if (ctx.AtStepBoundary(at.step).stop) {
        progress.Clear();
        throw dist::StoppedError(
            absl::StrCat("stopped at step ", at.step, " (stop signal; no --checkpoint_dir)"),
            at.step);
      }
      step_ms.push_back(SecondsSince(step_start) * 1e3);
      busy_ms.push_back(step_ms.back() -
                        (ctx.communicator().waited_seconds() - waited_before_step) * 1e3);
      if (flags.stop_at_step > 0 && at.step == flags.stop_at_step) {
        // Every rank is here after the same step, with no collective in flight:
        // returning (not throwing) ends the run as a finished one, in every process.
        progress.Clear();
        result.stopped_at_step = at.step;
        break;
      }
    }
    if (result.stopped_at_step > 0) break;  // no metrics row or checkpoint of a partial epoch
    const double epoch_train_s = SecondsSince(epoch_start);
    train_seconds += epoch_train_s;
    trained_samples += (k - first_k) * global_batch;
    // The epoch's mean training loss over every rank (all ranks ran k steps).
    loss_sum.mul_(1.0 / static_cast<double>(std::max<int64_t>(k, 1)));
    ctx.communicator().all_reduce(loss_sum, dist::ReduceOp::kAvg);
    const double epoch_loss = loss_sum.item();
    LogStragglers(ctx, epoch + 1, step_ms, busy_ms,
                  ctx.communicator().waited_seconds() - waited_at_start,
                  dp.overlap_stats(), overlap_at_start);
    double accuracy = 0;
    {
      dist::TraceSpan span(ctx, "evaluate");
      accuracy = Evaluate(ctx, *model, *data.test, data.batch_transform.get(), flags.bf16);
    }
    at.epoch = epoch + 1;
    at.best_accuracy = std::max(at.best_accuracy, accuracy);
    const double rate =
        static_cast<double>((k - first_k) * global_batch) / std::max(epoch_train_s, 1e-9);
    const double wall_s = at.elapsed_s + SecondsSince(start);
    progress.Clear();
    if (ctx.rank() == 0) {
      ctx.log().Info("{} epoch {}/{}: step {} train loss {} test accuracy {} ({} samples/s, "
                     "epoch {}, total {})",
                     data.name, epoch + 1, flags.epochs, at.step,
                     absl::StrFormat("%.4f", epoch_loss), absl::StrFormat("%.4f", accuracy),
                     absl::StrFormat("%.0f", rate), FormatDuration(SecondsSince(epoch_start)),
                     FormatDuration(wall_s));
    }
    metrics.Row(data.name, epoch + 1, at.step, epoch_loss, accuracy, rate, wall_s, optimizer->lr());
    if (tensorboard) {
      tensorboard->AddScalar("epoch/train_loss", epoch_loss, at.step);
      tensorboard->AddScalar("epoch/test_accuracy", accuracy, at.step);
      tensorboard->AddScalar("epoch/samples_per_s", rate, at.step);
      dist::ThrowIfError(tensorboard->Flush(), "--tensorboard_dir: ");
    }
    result.final_accuracy = accuracy;
    result.final_loss = epoch_loss;
    if (checkpoints) {
      // The next epoch starts at its beginning: that is the position the file holds.
      loader.set_state({.epoch = at.epoch, .position = 0});
      SetExtra(state, flags, data, at, 0, {}, wall_s);
      const absl::Status saved = checkpoints->Save(state);
      dist::ThrowIfError(saved, "saving the checkpoint: ");
    }
    ++result.epochs_done;
  }
  if (checkpoints) {
    const absl::Status written = checkpoints->Finish();
    dist::ThrowIfError(written, "saving the checkpoint: ");
  }
  if (trace != nullptr) {
    dist::ThrowIfError(dist::WriteTrace(ctx, *trace, flags.trace), "");
    if (ctx.rank() == 0) ctx.log().Info("trace of steps {} written to {}", flags.trace_steps, flags.trace);
  }
  result.best_accuracy = at.best_accuracy;
  result.steps = at.step;
  result.seconds = SecondsSince(start);
  result.samples_per_s = static_cast<double>(trained_samples) / std::max(train_seconds, 1e-9);
  result.world_size = ctx.world_size();
  result.process_index = ctx.process_index();
  return result;
}
}  // namespace

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
                   " global"),
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
