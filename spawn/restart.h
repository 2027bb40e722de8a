// Restarts in the same process (SpawnOptions::restart), after NVIDIA
// nvidia-resiliency-ext's inprocess.Wrapper: when a rank fails, spawn stops
// the run as it always does (the first failure wins, every communicator is
// aborted), joins every rank thread, rebuilds the communicators and calls the
// training function again on every rank. The function learns which attempt
// it is (Context::attempt(), 0 for the first) and restores what it stored in
// host memory (dist::SaveSnapshot / dist::RestoreSnapshot, spawn/train/checkpoint.h).
//
//   dist::SpawnOptions options;
//   options.restart = {.max_restarts = 3};
//   absl::Status s = dist::spawn(train, 4, "cpu", options);
//
// Which failures restart (each can be turned off):
//   on_exception   a rank's function threw, or returned a non-OK status, before
//                  the run was stopping (a collective that throws, e.g. an
//                  in-process communicator's error, counts here);
//   on_comm_error  a communicator reported an asynchronous error
//                  (Communicator::PollAsyncError; NCCL: ncclCommGetAsyncError),
//                  also one the watchdog finds after some or every rank has
//                  returned (it polls every min(timeout_s / 10, 100 ms));
//   on_timeout     a collective did not complete within timeout_s.
// Which always end the run: a start-up failure (the first attempt's, or the
// rebuild of the communicators before a restart); Ctrl-C or a stop signal
// (SpawnOptions::stop_signals) received at any time during the run; a CUDA
// error of a device (a fault on the device, such as cudaErrorIllegalAddress:
// CUDA keeps it in the device's context for the rest of the process, so no
// attempt in this process could run there; restart the process), whether the
// watchdog found it (Communicator::PollDeviceError: NCCL's query of a
// collective's event), a rank's collective threw it (dist::DeviceError), or
// the failed attempt's streams return it after the joins (the run's status
// then says "the CUDA context of cuda:N (...) has failed"); a failure
// after some rank's function *returned* OK in the same attempt while another
// rank had entered a collective the returned rank never entered (the ranks
// disagree on the steps to run: a program error, which the watchdog fails at
// once when a peer waits in a collective the returned rank never entered; a
// rank's own failure after its last collective, such as an error returned
// through DataParallel::join()'s guard, which answered the others' steps
// first, still restarts); a
// collective's timeout after every rank's function returned OK (a collective
// that some rank never entered, left in flight); a
// rank that left its
// function more than timeout_s after the stop (it was outside any abortable
// wait); every other failure of the watchdog's own (threads that do not
// exit, CUDA graphs kept past the function, a thread that cannot start).
// Once max_restarts restarts are used, the next failure ends the run: spawn
// returns it with its own code, its message prefixed by
// "spawn: gave up after N restart(s); the last failure: ". The programs map
// codes to exit statuses as before (docs/guide.md, "Stopping"), so a run that
// exhausts its restarts exits as its last failure would have.
//
// What each attempt keeps and rebuilds:
//   kept       the logger (and log_dir's files), the SIGINT and stop-signal
//              handlers (one signal ends every attempt), the snapshots below,
//              objects outside the function (the caller's: the function must
//              not rely on their state, a failed attempt may have left them
//              mid-step), spawn's device list (less the failed rank's device
//              after a world shrink, below).
//   rebuilt    the communicators (in-process groups; NCCL: ncclCommInitAll
//              again, after the old ones were aborted and destroyed, a code
//              path not run in tandem's CI yet), the watchdog (collective
//              sequence numbers start again at 1), the stop-signal step
//              agreement (its step counting; the signal handlers stay), the
//              rank threads (so thread_locals, and each rank's nn device and
//              generator: reseeded with (seed, rank) before the function, then
//              set from the snapshot by RestoreSnapshot), the Context, the
//              arguments (each attempt gets a fresh copy of spawn's args), and
//              every object the function makes (models, optimizers, loaders,
//              DataParallel). CUDA graphs die with the attempt that captured
//              them (released when the function returns, as in any run):
//              capture them again. Each GPU's deferred device error word
//              (a kernel's report of bad input, e.g. cross_entropy's target
//              check): once the failed attempt's threads are joined, spawn
//              waits (5 s at most, all devices together) for the work they left and
//              takes a report no host wait had read; it is added to that
//              attempt's failure (the restart's log line says it), and the
//              next attempt starts with a clean word (unless that work never
//              ended: a kernel still running after 5 s keeps its report).
//
// World shrink (RestartPolicy::leave_out_failed_rank): a restart after one
// rank's failure runs the next attempt on the other devices, the ranks after
// the failed one numbered one lower, each restoring the snapshot of the rank
// it was. The rank left out is the one whose function failed, or the one a
// collective's timeout names: the one rank that had not entered the collective
// its peers waited in (it hung elsewhere: a data loader, its own device).
// That rank must still leave its function within timeout_s of the stop (in a
// collective, a stop-aware wait or check_stop()), as every rank must for any
// restart.
//
// Snapshots: each rank stores its state as bytes in host memory owned by the
// run (SnapshotStore), every K steps at the program's choice. At each restart
// spawn picks the newest step that *every* rank stored (a rank may have
// stored a step its peers never reached before the failure) and every rank
// restores that step: at most K steps are run again. Without any such step
// the function starts from scratch. A run with max_restarts == 0 keeps no
// snapshots (SaveSnapshot returns OK at once).
//
// Several processes: OpenMPI 4.1 cannot cancel an operation in flight, so a
// job of several processes cannot abort and rebuild its cross-process
// communicators: spawn refuses max_restarts > 0 there at start-up
// (FailedPrecondition, before any process joins), on every process.
//
// Each restart writes one log line: the failure, the attempt, the snapshot
// step resumed from and the recovery time (from the stop to the new attempt's
// start).
//
// Thread-safety: SnapshotStore is thread-safe; the policy is read by spawn.
#ifndef TANDEM_SPAWN_RESTART_H_
#define TANDEM_SPAWN_RESTART_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tandem::dist {

struct RestartPolicy {
  // Restarts at most this many times in one run; 0: a failure ends the run
  // (no snapshots are kept). Negative: spawn returns InvalidArgument.
  int max_restarts = 0;
  bool on_exception = true;
  bool on_comm_error = true;
  bool on_timeout = true;
  // The largest snapshot one rank may store, in bytes; 0: no limit. A larger
  // one is refused with ResourceExhausted naming both sizes.
  int64_t max_snapshot_bytes = 0;
  // World shrink: the next attempt runs without the failed rank's device (one
  // rank fewer) when at least one rank remains and the failure names exactly
  // one rank: one rank's function failed (it threw or returned an error before
  // the run was stopping), or a collective timed out while exactly one running
  // rank had not entered it (the watchdog's timeout names the ranks the stuck
  // ones wait for). Otherwise (a communicator's error, several ranks failing,
  // a timeout naming several ranks or none: every rank had entered the
  // collective) every device stays; the log line says which rank was left out
  // and why, or why none was. The ranks after
  // the failed one move down one number; each restores the snapshot of the
  // rank it was (its model, optimizer, sampler position and step, not its
  // generator: AttemptInfo::world_shrunk). To keep the global batch G, the
  // program gives it to its sampler and DataParallel
  // (data::DistributedOptions::global_batch_size and
  // DataParallelOptions::global_batch_size): the ranks left take G/N samples
  // each, the first G mod N one more, and their gradients are weighed by rows.
  bool leave_out_failed_rank = false;
};

// The run's in-memory snapshots: per rank, the bytes stored at each step that
// a restart may still need (the newest step every rank holds, and newer ones).
// Owned by spawn's run, so they outlive every attempt. Thread-safe.
class SnapshotStore {
 public:
  SnapshotStore(int world_size, int64_t max_bytes);

  // Keeps `bytes` as local rank `rank`'s snapshot of `step` (replacing one of
  // the same step) and drops the snapshots no restart can use any more.
  // ResourceExhausted naming the size when it exceeds the limit or cannot be
  // allocated.
  absl::Status Put(int rank, int64_t step, std::string bytes);
  // Local rank `rank`'s snapshot of `step`, or null.
  std::shared_ptr<const std::string> Get(int rank, int64_t step) const;
  // The newest step every rank holds, if any.
  std::optional<int64_t> CommittedStep() const;
  // Drops every snapshot newer than `step` (all of them when nullopt): at a
  // restart, the steps some ranks stored past the committed one.
  void DiscardAfter(std::optional<int64_t> step);
  // Bytes held, every rank together.
  int64_t bytes() const;

 private:
  std::optional<int64_t> CommittedLocked() const;

  const int64_t max_bytes_;
  mutable std::mutex mu_;
  // [rank]: step -> bytes
  std::vector<std::map<int64_t, std::shared_ptr<const std::string>>> ranks_;
};

// What spawn tells a rank about the attempt it runs (Context::attempt_info()).
struct AttemptInfo {
  int attempt = 0;  // 0: the first call of the function; n: after n restarts
  SnapshotStore* snapshots = nullptr;  // null: the run keeps none (no restarts)
  std::optional<int64_t> resume_step;  // the step to restore on this attempt, if any
  // RestartPolicy::leave_out_failed_rank: the ranks of the first attempt, and
  // true once an attempt has had fewer: RestoreSnapshot then accepts a
  // snapshot taken by more ranks, leaving the generator as spawn seeded it.
  int first_world_size = 0;
  bool world_shrunk = false;
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_RESTART_H_
