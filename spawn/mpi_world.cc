// spawn's multi-process join over MPI (built with TANDEM_WITH_MPI): connects
// through the MPI transport (spawn/comm/mpi/mpi_transport.h, the only file with
// mpi.h), gathers every process's record and checks that they agree.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/status_macros.h"
#include "spawn/comm/mpi/mpi_transport.h"
#include "spawn/internal/process_world.h"
#include "spawn/signals.h"

namespace tandem::dist::internal {
namespace {

class MpiProcessWorld final : public ProcessWorld {
 public:
  MpiProcessWorld(int index, std::vector<ProcessInfo> processes,
                  std::unique_ptr<ProcessTransport> transport)
      : ProcessWorld(index, std::move(processes), std::move(transport)) {}

  [[noreturn]] void Abort(const absl::Status& status) override {
    std::fflush(stdout);
    std::cout.flush();
    std::cerr.flush();
    // The status is already logged as the run's first error line.
    // mpirun forwards the processes' output asynchronously, and its abort
    // banner could overtake the error line: give the line a moment to arrive,
    // so the root cause stays the job's first error line.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    // 75 (EX_TEMPFAIL): stopped before any step boundary, nothing to lose (the
    // programs' "stopped, resumable" status); 1: a failure.
    AbortMpiJob(IsStopped(status) ? 75 : 1);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessWorld>> JoinMpiWorld(const LauncherEnv& launcher,
                                                           const ProcessInfo& mine,
                                                           bool share_devices) {
  ASSIGN_OR_RETURN(MpiWorld world, ConnectMpi(SerializeProcessInfo(mine)));
  if (world.size == 1) {
    if (launcher.size > 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spawn: the launcher started ", launcher.size, " processes (", launcher.evidence,
          ") but MPI sees a world of 1: the launcher did not connect them (srun without "
          "--mpi=pmix? an mpirun of another MPI?); the copies would train ", launcher.size,
          " unrelated models"));
    }
    return std::unique_ptr<ProcessWorld>();  // processes = kOn without a launcher: one process
  }
  std::vector<ProcessInfo> processes;
  for (size_t p = 0; p < world.records.size(); ++p) {
    absl::StatusOr<ProcessInfo> info = ParseProcessInfo(world.records[p]);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat("spawn: process ", p, "'s ", info.status().message()));
    }
    processes.push_back(*std::move(info));
  }
  RETURN_IF_ERROR(CheckAgreement(processes, share_devices));
  return std::unique_ptr<ProcessWorld>(
      new MpiProcessWorld(world.index, std::move(processes), std::move(world.transport)));
}

}  // namespace tandem::dist::internal
