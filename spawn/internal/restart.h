// The restart loop of spawn (internal to spawn/; the contract is in
// spawn/restart.h): runs attempts of the training function until one ends
// without a failure that the policy restarts, or the restarts are used up.
// spawn/launch.cc hands it how to run one attempt and how to rebuild the
// communicators; the watchdog marks its own failures with their cause.
#ifndef TANDEM_SPAWN_INTERNAL_RESTART_H_
#define TANDEM_SPAWN_INTERNAL_RESTART_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "spawn/context.h"
#include "spawn/logger.h"
#include "spawn/options.h"
#include "spawn/restart.h"

namespace tandem::dist::internal {

// Where a run's first failure came from, when the watchdog found it (a status
// payload, removed before spawn returns). A failure without one came from a
// rank's function, or from spawn itself. kDevice: a CUDA error of a device
// itself (a fault on the device: sticky, the device's CUDA context in this
// process is unusable), found by the watchdog (Communicator::PollDeviceError),
// thrown on a rank (dist::DeviceError), or met on the failed attempt's streams
// after the joins; it never restarts.
enum class FailureCause { kCommunicator, kTimeout, kDevice };
absl::Status WithFailureCause(absl::Status status, FailureCause cause);
std::optional<FailureCause> GetFailureCause(const absl::Status& status);
// What a failed attempt's CUDA devices still held once its threads were
// joined (spawn/launch.cc, WithDeviceErrorsLeft): `reports`, the kernels'
// deferred reports that no host wait read before the stop; `broken`, one
// "cuda:N (CUDA's error)" per device whose streams returned a CUDA error (a
// fault on the device). Appended to `status`'s message, its payloads kept; a
// broken device marks the failure FailureCause::kDevice (no restart), whatever
// cause it had. A stopped run's status (IsStopped) stays as it is, the words
// logged as a warning instead. Nothing found: `status` unchanged.
absl::Status WithDeviceErrorsFound(absl::Status status, const std::vector<std::string>& reports,
                                   const std::vector<std::string>& broken, Logger& logger);
// A timeout's lagging ranks (a status payload, removed before spawn returns):
// the local ranks, running and in rank order, that had not entered the
// collective the stuck ranks waited in, when the watchdog could tell; the
// ranks the others waited for (Watchdog::CheckTimeouts). Empty when the status
// carries none.
absl::Status WithLaggingRanks(absl::Status status, const std::vector<int>& ranks);
std::vector<int> GetLaggingRanks(const absl::Status& status);

// The policy's own checks: InvalidArgument for a negative max_restarts;
// FailedPrecondition for max_restarts > 0 in a run that joins other processes
// (Processes::kOn, or kAuto under a launcher that started several).
absl::Status CheckRestartPolicy(const RestartPolicy& policy, Processes processes,
                                const LaunchInfo& launch);

// What spawn's run gives the loop. Every function is called on spawn's thread.
struct RestartRun {
  const RestartPolicy& policy;
  int world_size;  // this process's ranks
  double timeout_s;
  Logger& logger;
  const std::function<absl::Status(Context&)>& body;
  // One attempt of `body` on every rank, over the current communicators (the
  // first attempt's come from start-up); returns the attempt's outcome once
  // every rank thread has been joined and the communicators destroyed.
  std::function<absl::Status(const std::function<absl::Status(Context&)>& body)> run_attempt;
  // Makes new communicators before an attempt after the first; with
  // `leave_out`, first drops that local rank's device from the run (the next
  // attempts have one rank fewer).
  std::function<absl::Status(std::optional<int> leave_out)> rebuild;
  // The device of local rank `rank` of the current attempt, in words ("cpu", "cuda:1").
  std::function<std::string(int rank)> describe_device;
  // True when Ctrl-C or a stop signal arrived since the run began.
  std::function<bool()> stop_asked;
};

// Runs attempts (see spawn/restart.h) and returns the run's outcome, without
// the cause payloads.
absl::Status RunWithRestarts(const RestartRun& run);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_INTERNAL_RESTART_H_
