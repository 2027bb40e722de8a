// hapi callbacks: code that runs at fixed points of Model::fit / evaluate.
//
// Order (each on every rank, on the rank's thread, in the order the callbacks
// were given):
//   fit:      on_train_begin
//             for each epoch: on_epoch_begin
//                             for each step: on_train_batch_begin, on_train_batch_end
//                             [eval every eval_freq epochs: on_eval_begin, on_eval_end]
//                             on_epoch_end
//             on_train_end
//   evaluate: on_eval_begin, on_eval_end
// A "step" is one optimizer step (grad_accum_steps micro-batches). With
// FitOptions::checkpoint: on_checkpoint_load after a resume loaded a file
// (before on_train_begin), on_checkpoint_save at every save (the periodic ones
// after a step's on_train_batch_end, the epoch end's after on_epoch_end, the
// final one before on_train_end). FitOptions::snapshot_every_steps under a
// restart policy: on_checkpoint_save at every snapshot (after the step's
// on_train_batch_end and periodic checkpoint) and on_checkpoint_load after a
// restart restored one (ResumeInfo::snapshot).
//
// Logs: epoch and evaluation values after the reduction over ranks, so every
// rank sees the same numbers: "loss" of the training epoch (metrics run on
// evaluation data only), "eval_loss" and "eval_<metric>" of the evaluation
// (in the epochs that evaluate: every eval_freq-th and the last). At a batch end
// RunState::batch_loss holds the step's loss on the device (this rank's; read it
// with item(), a host wait, only when needed: ProgressLogger reads it every
// log_freq steps).
//
// Errors: an exception from a callback fails the run on every rank (spawn stops
// the others) with "callback <name> failed in <hook>: <what>". Stopping early:
// a callback sets RunState::stop_training at on_epoch_end (or at a batch end);
// fit takes the largest value over the ranks at the end of each epoch, so one
// rank's decision stops every rank at the same point.
//
// Thread-safety: callbacks belong to one rank; fit makes one set per rank from
// the CallbackFactory list (MakeCallback<T>(args...)).
#ifndef TANDEM_HAPI_CALLBACKS_H_
#define TANDEM_HAPI_CALLBACKS_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nn/checkpoint.h"
#include "nn/module.h"
#include "nn/tensor.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"
#include "spawn/context.h"

namespace tandem::dist {
class DataParallel;
class SummaryWriter;
class ZeroRedundancyOptimizer;
}  // namespace tandem::dist

namespace tandem::hapi {

using Logs = std::map<std::string, double>;

// A training checkpoint's own entries (dist::TrainingState::extra); keys
// starting with "hapi." are fit's.
using CheckpointExtra = std::map<std::string, nn::CheckpointValue>;

// What fit(resume = true) loaded.
struct ResumeInfo {
  std::string path;
  int epoch = 0;            // epochs finished
  int64_t epoch_steps = 0;  // steps done in epoch `epoch` (0: none)
  int64_t step = 0;         // optimizer steps in all
  CheckpointExtra extra;    // every entry of the file's extra
  // An in-memory snapshot after a restart (FitOptions::snapshot_every_steps;
  // path names it: "snapshot of step S (rank R)"), not a file.
  bool snapshot = false;
};

// What a callback may read (and, for stop_training, write) during a run.
struct RunState {
  dist::Context* ctx = nullptr;
  nn::Module* network = nullptr;         // this rank's network
  optim::Optimizer* optimizer = nullptr;  // null in evaluate()
  int epoch = 0;                          // the current epoch, from 0
  int epochs = 0;
  int64_t step = 0;                       // optimizer steps done so far in the fit
  int64_t steps_per_epoch = 0;
  // Optimizer steps done in the current epoch (with those before a resume or
  // restart that continued it).
  int64_t epoch_steps = 0;
  nn::Tensor batch_loss;                  // at on_train_batch_end: the step's loss (0-dim)
  // fit: FitOptions::eval_data is set; at on_epoch_end: this epoch evaluated it
  // (every eval_freq epochs and after the last), so its logs hold "eval_*".
  bool has_eval_data = false;
  bool evaluated = false;
  bool stop_training = false;
  dist::DataParallel* data_parallel = nullptr;  // fit only
  dist::ZeroRedundancyOptimizer* zero = nullptr;  // fit with FitOptions::zero
  // Set by a callback at on_train_batch_end, on every rank at the same step:
  // fit ends after that step (its periodic checkpoint, if one is due, still
  // saved) without the epoch's end (no evaluation, on_epoch_end or epoch-end
  // checkpoint) and without the final checkpoint; on_train_end runs, and
  // History::ended_at_step says where it ended.
  bool end_fit = false;
  // During on_checkpoint_save: true when the save is a restart's in-memory
  // snapshot (FitOptions::snapshot_every_steps: nothing is written or
  // logged), false for a checkpoint file.
  bool saving_snapshot = false;
};

class Callback {
 public:
  virtual ~Callback() = default;
  // For error messages ("ProgressLogger").
  virtual std::string name() const = 0;
  virtual void on_train_begin(RunState&) {}
  virtual void on_epoch_begin(RunState&) {}
  virtual void on_train_batch_begin(RunState&) {}
  virtual void on_train_batch_end(RunState&) {}
  virtual void on_eval_begin(RunState&) {}
  virtual void on_eval_end(RunState&, const Logs&) {}
  virtual void on_epoch_end(RunState&, const Logs&) {}
  virtual void on_train_end(RunState&, const Logs&) {}
  // Every rank at the same step: add entries to the checkpoint being saved
  // (collectives allowed).
  virtual void on_checkpoint_save(RunState&, CheckpointExtra&) {}
  // Every rank, after a resume loaded a checkpoint.
  virtual void on_checkpoint_load(RunState&, const ResumeInfo&) {}
};

using CallbackFactory = std::function<std::unique_ptr<Callback>()>;

template <typename C, typename... Args>
CallbackFactory MakeCallback(Args... args) {
  return [=] { return std::unique_ptr<Callback>(new C(args...)); };
}

// Rank 0 logs "epoch E/N step S/M loss L <rate> steps/s ETA Ts" every log_freq
// steps (the step's loss, a host wait at those steps only) and one line per
// epoch with its logs. Plain lines through the run's logger (no terminal control).
class ProgressLogger : public Callback {
 public:
  explicit ProgressLogger(int64_t log_freq = 10);
  std::string name() const override { return "ProgressLogger"; }
  void on_train_begin(RunState& s) override;
  void on_epoch_begin(RunState& s) override;
  void on_train_batch_end(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_eval_end(RunState& s, const Logs& logs) override;

 private:
  int64_t log_freq_;
  std::chrono::steady_clock::time_point epoch_start_;
  int64_t epoch_start_steps_ = 0;  // RunState::epoch_steps at on_epoch_begin
};

// Stops training when `monitor` ("eval_loss", "eval_acc", "loss", ...) has not
// improved by more than min_delta for `patience` epochs: at the end of the
// patience-th such epoch in a row (patience 0: the first), as Keras and Paddle
// do. mode: "min", "max", or "auto" (max for names containing "acc",
// "precision" or "recall").
// An evaluation value ("eval_*") is read in the epochs that evaluate
// (FitOptions::eval_freq), so patience counts evaluations, as Paddle's
// EarlyStopping does; the epochs between are skipped, and the line it logs
// on stopping counts evaluations ("for 2 evaluations"; a training value's
// counts epochs). A monitor missing from
// an epoch's logs otherwise (a misspelt name, an evaluation value without eval
// data) is an error naming it and the keys.
// Its best value and wait go into every checkpoint and snapshot
// ("hapi.EarlyStopping.<monitor>.*") and come back on resume and restart.
class EarlyStopping : public Callback {
 public:
  EarlyStopping(std::string monitor = "eval_loss", int patience = 0, std::string mode = "auto",
                double min_delta = 0);
  std::string name() const override { return "EarlyStopping"; }
  void on_train_begin(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_checkpoint_save(RunState& s, CheckpointExtra& extra) override;
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override;
  int stopped_epoch() const { return stopped_epoch_; }

 private:
  bool loaded_ = false;  // on_checkpoint_load restored best_ and wait_
  std::string monitor_;
  int patience_;
  bool maximize_;
  double min_delta_;
  double best_ = 0;
  bool have_best_ = false;
  int wait_ = 0;
  int stopped_epoch_ = -1;
};

// Steps a learning-rate schedule made from the rank's optimizer: after every
// optimizer step (by_step) or at every epoch end. Its position and base lrs
// go into every checkpoint and snapshot ("hapi.LRScheduler.*") and come back
// on resume and restart.
class LRSchedulerCallback : public Callback {
 public:
  using Factory = std::function<std::unique_ptr<optim::LRScheduler>(optim::Optimizer&)>;
  explicit LRSchedulerCallback(Factory make, bool by_step = true);
  std::string name() const override { return "LRScheduler"; }
  void on_train_begin(RunState& s) override;
  void on_train_batch_end(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_checkpoint_save(RunState& s, CheckpointExtra& extra) override;
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override;

 private:
  Factory make_;
  bool by_step_;
  std::unique_ptr<optim::LRScheduler> scheduler_;
  std::map<std::string, double> loaded_;  // on_checkpoint_load's, for on_train_begin
};

// Multiplies every parameter group's lr by `factor` (not below min_lr) when
// `monitor` has not improved by more than min_delta for `patience` epochs,
// then waits `cooldown` epochs before counting again (Paddle's and Keras'
// ReduceLROnPlateau; mode and the epochs an evaluation value is read in as
// EarlyStopping's). Every rank does the same on the same (reduced) logs, so
// the lrs stay equal. The lr lives in the optimizer and comes back with it on
// resume; best, wait and cooldown go into every checkpoint and snapshot
// ("hapi.ReduceLROnPlateau.<monitor>.*"). Not for an optimizer that an
// LRSchedulerCallback also drives (the schedule rewrites the lrs). Throws
// tandem::Error naming a bad factor (not in (0, 1)), patience, cooldown,
// min_lr or min_delta.
class ReduceLROnPlateau : public Callback {
 public:
  explicit ReduceLROnPlateau(std::string monitor = "loss", double factor = 0.1, int patience = 10,
                             std::string mode = "auto", double min_delta = 1e-4, int cooldown = 0,
                             double min_lr = 0);
  std::string name() const override { return "ReduceLROnPlateau"; }
  void on_train_begin(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_checkpoint_save(RunState& s, CheckpointExtra& extra) override;
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override;

 private:
  bool loaded_ = false;  // on_checkpoint_load restored the counters
  std::string monitor_;
  double factor_;
  int patience_;
  bool maximize_;
  double min_delta_;
  int cooldown_;
  double min_lr_;
  double best_ = 0;
  bool have_best_ = false;
  int wait_ = 0;
  int cooldown_left_ = 0;
};

// Rank 0 appends one JSON line per epoch ({"epoch": E, "step": S, <logs>}) to
// `path` (created, with its directory's existence checked at train begin: an
// error names the path). A fit that resumed (from a checkpoint or, after a
// restart, a snapshot) after E >= 1 finished epochs first drops the lines the
// interrupted run wrote for epochs >= E (DropRowsFromEpoch), which come
// again; a restart from epoch 0 cannot tell the interrupted attempt's lines
// from an earlier run's in the same file and appends after them.
class MetricsLogger : public Callback {
 public:
  explicit MetricsLogger(std::string path);
  std::string name() const override { return "MetricsLogger"; }
  void on_train_begin(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override;

 private:
  std::string path_;
  std::optional<int> resumed_epochs_;  // epochs finished at the checkpoint or snapshot loaded
};

// Rewrites the text file at `path` (atomically: a temporary file renamed over
// it) without the rows the interrupted run wrote for epochs from `epoch` on
// (0-based, as `epoch_of` reads it from a line; nullopt: not a row, such as a
// header): the trailing rows of epochs >= `epoch` whose epochs increase to
// the end of the file. Rows of other runs before them stay (an earlier
// epoch, a header or an epoch that does not continue the sequence stops the
// drop). A missing file is left alone. For per-epoch metrics files after a
// resume or a restart, whose rows for the epoch it continues in, and later
// ones, come again. Throws tandem::Error naming the path when it cannot be
// read or written.
void DropRowsFromEpoch(const std::string& path, int64_t epoch,
                       const std::function<std::optional<int64_t>(std::string_view)>& epoch_of);
// The integer after `"key": ` in a JSON line as MetricsLogger and the
// programs' --metrics write them ({"epoch": 3, "step": 120, ...}), or nullopt.
std::optional<int64_t> JsonLineInt(std::string_view line, std::string_view key);

// Rank 0 writes the network's state (safetensors, PyTorch-loadable) to
// dir/epoch_<E>.safetensors (E from 1) every save_freq epochs (0: none) and
// dir/final.safetensors at the end; with `monitor` set also
// dir/best.safetensors when the monitored value improves (mode and the epochs
// an evaluation value is read in as EarlyStopping's). Writes are atomic
// (nn/safetensors.h); on_train_end ends with a barrier, so that every rank's
// fit returns with the files written (an epoch's are before the epoch's end
// collectives): every rank's fit has the callback (a rank without it fails
// the run, the collective check or the watchdog naming this barrier).
// The best value goes into every checkpoint and snapshot
// ("hapi.ModelCheckpoint.<monitor>.*") and comes back on resume and restart.
class ModelCheckpoint : public Callback {
 public:
  explicit ModelCheckpoint(std::string dir, int save_freq = 1, std::string monitor = "",
                           std::string mode = "auto");
  std::string name() const override { return "ModelCheckpoint"; }
  void on_train_begin(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_train_end(RunState& s, const Logs& logs) override;
  void on_checkpoint_save(RunState& s, CheckpointExtra& extra) override;
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override;

 private:
  bool loaded_ = false;  // on_checkpoint_load restored best_
  std::string dir_;
  int save_freq_;
  std::string monitor_;
  bool maximize_;
  double best_ = 0;
  bool have_best_ = false;
};

// Rank 0 writes every epoch's logs as TensorBoard scalars (tag = log key) at
// the epoch's last step, into a new event file under `dir`; a fit resumed from
// a checkpoint (or an attempt restarted from a snapshot) at step S starts its
// file with a SessionLog START at S, so that TensorBoard shows the steps from S
// once, not twice.
class TensorBoard : public Callback {
 public:
  explicit TensorBoard(std::string dir);
  ~TensorBoard() override;
  std::string name() const override { return "TensorBoard"; }
  void on_train_begin(RunState& s) override;
  void on_epoch_end(RunState& s, const Logs& logs) override;
  void on_train_end(RunState& s, const Logs& logs) override;

 private:
  std::string dir_;
  std::unique_ptr<dist::SummaryWriter> writer_;
};

// True when `mode` ("min", "max", "auto") asks to maximise `monitor`; throws
// tandem::Error naming a bad mode, after `callback` ("EarlyStopping: ...") when given.
bool MaximizeFor(const std::string& monitor, const std::string& mode,
                 std::string_view callback = {});

}  // namespace tandem::hapi

#endif  // TANDEM_HAPI_CALLBACKS_H_
