// dist::SpawnOptions, the settings of a run of dist::spawn (spawn/launch.h), and
// what the launcher's environment says about this process (DetectLaunch).
// Apart from spawn/launch.h so that the multi-process join
// (spawn/process_world.cc) reads them without the launcher's header; user code
// gets them through spawn/launch.h or spawn/spawn.h.
#ifndef TANDEM_SPAWN_OPTIONS_H_
#define TANDEM_SPAWN_OPTIONS_H_

#include <csignal>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "spawn/comm/flight_recorder.h"
#include "spawn/restart.h"
#include "spawn/signals.h"

namespace tandem::dist {

// Whether spawn joins the other processes of a job (docs/multiprocess.md).
enum class Processes {
  // Join when an MPI launcher started this process as one of several
  // (OMPI_COMM_WORLD_SIZE, PMIX_SIZE, PMI_SIZE, SLURM_STEP_NUM_TASKS > 1).
  kAuto,
  // Always initialise MPI (a world of 1 without a launcher runs as one process).
  kOn,
  // Never: every process is its own job, even under a launcher.
  kOff,
};

// What the launcher's environment says about this process (no MPI call): how
// many processes it started, this one's index, and the variables read
// (docs/multiprocess.md); {1, 0, ""} when not started as one of several.
struct LaunchInfo {
  int processes = 1;
  int index = 0;
  std::string evidence;  // e.g. "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0"
};
LaunchInfo DetectLaunch();

struct SpawnOptions {
  // Let several ranks share one GPU ("0,0"), through the in-process communicator.
  bool share_devices = false;
  // When set, rank r also logs to log_dir/workerlog.r.
  std::string log_dir;
  // Every rank's lines to the console, not only rank 0's.
  bool log_all_ranks = false;
  // The start of a run logs the whole environment table (world size, gpus, visible
  // GPUs, communicator, versions, timeout, seed, log_dir, each rank's device);
  // by default one line (world size, processes, devices, communicator). A failed
  // run logs the table after its error either way.
  bool verbose = false;
  // A collective not completed within this many seconds ends the run; after a
  // stop, the watchdog names the ranks still running this long after it. The
  // programs' --timeout_s. Several processes: also the deadline of start-up
  // (from the join to the ranks' start: docs/multiprocess.md, "Start-up").
  // Positive and at most 1e9 (about 31.7 years; +inf and NaN are refused with
  // InvalidArgument).
  double timeout_s = 300;
  // Each rank's flight recorder keeps its last this many collectives (op,
  // sequence number, dtype and count, times, state), logged with the run's first
  // failure and on demand (Context::DumpFlightRecorder; spawn/comm/flight_recorder.h).
  // 0 turns it off; at most 1 << 20.
  int flight_recorder_entries = FlightRecorder::kDefaultEntries;
  // Rank r's generator is seeded with (seed, stream r).
  uint64_t seed = 0;
  // Console stream for the log (std::cerr when null); not owned.
  std::ostream* console = nullptr;
  // Install a SIGINT handler while the run lasts (the previous one is restored).
  bool handle_sigint = true;
  // Signals that ask for a graceful stop while the run lasts (the previous
  // handlers are restored): every rank stops at one agreed step boundary, after
  // its save, and spawn returns an IsStopped() status (spawn/signals.h). Empty:
  // the process keeps the default action (SIGTERM kills it). SIGINT is refused.
  std::vector<int> stop_signals = {SIGTERM, SIGUSR1};
  // After a stop signal the ranks have this long to stop (save included); then
  // the run ends with DeadlineExceeded. Keep it under the scheduler's kill wait
  // (Slurm's KillWait: 30 s by default).
  double stop_grace_s = 25;
  // Count stop signals from this scope's start instead of the run's (not
  // owned; see StopSignalScope): a program makes one first thing in main.
  const StopSignalScope* stop_signal_source = nullptr;
  // Several processes (mpirun, srun): see Processes. With several, global rank =
  // process order, then local order; the thread calling spawn is the process's
  // MPI thread while the ranks run, and every later multi-process spawn must be
  // called from that same thread.
  Processes processes = Processes::kAuto;
  // (name, value) pairs every process must agree on before anything runs, e.g.
  // {"--batch_size", "64"}; a difference ends every process with an error naming
  // the value, the hosts and the processes. timeout_s, seed, share_devices and the
  // tandem build are always compared. Ignored in a single-process run.
  std::vector<std::pair<std::string, std::string>> must_agree;
  // Restart the function on every rank after a failure, in this process
  // (spawn/restart.h: which failures, what each attempt keeps, snapshots).
  // Default: no restart. Refused in a job of several processes.
  RestartPolicy restart;
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_OPTIONS_H_
