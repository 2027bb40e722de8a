// The MPI implementation of the process transport (spawn/comm/mpi/process_transport.h).
// mpi.h stays inside mpi_transport.cc.
//
// MPI is initialised once per process with MPI_THREAD_FUNNELED by the first
// ConnectMpi, on that thread; every later MPI call must come from the same
// thread (spawn's caller, the communication thread while ranks run).
// MPI_Finalize runs at exit.
#ifndef TANDEM_SPAWN_COMM_MPI_MPI_TRANSPORT_H_
#define TANDEM_SPAWN_COMM_MPI_MPI_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "spawn/comm/mpi/process_transport.h"

namespace tandem::dist {
// Tunes the MPI library before MPI_Init (OpenMPI's non-blocking all-reduce
// for two processes); ConnectMpi calls it. Call it yourself before your own
// MPI_Init if your program initialises MPI. Declared in spawn/launch.h too.
void PrepareMpiInit();
}  // namespace tandem::dist

namespace tandem::dist::internal {

struct MpiWorld {
  int index = 0;  // this process in MPI_COMM_WORLD
  int size = 1;
  // Over a duplicate of MPI_COMM_WORLD (MPI_ERRORS_RETURN); null when size is 1.
  std::unique_ptr<ProcessTransport> transport;
  // Every process's `record`, in process order (empty when size is 1).
  std::vector<std::string> records;
};

// Initialises MPI on first use and connects this process to the launcher's
// world, gathering one record per process (blocking). An error when MPI cannot
// start or when called from another thread than the first call's.
absl::StatusOr<MpiWorld> ConnectMpi(const std::string& record);

// Ends every process of the job with `exit_code` (MPI_Abort); never returns.
[[noreturn]] void AbortMpiJob(int exit_code);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_MPI_MPI_TRANSPORT_H_
