#include "spawn/spawn.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nn/interrupt.h"
#include "nn/random.h"
#include "nn/status_macros.h"
#include "spawn/inprocess_communicator.h"
#include "spawn/signals.h"
#include "spawn/internal/process_world.h"
#if TANDEM_WITH_CUDA
#include "spawn/internal/nccl.h"
#endif

namespace tandem::dist::internal {
namespace {

// --- SIGINT ---------------------------------------------------------------------
// The first SIGINT only bumps a counter (async-signal-safe); each run's watchdog
// polls it and stops the run. The second one since the handler was installed
// exits the process at once, from the handler (write and _exit are
// async-signal-safe), with status 128 + SIGINT: the run is stopped, and a rank
// that never reaches a stop-aware point cannot hold the process. Installed by the
// first concurrent run, restored by the last.
std::atomic<uint64_t> g_sigint_count{0};
std::atomic<uint64_t> g_sigint_base{0};  // g_sigint_count when the handler was installed
constexpr int kSecondSigintExitStatus = 128 + SIGINT;

void ExitProcessNow(int status) { _exit(status); }
std::atomic<void (*)(int)> g_exit_process{&ExitProcessNow};
std::mutex g_sigint_mutex;
int g_sigint_users = 0;
struct sigaction g_previous_sigint;

extern "C" void OnSigint(int) {
  const uint64_t count = g_sigint_count.fetch_add(1, std::memory_order_relaxed) + 1;
  if (count - g_sigint_base.load(std::memory_order_relaxed) >= 2) {
    static const char kMessage[] =
        "\nspawn: second SIGINT: exiting now (the run is cancelled; exit status 130)\n";
    [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    g_exit_process.load(std::memory_order_relaxed)(kSecondSigintExitStatus);
  }
}

static_assert(std::atomic<void (*)(int)>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the SIGINT handler's atomics must be lock-free to be async-signal-safe");

class SigintScope {
 public:
  SigintScope(bool enabled, void (*exit_process)(int)) : enabled_(enabled) {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(g_sigint_mutex);
    if (g_sigint_users++ == 0) {
      g_exit_process.store(exit_process != nullptr ? exit_process : &ExitProcessNow);
      g_sigint_base.store(g_sigint_count.load());
      struct sigaction action {};
      action.sa_handler = OnSigint;
      sigemptyset(&action.sa_mask);
      sigaction(SIGINT, &action, &g_previous_sigint);
    }
  }
  ~SigintScope() {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(g_sigint_mutex);
    if (--g_sigint_users == 0) {
      sigaction(SIGINT, &g_previous_sigint, nullptr);
      g_exit_process.store(&ExitProcessNow);
    }
  }

 private:
  bool enabled_;
};

enum class RankState : int { kRunning, kFinished, kFailed };

// How long the watchdog's abort waits for a rank's library call in progress,
// at most (less when timeout_s is shorter), and the exit status of the process
// it then ends.
constexpr double kMaxAbortWaitS = 10;
constexpr int kAbortStuckExitStatus = 1;

// The state of one run shared by spawn's thread, the rank threads and the watchdog.
class Run {
 public:
  Run(std::vector<nn::Device> devices, Logger* logger, std::shared_ptr<InProcessGroup> group,
      const std::vector<std::unique_ptr<Communicator>>* comms, int rank_offset = 0,
      std::string where = "")
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

  std::stop_token stop_token() const { return stop_.get_token(); }
  bool stop_requested() const { return stop_.stop_requested(); }
  CollectiveTrace* trace(int rank) { return &traces_[rank]; }
  // The fewest collectives one of this process's ranks has entered (any thread).
  uint64_t FewestCollectivesEntered() const {
    uint64_t fewest = UINT64_MAX;
    for (const CollectiveTrace& t : traces_) {
      fewest = std::min(fewest, t.entered.load(std::memory_order_acquire));
    }
    return fewest == UINT64_MAX ? 0 : fewest;
  }
  // Several processes: the watchdog's timeout message ends with what this says
  // about the other processes (ProcessWorld::DescribeProgress). Set before Watch.
  void set_describe_remote(std::function<std::string(uint64_t)> describe) {
    describe_remote_ = std::move(describe);
  }
  // Several processes: Ctrl-C asks the step agreement for a stop, as SIGTERM
  // does, so that every process stops at one step boundary and ends on its own.
  // Cancelling this process's ranks at once would leave the other processes in
  // collectives with them: the job would end through MPI_Abort, a failure.
  // Set before Watch.
  void set_sigint_agreed() { sigint_agreed_ = true; }
  int world_size() const { return static_cast<int>(devices_.size()); }

  std::string RankName(int rank) const {
    // Several processes: the global rank, and where it runs.
    return absl::StrCat("rank ", rank_offset_ + rank, " (", devices_[rank].ToString(),
                        where_.empty() ? "" : ", ", where_, ")");
  }

  // Records a failure. The first one wins and stops the run; later ones are
  // logged as consequences. `cancelled`: the rank only noticed the stop.
  // `peer`: the failure reports another rank's (PeerFailedError); a later failure
  // of that rank's own (neither cancelled nor peer) replaces it as the run's cause.
  // `interrupt`: Ctrl-C's stop. It and an IsStopped() status (a stop signal
  // before any step boundary) are planned stops, not failures: logged as
  // information, and the ranks that only noticed them are not logged as
  // consequences of a failure (no ERROR line for a stop the user asked for).
  void Fail(int rank, absl::Status status, bool cancelled, bool peer = false,
            bool interrupt = false) {
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

  // spawn's thread, once every rank thread has been joined: the watchdog may end.
  void Joined() {
    std::lock_guard<std::mutex> lock(mutex_);
    joined_ = true;
    cv_.notify_all();
  }

  void Finish(int rank) {
    RankState running = RankState::kRunning;
    states_[rank].compare_exchange_strong(running, RankState::kFinished);
    std::lock_guard<std::mutex> lock(mutex_);
    if (++finished_ == world_size()) all_finished_ns_ = SteadyNowNs();
    cv_.notify_all();
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
  void Watch(double timeout_s, uint64_t sigint_at_start, StepAgreement& agreement,
             void (*exit_process)(int)) {
    const int64_t timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
    const auto poll = std::chrono::milliseconds(
        std::clamp<int64_t>(static_cast<int64_t>(timeout_s * 1000 / 10), 1, 100));
    std::unique_lock<std::mutex> lock(mutex_);
    while (!joined_ || (stop_.stop_requested() && !aborted_) ||
           (!stop_.stop_requested() && AnyCollectiveInFlight())) {
      // Woken at once by the first failure (Fail notifies) and by the aborter.
      cv_.wait_for(lock, poll, [&] { return stop_.stop_requested() && !aborter_.joinable(); });
      const bool aborted = aborted_;  // the aborter thread writes it
      lock.unlock();
      if (g_sigint_count.load(std::memory_order_relaxed) != sigint_at_start &&
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
      if (stop_.stop_requested() && !aborted) {
        AbortCommunicators(timeout_s, exit_process);
        CheckAbortOutcome(exit_process);
      }
      for (const auto& comm : *comms_) comm->PollCompleted();
      if (!stop_.stop_requested()) {
        CheckTimeouts(timeout_s, timeout_ns);
        CheckExits(timeout_s, timeout_ns);
      } else {
        CheckStragglers(timeout_s, timeout_ns);
      }
      lock.lock();
    }
    lock.unlock();
    if (aborter_.joinable()) aborter_.join();
  }

 private:
  // True when a rank has entered a collective that is not complete yet.
  bool AnyCollectiveInFlight() const {
    for (const CollectiveTrace& t : traces_) {
      if (t.entered.load(std::memory_order_acquire) > t.completed.load(std::memory_order_acquire)) {
        return true;
      }
    }
    return false;
  }

  // Fails the run with the first asynchronous error a communicator reports.
  void PollAsyncErrors() {
    for (size_t r = 0; r < comms_->size(); ++r) {
      absl::Status error = (*comms_)[r]->PollAsyncError();
      if (!error.ok()) {
        Fail(static_cast<int>(r),
             absl::Status(error.code(), absl::StrCat(RankName(static_cast<int>(r)), ": ",
                                                     error.message())),
             false);
        return;
      }
    }
  }

  // Aborts every communicator, on a thread of its own: an abort may itself
  // wait (a rank's library call in progress, at most the deadline
  // min(timeout_s, 10 s); NCCL's last ncclCommAbort until every CUDA graph
  // holding its work is destroyed, which a rank that reaches no stop-aware
  // point never does), and the watchdog goes on polling meanwhile. An abort
  // that reports it could not run, or that has not returned two deadlines
  // after it began, would leave the run waiting for good: the process ends,
  // the run's first failure and the reason written first. Watchdog thread.
  void AbortCommunicators(double timeout_s, void (*exit_process)(int)) {
    if (stopped_ns_ == 0) stopped_ns_ = SteadyNowNs();
    const double deadline_s = std::min(timeout_s, kMaxAbortWaitS);
    bool done;
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done = abort_done_;
      status = abort_status_;
    }
    if (!aborter_.joinable() || (done && !status.ok() && abort_escalated_)) {
      // The first start, or a retry after an injected exit returned (tests).
      if (aborter_.joinable()) aborter_.join();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        abort_done_ = false;
        abort_status_ = absl::OkStatus();
      }
      abort_escalated_ = false;
      abort_started_ns_ = SteadyNowNs();
      aborter_ = std::thread([this, deadline_s] { AbortAll(deadline_s); });
      return;
    }
    if (done || abort_escalated_) return;  // aborted_ is set on success
    if (static_cast<double>(SteadyNowNs() - abort_started_ns_) * 1e-9 <= 2 * deadline_s) return;
    status = absl::DeadlineExceededError(absl::StrCat(
        "the abort of the communicators has not returned after ", 2 * deadline_s,
        " s (NCCL's last abort waits until every CUDA graph that holds its collectives is "
        "destroyed: a rank that keeps one and reaches no collective, stop-aware wait or "
        "check_stop() holds it)"));
    EndProcess(status, exit_process);
  }

  // The aborter thread: every communicator, then the outcome for the watchdog.
  void AbortAll(double deadline_s) {
    const auto deadline = std::chrono::nanoseconds(static_cast<int64_t>(deadline_s * 1e9));
    absl::Status status;
    for (const auto& comm : *comms_) {
      absl::Status one = comm->Abort(deadline);
      if (!one.ok() && status.ok()) status = std::move(one);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    abort_done_ = true;
    abort_status_ = status;
    if (status.ok()) aborted_ = true;
    cv_.notify_all();
  }

  // Watchdog thread, after an abort that could not run or did not return.
  void EndProcess(const absl::Status& why, void (*exit_process)(int)) {
    abort_escalated_ = true;
    logger_->Write(LogLevel::kError, -1, nn::Device(),
                   absl::StrCat("spawn: ending the process (exit status ", kAbortStuckExitStatus,
                                ") after the run stopped (", result().message(), "): ",
                                why.message()));
    (exit_process != nullptr ? exit_process : &ExitProcessNow)(kAbortStuckExitStatus);
  }

  // Watchdog thread: escalates an abort that reported it could not run.
  void CheckAbortOutcome(void (*exit_process)(int)) {
    absl::Status status;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!abort_done_ || abort_status_.ok()) return;
      status = abort_status_;
    }
    if (!abort_escalated_) EndProcess(status, exit_process);
  }

  // Rank threads that all returned but have not exited timeout_s later: their
  // teardown waits on device work that the trace does not show (see Watch).
  void CheckExits(double timeout_s, int64_t timeout_ns) {
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

  // A stopped run whose rank threads have not all returned timeout_s after the
  // stop: those ranks are in code that reaches neither a collective nor a
  // stop-aware wait nor check_stop(). Threads are not killed; say once which
  // ranks spawn is waiting for.
  void CheckStragglers(double timeout_s, int64_t timeout_ns) {
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

  void CheckTimeouts(double timeout_s, int64_t timeout_ns) {
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
    std::string text =
        absl::StrCat("watchdog: a collective did not complete within ", timeout_s, " s;");
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
    if (describe_remote_) {
      // The collective the stuck ranks wait in: which processes had not entered it.
      uint64_t waiting_for = 0;
      for (const CollectiveTrace& t : traces_) {
        const uint64_t entered = t.entered.load(std::memory_order_acquire);
        if (entered > t.completed.load(std::memory_order_acquire)) {
          waiting_for = std::max(waiting_for, entered);
        }
      }
      absl::StrAppend(&text, ";", describe_remote_(waiting_for));
    }
    Fail(-1, absl::DeadlineExceededError(text), false);
  }


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
  // Watchdog thread only.
  int64_t stopped_ns_ = 0;
  bool straggler_reported_ = false;
  bool abort_escalated_ = false;
  std::thread aborter_;  // runs AbortAll; started and joined by the watchdog
  int64_t abort_started_ns_ = 0;
  // The aborter's outcome (guarded by mutex_).
  bool abort_done_ = false;
  absl::Status abort_status_;
  bool sigint_requested_ = false;  // the agreement was asked to stop (sigint_agreed_)
  std::function<std::string(uint64_t)> describe_remote_;
  bool sigint_agreed_ = false;
};

std::string CommunicatorKind(const std::vector<nn::Device>& devices) {
  if (devices[0].is_cpu()) return "in-process (CPU ranks)";
  if (HasSharedGpu(devices)) return "in-process (ranks share GPUs)";
  return "NCCL";
}

void LogEnvironment(Logger& logger, const std::vector<nn::Device>& devices,
                    const SpawnOptions& options, absl::string_view gpus, int visible_gpus,
                    const ProcessWorld* procs) {
  auto line = [&](absl::string_view key, absl::string_view value) {
    logger.Write(LogLevel::kInfo, -1, nn::Device(), absl::StrFormat("  %-16s %s", key, value));
  };
  logger.Write(LogLevel::kInfo, -1, nn::Device(), "distributed environment");
  line("world_size", absl::StrCat(procs ? procs->world_size() : devices.size()));
  line("gpus", absl::StrCat("\"", gpus, "\""));
  line("visible", DescribeVisibleGpus(visible_gpus));
  line("communicator", procs == nullptr   ? CommunicatorKind(devices)
                       : devices[0].is_cpu() ? "hierarchical: in-process + MPI (CPU ranks)"
                                             : "NCCL across processes");
#if TANDEM_WITH_CUDA
  line("versions", CudaNcclVersions());
#else
  line("versions", "built without CUDA");
#endif
  line("timeout_s", absl::StrCat(options.timeout_s));
  line("seed", absl::StrCat(options.seed));
  line("log_dir", options.log_dir.empty() ? "(none)" : options.log_dir);
  if (procs != nullptr) {
    for (const auto& [key, value] : procs->Describe()) line(key, value);
  } else {
    for (size_t r = 0; r < devices.size(); ++r) {
      line(absl::StrCat("rank ", r), devices[r].ToString());
    }
  }
  if (devices[0].is_cpu() && gpus.empty()) {
    logger.Write(LogLevel::kWarning, -1, nn::Device(),
                 "no GPU is visible: running on CPU ranks");
  }
}

// More rank threads than one process runs (a typo such as --nprocs=100000) is
// an error before any thread starts.
constexpr int kMaxRanksPerProcess = 1024;

absl::Status CheckRankCount(int ranks) {
  if (ranks > kMaxRanksPerProcess) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spawn: ", ranks, " ranks in one process: at most ", kMaxRanksPerProcess,
        " rank threads per process (check nprocs / --nprocs; use several processes for more)"));
  }
  return absl::OkStatus();
}

// Rank thread, once its function has returned or thrown: CUDA graphs that
// still hold the rank's collectives (kept in a thread_local, a static or
// outside the function) would make NCCL's abort and destroy wait for good.
// They are released, and keeping one is the rank's failure, naming them.
void ReleaseGraphsOnReturn(Run& run, int rank, Communicator& comm) {
  std::vector<std::string> graphs;
  try {
    graphs = comm.ReleaseGraphs(
        "it held NCCL collectives of a spawn run whose training function returned (destroy "
        "such graphs before it returns)");
  } catch (const std::exception& e) {
    graphs.push_back(absl::StrCat("(releasing them failed: ", e.what(), ")"));
  }
  if (graphs.empty()) return;
  run.Fail(rank,
           absl::FailedPreconditionError(absl::StrCat(
               run.RankName(rank), " returned while ", graphs.size(), " CUDA graph",
               graphs.size() == 1 ? "" : "s", " holding its NCCL collectives ",
               graphs.size() == 1 ? "was" : "were", " still alive: ", absl::StrJoin(graphs, ", "),
               "; released (a later replay throws). NCCL's abort and destroy wait until every "
               "such graph is gone: destroy them before the training function returns")),
           false);
}

absl::Status StartThread(std::vector<std::thread>& threads, const std::function<void()>& main) {
  try {
    threads.emplace_back(main);
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not start its thread (", threads.size(), " running): ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSpawn(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                      const std::function<void(int world_size)>& on_world_size,
                      const std::function<absl::Status(Context&)>& body) {
  return RunSpawnWithHooks(gpus, nprocs, options, SpawnHooks(), on_world_size, body);
}

absl::Status RunSpawnWithHooks(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                               const SpawnHooks& hooks,
                               const std::function<void(int world_size)>& on_world_size,
                               const std::function<absl::Status(Context&)>& body) {
  if (current_or_null() != nullptr) {
    return absl::FailedPreconditionError(
        "spawn called from a rank thread of another spawn: runs do not nest");
  }
  if (!(options.timeout_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SpawnOptions::timeout_s must be positive, not ", options.timeout_s));
  }
  RETURN_IF_ERROR(StopSignalScope::Validate(options.stop_signals));
  const int visible_gpus = nn::cuda_device_count();
  ASSIGN_OR_RETURN(std::vector<nn::Device> devices,
                   SelectDevices(gpus, nprocs, visible_gpus, options.share_devices));
  const int world = static_cast<int>(devices.size());  // this process's ranks
  RETURN_IF_ERROR(CheckRankCount(world));
  // Several processes (mpirun, srun): agree with the others, or stop here.
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessWorld> procs, JoinProcesses(options, devices, gpus));
  const int rank_offset = procs ? procs->rank_offset() : 0;
  const int global_world = procs ? procs->world_size() : world;
  ASSIGN_OR_RETURN(std::unique_ptr<Logger> logger,
                   Logger::Create(world, {.console = options.console,
                                          .all_ranks_to_console = options.log_all_ranks,
                                          .log_dir = options.log_dir,
                                          .first_rank = rank_offset,
                                          .first_process = !procs || procs->process_index() == 0,
                                          .process_tag = procs ? procs->Where() : ""}));
  LogEnvironment(*logger, devices, options, gpus, visible_gpus, procs.get());

  std::vector<std::unique_ptr<Communicator>> comms;
  std::shared_ptr<InProcessGroup> group;
  const bool use_nccl = devices[0].is_cuda() && !HasSharedGpu(devices);
  if (hooks.make_communicators) {
    ASSIGN_OR_RETURN(comms, hooks.make_communicators(devices));
  } else if (procs != nullptr && use_nccl) {
    ASSIGN_OR_RETURN(comms, procs->MakeNcclCommunicators(devices));
  } else if (procs != nullptr) {
    if (!devices[0].is_cpu()) {
      return absl::UnimplementedError(
          "spawn: ranks sharing a GPU across processes are not supported (give each process "
          "its own GPUs, or use CPU ranks)");
    }
    comms = procs->MakeCommunicators(devices);
  } else if (use_nccl) {
#if TANDEM_WITH_CUDA
    ASSIGN_OR_RETURN(comms, CreateNcclCommunicators(devices));
#else
    return absl::FailedPreconditionError("spawn: CUDA devices selected in a build without CUDA");
#endif
  } else {
    group = std::make_shared<InProcessGroup>(world);
    for (int r = 0; r < world; ++r) {
      comms.push_back(std::make_unique<InProcessCommunicator>(r, devices[r], group));
    }
  }

  on_world_size(world);
  Run run(devices, logger.get(), group, &comms, rank_offset, procs ? procs->Where() : "");
  SigintScope sigint(options.handle_sigint, hooks.exit_process);
  // The graceful stop (stop_signals): the ranks agree on the step at which they
  // stop; across processes through the communication thread's rounds
  // (spawn/signals.h), so a signal to any one process stops the whole job.
  StopSignalScope stop_signals(options.stop_signals);
  StepAgreement agreement(world,
                          options.stop_signal_source != nullptr ? options.stop_signal_source
                                                                : &stop_signals,
                          options.stop_grace_s, /*cross_process=*/procs != nullptr);
  const uint64_t sigint_at_start = g_sigint_count.load();

  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    auto rank_main = [&, r] {
      // Nothing escapes this thread: every outcome is reported to `run`.
      try {
        nn::DeviceGuard device_guard(devices[r]);
        nn::manual_seed(options.seed, static_cast<uint64_t>(rank_offset + r));
        comms[r]->Attach(run.stop_token(), run.trace(r));
        // Host waits on the GPU (item(), to(cpu), Synchronize...) end with the stop.
        nn::ScopedInterruptCheck interrupt([&run] {
          if (run.stop_requested()) {
            throw CancelledError("host wait on the device abandoned: the run is stopping");
          }
        });
        Context ctx(rank_offset + r, global_world, devices[r], comms[r].get(),
                    logger->ForRank(rank_offset + r, devices[r]), run.stop_token(),
                    {.local_rank = r,
                     .process_index = procs ? procs->process_index() : 0,
                     .process_count = procs ? procs->process_count() : 1,
                     .host = procs ? procs->host() : ""},
                    &agreement);
        CurrentContextGuard current(&ctx);
        absl::Status status = body(ctx);
        if (!status.ok()) {
          run.Fail(r,
                   absl::Status(status.code(), absl::StrCat(run.RankName(r), " returned: ",
                                                            status.ToString())),
                   false);
        }
      } catch (const StoppedError&) {  // the agreed stop: not a failure
        agreement.RankStopped(r);
      } catch (const PeerFailedError& e) {
        run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r), ": ", e.what())), false,
                 /*peer=*/true);
      } catch (const CancelledError& e) {
        run.Fail(r, absl::CancelledError(absl::StrCat(run.RankName(r), ": ", e.what())), true);
      } catch (const std::exception& e) {
        run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r), " threw: ", e.what())),
                 false);
      } catch (...) {
        run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r),
                                                     " threw an exception of unknown type")),
                 false);
      }
      ReleaseGraphsOnReturn(run, r, *comms[r]);
      if (procs) procs->RankExited(r);
      run.Finish(r);
      run.AwaitAbortIfStopping();  // before this thread's thread-local CUDA teardown
    };
    // A thread the system cannot start is a failure like any other, not std::terminate.
    absl::Status started = StartThread(threads, rank_main);
    if (!started.ok()) {
      run.Fail(-1, absl::Status(started.code(), absl::StrCat("spawn: ", run.RankName(r), ": ",
                                                              started.message())), false);
      for (int u = r; u < world; ++u) {
        if (procs) procs->RankExited(u);
        run.Finish(u);
      }
      break;
    }
  }
  if (procs) {
    run.set_describe_remote(
        [p = procs.get()](uint64_t waiting_for) { return p->DescribeProgress(waiting_for); });
    run.set_sigint_agreed();
  }
  std::thread watchdog(
      [&] { run.Watch(options.timeout_s, sigint_at_start, agreement, hooks.exit_process); });
  // Several processes: this thread is the process's MPI thread until every rank exited.
  if (procs) {
    procs->Serve(run.stop_token(),
                 {.agreement = &agreement,
                  .fail = [&run](absl::Status failure) { run.Fail(-1, std::move(failure), false); },
                  .collectives_entered = [&run] { return run.FewestCollectivesEntered(); }});
  }
  for (std::thread& t : threads) t.join();
  run.Joined();
  watchdog.join();

  absl::Status status = run.result();
  comms.clear();  // aborted by the watchdog if the run stopped; finalized otherwise
  if (status.ok()) status = agreement.Outcome();  // an agreed stop is not a failure
  // Several processes: the other processes may wait in a collective for this
  // one; the error line is written, now the launcher ends them all. An agreed
  // stop at a step is no failure: every process stopped at that step, saved,
  // and returns it (Serve's last round ended them together).
  if (procs && !status.ok() && !StoppedAtStep(status).has_value()) procs->Abort(status);
  if (status.ok()) logger->Write(LogLevel::kInfo, -1, nn::Device(), "all ranks finished");
  if (IsStopped(status)) logger->Write(LogLevel::kInfo, -1, nn::Device(), status.message());
  return status;
}

}  // namespace tandem::dist::internal

#if !TANDEM_WITH_MPI
namespace tandem::dist {
void PrepareMpiInit() {}  // spawn/mpi_world.cc: the MPI build's
}  // namespace tandem::dist
#endif
