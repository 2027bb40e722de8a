// Stop signals and the step-boundary agreement (see signals.h).
#include "spawn/signals.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <csignal>
#include <cstring>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tandem::dist {
namespace {

constexpr char kStoppedPayload[] = "type.tandem/dist.Stopped";

std::array<std::atomic<uint64_t>, NSIG> g_counts{};
std::mutex g_install_mutex;
std::array<int, NSIG> g_users{};
std::array<struct sigaction, NSIG> g_previous{};

extern "C" void OnStopSignal(int signal) {
  if (signal > 0 && signal < NSIG) g_counts[signal].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

bool IsStopped(const absl::Status& status) {
  return status.code() == absl::StatusCode::kCancelled &&
         status.GetPayload(kStoppedPayload).has_value();
}

std::optional<int64_t> StoppedAtStep(const absl::Status& status) {
  if (!IsStopped(status)) return std::nullopt;
  const std::string text(*status.GetPayload(kStoppedPayload));
  int64_t step = 0;
  if (text.empty() || !absl::SimpleAtoi(text, &step)) return std::nullopt;
  return step;
}

std::string SignalName(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    default: return absl::StrCat("signal ", signal);
  }
}

absl::Status StopSignalScope::Validate(const std::vector<int>& signals) {
  for (int s : signals) {
    if (s <= 0 || s >= NSIG || s == SIGKILL || s == SIGSTOP) {
      return absl::InvalidArgumentError(
          absl::StrCat("SpawnOptions::stop_signals: ", s, " cannot be caught"));
    }
    if (s == SIGINT) {
      return absl::InvalidArgumentError(
          "SpawnOptions::stop_signals: SIGINT (Ctrl-C) is spawn's immediate stop "
          "(handle_sigint), not a graceful one");
    }
  }
  return absl::OkStatus();
}

StopSignalScope::StopSignalScope(std::vector<int> signals) : signals_(std::move(signals)) {
  std::sort(signals_.begin(), signals_.end());
  signals_.erase(std::unique(signals_.begin(), signals_.end()), signals_.end());
  std::lock_guard<std::mutex> lock(g_install_mutex);
  for (int s : signals_) {
    if (g_users[s]++ == 0) {
      struct sigaction action {};
      action.sa_handler = OnStopSignal;
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_RESTART;
      sigaction(s, &action, &g_previous[s]);
    }
    at_start_.push_back(g_counts[s].load(std::memory_order_relaxed));
  }
}

StopSignalScope::~StopSignalScope() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  for (int s : signals_) {
    if (--g_users[s] == 0) sigaction(s, &g_previous[s], nullptr);
  }
}

int StopSignalScope::Received() const {
  for (size_t i = 0; i < signals_.size(); ++i) {
    if (g_counts[signals_[i]].load(std::memory_order_relaxed) != at_start_[i]) return signals_[i];
  }
  return 0;
}

namespace internal {

absl::Status StoppedStatus(const std::string& reason, std::optional<int64_t> step,
                           const std::string& detail) {
  absl::Status status = absl::CancelledError(
      step ? absl::StrCat("stopped by ", reason, " at step ", *step,
                          ": every rank stopped at the same step boundary", detail)
           : absl::StrCat("stopped by ", reason, detail));
  status.SetPayload(kStoppedPayload, absl::Cord(step ? absl::StrCat(*step) : std::string()));
  return status;
}

StepAgreement::StepAgreement(int world_size, const StopSignalScope* signals, double grace_s,
                             bool cross_process)
    : world_size_(world_size),
      signals_(signals),
      grace_s_(grace_s),
      cross_process_(cross_process),
      passed_(world_size, kNone),
      stopped_(world_size, false),
      decided_(world_size, kNone) {}

void StepAgreement::RequestStopLocked(const std::string& reason) {
  if (stop_requested_) return;
  stop_requested_ = true;
  stop_reason_ = reason;
  stop_seen_ = Clock::now();
}

void StepAgreement::NoteSignalsLocked() {
  if (signals_ == nullptr) return;
  if (cross_process_) {
    // A round spreads it to every process first.
    if (local_stop_code_ != 0 || stop_requested_) return;
    if (const int s = signals_->Received(); s != 0) {
      local_stop_code_ = s;
      local_reason_ = SignalName(s);
    }
    return;
  }
  if (stop_requested_) return;
  if (const int s = signals_->Received(); s != 0) RequestStopLocked(SignalName(s));
}

void StepAgreement::RequestStop(const std::string& reason, int signal) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cross_process_) return RequestStopLocked(reason);
  if (local_stop_code_ == 0 && !stop_requested_) {
    local_stop_code_ = signal > 0 && signal < NSIG ? signal : kStopRequestCode;
    local_reason_ = reason;
  }
}

int64_t StepAgreement::TargetLocked(int rank, int64_t step) const {
  int64_t target = step;
  for (int r = 0; r < world_size_; ++r) {
    if (r != rank && passed_[r] != kNone) target = std::max(target, passed_[r] + 1);
  }
  return target;
}

bool StepAgreement::SaveDueLocked(int64_t step) const {
  // One pending save at a time: a proposal while one is due is the same one.
  return !save_targets_.empty() && *save_targets_.rbegin() >= step;
}

void StepAgreement::PruneSaveTargetsLocked(const std::vector<int64_t>& decided) {
  const int64_t oldest = *std::min_element(decided.begin(), decided.end());
  if (oldest == kNone) return;
  while (!save_targets_.empty() && *save_targets_.begin() <= oldest) {
    save_targets_.erase(save_targets_.begin());
  }
}

StepAgreement::Decision StepAgreement::AtBoundary(int rank, int64_t step, bool propose_save,
                                                  std::stop_token stop) {
  std::unique_lock<std::mutex> lock(mutex_);
  NoteSignalsLocked();
  if (cross_process_) return CrossProcessBoundary(lock, rank, step, propose_save, stop);
  Decision decision;
  if (escalated_) {  // the run is being cancelled: the next collective throws
    passed_[rank] = step;
    return decision;
  }
  if (stop_requested_ && stop_target_ == kNone) stop_target_ = TargetLocked(rank, step);
  if (propose_save && !SaveDueLocked(step)) save_targets_.insert(TargetLocked(rank, step));
  decision.stop = stop_target_ != kNone && step >= stop_target_;
  decision.save = save_targets_.contains(step);
  passed_[rank] = step;
  PruneSaveTargetsLocked(passed_);  // targets every rank has passed can go
  return decision;
}

StepAgreement::Decision StepAgreement::CrossProcessBoundary(std::unique_lock<std::mutex>& lock,
                                                            int rank, int64_t step,
                                                            bool propose_save,
                                                            const std::stop_token& stop) {
  Decision decision;
  if (propose_save && phase_ == Phase::kIdle && !SaveDueLocked(step)) local_save_wanted_ = true;
  // Reported before waiting: a held rank's step is what bounds the target.
  passed_[rank] = step;
  const auto held = [this] {
    return phase_ == Phase::kHoldForSave || phase_ == Phase::kHoldForStop;
  };
  if (held() && !escalated_) {
    released_.wait(lock, stop, [&] { return !held() || escalated_; });
    if (stop.stop_requested()) {
      throw CancelledError(
          absl::StrCat("held at the boundary of step ", step, ": the run is stopping"));
    }
  }
  if (escalated_) return decision;  // the run is being cancelled: the next collective throws
  decision.stop = stop_target_ != kNone && step >= stop_target_;
  decision.save = save_targets_.contains(step);
  // Not passed_: a rank released from the hold may not have read its decision yet.
  decided_[rank] = step;
  PruneSaveTargetsLocked(decided_);
  return decision;
}

StepAgreement::Round StepAgreement::LocalRound() {
  std::lock_guard<std::mutex> lock(mutex_);
  NoteSignalsLocked();
  Round round;
  round.stop_code = stop_requested_ ? 0 : local_stop_code_;
  round.save_wanted = local_save_wanted_ ? 1 : 0;
  round.arrived = *std::max_element(passed_.begin(), passed_.end());
  return round;
}

bool StepAgreement::Urgent() {
  std::lock_guard<std::mutex> lock(mutex_);
  NoteSignalsLocked();
  return phase_ == Phase::kHoldForSave || phase_ == Phase::kHoldForStop ||
         (local_stop_code_ != 0 && !stop_requested_) ||
         (local_save_wanted_ && phase_ == Phase::kIdle);
}

void StepAgreement::ApplyRound(const Round& all) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (escalated_ || phase_ == Phase::kStopAgreed) return;
  const bool stop = all.stop_code != 0;
  if (stop && !stop_requested_) {
    std::string reason = local_reason_;
    if (local_stop_code_ == 0) {
      reason = all.stop_code == kStopRequestCode
                   ? std::string("a stop request on another process")
                   : absl::StrCat(SignalName(static_cast<int>(all.stop_code)),
                                  " on another process");
    }
    RequestStopLocked(reason);
  }
  switch (phase_) {
    case Phase::kIdle:
      // Hold the ranks; the next round's contributions are taken under the hold.
      if (stop) {
        phase_ = Phase::kHoldForStop;
        local_save_wanted_ = false;  // the stop saves
      } else if (all.save_wanted != 0) {
        phase_ = Phase::kHoldForSave;
        hold_since_ = Clock::now();
        local_save_wanted_ = false;
      }
      return;
    case Phase::kHoldForSave:
    case Phase::kHoldForStop:
      // Every rank is at or before its next boundary, and none passed a
      // boundary it has not reported: all.arrived + 1 is reached by all, passed by none.
      if (all.arrived == kNone) {
        // No rank of any process reached a boundary: nothing to agree on.
        escalated_ = true;
        pending_ = StoppedStatus(stop_reason_, std::nullopt,
                                 " before any rank reached a step boundary "
                                 "(dist::Context::AtStepBoundary): every rank was cancelled, "
                                 "nothing trained since the start of the run is lost");
      } else if (stop || phase_ == Phase::kHoldForStop) {
        stop_target_ = all.arrived + 1;
        phase_ = Phase::kStopAgreed;
      } else {
        save_targets_.insert(all.arrived + 1);
        phase_ = Phase::kIdle;
      }
      released_.notify_all();
      return;
    case Phase::kStopAgreed:
      return;
  }
}

void StepAgreement::RankStopped(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_[rank] = true;
}

absl::Status StepAgreement::Poll() {
  std::lock_guard<std::mutex> lock(mutex_);
  NoteSignalsLocked();
  if (!pending_.ok()) return std::exchange(pending_, absl::OkStatus());
  if (escalated_) return absl::OkStatus();
  if (phase_ == Phase::kHoldForSave &&
      std::chrono::duration<double>(Clock::now() - hold_since_).count() > grace_s_) {
    // The round that sets the save step never completed: another process
    // stopped taking part in the rounds without ending the job.
    escalated_ = true;
    released_.notify_all();
    return absl::DeadlineExceededError(absl::StrCat(
        "a save agreed between processes was not scheduled within ", grace_s_,
        " s (SpawnOptions::stop_grace_s): another process stopped taking part in the step "
        "agreement's rounds; this process's ranks were held at their step boundaries"));
  }
  if (!stop_requested_) return absl::OkStatus();
  const bool any_boundary = cross_process_ ||
      std::any_of(passed_.begin(), passed_.end(), [](int64_t p) { return p != kNone; });
  if (!any_boundary && stop_target_ == kNone) {
    escalated_ = true;
    return StoppedStatus(stop_reason_, std::nullopt,
                         " before any rank reached a step boundary "
                         "(dist::Context::AtStepBoundary): every rank was cancelled, nothing "
                         "trained since the start of the run is lost");
  }
  const double waited_s = std::chrono::duration<double>(Clock::now() - stop_seen_).count();
  if (waited_s < grace_s_) return absl::OkStatus();
  escalated_ = true;
  released_.notify_all();
  std::string text = absl::StrCat("stop (", stop_reason_, ") not completed within ", grace_s_,
                                  " s (SpawnOptions::stop_grace_s): agreed stop step ",
                                  stop_target_ == kNone ? std::string("none yet")
                                                        : absl::StrCat(stop_target_),
                                  ";");
  for (int r = 0; r < world_size_; ++r) {
    absl::StrAppend(&text, " rank ", r, ": ",
                    stopped_[r]         ? std::string("stopped")
                    : passed_[r] == kNone ? std::string("no step boundary yet")
                                          : absl::StrCat("last boundary at step ", passed_[r]),
                    r + 1 < world_size_ ? ";" : "");
  }
  return absl::DeadlineExceededError(text);
}

absl::Status StepAgreement::Outcome() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::none_of(stopped_.begin(), stopped_.end(), [](bool s) { return s; })) {
    return absl::OkStatus();
  }
  return StoppedStatus(stop_reason_.empty() ? std::string("a stop request") : stop_reason_,
                       stop_target_ == kNone ? std::nullopt : std::optional<int64_t>(stop_target_),
                       "");
}

}  // namespace internal
}  // namespace tandem::dist
