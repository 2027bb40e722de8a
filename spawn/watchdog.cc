#include "spawn/internal/watchdog.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spawn/internal/restart.h"

namespace tandem::dist::internal {

Watchdog::Watchdog(std::vector<nn::Device> devices, Logger* logger, std::shared_ptr<InProcessGroup> group,
    const std::vector<std::unique_ptr<Communicator>>* comms, int rank_offset,
    std::string where)
    : rank_offset_(rank_offset),
      where_(std::move(where)),
      devices_(std::move(devices)),
      logger_(logger),
      group_(std::move(group)),
      comms_(comms),
      traces_(devices_.size()),
      states_(devices_.size()) {
  for (auto& s : states_) s.store(RankState::kRunning);
}

uint64_t Watchdog::FewestCollectivesEntered() const {
  uint64_t fewest = UINT64_MAX;
  for (const CollectiveTrace& t : traces_) {
    fewest = std::min(fewest, t.entered.load(std::memory_order_acquire));
  }
  return fewest == UINT64_MAX ? 0 : fewest;
}

std::string Watchdog::RankName(int rank) const {
  // Several processes: the global rank, and where it runs.
  return absl::StrCat("rank ", rank_offset_ + rank, " (", devices_[rank].ToString(),
                      where_.empty() ? "" : ", ", where_, ")");
}

void Watchdog::Fail(int rank, absl::Status status, bool cancelled, bool peer,
          bool interrupt) {
  if (rank >= 0) states_[rank].store(RankState::kFailed);
  bool first = false;
  bool replaced = false;
  bool planned_stop = false;  // the run's first status is a planned stop
  const bool planned = interrupt || IsStopped(status);
  std::string message(status.message());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_.ok() || (first_is_peer_ && !cancelled && !peer)) {
      replaced = !first_.ok();
      first_ = std::move(status);
      first_is_peer_ = peer;
      first_is_planned_ = planned;
      first = true;
    }
    planned_stop = first_is_planned_;
  }
  if (replaced) {
    logger_->Write(LogLevel::kError, -1, nn::Device(), absl::StrCat("the cause: ", message));
  } else if (first) {
    logger_->Write(planned ? LogLevel::kInfo : LogLevel::kError, -1, nn::Device(), message);
    if (!planned) WriteFlightRecorders();
    stop_.request_stop();
    if (group_) group_->Cancel(absl::StrCat("the run is stopping: ", message));
    std::lock_guard<std::mutex> lock(mutex_);
    cv_.notify_all();  // the watchdog aborts the communicators now
  } else if (!(cancelled && planned_stop)) {
    logger_->Write(LogLevel::kError, rank, rank >= 0 ? devices_[rank] : nn::Device(),
                   absl::StrCat(cancelled ? "stopped as a consequence of the first failure: "
                                          : "failed after the first failure (consequence): ",
                                message));
  }
}

void Watchdog::SetFlightRecorderEntries(int entries) {
  for (CollectiveTrace& t : traces_) t.flight.Reset(entries);
}

void Watchdog::WriteFlightRecorders() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (flight_written_ || traces_.empty() || !traces_[0].flight.enabled()) return;
    flight_written_ = true;
  }
  std::vector<std::pair<std::string, const FlightRecorder*>> rings;
  for (int r = 0; r < world_size(); ++r) rings.emplace_back(RankName(r), &traces_[r].flight);
  for (const std::string& line : DumpFlightRecorders(rings, SteadyNowNs())) {
    logger_->Write(LogLevel::kInfo, -1, nn::Device(), line);
  }
}

void Watchdog::Joined() {
  std::lock_guard<std::mutex> lock(mutex_);
  joined_ = true;
  cv_.notify_all();
}

void Watchdog::Finish(int rank) {
  RankState running = RankState::kRunning;
  states_[rank].compare_exchange_strong(running, RankState::kFinished);
  std::lock_guard<std::mutex> lock(mutex_);
  if (++finished_ == world_size()) all_finished_ns_ = SteadyNowNs();
  cv_.notify_all();
}

void Watchdog::Watch(double timeout_s, const std::atomic<uint64_t>& sigint_count,
                     uint64_t sigint_at_start, StepAgreement& agreement,
                     void (*exit_process)(int)) {
  const int64_t timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
  const auto poll = std::chrono::milliseconds(
      std::clamp<int64_t>(static_cast<int64_t>(timeout_s * 1000 / 10), 1, 100));
  std::unique_lock<std::mutex> lock(mutex_);
  // The loop ends only after a round of polls that began once every rank thread
  // was joined: an asynchronous error raised after one round's poll and before
  // the last join (the last collectives of a run, on a loaded machine) is still
  // found, and fails the run rather than leaving it OK.
  bool polled_after_join = false;
  while (!joined_ || !polled_after_join || (stop_.stop_requested() && !aborted_) ||
         (!stop_.stop_requested() && AnyCollectiveInFlight())) {
    // Woken at once by the first failure (Fail notifies) and by the aborter,
    // and by the joins when nothing is left to wait for (a restart follows at once).
    // Also at once when every rank finished: the processes' last round waits
    // for the round of polls after that (PolledAfterEveryRankFinished).
    cv_.wait_for(lock, poll, [&] {
      return (stop_.stop_requested() && !aborter_.joinable()) ||
             (joined_ && (aborted_ || (!stop_.stop_requested() && !AnyCollectiveInFlight()))) ||
             (finished_ == world_size() && !polled_after_finish_.load());
    });
    const bool aborted = aborted_;  // the aborter thread writes it
    const bool joined = joined_;
    const bool all_finished = finished_ == world_size();
    lock.unlock();
    if (sigint_count.load(std::memory_order_relaxed) != sigint_at_start &&
        !stop_.stop_requested() && !sigint_requested_) {
      if (sigint_agreed_) {
        sigint_requested_ = true;
        agreement.RequestStop("SIGINT", SIGINT);
      } else {
        Fail(-1,
             absl::CancelledError("spawn: interrupted (SIGINT); every rank stopped at its "
                                  "next collective, stop-aware wait or step boundary (a "
                                  "second Ctrl-C exits at once)"),
             false, /*peer=*/false, /*interrupt=*/true);
      }
    }
    if (!stop_.stop_requested()) {
      // An agreed stop that overran its grace period (spawn/signals.h) is a failure.
      if (absl::Status stop = agreement.Poll(); !stop.ok()) Fail(-1, std::move(stop), false);
    }
    if (!stop_.stop_requested()) PollAsyncErrors();
    if (stop_.stop_requested() && !aborted) AbortCommunicators(timeout_s, exit_process);
    for (const auto& comm : *comms_) comm->PollCompleted();
    if (!stop_.stop_requested()) {
      CheckReturnedRanks();
      CheckTimeouts(timeout_s, timeout_ns);
      CheckExits(timeout_s, timeout_ns);
    } else {
      CheckStragglers(timeout_s, timeout_ns);
    }
    if (joined) polled_after_join = true;
    if (all_finished) polled_after_finish_.store(true, std::memory_order_release);
    lock.lock();
  }
  lock.unlock();
  if (aborter_.joinable()) aborter_.join();
}

bool Watchdog::AnyCollectiveInFlight() const {
  for (const CollectiveTrace& t : traces_) {
    if (t.entered.load(std::memory_order_acquire) > t.completed.load(std::memory_order_acquire)) {
      return true;
    }
  }
  return false;
}

void Watchdog::PollAsyncErrors() {
  // The devices' own failures first, every rank's before any communicator
  // error: an error a communicator reports because a device failed (NCCL's
  // kernels fail with their device, a peer's with it) is not the cause.
  for (const FailureCause cause : {FailureCause::kDevice, FailureCause::kCommunicator}) {
    for (size_t r = 0; r < comms_->size(); ++r) {
      Communicator& comm = *(*comms_)[r];
      absl::Status error =
          cause == FailureCause::kDevice ? comm.PollDeviceError() : comm.PollAsyncError();
      if (error.ok()) continue;
      const int rank = static_cast<int>(r);
      Fail(rank,
           WithFailureCause(
               absl::Status(error.code(), absl::StrCat(RankName(rank), ": ", error.message())),
               cause),
           false);
      return;
    }
  }
}

void Watchdog::AbortCommunicators(double timeout_s, void (*exit_process)(int)) {
  if (stopped_ns_ == 0) stopped_ns_ = SteadyNowNs();
  const double deadline_s = std::min(timeout_s, kMaxAbortWaitS);
  std::optional<absl::Status> outcome;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    outcome = abort_outcome_;
  }
  if (aborter_.joinable()) {
    if (outcome.has_value() && outcome->ok()) return;  // aborted_ is set
    if (outcome.has_value() && !abort_escalated_) return EndProcess(*outcome, exit_process);
    if (!outcome.has_value()) {  // still aborting
      const double running_s = static_cast<double>(SteadyNowNs() - abort_started_ns_) * 1e-9;
      if (abort_escalated_ || running_s <= 2 * deadline_s) return;
      return EndProcess(
          absl::DeadlineExceededError(absl::StrCat(
              "the abort of the communicators has not returned after ", 2 * deadline_s,
              " s (NCCL's last abort waits until every CUDA graph that holds its collectives "
              "is destroyed: a rank that keeps one and reaches no collective, stop-aware wait "
              "or check_stop() holds it)")),
          exit_process);
    }
    // An abort that could not run, escalated, and the injected exit returned
    // (tests): try again.
    aborter_.join();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_outcome_.reset();
  }
  abort_escalated_ = false;
  abort_started_ns_ = SteadyNowNs();
  aborter_ = std::thread([this, deadline_s] { AbortAll(deadline_s); });
}

void Watchdog::AbortAll(double deadline_s) {
  const auto deadline = std::chrono::nanoseconds(static_cast<int64_t>(deadline_s * 1e9));
  absl::Status status;
  for (const auto& comm : *comms_) {
    absl::Status one = comm->Abort(deadline);
    if (!one.ok() && status.ok()) status = std::move(one);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (status.ok()) aborted_ = true;
  abort_outcome_ = std::move(status);
  cv_.notify_all();
}

void Watchdog::EndProcess(const absl::Status& why, void (*exit_process)(int)) {
  abort_escalated_ = true;
  logger_->Write(LogLevel::kError, -1, nn::Device(),
                 absl::StrCat("spawn: ending the process (exit status ", kAbortStuckExitStatus,
                              ") after the run stopped (", result().message(), "): ",
                              why.message()));
  exit_process(kAbortStuckExitStatus);
}

void Watchdog::CheckExits(double timeout_s, int64_t timeout_ns) {
  int64_t finished_at;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ < world_size() || joined_) return;
    finished_at = all_finished_ns_;
  }
  if (SteadyNowNs() - finished_at <= timeout_ns) return;
  Fail(-1,
       absl::DeadlineExceededError(absl::StrCat(
           "watchdog: every rank returned, but their threads had not exited ", timeout_s,
           " s later: a thread's CUDA teardown waits on device work that not every rank ran "
           "(a collective or a CUDA graph replay issued by some ranks only)")),
       false);
}

void Watchdog::CheckStragglers(double timeout_s, int64_t timeout_ns) {
  if (straggler_reported_ || SteadyNowNs() - stopped_ns_ <= timeout_ns) return;
  straggler_reported_ = true;
  std::string ranks;
  for (int r = 0; r < world_size(); ++r) {
    if (states_[r].load() != RankState::kRunning) continue;
    absl::StrAppend(&ranks, ranks.empty() ? "" : ", ", RankName(r));
  }
  if (ranks.empty()) return;  // they have all returned and are finishing
  logger_->Write(LogLevel::kError, -1, nn::Device(),
                 absl::StrCat("watchdog: ", timeout_s, " s after the run stopped, spawn still "
                              "waits for ", ranks, ": running code that reaches no collective, "
                              "stop-aware wait or check_stop(); a second Ctrl-C exits at once"));
}

void Watchdog::CheckReturnedRanks() {
  for (int gone = 0; gone < world_size(); ++gone) {
    if (states_[gone].load() != RankState::kFinished) continue;
    // Final: a rank whose function has returned enters no more collectives.
    if (CheckReturnedRank(RankName(gone), traces_[gone].entered.load(std::memory_order_acquire))) {
      return;
    }
  }
  if (!returned_elsewhere_) return;
  for (const auto& [name, entered] : returned_elsewhere_()) {
    if (CheckReturnedRank(name, entered)) return;
  }
}

bool Watchdog::CheckReturnedRank(const std::string& gone, uint64_t gone_entered) {
  for (int r = 0; r < world_size(); ++r) {
    if (states_[r].load() != RankState::kRunning) continue;
    const CollectiveTrace& t = traces_[r];
    const uint64_t entered = t.entered.load(std::memory_order_acquire);
    // Work the returned rank entered but has not completed (NCCL, in flight)
    // is not counted against it: only a collective it never entered.
    if (entered <= t.completed.load(std::memory_order_acquire) || entered <= gone_entered) {
      continue;
    }
    // A labelled collective names its caller (Communicator::Label), which
    // says why every rank must reach it; otherwise the usual cause.
    const char* label = t.label.load(std::memory_order_relaxed);
    Fail(-1, absl::FailedPreconditionError(absl::StrCat(
                 "watchdog: ", gone, " returned from its function after entering ",
                 gone_entered, " collective(s), while ", RankName(r), " waits in ",
                 t.op.load(std::memory_order_relaxed), " #", entered,
                 FromLabel(label),
                 ", which it will never enter",
                 label != nullptr ? std::string()
                                  : ": the ranks ran different numbers of steps (uneven "
                                    "data); give every rank the same number of batches, or "
                                    "train inside DataParallel::join()")),
         false);
    return true;
  }
  return false;
}

std::optional<std::pair<uint64_t, int>> Watchdog::FewestEnteredByReturnedRank() const {
  std::optional<std::pair<uint64_t, int>> fewest;
  for (int r = 0; r < world_size(); ++r) {
    if (states_[r].load() != RankState::kFinished) continue;
    const uint64_t entered = traces_[r].entered.load(std::memory_order_acquire);
    if (!fewest.has_value() || entered < fewest->first) fewest = {{entered, rank_offset_ + r}};
  }
  return fewest;
}

uint64_t Watchdog::CollectiveWaitedIn(const char** op) const {
  uint64_t waited_in = 0;
  for (const CollectiveTrace& t : traces_) {
    const uint64_t entered = t.entered.load(std::memory_order_acquire);
    if (entered > t.completed.load(std::memory_order_acquire) && entered > waited_in) {
      waited_in = entered;
      if (op != nullptr) *op = t.op.load(std::memory_order_relaxed);
    }
  }
  return waited_in;
}

std::vector<int> Watchdog::RanksNotEntered(uint64_t collective) const {
  std::vector<int> behind;
  if (collective == 0) return behind;
  for (int r = 0; r < world_size(); ++r) {
    if (states_[r].load() == RankState::kRunning &&
        traces_[r].entered.load(std::memory_order_acquire) < collective) {
      behind.push_back(r);
    }
  }
  return behind;
}

std::string Watchdog::DescribeCollectives(int64_t now) const {
  std::string text;
  for (int r = 0; r < world_size(); ++r) {
    const CollectiveTrace& t = traces_[r];
    const uint64_t entered = t.entered.load(std::memory_order_acquire);
    const uint64_t completed = t.completed.load(std::memory_order_acquire);
    const RankState state = states_[r].load();
    absl::StrAppend(&text, " ", RankName(r), ": ");
    if (entered == 0) {
      absl::StrAppend(&text, "entered no collective");
    } else {
      absl::StrAppend(&text, entered > completed ? "waiting in " : "last completed ",
                      t.op.load(std::memory_order_relaxed), " #", entered);
      if (entered > completed) {
        absl::StrAppendFormat(
            &text, " for %.2f s",
            (now - t.entered_ns.load(std::memory_order_relaxed)) * 1e-9);
      }
    }
    absl::StrAppend(&text, state == RankState::kFinished ? " (fn returned)"
                           : state == RankState::kFailed ? " (failed)"
                                                         : " (running)",
                    r + 1 < world_size() ? ";" : "");
  }
  return text;
}

void Watchdog::CheckTimeouts(double timeout_s, int64_t timeout_ns) {
  const int64_t now = SteadyNowNs();
  bool stuck = false;
  for (auto& t : traces_) {
    const uint64_t entered = t.entered.load(std::memory_order_acquire);
    if (entered > t.completed.load(std::memory_order_acquire) &&
        now - t.entered_ns.load(std::memory_order_relaxed) > timeout_ns) {
      stuck = true;
    }
  }
  if (!stuck) return;
  std::string text = absl::StrCat("watchdog: a collective did not complete within ", timeout_s,
                                  " s;", DescribeCollectives(now));
  // The collective the stuck ranks wait in, and this process's running ranks
  // that have not entered it: the ranks they wait for (a rank stuck elsewhere:
  // a data loader, its own device). None when every rank entered it (the
  // collective itself hangs) or the ranks behind run in other processes.
  const char* op = "collective";
  const uint64_t waited_in = CollectiveWaitedIn(&op);
  const std::vector<int> behind = RanksNotEntered(waited_in);
  if (!behind.empty()) {
    absl::StrAppend(&text, "; the ranks in ", op, " #", waited_in, " wait for ");
    for (size_t i = 0; i < behind.size(); ++i) {
      absl::StrAppend(&text, i == 0 ? "" : i + 1 == behind.size() ? " and " : ", ",
                      RankName(behind[i]));
    }
    absl::StrAppend(&text, behind.size() == 1 ? ", which has not entered it"
                                              : ", which have not entered it");
  }
  // Several processes: which processes had not entered it.
  if (describe_remote_) absl::StrAppend(&text, ";", describe_remote_(waited_in));
  absl::Status status =
      WithFailureCause(absl::DeadlineExceededError(text), FailureCause::kTimeout);
  if (!behind.empty()) status = WithLaggingRanks(std::move(status), behind);
  Fail(-1, std::move(status), false);
}

}  // namespace tandem::dist::internal
