// The start-up of a multi-process run (internal to spawn/): from the moment the
// processes have joined (JoinProcesses returned a world) until the ranks start.
//
// In that span a process builds its logger and its communicators; with GPU
// ranks the processes exchange NCCL's unique id and wait for each other in
// ncclGroupEnd, neither of which has a deadline of its own. A process that
// fails or stalls there would hold the others for good, and a failed process's
// MPI_Finalize would wait for them. So, once the world exists:
//  - every error goes through the world's Abort (StartupGuard::Fail): the
//    failing process writes the error line first, then the launcher ends every
//    process (exit status 1);
//  - start-up has a deadline, the run's timeout_s, counted from the join. A
//    process still in a step of its own at the deadline names itself and the
//    step; a process waiting for the others (an MPI exchange, ncclGroupEnd)
//    waits kPeerMarginS longer, so that a stalled process that can still speak
//    reports first, then names what it waited in and the processes of its host
//    that are stopped or gone. Either way the world's Abort ends the job.
//
// Threads: one StartupGuard per run, made, used and destroyed on the thread
// that called spawn (the process's MPI thread); its own timer thread ends the
// job when a step of this process overruns the deadline. The timer calls the
// world's Abort only while the spawn thread is outside MPI (in local work or
// in NCCL): the MPI waits check the deadline themselves, on the MPI thread.
#ifndef TANDEM_SPAWN_INTERNAL_STARTUP_H_
#define TANDEM_SPAWN_INTERNAL_STARTUP_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spawn/comm/mpi/process_transport.h"
#include "spawn/logger.h"

namespace tandem::dist::internal {

class ProcessWorld;

// Test-only fault injection at start-up's points, read here and nowhere else:
//   TANDEM_TEST_STARTUP_FAULT=<point>:<process>:<fail|stall|stop>
// point: joined (right after the join), logger (before the logger is made),
// communicators (before the communicators are made). At that point, process
// <process> fails (StartupGuard::Enter returns an error), stalls (sleeps
// until the job is ended) or stops (SIGSTOP to itself: a process that cannot
// speak, which the others name). Unset: kNone. A malformed value is an
// InvalidArgument error naming it.
enum class StartupFault { kNone, kFail, kStall, kStop };
absl::StatusOr<StartupFault> StartupFaultAt(absl::string_view point, int process_index);

class StartupGuard {
 public:
  // How much longer a process waiting for the others waits than the deadline.
  static constexpr double kPeerMarginS = 2.0;

  // Starts the deadline (timeout_s from now). `world` must outlive the guard;
  // `console` is where lines go before the run's logger exists (std::cerr when
  // null). Registers itself with the world (ProcessWorld::startup()).
  StartupGuard(ProcessWorld* world, double timeout_s, std::ostream* console);
  // Stops the timer (without ending anything) and unregisters.
  ~StartupGuard();
  StartupGuard(const StartupGuard&) = delete;
  StartupGuard& operator=(const StartupGuard&) = delete;

  // Start-up goes on to step `what` ("creating the logger"), at fault point
  // `point` (StartupFaultAt's: a test fault's error is returned, a test stall
  // never returns). `waits_for_others`:
  // the step waits for the other processes outside MPI (ncclGroupEnd), so its
  // deadline has the peers' margin.
  absl::Status Enter(absl::string_view point, std::string what, bool waits_for_others = false);

  // Lines from now on also go to the run's logger (workerlogs). Not owned.
  void set_logger(Logger* logger);

  // Starts an MPI exchange with the other processes (`start`; `what`: "in the
  // exchange of NCCL's unique id") and polls it until it completes; at the
  // deadline plus the peers' margin, or when it throws, ends the job. Spawn
  // thread only. A request left in flight is left to the abort.
  void WaitForOthers(const std::function<std::unique_ptr<PendingOp>()>& start,
                     absl::string_view what);

  // Logs "spawn: start-up failed on process p (host h, pid n) while <step>:
  // <message>" and ends the job. Spawn thread only.
  [[noreturn]] void Fail(const absl::Status& status);

  // The last step: a barrier of every process, with the deadline, then the timer stops.
  void Finish();

 private:
  void Watch();
  // Claims the right to end the job (false: the other thread has it: wait for
  // the end). Caller holds mutex_.
  bool ClaimLocked();
  [[noreturn]] void End(const absl::Status& status);
  [[noreturn]] static void AwaitEnd();
  std::string Self() const;  // "process 1 (host h, pid p)"

  ProcessWorld* world_;
  const double timeout_s_;
  const std::chrono::steady_clock::time_point start_;
  std::unique_ptr<Logger> console_;  // for lines before the run's logger exists

  std::mutex mutex_;
  std::condition_variable cv_;
  Logger* logger_ = nullptr;  // guarded by mutex_
  std::string step_ = "setting up after the join";  // guarded by mutex_
  bool waits_for_others_ = false;  // guarded by mutex_
  bool in_mpi_ = false;            // guarded by mutex_: the spawn thread polls MPI
  bool done_ = false;              // guarded by mutex_
  bool ending_ = false;            // guarded by mutex_: a thread is ending the job
  std::thread timer_;
};

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_INTERNAL_STARTUP_H_
