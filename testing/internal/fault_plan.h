// The faults of one testing::RunRanks, shared by its rank threads: the step side
// (StepLog::EndStep) and the collective side (FaultyCommunicator, which wraps
// each rank's communicator through SpawnHooks::wrap_communicators).
#ifndef TANDEM_TESTING_INTERNAL_FAULT_PLAN_H_
#define TANDEM_TESTING_INTERNAL_FAULT_PLAN_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spawn/comm/communicator.h"
#include "testing/faults.h"

namespace tandem::testing::internal {

// Thread-safety: every method may be called from any thread.
class FaultPlan {
 public:
  // hang_limit_s: how long a kHang waits for the stop before it throws
  // tandem::Error saying that nothing stopped it.
  FaultPlan(std::vector<Fault> faults, int world_size, double hang_limit_s);

  // Fires the fault planned for `rank` at `step`, if any (see testing/faults.h):
  // throws, returns its error, hangs until `stop` then throws, or sleeps.
  absl::Status AtStep(int rank, int64_t step, const std::stop_token& stop);
  // The same in collective `sequence` (`op`: its name); kReturnError sets the
  // rank's asynchronous error instead of returning.
  void AtCollective(int rank, uint64_t sequence, const char* op, const std::stop_token& stop);
  // The asynchronous error a kReturnError fault set for `rank` (OK: none).
  absl::Status AsyncError(int rank) const;

  // SpawnHooks::wrap_communicators: each rank's communicator inside a
  // FaultyCommunicator over this plan (which must outlive the run).
  absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> Wrap(
      std::vector<std::unique_ptr<dist::Communicator>> communicators);

  std::vector<FaultEvent> events() const;

 private:
  // The fault at (rank, step or collective), taken so that it fires once.
  std::optional<Fault> Take(int rank, std::optional<int64_t> step,
                            std::optional<uint64_t> collective);
  // Runs the action of `fault` (not kReturnError at a collective).
  absl::Status Fire(const Fault& fault, const std::string& where, const std::stop_token& stop);
  void Record(const Fault& fault, std::string where, std::string outcome, double seconds);

  const std::chrono::duration<double> hang_limit_;
  mutable std::mutex mu_;
  std::vector<Fault> pending_;             // guarded by mu_
  std::vector<FaultEvent> events_;         // guarded by mu_
  std::vector<absl::Status> async_error_;  // per rank; guarded by mu_
};

}  // namespace tandem::testing::internal

#endif  // TANDEM_TESTING_INTERNAL_FAULT_PLAN_H_
