// Several processes, one job: the launcher's side (internal to spawn/; mpi.h
// never appears here; the bytes travel through spawn/comm/mpi/).
//
// When a program is started as P processes by an MPI launcher (mpirun, srun
// --mpi=pmix), spawn joins them into one world: each process runs one thread per
// local device, global rank = process order, then local order. The thread that
// called spawn is the process's communication thread: it alone talks to MPI
// (MPI_THREAD_FUNNELED) while the rank threads run.
//
// Pieces:
//  - DetectLauncher() (spawn/comm/mpi/process_transport.h): what the
//    environment says (no MPI call).
//  - JoinProcesses(): decides single vs multi-process, initialises MPI on first
//    use, exchanges every process's host, pid, devices, build and the options
//    that must agree, and fails on a disagreement (every process reaches the
//    same verdict from the same gathered data).
//  - ProcessWorld: the joined world of one spawn run. Serve() is the
//    communication thread's loop; MakeCommunicators() gives the CPU ranks their
//    hierarchical communicators (spawn/comm/mpi/hierarchical_communicator.h).
#ifndef TANDEM_SPAWN_INTERNAL_PROCESS_WORLD_H_
#define TANDEM_SPAWN_INTERNAL_PROCESS_WORLD_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nn/device.h"
#include "spawn/comm/communicator.h"
#include "spawn/comm/mpi/hierarchical_communicator.h"
#include "spawn/comm/mpi/process_transport.h"

namespace tandem::dist {
struct SpawnOptions;
}

namespace tandem::dist::internal {

// One process's record, as every process sees it after the agreement.
struct ProcessInfo {
  std::string host;
  int64_t pid = 0;
  std::vector<std::string> devices;  // this process's ranks' devices ("cpu", "cuda:0")
  std::vector<std::string> gpu_ids;  // physical GPU of each CUDA rank (CUDA_VISIBLE_DEVICES applied)
  std::string build;                 // tandem version and backends
  // Options and program flags that must agree: (name, value).
  std::vector<std::pair<std::string, std::string>> agreed;
};

class StepAgreement;
class StartupGuard;

// What the communication thread's loop needs from spawn.
struct ServeHooks {
  StepAgreement* agreement = nullptr;            // null: no rounds
  std::function<void(absl::Status)> fail;        // ends the run (a round's transport error)
  std::function<uint64_t()> collectives_entered;  // fewest collectives a local rank entered
  // The local rank whose function has returned having entered the fewest
  // collectives: (collectives it entered, its global rank), or nullopt when no
  // local rank has returned. Null: not reported.
  std::function<std::optional<std::pair<uint64_t, int>>()> returned_rank;
  // True once the watchdog has looked at this process's ranks after every one
  // returned (Watchdog::PolledAfterEveryRankFinished). Until then the rounds
  // count this process as running, so the last round (at which every process
  // ends) never comes before that look: a failure it finds (a communicator's
  // asynchronous error raised by the last collectives) has stopped this
  // process first, and the job ends with Abort instead of some processes
  // returning OK. Null: not waited for.
  std::function<bool()> exits_polled;
};

// A rank of another process whose function has returned, as the last round said.
struct ReturnedElsewhere {
  std::string name;        // "rank 1 (cpu, host h, pid p)", as that process names it
  uint64_t entered = 0;    // the collectives it entered (final: it enters no more)
};

// Every process's progress as of the last completed round (for the watchdog).
struct ProcessProgress {
  std::chrono::steady_clock::time_point at{};  // when that round completed; {} before the first
  std::vector<int64_t> entered;               // per process: fewest collectives a rank entered
  // Per process: the returned rank that entered the fewest collectives, as
  // (collectives entered, global rank); INT64_MIN entries when none returned.
  std::vector<int64_t> returned_entered;
  std::vector<int64_t> returned_rank;
};

// What the rounds compare of the processes' cross-process collectives.
struct CollectiveCheck {
  // The CPU ranks' exchange (its fingerprints); null (GPU ranks): nothing compared.
  const HierarchicalExchange* exchange = nullptr;
  // "process 1 (host h, pid p, rank 1)", for the mismatch's message.
  std::function<std::string(int process)> name;
};

// The communication thread's share of the step agreement across processes
// (spawn/signals.h): rounds of ControlAllReduceMax over (stop signal, save
// wanted, largest arrived step, ranks running, then three slots per process: the
// fewest collectives one of its ranks entered, and of its ranks whose functions
// have returned the one that entered the fewest: the collectives it entered and
// its global rank, INT64_MIN when none returned), one at a time, every
// kRoundPeriod or at once when the agreement is Urgent().
//
// The same rounds compare the processes' collectives (CollectiveCheck), at no
// cost to the collectives themselves: each round also carries, per process, how
// many collectives its communication thread has started, and for a window of up
// to kCheckWindow collectives that every process had started by the previous
// round the largest and the smallest of each fingerprint word (op, dtype,
// reduction and root in one, the element count in the other;
// spawn/comm/mpi/collective_fingerprint.h). A collective whose two differ
// is a mismatch: the next round carries each process's fingerprint of it, and
// its label as text (HierarchicalExchange::LabelOf, PackLabel: kLabelWords
// words a process, in that round only), and the run fails (hooks.fail) on every
// process with the same message, naming each side and each side's label
// ("collective mismatch across processes: process 0 (...) called all_reduce #4
// (1 float64, sum) from hapi::Model::save (...) while process 1 (...) called
// barrier #4"), about three rounds after the processes reached it. Compared:
// up to kCheckWindow collectives a round (6400 a second); a job that runs more
// falls behind, and once half the fingerprint history behind the comparison
// skips to the collectives still kept (the skipped ones are not compared).
class ControlPlane final : public BackgroundRounds {
 public:
  static constexpr std::chrono::milliseconds kRoundPeriod{10};
  static constexpr int kCheckWindow = 64;
  // running(): this process's rank threads that have not exited. progress(): told
  // every completed round's per-process slots (3 * processes values: the entered
  // slots of every process, then the returned ranks' entered, then their ranks).
  ControlPlane(ProcessTransport* transport, ServeHooks hooks, std::function<int()> running,
               std::function<void(const std::vector<int64_t>&)> progress,
               CollectiveCheck check = {});
  // A round still in flight (only on the way to Abort) is left to MPI, not freed.
  ~ControlPlane() override;
  // Advances the round in flight, applies a finished one, starts the next one
  // when due (none once `stop` is requested: the job is ending with Abort). False
  // once a round said that no process has a running rank (nor one whose
  // returned ranks its watchdog has not looked at yet: ServeHooks::exits_polled)
  // and every collective has been compared (the last round: every process ends
  // at the same one; the rounds that finish the comparison follow each other
  // without a pause), or after a transport error (reported to fail).
  bool Tick(const std::stop_token& stop) override;
  // How long the caller may sleep before the next Tick.
  std::chrono::microseconds NextWait() const override { return urgent_ ? std::chrono::microseconds(100)
                                                              : std::chrono::microseconds(2000); }

 private:
  static constexpr int kFixed = 4;  // slots before the per-process ones
  bool TickOrThrow(const std::stop_token& stop);
  // The collective check's slots: this process's part of the next round, and
  // what a completed round says (hooks.fail on a mismatch).
  void PutCollectives();
  void CheckCollectives();
  // Every collective the processes started has been compared (or nothing is).
  bool CollectivesCompared() const;
  std::string MismatchMessage() const;
  int64_t* started_slots() { return buffer_.data() + kFixed + 3 * processes_; }
  int64_t* probe_slots() { return started_slots() + processes_; }
  int64_t* window_slots() { return probe_slots() + Fingerprint::kWords * processes_; }
  // The probe round's labels, after every other slot: kLabelWords a process.
  int64_t* label_slots() { return buffer_.data() + base_slots_; }
  const int64_t* label_slots() const { return buffer_.data() + base_slots_; }
  // Leaves a round still in flight to MPI (request and buffer not freed).
  void AbandonRound();

  ProcessTransport* transport_;
  ServeHooks hooks_;
  std::function<int()> running_;
  std::function<void(const std::vector<int64_t>&)> progress_;
  CollectiveCheck check_;
  int processes_ = 0;
  size_t base_slots_ = 0;  // a round's slots; a probe round has the labels' after them
  std::vector<int64_t> buffer_;
  std::unique_ptr<PendingOp> op_;
  // Communication thread only; the same on every process (from the same rounds).
  uint64_t checked_ = 0;    // every collective up to this one agreed
  uint64_t common_ = 0;     // every process had started this many at the last round
  uint64_t probe_ = 0;      // a mismatched collective whose sides the next round names
  bool mismatch_reported_ = false;
  std::chrono::steady_clock::time_point next_round_{};
  bool urgent_ = false;
  bool finished_ = false;
};


// The processes of one spawn run.
class ProcessWorld {
 public:
  virtual ~ProcessWorld();

  int process_index() const { return process_index_; }
  int process_count() const { return static_cast<int>(processes_.size()); }
  const std::string& host() const { return processes_[process_index_].host; }
  int64_t pid() const { return processes_[process_index_].pid; }
  // Global rank of this process's local rank 0, and of the whole world.
  int rank_offset() const { return rank_offset_; }
  int world_size() const { return world_size_; }
  const std::vector<ProcessInfo>& processes() const { return processes_; }
  // "host h, pid p"
  std::string Where() const;
  // "process 1 (host h, pid p, rank 1)", "process 2 (host h, pid p, ranks 4..7)"
  std::string NameOf(int process) const;
  // The spawn header's lines: every process's host, pid, ranks and devices.
  std::vector<std::pair<std::string, std::string>> Describe() const;

  // The CPU ranks' communicators (local_devices.size() of them), hierarchical:
  // in-process step, one transport collective per process on Serve's thread,
  // in-process step back. Call once, before Serve. TANDEM_CHECK_COLLECTIVES=each
  // (agreed at the join) compares each collective between the processes before
  // its data moves (HierarchicalExchange::CheckEachCollective).
  std::vector<std::unique_ptr<Communicator>> MakeCommunicators(
      const std::vector<nn::Device>& local_devices);

  // GPU ranks on distinct GPUs: this process's part of one NCCL communicator over
  // every GPU rank of every process (process 0's unique id, broadcast through
  // MPI; the local ranks initialised in one group). Built with CUDA only.
  // During start-up (startup() set) the exchange and the group's wait keep its
  // deadline. FailedPrecondition with TANDEM_CHECK_COLLECTIVES=each, whose check
  // cannot see NCCL's collectives (every process agreed on it at the join, so
  // every process refuses).
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeNcclCommunicators(
      const std::vector<nn::Device>& local_devices);

  // The run's start-up guard while start-up lasts (spawn/internal/startup.h;
  // it registers itself), else null. Spawn thread only.
  StartupGuard* startup() const { return startup_; }
  void set_startup(StartupGuard* startup) { startup_ = startup; }
  // A barrier of every process (start-up's last step), before Serve.
  std::unique_ptr<PendingOp> StartBarrier();
  // "; process 1 (host h, pid p, rank 1) is stopped (SIGSTOP or a debugger)"
  // for each other process of this host that /proc shows stopped, gone or
  // waiting in the kernel; "" when none.
  std::string DescribeLocalPeers() const;

  // Rank threads call RankExited(local_rank) as their last act (any thread).
  void RankExited(int local_rank);

  // The communication thread's loop, on the thread that called spawn: runs the
  // ranks' cross-process collectives and the step agreement's rounds
  // (`agreement`, may be null: no rounds) until every rank of every process
  // exited. When `stop` is requested, requests waiting or in flight are
  // cancelled (their ranks throw CancelledError), the loop ends once the local
  // ranks exited, and the transport is left unusable: the run then must end
  // with Abort().
  // A round's transport error is reported through hooks.fail (which must stop the run).
  void Serve(std::stop_token stop, ServeHooks hooks);

  // For the watchdog (any thread), when this process's ranks have waited in
  // collective #`waiting_for` too long: which processes had not entered it at
  // the last round, and how long ago rounds last completed ("" without rounds).
  std::string DescribeProgress(uint64_t waiting_for) const;

  // For the watchdog (any thread): the ranks of the other processes whose
  // functions had returned at the last round (one per process: the one that
  // entered the fewest collectives). A rank of this process waiting in a
  // collective numbered above one's count waits for good.
  std::vector<ReturnedElsewhere> ReturnedRanksElsewhere() const;

  // Ends every process of the job after a failure: the caller has logged the
  // error line; this flushes and makes the launcher stop the other processes
  // (MPI_Abort with exit code 1, or 75 (EX_TEMPFAIL) when `status` IsStopped:
  // a stop before any step boundary, resumable). Never returns.
  [[noreturn]] virtual void Abort(const absl::Status& status) = 0;

 protected:
  ProcessWorld(int process_index, std::vector<ProcessInfo> processes,
               std::unique_ptr<ProcessTransport> transport);

 private:
  int process_index_;
  std::vector<ProcessInfo> processes_;
  int rank_offset_ = 0;
  int world_size_ = 0;
  std::unique_ptr<ProcessTransport> transport_;
  StartupGuard* startup_ = nullptr;
  std::shared_ptr<HierarchicalExchange> exchange_;
  int local_ranks_ = 0;
  std::atomic<int> exited_{0};
  // Outlives Serve: on the way to Abort a round may still be in flight, its
  // buffer in use by MPI.
  std::unique_ptr<ControlPlane> control_;
  mutable std::mutex progress_mutex_;
  ProcessProgress progress_;  // guarded by progress_mutex_
};

// Returns nullptr for a single-process run, or the joined world. Errors: started
// as several processes but built without MPI (or MPI sees a world of 1): the
// singleton trap; options or flags that differ between processes (the message
// names the value, the hosts and the processes); one GPU claimed by two
// processes of a host (unless share_devices). Every process returns the same
// verdict.
absl::StatusOr<std::unique_ptr<ProcessWorld>> JoinProcesses(
    const SpawnOptions& options, const std::vector<nn::Device>& local_devices,
    absl::string_view gpus);

// The NCCL settings every process of a job with GPU ranks must share, as
// ("environment NAME", value) entries of ProcessInfo::agreed: the launch mode,
// graph buffer registration, lazy connection, blocking communicators (spawn
// refuses some values and sets others: a difference would refuse, or hang, one
// process only) and the algorithm and protocol (ranks that choose differently
// do not meet). Unset reads "(unset)", except NCCL_GRAPH_REGISTER and
// NCCL_RUNTIME_CONNECT, which spawn sets to 0 when unset and so read "0".
std::vector<std::pair<std::string, std::string>> NcclEnvironmentToAgree();

// Pure helpers, tested without MPI.
// The record's wire form and back.
std::string SerializeProcessInfo(const ProcessInfo& info);
absl::StatusOr<ProcessInfo> ParseProcessInfo(absl::string_view bytes);
// The agreement check over every process's record (process order).
absl::Status CheckAgreement(const std::vector<ProcessInfo>& processes, bool share_devices);

#if TANDEM_WITH_MPI
// mpi_world.cc: MPI_Init_thread(FUNNELED) once per process, then the world of
// this run (MPI_COMM_WORLD duplicated). `mine` is this process's record.
absl::StatusOr<std::unique_ptr<ProcessWorld>> JoinMpiWorld(const LauncherEnv& launcher,
                                                           const ProcessInfo& mine,
                                                           bool share_devices);
#endif

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_INTERNAL_PROCESS_WORLD_H_
