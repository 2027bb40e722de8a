// hapi::Model: the training loop as a library (Paddle's paddle.Model, Keras'
// Model.fit), a thin composition of the pieces a hand-written loop uses
// (DataParallel, DistributedBatchSampler, DataLoader, optimizer, loss).
//
//   hapi::Model model([] { return std::make_shared<LeNet>(); });
//   model.prepare([](auto params) { return std::make_unique<optim::Adam>(params); },
//                 hapi::CrossEntropy(), {hapi::MakeMetric<hapi::Accuracy>()});
//   auto history = model.fit(train_set, {.epochs = 2, .batch_size = 64, .eval_data = test_set});
//   auto logs = model.evaluate(test_set);          // {"eval_loss": ..., "eval_acc": ...}
//
// Per rank, from factories: a module belongs to one rank's thread and device,
// so Model takes the network and the optimizer as factories and builds them
// on each rank (on the rank's device). Between calls Model keeps the weights
// (and, after fit, the optimizer state) as host copies, so fit, then
// evaluate, predict, save or another fit, continue from them; save() and
// load() carry both through files. The first call
// that builds the network takes rank 0's initial weights on every rank.
//
// Where it runs, with no change to the script:
//  - Called from a thread that dist::spawn did not start (main), each call
//    spawns over LaunchOptions' devices (gpus string, nprocs; under mpirun or
//    srun the job's processes join as one run) and returns when every rank is
//    done. Errors come back as spawn's Status, naming the rank.
//  - Called inside dist::spawn (a rank's function, each rank with its own
//    Model), it runs on that rank (ctx = dist::current()) with the others; an
//    error throws tandem::Error on the rank, as any failing step would. The
//    batch calls (train_batch, eval_batch, predict_batch) run only there.
//
// Data: datasets of (input, target) examples (data/dataset.h). Training draws
// each epoch's batches with DistributedBatchSampler (kWrapGlobalBatch: N ranks
// with batch B train as one rank with batch N*B, the same samples in the same
// order, for a loss that is the mean over the batch's rows: not so with
// CrossEntropy's weight or ignore_index, or kSum, see CrossEntropy); evaluate
// and predict use the kUneven tail, so every sample counts exactly once on any
// number of ranks. batch_size is per rank.
//
// Losses: the loss function returns the batch's mean loss (0-dim); the epoch's
// "loss" is the mean over the steps and ranks (accumulated on the device, read
// once per epoch). "eval_loss" is the loss of the whole evaluation set, as one
// rank would compute it in one batch: for the built-in losses (CrossEntropy,
// MeanSquaredError, which carry LossTerms) the sum over every rank's batches
// of their summed losses over the sum of their denominators; for a loss
// function of the user's own, each batch's mean weighed by its rows (see
// LossFunction).
//
// Options for memory and bandwidth: FitOptions::zero (the optimizer state
// sharded by dist::ZeroRedundancyOptimizer), data_parallel.comm_hook (bf16 /
// fp16 compressed gradients), and uneven (every sample once per epoch, ranks
// with different step counts under DataParallel::join()); they combine.
//
// CUDA ranks: FitOptions::cuda_graph captures the training step once and
// replays it for every full batch.
//
// In-process restarts: with FitOptions::snapshot_every_steps and a restart
// policy (SpawnOptions::restart), a fit whose rank failed continues after the
// restart from its newest in-memory snapshot rather than from the start.
//
// Thread-safety: a Model is used from one thread at a time (main, or one rank's
// thread); its calls from main run the ranks on spawn's threads.
#ifndef TANDEM_HAPI_MODEL_H_
#define TANDEM_HAPI_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "data/dataset.h"
#include "data/transforms.h"
#include "hapi/callbacks.h"
#include "hapi/metrics.h"
#include "hapi/summary.h"
#include "nn/module.h"
#include "nn/ops/loss.h"
#include "nn/tensor.h"
#include "optim/optimizer.h"
#include "spawn/launch.h"
#include "spawn/train/checkpoint_manager.h"
#include "spawn/train/data_parallel.h"

namespace tandem::hapi {

using NetworkFactory = std::function<std::shared_ptr<nn::Module>()>;
using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<nn::Tensor> params)>;
// A batch's loss in the form that adds up over batches and ranks: the set's
// loss is the sum of every batch's `sum` over the sum of every batch's
// `denominator` (PyTorch's reduction='mean' over the whole set).
struct LossTerms {
  nn::Tensor sum;  // 0-dim: the batch's loss with reduction sum
  // 0-dim: what the batch's mean divides `sum` by: its elements (mse_loss), the
  // sum of the class weights of its labels that are not ignore_index
  // (cross_entropy, nll_loss; without a weight, their count). Undefined for a
  // loss whose reduction is a sum: the set's loss is then the sum of the sums.
  nn::Tensor denominator;
};

// The loss Model trains and evaluates with: (output, target) -> 0-dim loss
// (the batch's mean, or with CrossEntropy's kSum its sum). Any callable of that
// signature converts to it (a lambda, a std::function), so user code passes
// its own; evaluate's "eval_loss" then weighs each batch's loss by its rows
// (exact for a mean over rows; not for a weighted mean, whose per-batch
// denominators differ). A LossFunction made with a `terms` form as well
// (CrossEntropy, MeanSquaredError, or the user's) evaluates exactly: the
// sum of every batch's LossTerms::sum over the sum of their denominators.
// Training calls the loss itself only. Thread-safety: called concurrently by
// the ranks' threads (both forms must allow that).
class LossFunction {
 public:
  using Function = std::function<nn::Tensor(const nn::Tensor& output, const nn::Tensor& target)>;
  using TermsFunction =
      std::function<LossTerms(const nn::Tensor& output, const nn::Tensor& target)>;

  LossFunction() = default;
  LossFunction(std::nullptr_t) {}  // NOLINT: empty, as a std::function
  // Any callable (output, target) -> nn::Tensor: evaluated by rows.
  template <typename F,
            typename = std::enable_if_t<
                !std::is_same_v<std::decay_t<F>, LossFunction> &&
                std::is_invocable_r_v<nn::Tensor, F&, const nn::Tensor&, const nn::Tensor&>>>
  LossFunction(F loss) : loss_(std::move(loss)) {}  // NOLINT: implicit, as a std::function
  // `loss` and its exact form `terms`, the same loss: on every batch loss's
  // value is terms.sum / terms.denominator (terms.sum without a denominator).
  LossFunction(Function loss, TermsFunction terms)
      : loss_(std::move(loss)), terms_(std::move(terms)) {}

  nn::Tensor operator()(const nn::Tensor& output, const nn::Tensor& target) const {
    return loss_(output, target);
  }
  explicit operator bool() const { return static_cast<bool>(loss_); }
  // As a std::function's `loss == nullptr` (and, rewritten, !=, nullptr == loss).
  friend bool operator==(const LossFunction& f, std::nullptr_t) { return !f; }
  bool has_terms() const { return static_cast<bool>(terms_); }
  // The batch's LossTerms; only when has_terms().
  LossTerms terms(const nn::Tensor& output, const nn::Tensor& target) const {
    return terms_(output, target);
  }

 private:
  Function loss_;
  TermsFunction terms_;
};

// nn::cross_entropy (mean) and nn::mse_loss (mean) as LossFunctions, each with
// its LossTerms (exact eval_loss).
// CrossEntropy takes labels (N) or, as Paddle's datasets give them, (N, 1), and
// nn::CrossEntropyOptions (weight, ignore_index, label_smoothing; reduction kMean
// or kSum: kNone, a loss per sample, label_smoothing outside [0, 1] and a weight
// that is undefined, not 1-D or requires grad throw here). A weight on another
// device than the output is copied to the output's device once per rank thread,
// at its first call (later in-place changes to the given weight are not seen there).
// On N ranks each rank reduces its own batch and DataParallel averages the
// gradients: with a weight or an ignore_index that a label meets, kMean divides
// by each rank's own weight sum, and kSum is each rank's sum (1/N of one rank's),
// so N ranks with batch B then differ from one rank with batch N*B (as
// PyTorch's DDP and Paddle do); label_smoothing alone keeps them equal.
// evaluate's "eval_loss" is the set's loss on any batch size and number of
// ranks: with kMean the sum of the weighted losses over the sum of the weights
// of the labels not ignored, all batches and ranks together (a batch whose
// labels are all ignore_index adds 0 to both); with kSum the sum over the
// set. A set whose labels are all ignore_index has, as PyTorch's mean of
// nothing, a kMean eval_loss of NaN (0 / 0), and a kSum one of 0.
LossFunction CrossEntropy();
LossFunction CrossEntropy(nn::CrossEntropyOptions options);
LossFunction MeanSquaredError();

// Where a call from main runs (ignored inside dist::spawn).
struct LaunchOptions {
  std::string gpus;  // spawn's gpus string: "" every visible GPU (CPU ranks without one), "cpu", "0,1"
  int nprocs = -1;   // ranks; -1: one per device of gpus
  dist::SpawnOptions spawn;
};

// Where a checkpoint stands (FitOptions::resume_position).
struct ResumePosition {
  int epoch = 0;              // epochs finished
  int64_t epoch_steps = 0;    // steps done in epoch `epoch` (0: at its start)
  double epoch_loss_sum = 0;  // their step losses, summed over the steps and every rank
};

struct FitOptions {
  int epochs = 1;
  int64_t batch_size = 32;  // per rank
  bool shuffle = true;
  bool drop_last = false;   // drop the last partial global batch
  uint64_t seed = 0;        // the shuffle order's seed (the same on every rank)
  int num_workers = 0;      // DataLoader worker threads per rank (max(2, 2 * num_workers) batches in flight)
  // Evaluated every eval_freq epochs (and after the last one) with eval_batch_size
  // (0: batch_size); its values join the epoch's logs as "eval_<name>".
  std::shared_ptr<const data::Dataset> eval_data;
  int eval_freq = 1;
  int64_t eval_batch_size = 0;
  // Micro-batches per optimizer step: the gradients of grad_accum_steps batches
  // are accumulated (DataParallel::no_sync) and reduced once; each micro-batch's
  // loss is scaled by 1/grad_accum_steps. A last group of an epoch shorter than
  // grad_accum_steps still steps.
  int grad_accum_steps = 1;
  bool bf16 = false;  // forward and loss under nn::AutocastGuard(kBFloat16)
  // Before each optimizer step the gradients (reduced over the ranks) are
  // scaled so that their global 2-norm is at most clip_grad_norm
  // (optim::clip_grad_norm_; with zero, ZeroRedundancyOptimizer's across the
  // shards). 0: no clipping. Refused with cuda_graph.
  double clip_grad_norm = 0;
  // Applied to each collated input batch on the host (e.g. data::ToFloatNormalize).
  std::shared_ptr<const data::Transform> batch_transform;
  // Buckets, comm hook (dist::Bf16CompressHook(), Fp16CompressHook(): the
  // gradients reduced in 16 bits; with zero, each bucket's reduce-scatter is
  // compressed the same way), unused parameters.
  dist::DataParallelOptions data_parallel;
  // dist::ZeroRedundancyOptimizer: the prepared optimizer made on each rank over
  // that rank's shards of DataParallel's buckets, so 1/N of its state per rank;
  // the parameters after every step are those of the unsharded optimizer.
  // RunState::optimizer is the wrapped (sharded) optimizer: lr schedules work
  // on it. Checkpoints and the state kept between calls hold the unsharded
  // layout (a fit with zero continues one without, and back, on any number of
  // ranks).
  bool zero = false;
  // Uneven training data: batches from the kUneven tail (every sample exactly
  // once per epoch, no padding or wrap-around; drop_last refused), so ranks may
  // run different numbers of steps; each epoch runs under DataParallel::join(),
  // whose gradients weigh each rank by its rows: N ranks with batch B train as
  // one rank with batch N*B on each step's union of batches (that one rank with
  // uneven = true too, whose last batch is the remainder). The epoch's "loss"
  // is one rank's too: each rank adds its batches' losses weighed by their rows
  // over the global batch's, and the sum is divided by the job's step count.
  // One exception: with grad_accum_steps > 1 a step whose micro-batches split
  // the epoch's tail unevenly over the ranks weighs all its rows alike (the
  // join's weighing), where one rank weighs each micro-batch by
  // 1 / grad_accum_steps, so the parameters part from one rank's there. RunState::step and
  // steps_per_epoch are this rank's; History::steps is the job's (the most any
  // rank ran). Batch-level callbacks must make no collective (a joined rank
  // cannot answer it). At each epoch's end every rank takes rank 0's
  // optimizer state (rank 0 ran every step; a rank that joined early did not
  // step its own optimizer in the steps it answered; with zero every shard saw
  // every step). Refused with checkpoint.dir: a joined rank cannot take
  // part in a save's step agreement; a stop signal then ends the run without
  // an agreed step, as Ctrl-C does.
  bool uneven = false;
  // At most this many optimizer steps per epoch (0: the whole epoch); the
  // loader's position moves to the next epoch afterwards.
  int64_t max_steps_per_epoch = 0;
  // CUDA ranks: the training step (zero_grad, forward and loss, backward with
  // DataParallel's bucket all-reduces, optimizer step) captured in an
  // nn::CudaGraph after the first full batch's eager step and replayed for
  // every full batch; a partial batch runs eagerly. Refused with
  // grad_accum_steps > 1, zero, uneven and clip_grad_norm; a CPU rank throws.
  bool cuda_graph = false;
  // BatchNorm2d layers become dist::SyncBatchNorm2d before DataParallel wraps the network.
  bool sync_batch_norm = false;
  // Training checkpoints (dist::CheckpointManager; dir empty: none): network,
  // optimizer, sampler position, step, every rank's generator and the epoch's
  // loss so far, every checkpoint.every_steps / every_minutes, the newest
  // checkpoint.keep kept, and one at the end of fit. A stop signal
  // (SpawnOptions::stop_signals: SIGTERM, SIGUSR1) saves at one agreed step on
  // every rank and fit returns spawn's IsStopped() status (inside a rank's
  // function: throws dist::StoppedError); without a directory it stops without
  // saving.
  dist::CheckpointManagerOptions checkpoint;
  // With checkpoint.dir: also save at the end of every epoch (after
  // on_epoch_end), as of the next epoch's start.
  bool checkpoint_each_epoch = false;
  // Continue from the newest checkpoint in checkpoint.dir that loads (none:
  // from the start): the same fit then ends as the uninterrupted one would.
  // Another number of ranks resumes too (not bit for bit: the generators stay
  // this run's); a checkpoint from inside an epoch then needs the same global
  // batch (batch_size * ranks: the loader's position counts global batches),
  // else fit fails naming both; one at an epoch's end resumes with any. A
  // checkpoint from inside an epoch also needs the grad_accum_steps it was
  // written with (its steps took that many loader batches each), on any world.
  bool resume = false;
  // For a checkpoint without fit's own entries ("hapi.epoch", ...: a file that
  // another training loop wrote): where it stands, from the file's entries and
  // path (an error names what is missing). Unset: such a file is an error
  // naming the missing entry.
  std::function<absl::StatusOr<ResumePosition>(const CheckpointExtra& extra,
                                               const std::string& path)>
      resume_position;
  // In-process restarts (SpawnOptions::restart, spawn/restart.h; from main:
  // LaunchOptions::spawn.restart): every snapshot_every_steps optimizer steps
  // (0: never) each rank stores an in-memory snapshot (dist::SaveSnapshot:
  // the checkpoint's entries, this rank's own, no file) of the network, the
  // optimizer (with zero: the unsharded state, gathered: a collective, so
  // that any world restores it), the loader's epoch and position, the step,
  // this rank's generator, and fit's counters: the epoch, its steps and this
  // rank's running loss, the history so far and the callbacks' entries
  // (on_checkpoint_save). On a later attempt (ctx.attempt() > 0) fit restores
  // the newest step every rank stored (on_checkpoint_load gets it, with
  // ResumeInfo::snapshot set) and continues: at most snapshot_every_steps
  // steps run again, and on CPU ranks the fit ends with the bits of the run
  // without the failure. A run without a restart policy stores nothing.
  // Without a snapshot (0, or a failure before the first one) a restarted
  // fit starts again from the weights it started with (with resume: from
  // the newest checkpoint). Refused with uneven at the first call, on every
  // rank (a join's state is not snapshotted); with cuda_graph the graph dies
  // with its attempt and is captured again. A world shrink (RestartPolicy::leave_out_failed_rank)
  // keeps the global batch G = batch_size * W0 (W0: the first attempt's
  // ranks): each of the W remaining ranks takes G / W rows, one more for the
  // first G mod W ranks (64 over 3: 22, 21, 21; the sampler's and
  // DataParallel's global_batch_size, which weighs each rank's gradient by its
  // rows), so the steps redone and the rest of the epoch draw the same samples
  // and step on the gradient of the same mean loss (inside a rank's function,
  // size batch_size from ctx.attempt_info().first_world_size, not
  // ctx.world_size(): a snapshot restored with another global batch is an
  // error naming both). Uneven shares with grad_accum_steps > 1 fail that
  // attempt on every rank naming both (from main with LaunchOptions::nprocs
  // set, such a policy is refused at the call). After a shrink the interrupted
  // epoch's loss leaves out the failed rank's steps before the snapshot.
  int64_t snapshot_every_steps = 0;
  // ProgressLogger every log_freq steps (0: none); further callbacks after it.
  int64_t log_freq = 0;
  std::vector<CallbackFactory> callbacks;
};

struct EvalOptions {
  int64_t batch_size = 32;  // per rank
  int num_workers = 0;
  bool bf16 = false;
  std::shared_ptr<const data::Transform> batch_transform;
  std::vector<CallbackFactory> callbacks;  // on_eval_begin / on_eval_end
};

// train_batch / eval_batch / predict_batch's options, per call.
struct BatchOptions {
  bool bf16 = false;  // forward and loss under nn::AutocastGuard(kBFloat16), as FitOptions::bf16
  // train_batch only (Paddle's update): false accumulates this batch's
  // gradients (under DataParallel::no_sync: no all-reduce, no step); the next
  // call with true reduces the accumulated sum over the ranks and steps. The
  // losses are not scaled: scale them in the loss for a mean over the
  // micro-batches (fit's grad_accum_steps divides by their count). Every rank
  // passes the same value: this is not checked, and ranks whose values differ
  // but reduce as often pair different sums of gradients in the all-reduce.
  // Gradients not yet stepped are dropped by any other call that folds the
  // batch run (fit, save, ...).
  bool update = true;
};

// Model::save's options.
struct SaveOptions {
  // Paddle's training: with the weights, the optimizer state (when the model
  // has one) in OptimizerStatePath(path). false: the weights only.
  bool training = true;
};

// Model::load's options.
struct LoadOptions {
  // Paddle's reset_optimizer: the weights only; the optimizer starts fresh
  // even when OptimizerStatePath(path) exists.
  bool reset_optimizer = false;
};

// Where save() puts the optimizer state of a model saved to `path`: path + ".optim".
std::string OptimizerStatePath(const std::string& path);

struct History {
  // Each epoch's logs (after the reduction over ranks) that this fit call ran:
  // after a resume from a checkpoint, the epochs from the resumed one on (the
  // earlier ones are in that run's History); an in-process restart from a
  // snapshot keeps the attempt's earlier epochs.
  std::vector<Logs> epochs;
  int64_t steps = 0;         // optimizer steps done so far (after a resume: in all)
  int64_t ended_at_step = 0;  // > 0: a callback's RunState::end_fit ended the fit there
  // FitOptions::snapshot_every_steps: snapshots stored over the fit's steps
  // (one per K steps; a step redone after a restart counts once), and the
  // step this attempt resumed from (-1: it started from the beginning).
  int64_t snapshots = 0;
  int64_t restored_snapshot_step = -1;
};

class Model {
 public:
  explicit Model(NetworkFactory network, LaunchOptions launch = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Sets the optimizer (made per rank from the rank's parameters), the loss and
  // the metrics (made per rank). The optimizer starts fresh, except with a
  // state that load() read before any prepare() (see load). Throws
  // tandem::Error on an empty factory or loss.
  void prepare(OptimizerFactory optimizer, LossFunction loss,
               std::vector<MetricFactory> metrics = {});

  // Trains (see the file comment). FailedPrecondition before prepare();
  // InvalidArgument naming the value for a bad option or an empty dataset; an
  // epoch without a step (drop_last with fewer examples than one global batch)
  // fails on the ranks, naming the sizes. A fit that fails (or throws inside
  // a rank's function) leaves the Model as it found it: the weights and the
  // optimizer state it kept, and a state that load() read before prepare()
  // still waiting (see load).
  absl::StatusOr<History> fit(std::shared_ptr<const data::Dataset> train, FitOptions options = {});
  // "eval_loss" (when prepared with a loss) and "eval_<metric>" for each metric,
  // over every sample exactly once. FailedPrecondition before prepare();
  // InvalidArgument for an empty dataset.
  absl::StatusOr<Logs> evaluate(std::shared_ptr<const data::Dataset> data,
                                EvalOptions options = {});
  // The network's outputs for every example, in dataset order, stacked along
  // dim 0, on the host, float32 (N, ...), the same on every rank.
  absl::StatusOr<nn::Tensor> predict(std::shared_ptr<const data::Dataset> data,
                                     EvalOptions options = {});

  // Paddle's train_batch / eval_batch / predict_batch, for a loop of the
  // user's own over batches (`for each batch: loss = model.train_batch(x, y)`).
  // They run inside dist::spawn's function only, each rank with its own Model
  // (as Paddle's per-process Model under paddle.distributed.launch), on the
  // rank's batch: inputs (N, ...) and labels (N, ...) of the same N >= 1
  // (eval_batch: N >= 0, see there), on the host or the rank's device. From
  // main they return FailedPrecondition (use fit / evaluate / predict there);
  // an undefined tensor, N = 0 or labels whose N differs are InvalidArgument
  // naming the shapes. A failure
  // inside the step (a network that refuses the shape, a collective) throws
  // tandem::Error on the rank, as fit's step would.
  //
  // The batch run: the first train_batch builds the rank's network as fit
  // would start it (the kept or loaded weights, or rank 0's fresh draw on
  // every rank; Build agrees over the ranks), DataParallel (default
  // DataParallelOptions) and the prepared optimizer with the kept or loaded
  // state, and keeps them in the Model; later calls continue them.
  // eval_batch and predict_batch use that run when there is one. fit,
  // evaluate, predict, save, load and prepare first fold the run into what
  // the Model keeps (the weights and the optimizer state, as a fit's end
  // does) and drop it: train_batch x 10 then save writes the trained weights
  // and optimizer state, a fit after it continues from them, and load() /
  // prepare() then replace or reset them as they say. state_dict copies the
  // run's weights and leaves it, and summary leaves it: both are the rank's
  // own (no collective), so one rank alone may call them between steps. A
  // load() (or prepare) between batch calls goes on every rank: on one rank
  // alone only that rank's run is dropped, and the next train_batch /
  // eval_batch fails on every rank with a collective mismatch (an evaluate
  // or fit on every rank after it agrees as load() says: rank 0's loaded
  // weights to all, a loaded optimizer state refused by the next fit or
  // train_batch). The run belongs to the spawn that built it: a call in a
  // later spawn folds it and builds another.
  //
  // train_batch: one optimizer step, fit's own code (fit_loop.cc): forward
  // and loss through DataParallel, backward with its gradient all-reduce,
  // step, zero_grad (with options.update = false: backward only, see
  // BatchOptions); no clipping, no ZeRO (fit's options), and no lr schedule (schedules are fit's callbacks; the
  // optimizer keeps the lr it was made with). N ranks with batch B step as
  // one rank with batch N * B (DataParallel averages the gradients, for a
  // loss that is the batch's mean). Returns this rank's batch loss, 0-dim,
  // detached, on the rank's device (no host sync: .item() is the caller's).
  // A collective: every rank calls it, as often (its collectives are
  // labelled, so a rank that calls it alone fails naming train_batch).
  // FailedPrecondition before prepare().
  absl::StatusOr<nn::Tensor> train_batch(const nn::Tensor& inputs, const nn::Tensor& labels,
                                         BatchOptions options = {});
  // eval_batch: eval mode, no grad: "loss" (when prepared with a loss) and
  // each metric's value under its name ("acc"), over this call's batches of
  // every rank, as evaluate() gives them for a set of those batches (the
  // same sums: one small all_reduce, so a collective, labelled as
  // train_batch's). Without a batch run it builds one (as evaluate, agreed
  // over the ranks) for the later batch calls. A rank without rows in a call
  // (its share of evaluate's kUneven tail is empty: the sampler gives it one
  // batch fewer) passes inputs and labels of 0 rows, so that it still takes
  // part; they add nothing (0 rows on every rank: InvalidArgument on every
  // rank). FailedPrecondition before prepare().
  absl::StatusOr<Logs> eval_batch(const nn::Tensor& inputs, const nn::Tensor& labels,
                                  BatchOptions options = {});
  // predict_batch: the network's output for this rank's batch, eval mode, no
  // grad, no collective, on the rank's device (float32 under bf16). Needs no
  // prepare(). Without a batch run it builds the network from the kept
  // weights; with none kept yet, from this rank's own draw (as state_dict()
  // inside a rank's function: ranks differ until a collective call, or a
  // load() on every rank, gives them the same weights).
  absl::StatusOr<nn::Tensor> predict_batch(const nn::Tensor& inputs, BatchOptions options = {});

  // Paddle's model.save(path, training) / model.load(path, reset_optimizer).
  // save: the network's weights (parameters and buffers) to `path` as
  // safetensors, PyTorch's names, and, with options.training (the default)
  // and an optimizer state (after a fit, or from a load), that state to
  // OptimizerStatePath(path): an nn checkpoint file (nn/checkpoint.h: CRC-32,
  // atomic write) of the optimizer's entries as a training checkpoint holds
  // them (dist::PutOptimizerEntries), the optimizer's type ("hapi.optimizer")
  // and a fingerprint of the weights saved with it ("hapi.weights_fnv1a64").
  // With FitOptions::zero it is the unsharded state (what the optimizer would
  // hold on one rank), so any world and either setting continues from it.
  // Inside a rank's function save is a collective, as fit is: every rank
  // calls it, the process's first rank writes the files for its process's
  // ranks (each process its own copy, as Paddle's local rank 0 does), and
  // every rank returns once every process's files are written (an all_reduce
  // before the write and one after), with an error on every rank when a
  // writer failed (the writer's names the cause). Weights that each rank drew
  // for itself (a save or state_dict() before any other call) first become
  // rank 0's on every rank (a broadcast), as a first fit takes them, and so
  // do weights that rank 0 alone loaded since the ranks' last call; a rank
  // other than 0 that holds weights of its own (a load() there alone) while
  // rank 0's were drawn, or that loaded while rank 0 did not, is a
  // FailedPrecondition on every rank, nothing written. A rank that calls it
  // alone (`if (rank == 0) save(path)`) fails the run: the in-process
  // collective check, or the watchdog when the other ranks have returned,
  // names hapi::Model::save and says to call it on every rank
  // (dist::Communicator::Label). Both files are written atomically over the
  // earlier ones (each through a temporary file created exclusively), never
  // removed first, so writers of one path at once (the processes of a job on
  // a shared filesystem, or threads saving from outside spawn) always leave
  // an optimizer file; a save that fails between the two leaves the earlier
  // optimizer file, whose weights fingerprint load() refuses. Without an
  // optimizer file to write, save removes one that an earlier save left at
  // OptimizerStatePath(path) (it would go with other weights), before writing
  // the weights. Errors name the file.
  absl::Status save(const std::string& path, SaveOptions options = {});
  // load: the weights of `path`, read strictly (names, shapes, dtypes), and,
  // unless options.reset_optimizer, the optimizer state of
  // OptimizerStatePath(path) when that file exists: the next fit continues
  // bit for bit as the saved model's next fit would have (same options; its
  // epochs count from 0 again, as Paddle's, so a shuffled order differs).
  // Without the file (or with reset_optimizer) the optimizer starts fresh.
  // After prepare(), the file is checked against the prepared optimizer (the
  // factory's over a network the factory builds): another type, group or
  // parameter count, or state shapes, and a file that is corrupt, truncated
  // or not an optimizer file, are InvalidArgument / DataLoss / NotFound
  // naming the file and what differs, and the Model is left unchanged. So,
  // before or after prepare(), is a file whose fingerprint is not of the
  // weights `path` holds (written over since: ModelCheckpoint's
  // final.safetensors, nn::SaveSafetensors, a copy): InvalidArgument naming
  // both files.
  // Before prepare() the file is read and verified (format, checksum) and its
  // state waits for prepare(), which keeps it until a fit() has checked it
  // against the prepared optimizer (FailedPrecondition naming the file and
  // what differs, the state still waiting) and finished; after that fit any
  // prepare() starts the optimizer fresh, as it does when no state waits. A
  // fit that fails after the check leaves the state waiting, so a prepare()
  // after it keeps the state and the next fit checks it again.
  // Inside a rank's function load is this rank's alone (no collective). The
  // next evaluate, predict or fit agrees over the ranks (one all_reduce of a
  // few flags, labelled with the call) whether any rank's Model lacks weights
  // of its own or loaded since the ranks' last call while another did not; if
  // so every rank takes rank 0's: `if (rank == 0) load(path)` gives every
  // rank the loaded weights, before or after earlier calls. That call throws
  // on every rank, naming the rank, when another rank's Model holds weights
  // (a load there alone) while rank 0's has none, or loaded while rank 0's
  // did not; a fit does when some ranks hold an optimizer state that others
  // lack (rank 0 alone loaded one: load on every rank, or with
  // reset_optimizer), or when rank 0 alone loaded one over the others' own
  // (load on every rank), also after an evaluate or predict between them
  // (which give every rank rank 0's weights, not its optimizer state); and
  // every rank throws, naming both calls, when the ranks make different ones
  // of these calls. train_batch agrees and refuses as fit.
  absl::Status load(const std::string& path, LoadOptions options = {});
  // Host copies of the current weights. Before any call has built the network,
  // state_dict() and save() build one on the calling thread and keep its
  // weights: every later call starts from them. Inside a rank's function each
  // rank's state_dict() draws its own; the next call on the ranks (save, fit,
  // evaluate, predict) takes rank 0's on every rank, and save writes those.
  absl::StatusOr<nn::StateDict> state_dict();

  // The network's layers, output shapes and parameter counts for an input of
  // `input_shape`, batch first (hapi/summary.h), from a network the factory
  // builds on the calling thread's device (the CPU from main), not kept; the
  // thread's generator is put back after the factory. Needs no prepare().
  absl::StatusOr<ModelSummary> summary(const nn::Shape& input_shape);

  const LaunchOptions& launch_options() const { return launch_; }

  struct RankRun;  // one rank's network, optimizer and metrics for one call

 private:
  absl::Status RunOnRanks(const std::function<absl::Status(dist::Context&)>& body);
  absl::Status CheckPrepared(const char* call) const;
  // Keeps a freshly built network's weights when none are kept yet.
  absl::Status Materialize();
  // save() inside a rank's function: every rank's kept weights become rank 0's
  // when any rank's are its own draw (kept_.weights_of_this_rank); a collective.
  void TakeRankZerosWeights(dist::Context& ctx);
  // Whether `state` (of an optimizer of type `type`, read from `file`) fits
  // the prepared optimizer over `network`'s parameters; the calling thread's
  // generator is left as it was.
  absl::Status CheckOptimizerState(const optim::StateDict& state, const std::string& type,
                                   const std::string& file, nn::Module& network) const;
  // The state load() read before any prepare(), checked against the prepared
  // optimizer (FailedPrecondition naming the file); OK when there is none.
  absl::Status CheckPendingOptimizerState();
  // Whether every rank takes rank 0's weights: some rank's Model has none,
  // or only its own draw, or some ranks loaded since the last agreement and
  // others did not. Inside a rank's function one all_reduce (labelled with
  // `call` by Build) makes the answer every rank's, and throws on every rank
  // as load() says (different calls; weights that rank 0's would drop; for
  // `training`, optimizer states that differ).
  bool AgreeToTakeRankZerosWeights(dist::Context& ctx, const char* call, bool training);
  // This rank's network (weights from the host copy when there is one; rank
  // 0's on every rank when AgreeToTakeRankZerosWeights: broadcast here unless
  // a DataParallel made next broadcasts them) and metrics.
  std::unique_ptr<RankRun> Build(dist::Context& ctx, const char* call,
                                 bool wrapped_by_data_parallel);
  // Copies the rank's weights and optimizer state to the host (local rank 0 when spawned).
  void Keep(dist::Context& ctx, RankRun& run);
  void KeepRun(RankRun& run);  // Keep's copies, on any rank
  // The batch calls' rank (FailedPrecondition from main, naming `call`).
  absl::StatusOr<dist::Context*> BatchContext(const char* call) const;
  // Whether the batch run was built by this rank's function (not an earlier spawn's).
  bool BatchRunIsOf(const dist::Context& ctx) const;
  // train_batch's DataParallel and optimizer (building them when needed).
  // FailedPrecondition for a state load() read that does not fit the optimizer.
  absl::Status EnsureTrainingRun(dist::Context& ctx, int64_t rows);
  // Makes `run` this rank's batch run (an earlier one was folded first).
  void AdoptBatchRun(std::unique_ptr<RankRun> run, const dist::Context& ctx, bool training,
                     bool agreed);
  // Keeps the batch run's weights and optimizer state when it trained; drops it.
  void FoldBatchRun();
  // The same copies, leaving the run (a call of the rank's own, no collective:
  // the other ranks keep theirs); an earlier spawn's run is folded.
  void CopyBatchRun();
  History FitOnRank(dist::Context& ctx, const std::shared_ptr<const data::Dataset>& train,
                    const FitOptions& options);
  nn::Tensor PredictOnRank(dist::Context& ctx, const std::shared_ptr<const data::Dataset>& data,
                           const EvalOptions& options);

  NetworkFactory network_;
  LaunchOptions launch_;
  OptimizerFactory optimizer_;
  LossFunction loss_;
  std::vector<MetricFactory> metrics_;
  // What the Model keeps between calls, as host copies (from local rank 0:
  // DataParallel keeps every rank's weights equal). A fit that fails puts back
  // what it found.
  struct Kept {
    nn::StateDict weights;
    bool have_weights = false;
    // weights are a network that Materialize() built inside a rank's function:
    // this rank's own draw, which the next call on the ranks replaces by rank 0's.
    bool weights_of_this_rank = false;
    // weights (and optimizer state) are a load() inside a rank's function
    // since the ranks last agreed on their weights and optimizer states (a
    // training call's Build; evaluate's, predict's and save's agree on the
    // weights only, and leave it): this rank's alone until then, as the
    // other ranks may not have loaded.
    bool loaded_since_agreed = false;
    optim::StateDict optimizer_state;
    bool have_optimizer_state = false;
    std::string optimizer_type;  // Optimizer::name() of the kept state
    // A state load() read before any prepare(): the file it came from, until a
    // fit has checked it against the prepared optimizer ("" otherwise).
    std::string unchecked_optimizer_file;
  };
  Kept kept_;
  // This call spawned its ranks (from main) rather than running on the caller's rank.
  bool spawned_ = false;
  // The batch calls' run on this rank (see train_batch), while there is one.
  std::unique_ptr<RankRun> batch_run_;
  bool batch_training_ = false;  // built by train_batch: DataParallel and optimizer
  bool batch_agreed_ = false;    // built by a call that agreed over the ranks
  const dist::Context* batch_ctx_ = nullptr;  // the rank that built it, and its spawn's
  std::stop_token batch_spawn_;               // stop state (outlives any reuse of the address)
};

}  // namespace tandem::hapi

#endif  // TANDEM_HAPI_MODEL_H_
