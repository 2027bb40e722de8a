// What one cross-process collective is, packed into 63 bits (internal to spawn/),
// so that the processes can compare their collectives inside the step
// agreement's rounds (spawn/internal/process_world.h, ControlPlane) without a
// message of their own per collective.
//
// Bits, low to high: numel (34: up to 16 Gi elements; MPI's counts stop at
// 2 GiB), root (20: a broadcast's global root; 0 for the other ops), dtype (4),
// reduction (2: 0 for ops that do not reduce), op (3). The value is never
// negative, so -fingerprint and INT64_MIN ("none") fit the rounds' MAX.
// Pure functions: no thread, no MPI.
#ifndef TANDEM_SPAWN_COMM_MPI_COLLECTIVE_FINGERPRINT_H_
#define TANDEM_SPAWN_COMM_MPI_COLLECTIVE_FINGERPRINT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nn/dtype.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist::internal {

struct CollectiveShape {
  const char* op = "";  // "all_reduce", "reduce_scatter", "broadcast", "all_gather", "barrier"
  ReduceOp reduce = ReduceOp::kSum;  // all_reduce, reduce_scatter
  int root = 0;                      // broadcast: global rank
  nn::DType dtype = nn::DType::kFloat32;
  int64_t numel = 0;                 // each rank's input; 0 for barrier
};

// Throws tandem::Error for an op the hierarchical exchange does not run.
int64_t PackFingerprint(const CollectiveShape& shape);
// "all_reduce #4 (1530 float32, sum)", "broadcast #2 (64 float32, root 1)",
// "barrier #7"; an unknown op or dtype reads "op?" / "dtype?".
std::string DescribeFingerprint(int64_t fingerprint, uint64_t sequence);

// fingerprints: every process's fingerprint of collective `sequence`, in process
// order (INT64_MIN: unknown, left out). "" when the known ones agree, else
// "collective mismatch across processes: <name(0)> called all_reduce #4 (...)
// while <name(1)> called all_gather #4 (...)[, <name(p)> called ...] (op, size,
// ...)": the first process against the first that differs, then every further
// process that differs from the first.
std::string CollectiveMismatch(const std::vector<int64_t>& fingerprints, uint64_t sequence,
                               const std::function<std::string(int process)>& name);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_MPI_COLLECTIVE_FINGERPRINT_H_
