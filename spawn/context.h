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
#include "nn/tensor.h"
#include "spawn/comm/communicator.h"
#include "spawn/logger.h"
#include "spawn/restart.h"

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

  // The run's trace recorder (spawn/observe/trace.h), or null: spans (TraceSpan,
  // DataParallel's buckets) go to it. Not owned; set by the training function.
  TraceRecorder* trace() const { return trace_; }
  void set_trace(TraceRecorder* trace) { trace_ = trace; }

  // Restarts (SpawnOptions::restart, spawn/restart.h): which call of the
  // function on this rank this is (0: the first; n: after n restarts), the
  // run's snapshots and the step this attempt resumes from.
  // dist::RestoreSnapshot (spawn/train/checkpoint.h) reads them for you.
  int attempt() const { return attempt_.attempt; }
  const AttemptInfo& attempt_info() const { return attempt_; }
  // Set by spawn before the function runs.
  void set_attempt_info(const AttemptInfo& info) { attempt_ = info; }

  // This rank's flight recorder (spawn/comm/flight_recorder.h): its last
  // SpawnOptions::flight_recorder_entries collectives, one line each after a
  // heading, each "flight recorder: rank R (device) #N op dtype[count] state: ...".
  // spawn logs every rank's with the run's first failure; this is the same
  // text on demand (e.g. from a training loop that suspects a slow rank).
  std::string DumpFlightRecorder() const { return communicator_->DumpFlightRecorder(); }

  // SBP-style data parallelism (OneFlow's split(0) for the data, the model
  // broadcast by DataParallel): every rank holds the same global tensor `x` and
  // split gives this rank's part of it, so the user writes the single-device
  // loop with `dp(ctx.split(x))`. The rows follow DistributedBatchSampler's rule
  // exactly (data/sampler.h, no shuffle, one global batch): with n = x.size(dim)
  // and N = world_size(), every rank gets ceil(n / N) rows, rank r the positions
  // r*ceil(n/N) ... in order, wrapping around to the start of `dim` where n is not a
  // multiple of N (so the last ranks' parts repeat the first rows, as the
  // sampler pads its last global batch). Where N divides n the parts are disjoint
  // and N ranks averaging gradients train exactly as one rank on `x` (a mean loss).
  //   x: any shape with at least one dim, any dtype, on any device; dim: negative
  //   counts from the end. Returns: x's shape with size(dim) = ceil(n / N) (0 for
  //   n = 0); a view of x for dim 0 without wrap, else a copy (index_select).
  //   Differentiable with respect to a float x. No collective: each rank cuts its
  //   own part (a copy uploads its row indices from the host).
  // Throws tandem::Error naming the dim and the shape on a bad dim or a 0-dim x.
  nn::Tensor split(const nn::Tensor& x, int64_t dim = 0) const;

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
  AttemptInfo attempt_;
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
