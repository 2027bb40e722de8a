// testing::RunRanks: runs a training function on N in-process ranks (one thread
// each, through spawn), records what each rank reports per step, and injects
// faults (testing/faults.h) and fake communicators (testing/fake_communicator.h).
// testing/equivalence.h compares a run of N ranks with a run of one.
//
// The training function is the program's own, given a StepLog to report to:
//
//   absl::Status Train(dist::Context& ctx, testing::StepLog& log) {
//     Net net;
//     dist::DataParallel dp(net, ctx);
//     optim::SGD sgd(dp.parameters(), {.lr = 0.1});
//     for (int step = 0; step < 5; ++step) {
//       ...                                        // forward, backward, sgd.step()
//       RETURN_IF_ERROR(log.EndStep(loss, net));   // records; a planned fault fires here
//     }
//     return absl::OkStatus();
//   }
//   testing::RunReport report;
//   absl::Status s = testing::RunRanks(Train, {.ranks = 2}, &report);
//
// Restarts (spawn.restart, spawn/restart.h): on each attempt after the first
// a rank's record is cut back to the step the attempt resumes from (the
// snapshot's step, 0 without one), so that StepLog's step numbers stay the
// training's own and the final record reads as one run's. After a world
// shrink (RestartPolicy::leave_out_failed_rank) record r is written by the
// rank numbered r in the attempt, and the rank left out keeps its record as it
// ended. Faults fire once
// in the whole run; a collective's asynchronous error (kReturnError) belongs to
// the communicator it was reported by, and the rebuilt ones start clean.
//
// Errors: RunRanks returns InvalidArgument for bad options (naming the value) and
// otherwise exactly what spawn returns for the run: the first failure, naming
// the rank (spawn/launch.h).
//
// Threads: the training function runs on spawn's rank threads; RunRanks returns
// after every one has been joined. RunRanks may be called from any thread but not
// from a rank thread (runs do not nest). A rank that never reaches a
// collective, a stop-aware wait or check_stop() after a stop cannot be ended
// (threads are not killed): spawn's watchdog then logs it and RunRanks waits.
#ifndef TANDEM_TESTING_RUN_H_
#define TANDEM_TESTING_RUN_H_

#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nn/module.h"
#include "nn/tensor.h"
#include "spawn/context.h"
#include "spawn/launch.h"
#include "testing/fake_communicator.h"
#include "testing/faults.h"

namespace tandem::testing {

namespace internal {
class FaultPlan;
}  // namespace internal

// A tensor's values at one step, in float64 on the host.
struct NamedValues {
  std::string name;  // the module's name for it: "l1.weight"
  nn::Shape shape;
  std::vector<double> values;  // row-major
};

// What one rank reported: its loss at each step and, when the run records
// parameters, a copy of its module's parameters after each step.
struct RankRecord {
  std::vector<double> losses;
  std::vector<std::vector<NamedValues>> parameters;  // [step][parameter], parameters() order
};

// One rank's side of a run, handed to the training function by RunRanks.
// Thread-safety: belongs to its rank's thread.
class StepLog {
 public:
  // RunRanks makes one per rank. Made by hand (plan null), it records into *record
  // and fires nothing: a training function can then run without RunRanks.
  StepLog(dist::Context& ctx, RankRecord* record, internal::FaultPlan* plan = nullptr,
          bool record_parameters = true);
  // After every training step: records the step's loss (this rank's) and, when
  // the run records parameters, a copy of `module`'s parameters (named as
  // module.named_parameters() names them: pass the model itself, the module a
  // DataParallel wraps). Then fires a fault planned
  // at this rank and step: returns its error (kReturnError), throws (kThrow,
  // kHang once the run stops) or sleeps (kSlow). OK otherwise.
  // loss: a tensor of one element (read with item(), a host wait), or a value.
  absl::Status EndStep(const nn::Tensor& loss, const nn::Module& module);
  absl::Status EndStep(double loss, const nn::Module& module);
  // Only the loss (nothing to compare parameters with at this step).
  absl::Status EndStep(double loss);
  // Steps reported so far (the next step's number).
  int64_t steps() const { return static_cast<int64_t>(record_->losses.size()); }
  dist::Context& context() const { return ctx_; }

 private:
  absl::Status Record(double loss, const nn::Module* module);

  dist::Context& ctx_;
  RankRecord* record_;
  internal::FaultPlan* plan_;
  bool record_parameters_;
};

// The function under test. It runs on every rank; it may also throw.
using TrainingFunction = std::function<absl::Status(dist::Context& ctx, StepLog& log)>;

// The spawn options RunRanks uses unless told otherwise: every rank's log lines,
// a 60 s watchdog, seed 0, no signal handlers (a test binary keeps its own),
// one process even under mpirun, and the log captured into RunReport::log
// (console null).
inline dist::SpawnOptions DefaultTestSpawnOptions() {
  return {.log_all_ranks = true,
          .timeout_s = 60,
          .seed = 0,
          .handle_sigint = false,
          .stop_signals = {},
          .processes = dist::Processes::kOff};
}

struct RunOptions {
  // Ranks, on the devices of `gpus` (spawn's gpus string: "cpu", "0,1", ...;
  // "0,0" needs spawn.share_devices).
  int ranks = 2;
  std::string gpus = "cpu";
  // seed: rank r's generator starts at (seed, stream r); timeout_s: the
  // watchdog's limit. console null: the log goes to RunReport::log.
  dist::SpawnOptions spawn = DefaultTestSpawnOptions();
  // Faults to inject (testing/faults.h).
  std::vector<Fault> faults;
  // When set, the ranks talk through fake asynchronous communicators over this
  // group (its world size must be `ranks`) instead of spawn's own.
  std::shared_ptr<FakeGroup> fake_group;
  // Record each step's parameters (EndStep with a module); off: losses only.
  bool record_parameters = true;
  // TF32 off during the run (testing/seed.h, ScopedDeterminism).
  bool deterministic = true;
  // A kHang fault that no stop has ended after this long throws instead
  // (a hang at the end of a run, where no other rank waits for it, would
  // otherwise never end).
  double hang_limit_s = 120;
};

struct RunReport {
  std::vector<RankRecord> ranks;  // by local rank
  std::vector<FaultEvent> faults;  // those that fired, in firing order
  double seconds = 0;              // spawn's call, from start to return
  // Calls of the function per rank: 1 + restarts (SpawnOptions::restart); 0
  // when the run ended before its ranks were set up (a bad option, start-up).
  int attempts = 0;
  std::string log;                 // the run's log when RunOptions::spawn.console was null
};

// Runs `fn` on options.ranks ranks (see the top of this file). `report` (may
// be null) receives what the ranks recorded, also when the run failed.
absl::Status RunRanks(const TrainingFunction& fn, const RunOptions& options = {},
                 RunReport* report = nullptr);

}  // namespace tandem::testing

#endif  // TANDEM_TESTING_RUN_H_
