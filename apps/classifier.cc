// The data-parallel classifier training of train_mnist and train_cifar10: a
// hapi::Model fit (the loop, evaluation, checkpoints and resume) with a
// callback for the programs' outputs (progress, epoch lines and metrics rows,
// straggler lines, TensorBoard, the checkpoints' app entries); see common.h.
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
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
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
#include "data/dataset.h"
#include "hapi/model.h"
#include "nn/error.h"
#include "nn/safetensors.h"
#include "optim/lr_scheduler.h"
#include "spawn/signals.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/comm_hooks.h"
#include "spawn/train/zero_redundancy_optimizer.h"

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
std::shared_ptr<const data::Dataset> Prefix(std::shared_ptr<const data::Dataset> base, int64_t n) {
  std::vector<int64_t> indices(static_cast<size_t>(std::min(n, base->size())));
  std::iota(indices.begin(), indices.end(), int64_t{0});
  return std::make_shared<data::Subset>(std::move(base), std::move(indices));
}

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
  // Drops the rows of epochs from `epoch` on (0-based) and appends after the rest.
  void DropRowsFromEpoch(int epoch) {
    if (path_.empty()) return;
    out_.close();
    auto epoch_of = [this](std::string_view line) -> std::optional<int64_t> {
      // 1-based in the file.
      if (jsonl_) {
        const std::optional<int64_t> row_epoch = hapi::JsonLineInt(line, "epoch");
        if (!row_epoch.has_value()) return std::nullopt;
        return *row_epoch - 1;
      }
      int64_t row_epoch = 0;
      // dataset,epoch,step,loss,accuracy,samples_per_s,wall_s,lr: the epoch is the
      // seventh field from the end (a dataset's name may hold a comma).
      const std::vector<std::string> fields = absl::StrSplit(std::string(line), ',');
      if (fields.size() < 8 || !absl::SimpleAtoi(fields[fields.size() - 7], &row_epoch)) {
        return std::nullopt;  // the header
      }
      return row_epoch - 1;
    };
    hapi::DropRowsFromEpoch(path_, epoch, epoch_of);
    out_.open(path_, std::ios::app);
    TANDEM_CHECK(out_.good(), "--metrics: cannot open \"", path_, "\" for appending");
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

// What one rank's run carries past hapi::Model::fit: its result and what a
// checkpoint restored (best accuracy, elapsed time, the resumed step).
struct RankRun {
  TrainResult result;
  double elapsed_before_s = 0;  // wall time of the earlier parts of the run
  int64_t resumed_step = 0;
  int resumed_epoch = -1;        // the epoch a mid-epoch checkpoint continues
  int64_t resumed_epoch_steps = 0;
  bool restarted = false;  // this attempt restored a snapshot (--max_restarts)
  double train_seconds = 0;
  int64_t trained_samples = 0;
  const Clock::time_point start = Clock::now();
};

// The programs' outputs as a hapi callback, on every rank: the lr schedule,
// progress lines, the TensorBoard windows and epoch scalars, the straggler
// summary, the epoch line and metrics row, the checkpoints' app entries,
// --trace's steps, --test_slow_rank and --stop_at_step.
class ClassifierOutputs : public hapi::Callback {
 public:
  ClassifierOutputs(dist::Context& ctx, const RunFlags& flags, const ClassifierData& data,
                    dist::TraceRecorder* trace, RankRun* run)
      : ctx_(ctx), flags_(flags), data_(data), trace_(trace), run_(run), progress_(ctx, flags) {
    global_batch_ = int64_t{flags.batch_size} * ctx.world_size() * flags.grad_accum_steps;
    redraw_every_ = progress_.tty() ? 5 : flags.log_every;
    tb_on_ = !flags.tensorboard_dir.empty();
    // Opened here, before fit: a directory that cannot be created fails with its own line.
    tensorboard_ = OpenTensorBoard(ctx, flags);
    // After a restart (--max_restarts) the earlier attempts' rows stay.
    metrics_.emplace(ctx.rank() == 0 ? flags.metrics : "", flags.resume || ctx.attempt() > 0);
    if (flags.test_slow_rank == ctx.rank()) slow_ms_ = flags.test_slow_ms;
  }
  std::string name() const override { return "ClassifierOutputs"; }

  void on_checkpoint_load(hapi::RunState& s, const hapi::ResumeInfo& info) override {
    auto value = [&]<typename T>(const std::string& key, T) {
      absl::StatusOr<T> v = dist::ExtraValue<T>(info.extra, key, info.path);
      TANDEM_CHECK(v.ok(), "--resume: ", v.status().ToString());
      return *v;
    };
    const std::string program = value("program", std::string());
    TANDEM_CHECK(program == flags_.program, "--resume: ", info.path, " was written by ", program,
                 ", not ", flags_.program);
    run_->result.best_accuracy = value("best_accuracy", 0.0);
    run_->elapsed_before_s = value("elapsed_s", 0.0);
    if (info.snapshot) {
      // A restart continues this run: its epochs so far count in the summary.
      run_->restarted = true;
      run_->result.epochs_done = static_cast<int>(value("epochs_done", int64_t{0}));
      run_->result.final_accuracy = value("final_accuracy", 0.0);
      run_->result.final_loss = value("final_loss", 0.0);
    }
    run_->resumed_step = info.step;
    resumed_epochs_ = info.epoch;
    if (info.epoch_steps > 0) {
      run_->resumed_epoch = info.epoch;
      run_->resumed_epoch_steps = info.epoch_steps;
    }
    if (ctx_.rank() == 0) {
      ctx_.log().Info("resumed from {}: {} epoch(s) done{}, step {}, best test accuracy {}",
                      info.path, info.epoch,
                      info.epoch_steps > 0 ? absl::StrCat(" and ", info.epoch_steps,
                                                          " step(s) of epoch ", info.epoch + 1)
                                           : std::string(),
                      info.step, absl::StrFormat("%.4f", run_->result.best_accuracy));
    }
  }

  void on_train_begin(hapi::RunState& s) override {
    ctx_.set_trace(trace_);
    // A resume or a restart continues after resumed_epochs_ finished epochs:
    // the rows an interrupted attempt wrote for later ones come again.
    if (flags_.resume || ctx_.attempt() > 0) metrics_->DropRowsFromEpoch(resumed_epochs_);
    steps_per_epoch_ = s.steps_per_epoch;
    if (flags_.lr_schedule == "cosine") {
      // On the flag's lr, not a restored one: the position is the global step.
      s.optimizer->set_lr(flags_.lr);
      schedule_ = std::make_unique<optim::CosineAnnealingLR>(
          *s.optimizer, std::max<int64_t>(s.steps_per_epoch * flags_.epochs, 1));
    }
    // A resumed run repeats the steps after its checkpoint: TensorBoard drops the
    // earlier file's events from here on.
    if (tensorboard_ && (flags_.resume || run_->restarted) && run_->resumed_step > 0) {
      tensorboard_->AddSessionStart(run_->resumed_step);
    }
  }

  void on_epoch_begin(hapi::RunState& s) override {
    epoch_ = s.epoch;
    epoch_start_ = Clock::now();
    k_ = s.epoch == run_->resumed_epoch ? run_->resumed_epoch_steps : 0;
    first_k_ = k_;
    window_sum_ = nn::zeros({}, {.dtype = nn::kFloat64, .device = ctx_.device()});
    window_ = 0;
    tb_sum_ = nn::zeros({}, {.dtype = nn::kFloat64, .device = ctx_.device()});
    tb_window_ = 0;
    tb_window_start_ = Clock::now();
    step_ms_.clear();
    busy_ms_.clear();
    step_ms_.reserve(static_cast<size_t>(steps_per_epoch_ - k_));  // no allocation in a step
    busy_ms_.reserve(static_cast<size_t>(steps_per_epoch_ - k_));
    waited_at_start_ = ctx_.communicator().waited_seconds();
    overlap_at_start_ = s.data_parallel->overlap_stats();
  }

  void on_train_batch_begin(hapi::RunState& s) override {
    ctx_.check_stop();
    step_start_ = Clock::now();
    waited_before_step_ = ctx_.communicator().waited_seconds();
    if (trace_ != nullptr) trace_->BeginStep(ctx_.rank(), s.step);
    // The lr is set before a --cuda_graph replay too: the optimizer's pre-replay hook uploads it.
    if (schedule_) ScheduleAt(*schedule_, s.step);
  }

  void on_train_batch_end(hapi::RunState& s) override {
    if (slow_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    window_sum_.add_(s.batch_loss);
    ++window_;
    if (tb_on_) {
      tb_sum_.add_(s.batch_loss);
      ++tb_window_;
    }
    const bool epoch_end = k_ + 1 == steps_per_epoch_;
    if (tb_on_ && ((k_ + 1) % flags_.log_every == 0 || epoch_end)) LogTensorBoardWindow(s);
    if (ctx_.rank() == 0 && ((k_ + 1) % redraw_every_ == 0 || epoch_end)) ShowProgress();
    step_ms_.push_back(SecondsSince(step_start_) * 1e3);
    busy_ms_.push_back(step_ms_.back() -
                       (ctx_.communicator().waited_seconds() - waited_before_step_) * 1e3);
    ++k_;
    if (flags_.stop_at_step > 0 && s.step == flags_.stop_at_step) {
      // Every rank is here after the same step: fit then ends as a finished
      // one (no row or checkpoint of the partial epoch), in every process.
      progress_.Clear();
      run_->result.stopped_at_step = s.step;
      s.end_fit = true;
    }
    if (flags_.test_fail_rank == ctx_.rank() && s.step == flags_.test_fail_step &&
        ctx_.attempt() == 0) {
      throw Error(absl::StrCat("--test_fail_at: rank ", ctx_.rank(), " fails after step ", s.step));
    }
  }

  // Before the evaluation: the epoch's training time and straggler summary.
  void on_eval_begin(hapi::RunState& s) override {
    epoch_train_s_ = SecondsSince(epoch_start_);
    LogStragglers(ctx_, s.epoch + 1, step_ms_, busy_ms_,
                  ctx_.communicator().waited_seconds() - waited_at_start_,
                  s.data_parallel->overlap_stats(), overlap_at_start_);
  }

  void on_epoch_end(hapi::RunState& s, const hapi::Logs& logs) override {
    const double epoch_loss = logs.at("loss");
    const double accuracy = logs.at("eval_acc");
    TrainResult& r = run_->result;
    run_->train_seconds += epoch_train_s_;
    const int64_t trained = SamplesIn(k_) - SamplesIn(first_k_);
    run_->trained_samples += trained;
    r.best_accuracy = std::max(r.best_accuracy, accuracy);
    const double rate = static_cast<double>(trained) / std::max(epoch_train_s_, 1e-9);
    const double wall_s = run_->elapsed_before_s + SecondsSince(run_->start);
    progress_.Clear();
    if (ctx_.rank() == 0) {
      ctx_.log().Info("{} epoch {}/{}: step {} train loss {} test accuracy {} ({} samples/s, "
                      "epoch {}, total {})",
                      data_.name, s.epoch + 1, flags_.epochs, s.step,
                      absl::StrFormat("%.4f", epoch_loss), absl::StrFormat("%.4f", accuracy),
                      absl::StrFormat("%.0f", rate), FormatDuration(SecondsSince(epoch_start_)),
                      FormatDuration(wall_s));
    }
    metrics_->Row(data_.name, s.epoch + 1, s.step, epoch_loss, accuracy, rate, wall_s,
                  s.optimizer->lr());
    if (tensorboard_) {
      tensorboard_->AddScalar("epoch/train_loss", epoch_loss, s.step);
      tensorboard_->AddScalar("epoch/test_accuracy", accuracy, s.step);
      tensorboard_->AddScalar("epoch/samples_per_s", rate, s.step);
      dist::ThrowIfError(tensorboard_->Flush(), "--tensorboard_dir: ");
    }
    r.final_accuracy = accuracy;
    r.final_loss = epoch_loss;
    ++r.epochs_done;
  }

  void on_checkpoint_save(hapi::RunState& s, hapi::CheckpointExtra& extra) override {
    if (!s.saving_snapshot) progress_.Clear();  // the checkpoint's line follows; a snapshot logs none
    extra["program"] = flags_.program;
    extra["dataset"] = data_.name;
    extra["best_accuracy"] = run_->result.best_accuracy;
    extra["elapsed_s"] = run_->elapsed_before_s + SecondsSince(run_->start);
    // For a restart's snapshot (a resumed file counts its own process's epochs).
    extra["epochs_done"] = int64_t{run_->result.epochs_done};
    extra["final_accuracy"] = run_->result.final_accuracy;
    extra["final_loss"] = run_->result.final_loss;
  }

  void on_train_end(hapi::RunState& s, const hapi::Logs&) override {
    if (ctx_.rank() != 0) return;
    int64_t state_bytes = 0;
    if (s.zero != nullptr) {
      state_bytes = s.zero->state_bytes();
    } else {
      for (const auto& [key, t] : s.optimizer->state_dict().tensors) state_bytes += t.nbytes();
    }
    ctx_.log().Info("optimizer state: {} bytes on rank 0 ({})", state_bytes,
                    s.zero != nullptr ? absl::StrCat("sharded over ", ctx_.world_size(), " ranks")
                                      : std::string("unsharded"));
  }

 private:
  // The examples an epoch's first k steps train: whole global batches, the last
  // step what the epoch has left (with --grad_accum_steps above the epoch's
  // micro-batches, the one step trains the whole training set).
  int64_t SamplesIn(int64_t k) const {
    return std::min(k * global_batch_, static_cast<int64_t>(data_.train->size()));
  }

  // --tensorboard_dir, every --log_every steps and at the epoch's end: every
  // rank's mean loss and step time over the window, gathered; rank 0 writes them.
  void LogTensorBoardWindow(hapi::RunState& s) {
    const double step_ms = SecondsSince(tb_window_start_) * 1e3 / static_cast<double>(tb_window_);
    nn::Tensor mine = nn::from_vector<double>(
        {tb_sum_.item() / static_cast<double>(tb_window_), step_ms}, {2},
        {.dtype = nn::kFloat64, .device = ctx_.device()});
    const std::vector<double> all = ctx_.communicator().all_gather(mine).to_vector<double>();
    if (tensorboard_) {
      double loss_mean = 0;
      for (int r = 0; r < ctx_.world_size(); ++r) loss_mean += all[2 * r] / ctx_.world_size();
      tensorboard_->AddScalar("train/loss", loss_mean, s.step);
      tensorboard_->AddScalar("train/learning_rate", s.optimizer->lr(), s.step);
      tensorboard_->AddScalar("train/samples_per_s",
                              static_cast<double>(SamplesIn(k_ + 1) -
                                                  SamplesIn(k_ + 1 - tb_window_)) /
                                  std::max(SecondsSince(tb_window_start_), 1e-9),
                              s.step);
      for (int r = 0; r < ctx_.world_size(); ++r) {
        tensorboard_->AddScalar(absl::StrCat("step_time_ms/rank_", r), all[2 * r + 1], s.step);
      }
    }
    tb_sum_.zero_();
    tb_window_ = 0;
    tb_window_start_ = Clock::now();
  }

  // Rank 0: the progress bar or line after step k_ + 1 of the epoch, with the
  // mean loss since the last one.
  void ShowProgress() {
    const int64_t done = k_ + 1;
    const double elapsed = SecondsSince(epoch_start_);
    // Timed from this attempt's first step of the epoch (a resume's first_k_).
    const double rate =
        static_cast<double>(SamplesIn(done) - SamplesIn(first_k_)) / std::max(elapsed, 1e-9);
    const double eta = elapsed / static_cast<double>(done - first_k_) *
                       static_cast<double>(steps_per_epoch_ - done);
    progress_.Update(epoch_ + 1, done, steps_per_epoch_, window_sum_.item() / window_, rate, eta);
    window_sum_.zero_();
    window_ = 0;
  }

  dist::Context& ctx_;
  const RunFlags& flags_;
  const ClassifierData& data_;
  dist::TraceRecorder* trace_;
  RankRun* run_;
  Progress progress_;
  std::optional<MetricsWriter> metrics_;
  int resumed_epochs_ = 0;  // epochs finished at the checkpoint or snapshot loaded
  std::unique_ptr<dist::SummaryWriter> tensorboard_;
  std::unique_ptr<optim::LRScheduler> schedule_;
  int64_t global_batch_ = 0;
  int64_t redraw_every_ = 0;
  bool tb_on_ = false;
  int slow_ms_ = 0;
  int64_t steps_per_epoch_ = 0;
  // The current epoch: its start, steps done (k_; first_k_ where this process
  // started it), the loss windows, step times and what the straggler line
  // compares against.
  int epoch_ = 0;
  Clock::time_point epoch_start_;
  int64_t k_ = 0, first_k_ = 0;

  nn::Tensor window_sum_, tb_sum_;
  int64_t window_ = 0, tb_window_ = 0;
  Clock::time_point tb_window_start_, step_start_;
  std::vector<double> step_ms_, busy_ms_;
  double waited_at_start_ = 0, waited_before_step_ = 0, epoch_train_s_ = 0;
  dist::DataParallel::OverlapStats overlap_at_start_;
};

// Checkpoints of the programs' earlier versions (their own loop): "epoch"
// (epochs done), "epoch_step" (steps done in the next one; absent in the
// oldest files) and each rank's "epoch_loss_sum.<r>" (absent when another
// number of ranks wrote it: the epoch's mean loss then counts its steps after
// the checkpoint only).
absl::StatusOr<hapi::ResumePosition> ResumePositionOfEarlierVersions(
    const hapi::CheckpointExtra& extra, const std::string& path) {
  hapi::ResumePosition at;
  absl::StatusOr<int64_t> epoch = dist::ExtraValue<int64_t>(extra, "epoch", path);
  if (!epoch.ok()) return epoch.status();
  at.epoch = static_cast<int>(*epoch);
  if (extra.contains("epoch_step")) {
    absl::StatusOr<int64_t> steps = dist::ExtraValue<int64_t>(extra, "epoch_step", path);
    if (!steps.ok()) return steps.status();
    at.epoch_steps = *steps;
  }
  for (const auto& [key, value] : extra) {
    if (!absl::StartsWith(key, "epoch_loss_sum.")) continue;
    absl::StatusOr<double> sum = dist::ExtraValue<double>(extra, key, path);
    if (!sum.ok()) return sum.status();
    at.epoch_loss_sum += *sum;
  }
  return at;
}

TrainResult TrainClassifierImpl(dist::Context& ctx, const RunFlags& flags,
                                const ClassifierData& data,
                                const std::function<std::shared_ptr<nn::Module>()>& make_model,
                                dist::TraceRecorder* trace) {
  RankRun run;
  hapi::Model model(make_model);
  if (!flags.init_from.empty()) dist::ThrowIfError(model.load(flags.init_from), "--init_from: ");
  model.prepare(
      [name = flags.optimizer, lr = flags.lr](std::vector<nn::Tensor> params) {
        return MakeOptimizer(name, std::move(params), lr);
      },
      hapi::CrossEntropy(), {hapi::MakeMetric<hapi::Accuracy>()});
  hapi::FitOptions o{.epochs = flags.epochs,
                     .batch_size = flags.batch_size,
                     .seed = flags.seed,
                     .num_workers = flags.num_workers,
                     .eval_data = data.test,
                     // 100 images a batch: the activations of 500 (LeNet: 31 MB per conv
                     // output, kept in the host allocator's cache afterwards) raised
                     // train_mnist's peak RSS from 130 MB to 290 MB per rank.
                     .eval_batch_size = 100,
                     .grad_accum_steps = flags.grad_accum_steps,
                     .bf16 = flags.bf16,
                     .batch_transform = data.batch_transform,
                     .zero = flags.zero,
                     .max_steps_per_epoch = flags.max_steps_per_epoch,
                     .cuda_graph = flags.cuda_graph,
                     .resume = flags.resume,
                     .snapshot_every_steps = flags.max_restarts > 0 ? flags.snapshot_every : 0};
  if (flags.comm_hook == "bf16") o.data_parallel.comm_hook = dist::Bf16CompressHook();
  if (flags.comm_hook == "fp16") o.data_parallel.comm_hook = dist::Fp16CompressHook();
  if (!flags.checkpoint_dir.empty()) {
    o.checkpoint = CheckpointOptions(flags);
    o.checkpoint_each_epoch = true;
    o.resume_position = ResumePositionOfEarlierVersions;
  }
  o.callbacks = {[&] {
    return std::make_unique<ClassifierOutputs>(ctx, flags, data, trace, &run);
  }};
  const absl::StatusOr<hapi::History> history = model.fit(data.train, o);
  dist::ThrowIfError(history.status(), "");
  TrainResult result = run.result;
  if (flags.epochs == 0) {
    // The test accuracy of --init_from's weights (or the checkpoint's), nothing trained.
    const absl::StatusOr<hapi::Logs> logs = model.evaluate(
        data.test, {.batch_size = 100, .bf16 = flags.bf16, .batch_transform = data.batch_transform});
    dist::ThrowIfError(logs.status(), "");
    result.best_accuracy = result.final_accuracy = logs->at("eval_acc");
    result.evaluated_only = true;
  }
  if (!flags.save_safetensors.empty() && ctx.rank() == 0 && result.stopped_at_step == 0) {
    const absl::StatusOr<nn::StateDict> weights = model.state_dict();
    dist::ThrowIfError(weights.status(), "--save_safetensors: ");
    dist::ThrowIfError(nn::SaveSafetensors(flags.save_safetensors, *weights,
                                           {{"format", "pt"},
                                            {"program", flags.program},
                                            {"step", absl::StrCat(history->steps)}}),
                       "--save_safetensors: ");
    ctx.log().Info("model written to {}", flags.save_safetensors);
  }
  if (trace != nullptr) {
    dist::ThrowIfError(dist::WriteTrace(ctx, *trace, flags.trace), "");
    if (ctx.rank() == 0) {
      ctx.log().Info("trace of steps {} written to {}", flags.trace_steps, flags.trace);
    }
  }
  result.steps = history->steps;
  result.seconds = SecondsSince(run.start);
  result.samples_per_s = static_cast<double>(run.trained_samples) / std::max(run.train_seconds, 1e-9);
  result.world_size = ctx.world_size();
  result.process_index = ctx.process_index();
  return result;
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
  if (flags.train_limit > 0) data.train = Prefix(data.train, flags.train_limit);
  if (flags.test_limit > 0) data.test = Prefix(data.test, flags.test_limit);
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
  // Several processes read their own copies of the data (--data_dir may differ
  // per host): copies of other sizes would run other numbers of steps and pair
  // unlike collectives across processes (OpenMPI then aborted the job in its own
  // cleanup). They must agree, as the flags do.
  dist::SpawnOptions options = MakeSpawnOptions(flags);
  options.must_agree.emplace_back("training examples in --data_dir",
                                  absl::StrCat(data.train->size()));
  options.must_agree.emplace_back("test examples in --data_dir", absl::StrCat(data.test->size()));
  const Clock::time_point start = Clock::now();
  absl::StatusOr<std::vector<TrainResult>> results = dist::spawn(
      [&](dist::Context& ctx) {
        return TrainClassifier(ctx, flags, data, make_model, trace ? &*trace : nullptr);
      },
      flags.nprocs, flags.gpus, options);
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
