// The watchdog of one spawn run (internal to spawn/): records the first
// failure and stops the run, aborts the communicators as soon as it stops (on
// an aborter thread, never waiting for good), fails the run on a library's
// asynchronous error, ends a collective that takes longer than timeout_s,
// reports stragglers after a stop, and lives until every rank thread has been
// joined. spawn/launch.cc starts it; docs/gpu.md has the long form.
#ifndef TANDEM_SPAWN_INTERNAL_WATCHDOG_H_
#define TANDEM_SPAWN_INTERNAL_WATCHDOG_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "nn/device.h"
#include "spawn/comm/communicator.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"
#include "spawn/logger.h"
#include "spawn/signals.h"

namespace tandem::dist::internal {

enum class RankState : int { kRunning, kFinished, kFailed };

// How long the watchdog's abort waits for a rank's library call in progress,
// at most (less when timeout_s is shorter), and the exit status of the process
// it then ends.
constexpr double kMaxAbortWaitS = 10;
constexpr int kAbortStuckExitStatus = 1;
// The longest timeout_s a run accepts (about 31.7 years): the watchdog counts in
// int64 nanoseconds, which end near 9.2e9 s; beyond this (and +inf) spawn refuses.
constexpr double kMaxTimeoutS = 1e9;

// The state of one run shared by spawn's thread, the rank threads and the
// watchdog thread, and the watchdog's loop (Watch). Thread-safe where a method
// says "any thread"; Watch and its helpers run on the watchdog thread only.
class Watchdog {
 public:
  Watchdog(std::vector<nn::Device> devices, Logger* logger, std::shared_ptr<InProcessGroup> group,
      const std::vector<std::unique_ptr<Communicator>>* comms, int rank_offset = 0,
      std::string where = "");

  std::stop_token stop_token() const { return stop_.get_token(); }
  bool stop_requested() const { return stop_.stop_requested(); }
  CollectiveTrace* trace(int rank) { return &traces_[rank]; }
  // Sizes every rank's flight recorder (0: off); before the rank threads start.
  void SetFlightRecorderEntries(int entries);
  // The fewest collectives one of this process's ranks has entered (any thread).
  uint64_t FewestCollectivesEntered() const;
  // Several processes: the watchdog's timeout message ends with what this says
  // about the other processes (ProcessWorld::DescribeProgress). Set before Watch.
  void set_describe_remote(std::function<std::string(uint64_t)> describe) {
    describe_remote_ = std::move(describe);
  }
  // The local rank whose function has returned having entered the fewest
  // collectives: (collectives entered, global rank); nullopt when none (any thread).
  std::optional<std::pair<uint64_t, int>> FewestEnteredByReturnedRank() const;
  // Several processes: the ranks of the other processes whose functions have
  // returned, as (name, collectives entered), from the last round between the
  // processes (ProcessWorld::ReturnedRanksElsewhere); CheckReturnedRanks holds
  // this process's waiting ranks against them too. Set before Watch.
  void set_returned_elsewhere(
      std::function<std::vector<std::pair<std::string, uint64_t>>()> returned) {
    returned_elsewhere_ = std::move(returned);
  }
  // Several processes: Ctrl-C asks the step agreement for a stop, as SIGTERM
  // does, so that every process stops at one step boundary and ends on its own.
  // Cancelling this process's ranks at once would leave the other processes in
  // collectives with them: the job would end through MPI_Abort, a failure.
  // Set before Watch.
  void set_sigint_agreed() { sigint_agreed_ = true; }
  int world_size() const { return static_cast<int>(devices_.size()); }

  std::string RankName(int rank) const;

  // Records a failure. The first one wins and stops the run; later ones are
  // logged as consequences. `cancelled`: the rank only noticed the stop.
  // `peer`: the failure reports another rank's (PeerFailedError); a later failure
  // of that rank's own (neither cancelled nor peer) replaces it as the run's cause.
  // `interrupt`: Ctrl-C's stop. It and an IsStopped() status (a stop signal
  // before any step boundary) are planned stops, not failures: logged as
  // information, and the ranks that only noticed them are not logged as
  // consequences of a failure (no ERROR line for a stop the user asked for).
  void Fail(int rank, absl::Status status, bool cancelled, bool peer = false,
            bool interrupt = false);

  // spawn's thread, once every rank thread has been joined: the watchdog may end.
  void Joined();

  void Finish(int rank);

  // True once a round of the watchdog's polls that began after every rank's
  // Finish has ended (any thread): a failure that round found (an asynchronous
  // error) has requested the stop before this reads true.
  bool PolledAfterEveryRankFinished() const {
    return polled_after_finish_.load(std::memory_order_acquire);
  }

  absl::Status result() {
    std::lock_guard<std::mutex> lock(mutex_);
    return first_;
  }

  // A rank thread, after Finish: when the run is stopping, returns once the
  // watchdog has aborted the communicators. The thread's CUDA teardown (its
  // thread-local handles: cudnnDestroy synchronises the device) then runs after
  // the abort, when no stream of the thread waits on a collective any more.
  void AwaitAbortIfStopping() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return aborted_ || !stop_.stop_requested(); });
  }

  // The watchdog. Until every rank thread has been joined (and, in a stopping
  // run, the communicators are aborted): turns SIGINT into a stop; aborts every
  // communicator as soon as the run stops, not after the joins (a rank blocked
  // on a stream behind a collective that a failed peer never joined would not
  // join); fails the run on a communicator's asynchronous error; ends a run
  // whose collective takes longer than timeout_s; and, once stopped, reports
  // ranks that have not returned timeout_s later.
  //
  // It lives until the joins, not only until the rank functions return: a
  // thread's exit still runs its CUDA teardown (cudnnDestroy synchronises the
  // device), which waits for good behind device work that not every rank ran
  // (a collective of uneven batches; a CUDA graph replayed once more on one
  // rank). Traced work shows as a collective in flight and times out; rank
  // threads that all returned but have not exited timeout_s later fail the run
  // too, and the abort then lets their teardown end. Requests to stop that come
  // late (the MPI thread's fail hook) still reach a live watchdog. After the
  // joins it goes on while a collective is in flight: the communicators'
  // destruction (ncclCommFinalize) would wait for it.
  // sigint_count: the process's SIGINT counter (spawn's handler); a change
  // from sigint_at_start is a Ctrl-C. exit_process: ends the process (never
  // null; tests inject one that returns).
  void Watch(double timeout_s, const std::atomic<uint64_t>& sigint_count,
             uint64_t sigint_at_start, StepAgreement& agreement, void (*exit_process)(int));

 private:
  // The first failure's flight recorder dump: every rank's ring, to the log
  // after the error line, once per run (spawn/comm/flight_recorder.h).
  void WriteFlightRecorders();

  // True when a rank has entered a collective that is not complete yet.
  bool AnyCollectiveInFlight() const;

  // Fails the run with the first asynchronous error a communicator reports:
  // a device's (Communicator::PollDeviceError, FailureCause::kDevice) when any
  // rank's has one, else a communicator's own (PollAsyncError,
  // FailureCause::kCommunicator).
  void PollAsyncErrors();

  // Aborts every communicator, on a thread of its own: an abort may itself
  // wait (a rank's library call in progress, at most the deadline
  // min(timeout_s, 10 s); NCCL's last ncclCommAbort until every CUDA graph
  // holding its work is destroyed, which a rank that reaches no stop-aware
  // point never does), and the watchdog goes on polling meanwhile. An abort
  // that reports it could not run, or that has not returned two deadlines
  // after it began, would leave the run waiting for good: the process ends,
  // the run's first failure and the reason written first. Watchdog thread.
  void AbortCommunicators(double timeout_s, void (*exit_process)(int));

  // The aborter thread: every communicator, then the outcome for the watchdog.
  void AbortAll(double deadline_s);

  // Watchdog thread, after an abort that could not run or did not return.
  void EndProcess(const absl::Status& why, void (*exit_process)(int));

  // Rank threads that all returned but have not exited timeout_s later: their
  // teardown waits on device work that the trace does not show (see Watch).
  void CheckExits(double timeout_s, int64_t timeout_ns);

  // A stopped run whose rank threads have not all returned timeout_s after the
  // stop: those ranks are in code that reaches neither a collective nor a
  // stop-aware wait nor check_stop(). Threads are not killed; say once which
  // ranks spawn is waiting for.
  void CheckStragglers(double timeout_s, int64_t timeout_ns);

  // A collective in flight longer than timeout_s fails the run
  // (DeadlineExceeded, FailureCause::kTimeout) naming each rank's last
  // collective. When running ranks of this process have not entered the
  // collective the stuck ranks wait in, the message names them and the status
  // carries them (local ranks) as its lagging ranks (WithLaggingRanks,
  // spawn/internal/restart.h): RestartPolicy::leave_out_failed_rank leaves out
  // one such rank.
  void CheckTimeouts(double timeout_s, int64_t timeout_ns);
  // " rank 0 (cpu): waiting in all_reduce #9 for 1.20 s (running); ...": every
  // rank's last collective, for the timeout's message.
  std::string DescribeCollectives(int64_t now) const;
  // The collective the ranks in flight wait in: the highest number one of them
  // has entered (0 when none is in flight), and its name in *op when not null.
  uint64_t CollectiveWaitedIn(const char** op = nullptr) const;
  // The running local ranks that have not entered collective `collective`
  // (none for 0), in rank order.
  std::vector<int> RanksNotEntered(uint64_t collective) const;

  // A rank of this process whose function has returned while another waits in a
  // collective numbered above the last one the returned rank entered: that
  // collective can never complete, so the run fails now (naming both, and
  // DataParallel::join() as the remedy for uneven data) instead of at timeout_s.
  // Ranks of other processes count too, as the last round between the
  // processes reported them (set_returned_elsewhere).
  void CheckReturnedRanks();
  // The check for one returned rank: fails the run and returns true when a
  // running local rank waits in a collective numbered above `gone_entered`.
  bool CheckReturnedRank(const std::string& gone, uint64_t gone_entered);


  const int rank_offset_;
  const std::string where_;
  const std::vector<nn::Device> devices_;
  Logger* logger_;
  std::shared_ptr<InProcessGroup> group_;
  const std::vector<std::unique_ptr<Communicator>>* comms_;
  std::vector<CollectiveTrace> traces_;
  std::vector<std::atomic<RankState>> states_;
  std::stop_source stop_;
  std::mutex mutex_;
  std::condition_variable cv_;
  absl::Status first_;
  bool first_is_peer_ = false;  // first_ reports another rank's failure
  bool first_is_planned_ = false;  // first_ is a planned stop (see Fail)
  int finished_ = 0;
  int64_t all_finished_ns_ = 0;  // when finished_ reached world_size()
  bool joined_ = false;   // every rank thread was joined (guarded by mutex_)
  bool aborted_ = false;  // the communicators were aborted (guarded by mutex_)
  bool flight_written_ = false;  // WriteFlightRecorders ran (guarded by mutex_)
  std::atomic<bool> polled_after_finish_{false};  // PolledAfterEveryRankFinished
  // Watchdog thread only.
  int64_t stopped_ns_ = 0;
  bool straggler_reported_ = false;
  bool abort_escalated_ = false;
  std::thread aborter_;  // runs AbortAll; started and joined by the watchdog
  int64_t abort_started_ns_ = 0;
  // The aborter's outcome once it has returned (guarded by mutex_).
  std::optional<absl::Status> abort_outcome_;
  bool sigint_requested_ = false;  // the agreement was asked to stop (sigint_agreed_)
  std::function<std::string(uint64_t)> describe_remote_;
  std::function<std::vector<std::pair<std::string, uint64_t>>()> returned_elsewhere_;
  bool sigint_agreed_ = false;
};

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_INTERNAL_WATCHDOG_H_
