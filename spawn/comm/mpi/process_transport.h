// Byte-level transport between the processes of one job, and what the
// launcher's environment says about them: the interface the hierarchical
// communicator (spawn/comm/mpi/hierarchical_communicator.h) and spawn's
// multi-process join (spawn/internal/process_world.h) share. The MPI
// implementation is spawn/comm/mpi/mpi_transport.h; mpi.h never appears here.
#ifndef TANDEM_SPAWN_COMM_MPI_PROCESS_TRANSPORT_H_
#define TANDEM_SPAWN_COMM_MPI_PROCESS_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nn/dtype.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist::internal {

// What the launcher's environment variables say about this process.
struct LauncherEnv {
  int size = 1;           // processes the launcher started (1: none or a single one)
  int rank = 0;           // this process's index among them
  std::string evidence;   // e.g. "OMPI_COMM_WORLD_SIZE=2"; empty when not launched
};

// Reads, in this order: OMPI_COMM_WORLD_SIZE/OMPI_COMM_WORLD_RANK (OpenMPI's
// mpirun), PMIX_SIZE/PMIX_RANK (PMIx launchers), PMI_SIZE/PMI_RANK (MPICH
// hydra, Slurm PMI2), SLURM_STEP_NUM_TASKS/SLURM_PROCID (inside an srun step,
// not an sbatch script). The first pair present wins.
LauncherEnv DetectLauncher();

// Non-blocking operation between processes; Test() advances and reports it.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  virtual bool Test() = 0;
};

// Byte-level collectives between the processes of one run, started by the
// communication thread only. Counts and offsets are bytes. Buffers must stay
// alive and untouched until Test() returned true.
class ProcessTransport {
 public:
  virtual ~ProcessTransport() = default;
  virtual int process_index() const = 0;
  virtual int process_count() const = 0;
  // recv holds every process's block in process order (offsets: running sum of
  // counts); this process's block is already in place (MPI_IN_PLACE).
  virtual std::unique_ptr<PendingOp> AllGatherInPlace(void* recv,
                                                      const std::vector<int64_t>& counts) = 0;
  // Sends send[send_offsets[q], +send_counts[q]) to process q and receives process
  // q's block into recv[recv_offsets[q], +recv_counts[q]).
  virtual std::unique_ptr<PendingOp> AllToAll(const void* send,
                                              const std::vector<int64_t>& send_counts,
                                              void* recv,
                                              const std::vector<int64_t>& recv_counts) = 0;
  virtual std::unique_ptr<PendingOp> Broadcast(void* data, int64_t bytes, int root_process) = 0;
  virtual std::unique_ptr<PendingOp> Barrier() = 0;
  // data[0..count) = the element-wise sum (kSum) or maximum (kMax) over the
  // processes, in place. float32, float64, int64.
  virtual std::unique_ptr<PendingOp> AllReduceInPlace(void* data, int64_t count, nn::DType dtype,
                                                      ReduceOp op) = 0;
  // data[0..n) = the element-wise maximum over the processes, on a channel of
  // its own (the control plane: it never waits behind the ranks' traffic).
  virtual std::unique_ptr<PendingOp> ControlAllReduceMax(int64_t* data, int n) = 0;
};

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_MPI_PROCESS_TRANSPORT_H_
