#include "hapi/callbacks.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nn/error.h"
#include "nn/safetensors.h"
#include "spawn/comm/communicator.h"
#include "spawn/observe/summary_writer.h"

namespace tandem::hapi {
namespace {

bool IsRankZero(const RunState& s) { return s.ctx != nullptr && s.ctx->rank() == 0; }

std::string FormatLogs(const Logs& logs) {
  std::vector<std::string> parts;
  for (const auto& [key, value] : logs) parts.push_back(absl::StrFormat("%s %.6g", key, value));
  return absl::StrJoin(parts, " ");
}

// The monitored value of this epoch; nullopt for an evaluation value in an
// epoch that did not evaluate (FitOptions::eval_freq).
std::optional<double> Monitored(const std::string& who, const std::string& monitor,
                                const RunState& s, const Logs& logs) {
  auto it = logs.find(monitor);
  if (it == logs.end()) {
    if (monitor.starts_with("eval_") && s.has_eval_data && !s.evaluated) return std::nullopt;
    std::vector<std::string> keys;
    for (const auto& [key, value] : logs) keys.push_back(key);
    Fail(who, ": monitor '", monitor, "' is not among this epoch's logs (",
         keys.empty() ? "none" : absl::StrJoin(keys, ", "),
         "); evaluation values need eval data in FitOptions");
  }
  return it->second;
}

// What the monitoring callbacks count: an evaluation value is read in the
// epochs that evaluate (every eval_freq-th), any other value every epoch.
// "3 evaluations" / "1 epoch".
std::string CountedChecks(const std::string& monitor, const RunState& s, int count) {
  const bool evaluations = monitor.starts_with("eval_") && s.has_eval_data;
  return absl::StrCat(count, evaluations ? " evaluation" : " epoch", count == 1 ? "" : "s");
}

void SaveWeights(const std::string& path, const nn::Module& network) {
  absl::Status st = nn::SaveSafetensors(path, network);
  TANDEM_CHECK(st.ok(), "ModelCheckpoint: ", st.message());
}

// The monitoring callbacks' rule: true, with best set to value, when value
// improves on best by more than min_delta. A NaN never improves, not even as
// the first value (Keras starts from an infinite best; a NaN best would stop
// every later value from improving).
bool Improve(double value, bool maximize, double min_delta, double& best, bool& have_best) {
  const bool better = have_best ? (maximize ? value > best + min_delta : value < best - min_delta)
                                : !std::isnan(value);
  if (better) {
    best = value;
    have_best = true;
  }
  return better;
}

// A monitoring callback's entries in checkpoints and snapshots:
// "<key>best", "<key>have_best" and an integer "<key><name>" per counter.
void SaveMonitorState(CheckpointExtra& extra, const std::string& key, double best, bool have_best,
                      std::initializer_list<std::pair<const char*, int>> counters) {
  extra[key + "best"] = best;
  extra[key + "have_best"] = int64_t{have_best ? 1 : 0};
  for (const auto& [name, value] : counters) extra[key + name] = int64_t{value};
}

// Reads what SaveMonitorState wrote; false (nothing read) when an entry is
// missing, an error naming the file when one has the wrong type.
bool LoadMonitorState(const ResumeInfo& info, const char* who, const std::string& key,
                      double& best, bool& have_best,
                      std::initializer_list<std::pair<const char*, int*>> counters) {
  auto best_it = info.extra.find(key + "best");
  auto have_it = info.extra.find(key + "have_best");
  if (best_it == info.extra.end() || have_it == info.extra.end()) return false;
  bool types = std::holds_alternative<double>(best_it->second) &&
               std::holds_alternative<int64_t>(have_it->second);
  for (const auto& [name, value] : counters) {
    auto it = info.extra.find(key + name);
    if (it == info.extra.end()) return false;
    types = types && std::holds_alternative<int64_t>(it->second);
  }
  TANDEM_CHECK(types, who, ": ", info.path, ": the entries ", key, "* have the wrong types");
  best = std::get<double>(best_it->second);
  have_best = std::get<int64_t>(have_it->second) != 0;
  for (const auto& [name, value] : counters) {
    *value = static_cast<int>(std::get<int64_t>(info.extra.at(key + name)));
  }
  return true;
}

}  // namespace

bool MaximizeFor(const std::string& monitor, const std::string& mode, std::string_view callback) {
  if (mode == "max") return true;
  if (mode == "min") return false;
  TANDEM_CHECK(mode == "auto", std::string(callback), callback.empty() ? "" : ": ",
               "mode must be \"min\", \"max\" or \"auto\", got '", mode, "'");
  for (const char* up : {"acc", "precision", "recall"})
    if (monitor.find(up) != std::string::npos) return true;
  return false;
}

// --- ProgressLogger ------------------------------------------------------------------

ProgressLogger::ProgressLogger(int64_t log_freq) : log_freq_(log_freq) {
  TANDEM_CHECK(log_freq >= 1, "ProgressLogger: log_freq must be >= 1, got ", log_freq);
}

void ProgressLogger::on_train_begin(RunState& s) {
  if (IsRankZero(s))
    s.ctx->log().Info("fit: {} epoch{} of {} step{} on {} rank{}", s.epochs,
                      s.epochs == 1 ? "" : "s", s.steps_per_epoch,
                      s.steps_per_epoch == 1 ? "" : "s", s.ctx->world_size(),
                      s.ctx->world_size() == 1 ? "" : "s");
}

void ProgressLogger::on_epoch_begin(RunState& s) {
  epoch_start_ = std::chrono::steady_clock::now();
  epoch_start_steps_ = s.epoch_steps;
}

void ProgressLogger::on_train_batch_end(RunState& s) {
  const int64_t in_epoch = s.epoch_steps;
  if (!IsRankZero(s) || in_epoch % log_freq_ != 0 || !s.batch_loss.defined()) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start_).count();
  const double rate = seconds > 0 ? (in_epoch - epoch_start_steps_) / seconds : 0;
  const double eta = rate > 0 ? (s.steps_per_epoch - in_epoch) / rate : 0;
  s.ctx->log().Info("epoch {}/{} step {}/{} loss {} {} steps/s ETA {}s", s.epoch + 1, s.epochs,
                    in_epoch, s.steps_per_epoch, absl::StrFormat("%.6g", s.batch_loss.item()),
                    absl::StrFormat("%.1f", rate), absl::StrFormat("%.0f", eta));
}

void ProgressLogger::on_epoch_end(RunState& s, const Logs& logs) {
  if (IsRankZero(s)) s.ctx->log().Info("epoch {}/{}: {}", s.epoch + 1, s.epochs, FormatLogs(logs));
}

void ProgressLogger::on_eval_end(RunState& s, const Logs& logs) {
  if (IsRankZero(s) && s.optimizer == nullptr) s.ctx->log().Info("eval: {}", FormatLogs(logs));
}

// --- EarlyStopping -------------------------------------------------------------------

EarlyStopping::EarlyStopping(std::string monitor, int patience, std::string mode, double min_delta)
    : monitor_(std::move(monitor)), patience_(patience),
      maximize_(MaximizeFor(monitor_, mode, "EarlyStopping")), min_delta_(min_delta) {
  TANDEM_CHECK(patience >= 0, "EarlyStopping: patience must be >= 0, got ", patience);
  TANDEM_CHECK(min_delta >= 0, "EarlyStopping: min_delta must be >= 0, got ", min_delta);
}

void EarlyStopping::on_train_begin(RunState&) {
  stopped_epoch_ = -1;
  if (loaded_) return;  // a resume or restart continues the count
  have_best_ = false;
  wait_ = 0;
}

void EarlyStopping::on_checkpoint_save(RunState&, CheckpointExtra& extra) {
  SaveMonitorState(extra, absl::StrCat("hapi.EarlyStopping.", monitor_, "."), best_, have_best_,
                   {{"wait", wait_}});
}

void EarlyStopping::on_checkpoint_load(RunState&, const ResumeInfo& info) {
  if (LoadMonitorState(info, "EarlyStopping", absl::StrCat("hapi.EarlyStopping.", monitor_, "."),
                       best_, have_best_, {{"wait", &wait_}})) {
    loaded_ = true;
  }
}

void EarlyStopping::on_epoch_end(RunState& s, const Logs& logs) {
  const std::optional<double> monitored = Monitored("EarlyStopping", monitor_, s, logs);
  if (!monitored.has_value()) return;
  if (Improve(*monitored, maximize_, min_delta_, best_, have_best_)) {
    wait_ = 0;
    return;
  }
  // Keras' and Paddle's rule: stop at the patience-th evaluation in a row
  // without an improvement (patience 0: the first).
  if (++wait_ >= patience_) {
    s.stop_training = true;
    stopped_epoch_ = s.epoch;
    if (IsRankZero(s))
      s.ctx->log().Info("EarlyStopping: {} has not improved on {} for {}; stopping", monitor_,
                        best_, CountedChecks(monitor_, s, wait_));
  }
}

// --- LRSchedulerCallback -------------------------------------------------------------

LRSchedulerCallback::LRSchedulerCallback(Factory make, bool by_step)
    : make_(std::move(make)), by_step_(by_step) {
  TANDEM_CHECK(static_cast<bool>(make_), "LRSchedulerCallback: the scheduler factory is empty");
}

void LRSchedulerCallback::on_train_begin(RunState& s) {
  TANDEM_CHECK(s.optimizer != nullptr, "LRSchedulerCallback: no optimizer (prepare() one)");
  scheduler_ = make_(*s.optimizer);
  TANDEM_CHECK(scheduler_ != nullptr, "LRSchedulerCallback: the factory returned no scheduler");
  if (!loaded_.empty()) {
    absl::Status st = scheduler_->load_state_dict(loaded_);
    TANDEM_CHECK(st.ok(), "LRSchedulerCallback: the checkpoint's schedule: ", st.message());
  }
}

void LRSchedulerCallback::on_checkpoint_save(RunState&, CheckpointExtra& extra) {
  if (scheduler_ == nullptr) return;
  for (const auto& [key, value] : scheduler_->state_dict()) extra["hapi.LRScheduler." + key] = value;
}

void LRSchedulerCallback::on_checkpoint_load(RunState&, const ResumeInfo& info) {
  constexpr char kPrefix[] = "hapi.LRScheduler.";
  loaded_.clear();
  for (const auto& [key, value] : info.extra) {
    if (!key.starts_with(kPrefix)) continue;
    TANDEM_CHECK(std::holds_alternative<double>(value), "LRSchedulerCallback: ", info.path,
                 ": entry ", key, " is not a number");
    loaded_[key.substr(sizeof(kPrefix) - 1)] = std::get<double>(value);
  }
}

void LRSchedulerCallback::on_train_batch_end(RunState&) {
  if (by_step_) scheduler_->step();
}

void LRSchedulerCallback::on_epoch_end(RunState&, const Logs&) {
  if (!by_step_) scheduler_->step();
}

// --- ReduceLROnPlateau ---------------------------------------------------------------

ReduceLROnPlateau::ReduceLROnPlateau(std::string monitor, double factor, int patience,
                                     std::string mode, double min_delta, int cooldown,
                                     double min_lr)
    : monitor_(std::move(monitor)), factor_(factor), patience_(patience),
      maximize_(MaximizeFor(monitor_, mode, "ReduceLROnPlateau")), min_delta_(min_delta),
      cooldown_(cooldown),
      min_lr_(min_lr) {
  TANDEM_CHECK(factor > 0 && factor < 1, "ReduceLROnPlateau: factor must be in (0, 1), got ",
               factor);
  TANDEM_CHECK(patience >= 0, "ReduceLROnPlateau: patience must be >= 0, got ", patience);
  TANDEM_CHECK(cooldown >= 0, "ReduceLROnPlateau: cooldown must be >= 0, got ", cooldown);
  TANDEM_CHECK(min_lr >= 0, "ReduceLROnPlateau: min_lr must be >= 0, got ", min_lr);
  TANDEM_CHECK(min_delta >= 0, "ReduceLROnPlateau: min_delta must be >= 0, got ", min_delta);
}

void ReduceLROnPlateau::on_train_begin(RunState& s) {
  TANDEM_CHECK(s.optimizer != nullptr, "ReduceLROnPlateau: no optimizer (prepare() one)");
  if (loaded_) return;  // a resume or restart continues the counts
  have_best_ = false;
  wait_ = 0;
  cooldown_left_ = 0;
}

void ReduceLROnPlateau::on_epoch_end(RunState& s, const Logs& logs) {
  const std::optional<double> value = Monitored("ReduceLROnPlateau", monitor_, s, logs);
  if (!value.has_value()) return;
  if (cooldown_left_ > 0) {
    --cooldown_left_;
    wait_ = 0;
  }
  if (Improve(*value, maximize_, min_delta_, best_, have_best_)) {
    wait_ = 0;
    return;
  }
  if (cooldown_left_ > 0 || ++wait_ < patience_) return;
  optim::Optimizer& optimizer = *s.optimizer;
  bool reduced = false;
  for (int64_t g = 0; g < optimizer.num_groups(); ++g) {
    const double lr = optimizer.lr(g);
    if (lr <= min_lr_) continue;
    optimizer.set_lr(g, std::max(lr * factor_, min_lr_));
    reduced = true;
  }
  if (!reduced) return;
  cooldown_left_ = cooldown_;
  wait_ = 0;
  if (IsRankZero(s))
    s.ctx->log().Info("ReduceLROnPlateau: {} has not improved on {} for {}; lr now {}",
                      monitor_, best_, CountedChecks(monitor_, s, patience_), optimizer.lr(0));
}

void ReduceLROnPlateau::on_checkpoint_save(RunState&, CheckpointExtra& extra) {
  SaveMonitorState(extra, absl::StrCat("hapi.ReduceLROnPlateau.", monitor_, "."), best_,
                   have_best_, {{"wait", wait_}, {"cooldown_left", cooldown_left_}});
}

void ReduceLROnPlateau::on_checkpoint_load(RunState&, const ResumeInfo& info) {
  if (LoadMonitorState(info, "ReduceLROnPlateau",
                       absl::StrCat("hapi.ReduceLROnPlateau.", monitor_, "."), best_, have_best_,
                       {{"wait", &wait_}, {"cooldown_left", &cooldown_left_}})) {
    loaded_ = true;
  }
}

// --- MetricsLogger -------------------------------------------------------------------

MetricsLogger::MetricsLogger(std::string path) : path_(std::move(path)) {
  TANDEM_CHECK(!path_.empty(), "MetricsLogger: the path is empty");
}

void MetricsLogger::on_train_begin(RunState& s) {
  if (!IsRankZero(s)) return;
  // A fit continuing after E >= 1 finished epochs drops the interrupted
  // attempt's rows of epochs >= E (its own rows of epochs < E end the drop).
  // From epoch 0 its rows cannot be told from those of a run before it in the
  // same file: they stay, and the rows of the epochs run again follow them.
  if (resumed_epochs_.value_or(0) > 0) {
    DropRowsFromEpoch(path_, *resumed_epochs_,
                      [](std::string_view line) { return JsonLineInt(line, "epoch"); });
  }
  std::ofstream out(path_, std::ios::app);
  TANDEM_CHECK(out.good(), "MetricsLogger: cannot open '", path_, "' for appending");
}

void MetricsLogger::on_epoch_end(RunState& s, const Logs& logs) {
  if (!IsRankZero(s)) return;
  std::string line = absl::StrCat("{\"epoch\": ", s.epoch, ", \"step\": ", s.step);
  for (const auto& [key, value] : logs) {
    // JSON has no NaN or infinity: null stands for them.
    absl::StrAppend(&line, ", \"", key, "\": ",
                    std::isfinite(value) ? absl::StrFormat("%.17g", value) : "null");
  }
  line += "}\n";
  std::ofstream out(path_, std::ios::app);
  out << line;
  out.flush();
  TANDEM_CHECK(out.good(), "MetricsLogger: writing '", path_, "' failed");
}

void MetricsLogger::on_checkpoint_load(RunState&, const ResumeInfo& info) {
  resumed_epochs_ = info.epoch;
}

std::optional<int64_t> JsonLineInt(std::string_view line, std::string_view key) {
  const std::string quoted = "\"" + std::string(key) + "\": ";
  const size_t at = line.find(quoted);
  if (at == std::string_view::npos) return std::nullopt;
  const std::string_view rest = line.substr(at + quoted.size());
  int64_t value = 0;
  if (!absl::SimpleAtoi(std::string(rest.substr(0, rest.find_first_of(",}"))), &value)) {
    return std::nullopt;
  }
  return value;
}

void DropRowsFromEpoch(const std::string& path, int64_t epoch,
                       const std::function<std::optional<int64_t>(std::string_view)>& epoch_of) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return;
  std::ifstream in(path);
  TANDEM_CHECK(in.good(), "cannot read the metrics file '", path, "'");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  TANDEM_CHECK(in.eof(), "reading the metrics file '", path, "' failed");
  // The interrupted run's own rows end the file, their epochs increasing:
  // from the end, drop rows of epochs >= `epoch` while the epochs go down; a
  // header, an earlier epoch or a row of another run before it stops.
  size_t keep = lines.size();
  int64_t later = std::numeric_limits<int64_t>::max();
  while (keep > 0) {
    const std::optional<int64_t> row_epoch = epoch_of(lines[keep - 1]);
    if (!row_epoch.has_value() || *row_epoch < epoch || *row_epoch >= later) break;
    later = *row_epoch;
    --keep;
  }
  if (keep == lines.size()) return;
  std::string kept;
  for (size_t i = 0; i < keep; ++i) absl::StrAppend(&kept, lines[i], "\n");
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << kept;
    out.flush();
    TANDEM_CHECK(out.good(), "writing '", temporary, "' failed");
  }
  std::filesystem::rename(temporary, path, error);
  TANDEM_CHECK(!error, "renaming '", temporary, "' to '", path, "' failed: ", error.message());
}

// --- ModelCheckpoint -----------------------------------------------------------------

ModelCheckpoint::ModelCheckpoint(std::string dir, int save_freq, std::string monitor,
                                 std::string mode)
    : dir_(std::move(dir)), save_freq_(save_freq), monitor_(std::move(monitor)),
      maximize_(MaximizeFor(monitor_, mode, "ModelCheckpoint")) {
  TANDEM_CHECK(!dir_.empty(), "ModelCheckpoint: the directory is empty");
  TANDEM_CHECK(save_freq >= 0, "ModelCheckpoint: save_freq must be >= 0, got ", save_freq);
}

void ModelCheckpoint::on_checkpoint_save(RunState&, CheckpointExtra& extra) {
  if (monitor_.empty()) return;
  SaveMonitorState(extra, absl::StrCat("hapi.ModelCheckpoint.", monitor_, "."), best_, have_best_,
                   {});
}

void ModelCheckpoint::on_checkpoint_load(RunState&, const ResumeInfo& info) {
  if (monitor_.empty()) return;
  if (LoadMonitorState(info, "ModelCheckpoint",
                       absl::StrCat("hapi.ModelCheckpoint.", monitor_, "."), best_, have_best_,
                       {})) {
    loaded_ = true;
  }
}

void ModelCheckpoint::on_train_begin(RunState& s) {
  if (!loaded_) have_best_ = false;
  if (!IsRankZero(s)) return;
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  TANDEM_CHECK(!ec, "ModelCheckpoint: cannot create directory '", dir_, "': ", ec.message());
}

void ModelCheckpoint::on_epoch_end(RunState& s, const Logs& logs) {
  const std::optional<double> value =
      monitor_.empty() ? std::nullopt : Monitored("ModelCheckpoint", monitor_, s, logs);
  if (value.has_value()) {
    if (Improve(*value, maximize_, 0, best_, have_best_) && IsRankZero(s)) {
      SaveWeights(dir_ + "/best.safetensors", *s.network);
    }
  }
  if (IsRankZero(s) && save_freq_ > 0 && (s.epoch + 1) % save_freq_ == 0)
    SaveWeights(absl::StrCat(dir_, "/epoch_", s.epoch + 1, ".safetensors"), *s.network);
}

void ModelCheckpoint::on_train_end(RunState& s, const Logs&) {
  if (IsRankZero(s)) SaveWeights(dir_ + "/final.safetensors", *s.network);
  // No collective follows on_train_end in fit (the epochs' files are written
  // before the epoch end's): every rank's fit returns once the file is there.
  // A rank whose fit lacks the callback fails the run naming it.
  if (s.ctx == nullptr) return;
  dist::Communicator::Label label(
      s.ctx->communicator(),
      "hapi::ModelCheckpoint::on_train_end (a barrier: every rank's fit has the callback)");
  s.ctx->communicator().barrier();
}

// --- TensorBoard ---------------------------------------------------------------------

TensorBoard::TensorBoard(std::string dir) : dir_(std::move(dir)) {
  TANDEM_CHECK(!dir_.empty(), "TensorBoard: the directory is empty");
}

TensorBoard::~TensorBoard() = default;

void TensorBoard::on_train_begin(RunState& s) {
  if (!IsRankZero(s)) return;
  auto writer = dist::SummaryWriter::Open(dir_);
  TANDEM_CHECK(writer.ok(), "TensorBoard: ", writer.status().message());
  writer_ = std::move(writer).value();
  // A fit resumed from a checkpoint, or an attempt restarted from a snapshot,
  // starts at step s.step and writes the steps from there again: a SessionLog
  // START there makes TensorBoard drop the earlier files' events from it on.
  if (s.step > 0) writer_->AddSessionStart(s.step);
}

void TensorBoard::on_epoch_end(RunState& s, const Logs& logs) {
  if (writer_ == nullptr) return;
  for (const auto& [key, value] : logs) writer_->AddScalar(key, value, s.step);
  absl::Status st = writer_->Flush();
  TANDEM_CHECK(st.ok(), "TensorBoard: ", st.message());
}

void TensorBoard::on_train_end(RunState&, const Logs&) {
  if (writer_ == nullptr) return;
  absl::Status st = writer_->Flush();
  writer_.reset();
  TANDEM_CHECK(st.ok(), "TensorBoard: ", st.message());
}

}  // namespace tandem::hapi
