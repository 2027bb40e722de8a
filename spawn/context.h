// dist::Context: what a rank's function knows about its place in the run.
//
//   void train(dist::Context& ctx, int epochs) {
//     ctx.log().Info("rank {} of {} on {}", ctx.rank(), ctx.world_size(), ctx.device());
//     ...
//     ctx.check_stop();   // at a step boundary: throws when the run is stopping
//   }
//
// spawn makes one Context per rank thread, sets that thread's nn device
// (nn::DeviceGuard) and generator (nn::manual_seed(seed, rank)) before calling fn,
// and makes the Context reachable from the thread through dist::current().
//
// Thread-safety: a Context belongs to its rank's thread; stop_requested() may be
// read from any thread.
#ifndef TANDEM_SPAWN_CONTEXT_H_
#define TANDEM_SPAWN_CONTEXT_H_

#include <cstdint>
#include <stop_token>
#include <string>

#include "nn/device.h"
#include "spawn/communicator.h"
#include "spawn/logger.h"

namespace tandem::dist {

class TraceRecorder;

namespace internal {
class StepAgreement;
}  // namespace internal

// What the ranks agreed on at a step boundary (see spawn/signals.h).
struct StepDecision {
  bool stop = false;  // a stop signal: save, then stop at this step (every rank)
  bool save = false;  // a save proposed by some rank is due at this step (every rank)
};

// Where a rank runs in a job of several processes (one process: the defaults).
struct Placement {
  int local_rank = -1;     // rank within this process; -1: the same as the rank
  int process_index = 0;   // this process among the job's (launcher order)
  int process_count = 1;
  std::string host;        // empty: this machine's name is not needed (one process)
};

class Context {
 public:
  Context(int rank, int world_size, nn::Device device, Communicator* communicator,
          RankLogger logger, std::stop_token stop, Placement placement = {},
          internal::StepAgreement* agreement = nullptr);
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Global: process order, then local order; world_size() counts every process's ranks.
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // This rank among its process's ranks (== rank() in a single-process run).
  int local_rank() const { return placement_.local_rank; }
  int process_index() const { return placement_.process_index; }
  int process_count() const { return placement_.process_count; }
  // Host name of this process ("" in a single-process run).
  const std::string& host() const { return placement_.host; }
  nn::Device device() const { return device_; }
  Communicator& communicator() const { return *communicator_; }
  const RankLogger& log() const { return logger_; }
  std::stop_token stop_token() const { return stop_; }
  // True once another rank failed, the watchdog fired or Ctrl-C was pressed.
  bool stop_requested() const { return stop_.stop_requested(); }
  // Throws CancelledError when stop_requested(): call at step boundaries so a
  // rank that does no collective still stops promptly.
  void check_stop() const;
  // The step-boundary agreement (spawn/signals.h): call on every rank after
  // every training step with the number of steps done (consecutive values).
  // stop: a stop signal (SpawnOptions::stop_signals) arrived and every rank
  // gets stop at this same step; save what must be saved, then throw
  // dist::StoppedError. propose_save: ask for a save that every rank makes at
  // one agreed step (a later boundary's save). A Context not made by spawn
  // never stops or saves. CheckpointManager::AtStepBoundary calls it for you.
  StepDecision AtStepBoundary(int64_t step, bool propose_save = false);

  // The run's trace recorder (spawn/trace.h), or null: spans (TraceSpan,
  // DataParallel's buckets) go to it. Not owned; set by the training function.
  TraceRecorder* trace() const { return trace_; }
  void set_trace(TraceRecorder* trace) { trace_ = trace; }

 private:
  int rank_;
  int world_size_;
  nn::Device device_;
  Communicator* communicator_;
  RankLogger logger_;
  std::stop_token stop_;
  Placement placement_;
  internal::StepAgreement* agreement_;
  TraceRecorder* trace_ = nullptr;
};

// The Context of the calling rank thread. Throws tandem::Error when called from a
// thread that spawn did not start.
Context& current();
// The same, or nullptr outside a rank thread.
Context* current_or_null();

namespace internal {
// Makes `ctx` the calling thread's current Context for the guard's lifetime.
class CurrentContextGuard {
 public:
  explicit CurrentContextGuard(Context* ctx);
  ~CurrentContextGuard();
  CurrentContextGuard(const CurrentContextGuard&) = delete;
  CurrentContextGuard& operator=(const CurrentContextGuard&) = delete;

 private:
  Context* previous_;
};
}  // namespace internal

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_CONTEXT_H_
