// Graceful stop on a signal: every rank stops at the SAME step boundary.
//
// Clusters stop jobs with SIGTERM (Slurm at the time limit or on preemption,
// Kubernetes on eviction) and SIGKILL a grace period later; Slurm's --signal
// sends SIGUSR1 ahead of the limit. While spawn runs, the signals of
// SpawnOptions::stop_signals (default SIGTERM, SIGUSR1) do not kill the process:
// they ask the run to stop, and the ranks agree on the step at which they all
// stop, so a checkpoint can be saved collectively (dist::CheckpointManager does
// it) before the run ends.
//
// The contract for a training function (what dist::CheckpointManager does):
//   for (...) {
//     ... one training step ...;   ++step;
//     if (ctx.AtStepBoundary(step).stop) {   // every rank, every step, consecutive steps
//       ... save a checkpoint (collectives still work) ...;
//       throw dist::StoppedError("...", step);   // or return
//     }
//   }
// Ranks of a data-parallel loop can be one step apart when the signal lands
// (one has finished step s, another is still in it). The agreement: at each
// boundary a rank records the step it passes; the first rank to see a pending
// stop sets the target to the smallest step that no rank has passed yet
// (max(its own step, every other rank's passed step + 1)); every rank stops at
// its boundary with step == target. So ranks that call AtStepBoundary at every
// step with consecutive values all get stop == true at the same step, and the
// collectives of the save line up. The same agreement serves saves that a rank
// decides on its own (e.g. rank 0's clock for --checkpoint_every_minutes):
// AtStepBoundary(step, /*propose_save=*/true).
//
// What happens when the contract is not kept:
//   - A stop signal before any rank has reached a step boundary (or in a
//     function that never calls AtStepBoundary) cancels the run at once, as
//     Ctrl-C does (collectives throw), because no step boundary could be agreed
//     on; spawn's status is still IsStopped(), with no step: nothing was trained
//     since the last checkpoint (there were no boundaries).
//   - Ranks that have not all stopped within SpawnOptions::stop_grace_s of the
//     signal end the run with DeadlineExceeded naming each rank's last step.
//
// spawn's status: when a rank throws StoppedError (after the agreed stop) spawn
// does not treat it as a failure: the other ranks keep their collectives for
// the save; once all threads are joined spawn returns Cancelled with a payload
// that IsStopped() recognises ("stopped by SIGTERM at step S"). A failure of
// any rank still wins. Ctrl-C (SIGINT) is not a stop signal in one process: it
// stops at once without an agreed step (see SpawnOptions::handle_sigint); in a
// job of several processes spawn's watchdog turns it into RequestStop (spawn/launch.h).
//
// Several processes (mpirun, srun): the target must be the same in every
// process, and ranks of different processes share no memory. There the
// agreement runs in rounds on the processes' communication threads (spawn's
// caller, the MPI thread): every ~10 ms, and at once while something is
// pending, each process contributes (stop signal seen, save wanted, the
// largest step its ranks arrived at, ranks still running) to an all-reduce
// (MAX) of its own, apart from the ranks' traffic. A round that reports a stop
// (or a save) makes every process HOLD its ranks at their next boundary; the
// next round's largest arrived step M then bounds every rank (none can pass a
// boundary it has not reported while held), and every process sets the target
// to M + 1 and releases its ranks. The hold lasts two rounds (about a
// millisecond on one host), once per stop or save, never on ordinary steps.
// A signal sent to any one process stops them all; the other processes name
// the signal from the round ("SIGTERM on another process").
//
// Thread-safety: the signal handlers only bump atomic counters
// (async-signal-safe); StepAgreement is called from the rank threads, the
// watchdog and the communication thread under one mutex.
#ifndef TANDEM_SPAWN_SIGNALS_H_
#define TANDEM_SPAWN_SIGNALS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist {

// Thrown on every rank after the agreed stop (and the save): spawn records the
// rank as stopped, not failed. A CancelledError, so code that does not know it
// still treats it as an interruption.
class StoppedError : public CancelledError {
 public:
  StoppedError(const std::string& what, int64_t step) : CancelledError(what), step_(step) {}
  int64_t step() const { return step_; }

 private:
  int64_t step_;
};

// True when `status` is spawn's "every rank stopped after a stop signal"
// (see the file comment). The code is kCancelled.
bool IsStopped(const absl::Status& status);
// The step at which the ranks stopped, or nullopt (not a stop, or the stop came
// before any step boundary).
std::optional<int64_t> StoppedAtStep(const absl::Status& status);

// "SIGTERM", "SIGUSR1", ... or "signal N".
std::string SignalName(int signal);

// Installs a counting handler for each of `signals` for the scope's lifetime
// (the previous handlers are restored when the last scope using a signal
// ends); Received() compares the process-wide counts with those at the scope's
// start. spawn makes one per run; a program can make one at its start and
// pass it as SpawnOptions::stop_signal_source, so that a signal that arrives
// before spawn (while data loads) neither kills the process nor is missed. SIGINT is refused (spawn's own Ctrl-C handler owns it), as are
// SIGKILL/SIGSTOP and numbers outside 1..NSIG-1.
class StopSignalScope {
 public:
  static absl::Status Validate(const std::vector<int>& signals);
  // `signals` must have passed Validate.
  explicit StopSignalScope(std::vector<int> signals);
  ~StopSignalScope();
  StopSignalScope(const StopSignalScope&) = delete;
  StopSignalScope& operator=(const StopSignalScope&) = delete;

  // The first of the scope's signals received since the scope began, or 0.
  int Received() const;

 private:
  std::vector<int> signals_;
  std::vector<uint64_t> at_start_;
};

namespace internal {

// The per-run agreement on step boundaries (see the file comment).
class StepAgreement {
 public:
  // `signals` may be null (no stop signals: only RequestStop stops).
  // `cross_process`: this process is one of several; ApplyRound, driven by the
  // communication thread, decides the targets (see the file comment).
  StepAgreement(int world_size, const StopSignalScope* signals, double grace_s,
                bool cross_process = false);

  struct Decision {
    bool stop = false;  // stop (after saving) at this step
    bool save = false;  // a save agreed on through propose_save is due at this step
  };
  // Local rank `rank` is at the boundary after step `step`. Across processes it
  // may wait here (briefly, while a round decides a target); `stop` ends that
  // wait with CancelledError.
  Decision AtBoundary(int rank, int64_t step, bool propose_save, std::stop_token stop = {});
  // Asks for a stop as a stop signal would (tests, or a program's own reason).
  // `signal`: the signal behind the request, named to the other processes
  // ("SIGINT on another process"); 0: "a stop request on another process".
  void RequestStop(const std::string& reason, int signal = 0);
  // Rank `rank` threw StoppedError.
  void RankStopped(int rank);
  // The watchdog, every poll: non-OK when the run must be cancelled (a stop
  // before any boundary: IsStopped status; the grace period ran out:
  // DeadlineExceeded). Returns non-OK at most once.
  absl::Status Poll();
  // After every rank returned: the IsStopped status when a rank stopped, else OK.
  absl::Status Outcome();

  // Several processes: one round of the exchange. The communication thread
  // takes LocalRound(), reduces every field with MAX over the processes, and
  // hands the result to ApplyRound().
  static constexpr int64_t kNone = INT64_MIN;
  static constexpr int64_t kStopRequestCode = 1000;  // RequestStop (signals are < NSIG)
  struct Round {
    int64_t stop_code = 0;    // a stop signal's number, kStopRequestCode, or 0
    int64_t save_wanted = 0;  // 1: a rank proposed a save
    int64_t arrived = kNone;  // the largest step a local rank arrived at
  };
  Round LocalRound();
  void ApplyRound(const Round& all);
  // Something waits for a round: the communication thread should start one now.
  bool Urgent();

 private:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kIdle, kHoldForSave, kHoldForStop, kStopAgreed };
  // Notes a pending signal. Caller holds mutex_.
  void NoteSignalsLocked();
  // Marks the stop as requested (once). Caller holds mutex_.
  void RequestStopLocked(const std::string& reason);
  // The smallest step no rank other than `rank` has passed, at least `step`.
  int64_t TargetLocked(int rank, int64_t step) const;
  // A save target at or after `step` is already set. Caller holds mutex_.
  bool SaveDueLocked(int64_t step) const;
  // Drops the save targets at or before every rank's step in `decided` (the
  // last step each rank got its decision for). Caller holds mutex_.
  void PruneSaveTargetsLocked(const std::vector<int64_t>& decided);
  Decision CrossProcessBoundary(std::unique_lock<std::mutex>& lock, int rank, int64_t step,
                                bool propose_save, const std::stop_token& stop);

  const int world_size_;
  const StopSignalScope* signals_;
  const double grace_s_;
  const bool cross_process_;
  std::mutex mutex_;
  std::vector<int64_t> passed_;  // last boundary step each rank passed (across processes:
                                 // arrived at), kNone before the first
  std::vector<bool> stopped_;
  bool stop_requested_ = false;
  std::string stop_reason_;  // "SIGTERM"
  Clock::time_point stop_seen_;
  int64_t stop_target_ = kNone;
  std::set<int64_t> save_targets_;
  bool escalated_ = false;
  // Across processes only.
  std::vector<int64_t> decided_;  // the last step each rank got its decision for
  int64_t local_stop_code_ = 0;  // noted here, not yet in a round's result
  std::string local_reason_;
  bool local_save_wanted_ = false;
  Phase phase_ = Phase::kIdle;
  std::condition_variable_any released_;  // ranks held at a boundary wait here
  Clock::time_point hold_since_;          // when kHoldForSave began
  absl::Status pending_;                  // for Poll: a stop before any boundary
};

// The IsStopped status.
absl::Status StoppedStatus(const std::string& reason, std::optional<int64_t> step,
                           const std::string& detail);

}  // namespace internal
}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_SIGNALS_H_
