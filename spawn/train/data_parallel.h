// dist::DataParallel: the gradients of a model averaged over the ranks of a run.
//
//   LinearNet net;                          // on ctx.device()
//   dist::DataParallel dp(net, ctx);        // rank 0's weights broadcast to all
//   auto loss = loss_fn(dp(x), y);
//   loss.backward();                        // buckets all-reduced during backward
//   sgd.step();                             // grads hold the mean over ranks
//
// Construction (a collective: every rank constructs its DataParallel at the same
// point): checks that every rank has the same parameter and buffer names, shapes
// and dtypes (a difference throws tandem::Error naming the first mismatch on
// every rank, instead of a hang), then broadcasts rank 0's values.
//
// Backward: parameters are grouped into buckets in reverse registration order
// (roughly the order backward produces their gradients); the first bucket holds
// at most first_bucket_bytes, the others bucket_bytes. Each gradient is a view
// into its bucket's flat buffer. When the last gradient of a bucket is final (a
// grad-ready hook) the bucket's all-reduce is launched (buckets always launch in
// order, so every rank issues the same collectives); on CPU ranks it runs on the
// backward thread right then, with NCCL on the communication stream, overlapping
// the rest of the backward pass. At the end of backward (autograd::QueueCallback)
// the compute stream waits for the last bucket: every gradient then holds the
// mean over ranks. A grad-ready hook the caller registers on a parameter after
// the DataParallel was made runs after DataParallel's, when the bucket's
// all-reduce may already be launched: it must neither read nor write the
// gradient (with NCCL the collective is reducing it on the communication
// stream meanwhile; in-process it may already hold the mean). Register such hooks
// before making the DataParallel, or reduce through a comm hook.
// One live DataParallel per parameter: making a second over the same module, or
// over a module inside (or around) a wrapped one, throws tandem::Error naming the
// rank (destroy the first to wrap the module again).
//
// A parameter that got no gradient in a backward pass is an error naming it,
// unless find_unused_parameters is set: then it counts as a zero gradient.
//
// A backward pass that threw leaves bucket all-reduces that nobody waited for:
// their handles are dropped as the exception leaves backward (and, again, at the
// next forward or backward), which orders the compute stream after them (CPU:
// waits for them), so no bucket is zeroed (zero_grad, forward) or refilled while
// a collective may still reduce it.
//
// Uneven batches of one global batch (every step's rows over the ranks sum to
// G, as a DistributedBatchSampler with global_batch_size gives them: 22, 21, 21
// for 64 on 3 ranks) need no join: DataParallelOptions::global_batch_size
// weighs each rank's gradient by its rows without a collective (below).
//
// Uneven inputs: join() returns a guard (PyTorch's DistributedDataParallel.join()):
//
//   {
//     auto join = dp.join();                // every rank, before its loop
//     while (auto batch = loader.next()) {  // ranks may have different step counts
//       auto loss = loss_fn(dp(batch->data), batch->target);
//       loss.backward();
//       sgd.step();
//       sgd.zero_grad();
//     }
//     ThrowIfError(join.finish(), "");     // a rank whose data ran out answers the
//   }                                      // others' steps here until all are done
//
// Inside it each step starts (at forward) with one small all_gather, the step
// agreement, and the gradients are weighted by the samples actually seen: the
// result is sum_r n_r g_r / sum_r n_r (n_r: rows of rank r's x, g_r: its
// gradient of its mean loss), which a joined rank (n_r = 0) answers with zero
// gradients; SyncBatchNorm layers converted before this DataParallel was made
// answer with a count of 0 and weigh their gradient sums the same way. So ranks
// with 10, 10 and 7 batches neither hang nor bias the update: they train as one
// rank on the union of each step's batches. A comm hook (options.comm_hook)
// runs inside the join too, on each rank's bucket scaled by n_r N / sum_r n_r
// (its mean over the ranks is then the weighted sum; the factor is exactly 1
// when every batch has the same rows, which gives the bits of the run without
// join); a joined rank runs the same hook on its zeroed bucket, so it makes the
// hook's own collectives (compressed zeros). The hook must make the same
// collectives whatever the gradients hold. A ZeroRedundancyOptimizer (made
// before the guard) keeps working: its reduce-scatter hook runs as above, and a
// joined rank replays its step() (and clip_grad_norm_()): it steps its own
// shard's optimizer with the reduced gradient and all-gathers the updated
// parameters with the others (see zero_redundancy_optimizer.h). Rules: one
// synchronised forward per step (no_sync() micro-batches before it accumulate;
// the step then weighs all their rows); broadcast_buffers broadcasts from the
// step's lowest active rank; every other collective of a step must go through
// JoinGuard::all_reduce (a sum; a joined rank adds zeros).
// Another collective in a step is found at the next step agreement, where every
// rank throws the same error naming the rank (a step that made one while a rank
// had already joined fails at that collective: the in-process communicator's
// mismatch error, or the watchdog's timeout). A rank that joins before its first
// step is the same kind of error. When every rank has joined, each takes the
// parameters and buffers of the lowest rank that ran the last step (a rank that
// joined early missed the last updates; PyTorch does the same), so all ranks
// leave the guard with one model; the optimizer states of early joiners are
// their own (with ZeroRedundancyOptimizer every rank's shard of the state saw
// every step). An exception leaving the loop skips the answering: the rank fails
// and the run stops at once, as outside a join.
//
// CUDA graphs (nn/graph.h): with the NCCL communicator, forward + backward
// (bucket all-reduces on the communication stream, joined back into the compute
// stream at the end of backward) can be captured after one eager step and
// replayed; the gradient buffers stay in place. The in-process communicator
// cannot be captured (its collectives throw under capture).
//
// Thread-safety: belongs to its rank's thread, like the module. The module must
// outlive the DataParallel.
#ifndef TANDEM_SPAWN_TRAIN_DATA_PARALLEL_H_
#define TANDEM_SPAWN_TRAIN_DATA_PARALLEL_H_

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "nn/module.h"
#include "nn/tensor.h"
#include "spawn/comm/communicator.h"
#include "spawn/context.h"
#include "spawn/train/join.h"
#include "spawn/train/comm_hooks.h"

namespace tandem::dist {

struct DataParallelOptions {
  int64_t bucket_bytes = int64_t{25} << 20;
  int64_t first_bucket_bytes = int64_t{1} << 20;
  // Treat a parameter that got no gradient as a zero gradient instead of an error.
  bool find_unused_parameters = false;
  // Broadcast rank 0's buffers (BatchNorm running statistics) at every
  // synchronised forward with autograd on, as PyTorch's DDP does by default, so
  // that every rank evaluates and checkpoints the same statistics (without it
  // each rank's BatchNorm2d keeps the statistics of its own slices). One
  // broadcast per buffer dtype; nothing for a model without buffers. Inside
  // join() the root is the step's lowest active rank.
  bool broadcast_buffers = true;
  // Reduce gradients during backward. Off: the caller reduces by hand
  // (scale_loss, apply_collective_grads).
  bool reduce_in_backward = true;
  // Called on the backward thread as each bucket's all-reduce is launched
  // (bucket index, number of parameters in it): for tests and profiling.
  std::function<void(int bucket, int params)> on_bucket_launch;
  // How each bucket is reduced (spawn/train/comm_hooks.h); empty: all_reduce_async(kAvg).
  // Inside join() too, on gradients scaled to the step's sample weighting.
  CommHook comm_hook;
  // Samples per step over every rank, G, for ranks whose batches differ in rows
  // (data::DistributedOptions::global_batch_size with N not dividing G: 64 over
  // 3 ranks gives 22, 21, 21). Set, each bucket is scaled by n_r N / G before
  // it is reduced (n_r: the rows, dimension 0, of this rank's synchronised
  // forward in the step plus those of its no_sync() micro-batches before it;
  // one synchronised forward per backward; forwards with autograd off, an
  // evaluation's, do not count; a comm hook gets the scaled bucket; SyncBatchNorm
  // layers weigh the gradient sums of each forward's backward by that forward's
  // rows on every rank, so that with no_sync() the micro-batches of a step must
  // split each rank's rows evenly, as the weighing of its gradients assumes), so the mean
  // over the ranks is sum_r n_r g_r / G (g_r: the gradient of this rank's mean
  // loss): the gradient of the mean loss over the G samples, as one rank with
  // batch G computes it. No collective: the ranks' rows must sum to G in every
  // step, which is not checked (the sampler's full global batches do, and
  // kWrapGlobalBatch makes none other; a shorter tail wants join(), which
  // counts rows with one all_gather a step); a rank whose step has more than G
  // rows throws naming both. When n_r N = G (equal batches) the factor is 1
  // and no multiply is made: the bits of 0. 0: the plain mean over the ranks.
  // Refused with reduce_in_backward off and inside join() (which weighs by the
  // rows it counts).
  int64_t global_batch_size = 0;
};

class DataParallel {
 public:
  DataParallel(nn::Module& module, Context& ctx, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // The module's forward; also points gradients into the buckets and, with
  // broadcast_buffers, broadcasts rank 0's buffers first.
  nn::Tensor forward(const nn::Tensor& x);
  nn::Tensor operator()(const nn::Tensor& x) { return forward(x); }

  std::vector<nn::Tensor> parameters() const { return module_.parameters(); }
  nn::Module& module() const { return module_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Parameter names of bucket b, in the bucket's order.
  std::vector<std::string> bucket_parameter_names(int b) const;
  // Bucket b as a comm hook sees it (its buffer: the gradients of this rank).
  GradBucket bucket(int b) const;
  // Replaces options.comm_hook (ZeroRedundancyOptimizer installs its own); call
  // it between backward passes, on every rank.
  void register_comm_hook(CommHook hook) { options_.comm_hook = std::move(hook); }
  bool has_comm_hook() const { return static_cast<bool>(options_.comm_hook); }
  const CommHook& comm_hook() const { return options_.comm_hook; }

  // While the guard lives, backward passes only accumulate local gradients
  // (gradient accumulation); the next synchronised backward reduces the
  // accumulated sum. Made by no_sync() or directly (e.g. in a std::optional),
  // the same checks either way. Inside join() the micro-batches of a step
  // accumulate too: the step agreement runs at the step's synchronised forward
  // and weighs the step by every row this rank saw in it (see the file comment);
  // a module with SyncBatchNorm layers (whose forward is a collective) is refused
  // there, naming both, because a joined rank cannot answer collectives made
  // before the agreement.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DataParallel* dp);
    // Left by an exception: the step is abandoned, and the rows its micro-batches
    // counted (global_batch_size, join()) do not carry into the next one.
    ~NoSyncGuard() {
      dp_->sync_ = previous_;
      if (std::uncaught_exceptions() > exceptions_) dp_->step_rows_ = 0;
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DataParallel* dp_;
    bool previous_;
    int exceptions_ = std::uncaught_exceptions();
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(this); }

  // See the file comment. Not a collective itself; every rank must make its
  // guard before its loop. Throws tandem::Error inside another join, inside
  // no_sync(), or without reduce_in_backward.
  //
  //   auto join = dp.join();
  //   while (auto batch = loader.next()) { ... }
  //   ThrowIfError(join.finish(), "");        // or RETURN_IF_ERROR(join.finish())
  //
  // finish() is where a finished rank answers the others' steps: collectives,
  // whose failure it returns. The destructor never throws: it calls finish() if
  // the caller did not (unless an exception is leaving the scope: then the rank
  // fails at once and the guard only leaves join mode), and defers a failure to
  // this rank's next collective, or, without one, to the rank's end
  // (Communicator::DeferError), so the error still reaches every rank and spawn.
  // The guard may be held in a std::optional.
  class JoinGuard {
   public:
    explicit JoinGuard(DataParallel* dp);
    ~JoinGuard();
    JoinGuard(const JoinGuard&) = delete;
    JoinGuard& operator=(const JoinGuard&) = delete;
    // Answers the other ranks' steps until every rank has joined, then every
    // rank takes the model of a rank that ran the last step (collectives, on
    // every rank, after its loop). Returns what ended it early: the step
    // agreement's error (the same on every rank: a collective that is not
    // joinable, a rank with no step) or the run's stop (kCancelled). The guard is
    // done after the first call, whatever its outcome; later calls return that
    // outcome and make no collective.
    absl::Status finish();
    // A joinable sum over the ranks, inside a step (a loss or a count for a
    // log line): a rank that has joined adds zeros. Only ReduceOp::kSum.
    void all_reduce(nn::Tensor& x, ReduceOp op = ReduceOp::kSum);

   private:
    DataParallel* dp_;
    int exceptions_;
    std::optional<absl::Status> finished_;
  };
  [[nodiscard]] JoinGuard join() { return JoinGuard(this); }
  // The join's bookkeeping, for the work of other classes that a joined rank
  // must answer (ZeroRedundancyOptimizer records its step; see join.h).
  internal::JoinState& join_state() { return join_; }

  // Paddle's explicit API, for gradients reduced by hand (inside no_sync() or
  // with reduce_in_backward off): loss / world_size, then after backward
  // apply_collective_grads() sums every gradient over the ranks.
  nn::Tensor scale_loss(const nn::Tensor& loss) const;
  void apply_collective_grads();

  // How much of the gradients' all-reduce ran behind backward, summed over every
  // pass so far (host time). Per bucket, exposed = the time the rank was blocked
  // by it (inside the all_reduce_async call, in its wait); hidden = when the
  // communicator runs it on another thread and reports when it finished
  // (Work::finished_at: the cross-process communicator), the part of its run
  // (from its launch, or the previous bucket's end, to its end) before the end of
  // backward; comm_s = exposed + hidden. The in-process communicator runs it
  // inside the call (nothing hidden); NCCL: not measured on the host.
  struct OverlapStats {
    double comm_s = 0;
    double hidden_s = 0;
  };
  OverlapStats overlap_stats() const { return overlap_; }

 private:
  struct Bucket {
    nn::Tensor buffer;                 // flat, all of the bucket's gradients
    std::vector<int> params;           // indices into params_
    int pending = 0;                   // gradients not yet final in this pass
    std::chrono::steady_clock::time_point launched;  // the all_reduce_async call began
    std::chrono::steady_clock::time_point returned;  // ... and returned
    int64_t wire_bytes = 0;            // of the tensor its collective reduces
    // The bucket's all-reduce in flight. Declared last: destroyed first, so the
    // buffer outlives it (see Work's contract on unwaited handles).
    std::shared_ptr<Work> work;
  };
  struct Slot {
    std::string name;
    nn::Tensor param;
    int bucket = 0;
    nn::Tensor view;                   // the gradient's place in its bucket
    bool ready = false;
    int hook = -1;
  };

  void CheckSameModelOnEveryRank();
  void BuildBuckets();
  // Makes param i's gradient the view into its bucket (copying any gradient it had).
  void PlaceGrad(int i, bool zero_if_undefined);
  void OnGradReady(int i);
  void LaunchReadyBuckets();
  // Inside join(), with a comm hook: bucket `index` scaled to its share of the
  // step's samples, then the hook; recorded for a joined rank to replay.
  void LaunchHookedBucketInJoin(int index);
  // Outside join(): bucket `b` (the next one) reduced, weighed by
  // options_.global_batch_size's step scale when set.
  void LaunchBucket(Bucket& b);
  // options_.global_batch_size: counts a forward's rows into the step's scale.
  void WeighStepRows(int64_t rows);
  void FinishBackward();
  // Destroys the handles of collectives no pass waited for (a backward that threw).
  void DropUnwaitedWork();

  // Points the SyncBatchNorm layers of the module at join_ (or, null, away);
  // returns how many there are.
  int ConnectSyncBatchNorm(internal::JoinState* join);
  // broadcast_buffers' collectives at a forward (recorded inside join()).
  void BroadcastBuffers();

  nn::Module& module_;
  Context& ctx_;
  DataParallelOptions options_;
  std::vector<Slot> params_;          // registration order
  std::vector<Bucket> buckets_;
  bool sync_ = true;
  bool pass_started_ = false;
  int next_bucket_ = 0;
  int sync_batch_norm_layers_ = 0;
  // Rows of this step's no_sync() micro-batches so far: inside join(), or with
  // options_.global_batch_size.
  int64_t step_rows_ = 0;
  double step_scale_ = 1;  // global_batch_size: n_r N / G of the current step
  double step_weight_ = 1;  // global_batch_size: n N / G of the last forward (SyncBatchNorm's weight)
  OverlapStats overlap_;
  internal::JoinState join_;
};

namespace internal {
// The broadcast_buffers setting of the live DataParallel made over `module`
// (the newest, when several are), or nullopt when none is (any thread).
// Checkpoints ask it to state which buffers they hold (spawn/train/checkpoint.h).
std::optional<bool> BroadcastBuffersOf(const nn::Module* module);
}  // namespace internal

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_TRAIN_DATA_PARALLEL_H_
