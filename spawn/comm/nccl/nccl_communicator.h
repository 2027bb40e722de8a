// NCCL communicators for ranks on distinct GPUs (spawn/comm/nccl/nccl_communicator.cc,
// compiled only with TANDEM_WITH_CUDA). Keeps nccl.h out of every other file.
// Internal to spawn.
#ifndef TANDEM_SPAWN_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define TANDEM_SPAWN_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nn/device.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist::internal {

// One communicator per device (rank i on devices[i]) from one ncclCommInitAll,
// called from spawn's thread before the rank threads start, with
// NCCL_RUNTIME_CONNECT=0 and NCCL_GRAPH_REGISTER=0 so that no later call waits
// on its peers inside NCCL. The communicators are blocking (no asynchronous
// group path per collective); spawn's watchdog aborts them through
// Communicator::Abort as soon as the run stops, which their guard makes safe
// while the rank threads still use them (see nccl_communicator.cc). Errors
// name the devices and NCCL's text. The calling thread keeps its device (one
// that had no CUDA context keeps devices[0]).
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<nn::Device>& devices);

// "NCCL 2.28.3, CUDA runtime 13.0, driver 13.0".
std::string CudaNcclVersions();

// --- Across processes (spawn/internal/process_world.h) ---------------------------
// A fresh ncclUniqueId as bytes (process 0 makes it; MPI broadcasts it).
absl::StatusOr<std::string> NcclUniqueIdBytes();
// This process's communicators of a world of world_size GPU ranks spread over
// several processes: local rank i is global rank first_rank + i. Every process
// calls it with the same id; the local ranks are initialised in one group,
// blocking, with ncclCommInitRankConfig (so the call returns when every
// process has joined: a process that never does holds the others here, before
// the watchdog runs; the launcher ends the job when that process exits).
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicatorsAcross(
    const std::vector<nn::Device>& devices, const std::string& unique_id, int first_rank,
    int world_size);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_NCCL_NCCL_COMMUNICATOR_H_
