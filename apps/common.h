// tandem_apps_common: what the training programs (train_linear, train_mnist,
// train_cifar10) share: the common Abseil flags and their validation, optimizer
// choice, the metrics file, the data-parallel classifier training (a
// hapi::Model fit, apps/classifier.cc) with progress output, per-epoch
// checkpoints and resume, and the final summary.
//
// Flags defined here (every program links them; --help explains each):
//   --gpus --nprocs --share_devices --seed --num_workers --log_dir
//   --checkpoint_dir --resume --checkpoint_every_steps --checkpoint_every_minutes
//   --keep_checkpoints --metrics --deterministic --bf16 --cpu_threads --log_every
//   --max_steps_per_epoch --train_limit --test_limit --stop_at_step --timeout_s
//   --tensorboard_dir --trace --trace_steps --grad_accum_steps --comm_hook --zero
//   --init_from --save_safetensors --cuda_graph --max_restarts --snapshot_every
// and, for tests only (apps/test_hooks.cc, not in --help), --test_slow_rank,
// --test_fail_at and --test_checkpoint_write_delay_ms.
// Flags whose defaults differ per program (--epochs, --batch_size, --lr,
// --lr_schedule, --optimizer, --data_dir) are defined in each program's main file and copied
// into RunFlags by it.
//
// Exit statuses of the programs (kExitStatusHelp, also in --help): 0 success,
// 1 a failure during the run (one line naming the rank), 2 a bad flag value (one
// line naming the flag and the value), 75 (EX_TEMPFAIL) stopped by SIGTERM or
// SIGUSR1 (in a job of several processes also SIGINT: spawn/launch.h) after every rank
// saved a checkpoint at the same step: --resume continues, 130 stopped without
// a checkpoint of that point (Ctrl-C, --stop_at_step, or a stop signal without
// --checkpoint_dir). A planned stop is no failure in a job of several processes
// either: every process ends with the status and the one line a single process
// would give, without MPI_Abort.
//
// Thread-safety: ParseFlagsOrExit / ValidateOrExit run on the main thread before
// spawn; TrainClassifier runs on every rank thread with its own Context.
#ifndef TANDEM_APPS_COMMON_H_
#define TANDEM_APPS_COMMON_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "data/dataset.h"
#include "nn/device.h"
#include "nn/module.h"
#include "nn/tensor.h"
#include "optim/optimizer.h"
#include "spawn/train/checkpoint_manager.h"
#include "spawn/spawn.h"
#include "spawn/observe/summary_writer.h"
#include "spawn/observe/trace.h"

namespace tandem::apps {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadFlag = 2;
inline constexpr int kExitStoppedResumable = 75;  // EX_TEMPFAIL
inline constexpr int kExitStopped = 130;
inline constexpr char kExitStatusHelp[] =
    "Exit status: 0 done; 1 a failure (one line naming the rank); 2 a bad flag value; 75 "
    "stopped by SIGTERM or SIGUSR1 (in a job of several processes also by a Ctrl-C that "
    "reaches them) after every rank saved a checkpoint of the same step (run again with "
    "--resume to continue); 130 stopped without a checkpoint of that point (Ctrl-C, "
    "--stop_at_step, or a stop signal without --checkpoint_dir). Under mpirun or srun a stop "
    "ends every process with the same status.";

// The values of every flag of a run, after parsing and validation.
struct RunFlags {
  std::string program;  // "train_mnist", for messages
  // Common flags.
  std::string gpus;
  int nprocs = -1;
  bool share_devices = false;
  uint64_t seed = 0;
  int num_workers = 0;
  std::string log_dir;
  std::string checkpoint_dir;
  bool resume = false;
  std::string metrics;
  std::string tensorboard_dir;  // "" : no TensorBoard event file
  std::string trace;            // "" : no Chrome trace
  std::string trace_steps = "10:20";  // the --trace window, "K:N" or "K:"
  dist::TraceWindow trace_window;      // trace_steps parsed (ValidateOrExit)
  bool deterministic = true;
  bool bf16 = false;  // forward + loss under nn::AutocastGuard(kBFloat16)
  int cpu_threads = 0;  // OpenBLAS / oneDNN threads on CPU ranks; 0: automatic (ValidateOrExit sets it)
  int64_t log_every = 100;
  int64_t max_steps_per_epoch = 0;  // 0: whole epochs
  int64_t train_limit = 0;          // 0: the whole training set
  int64_t test_limit = 0;           // 0: the whole test set
  int64_t stop_at_step = 0;         // 0: never
  double timeout_s = 300;           // SpawnOptions::timeout_s
  int64_t checkpoint_every_steps = 0;   // 0: off
  double checkpoint_every_minutes = 0;  // 0: off
  int keep_checkpoints = 0;             // 0: keep all
  // Weights exchanged with other tools as safetensors files (nn/safetensors.h):
  // --init_from loads the model's parameters and buffers (strictly: names,
  // shapes and dtypes) before training (a --resume checkpoint, when one loads,
  // replaces them); with --epochs=0 the run only evaluates them on the test set.
  // --save_safetensors: global rank 0 writes the model there at the end.
  std::string init_from;         // "" : the model's own initialisation
  std::string save_safetensors;  // "" : not written
  // Test hooks (--test_slow_rank=R:MS, --test_checkpoint_write_delay_ms).
  int test_slow_rank = -1;  // -1: no rank sleeps
  int test_slow_ms = 0;     // what rank test_slow_rank sleeps in every step
  // --test_fail_at=R:S: rank R throws after global step S on the run's first
  // attempt (a failure for --max_restarts to restart).
  int test_fail_rank = -1;  // -1: no rank fails
  int64_t test_fail_step = 0;
  double test_checkpoint_write_delay_ms = 0;  // CheckpointManagerOptions::write_delay_s * 1000
  int grad_accum_steps = 1;  // micro-batches of batch_size per optimizer step
  std::string comm_hook = "allreduce";  // how buckets are reduced: "allreduce" or "bf16"
  bool zero = false;  // dist::ZeroRedundancyOptimizer: 1/N of the optimizer state per rank
  // --cuda_graph: the classifier's training step captured once in an
  // nn::CudaGraph and replayed for every full batch (hapi::FitOptions::cuda_graph). ValidateOrExit
  // refuses it on CPU ranks, on ranks sharing a GPU and with the options the
  // captured step cannot hold (--grad_accum_steps > 1, --zero, --trace).
  bool cuda_graph = false;
  // In-process restarts (SpawnOptions::restart.max_restarts; train_mnist and
  // train_cifar10 only): after a failure every rank continues from the newest
  // snapshot (hapi::FitOptions::snapshot_every_steps = snapshot_every, taken
  // only when max_restarts > 0; 0: a restart trains from the start). The exit
  // status once the restarts are used up is the last failure's (1).
  int max_restarts = 0;
  int64_t snapshot_every = 1;
  // Per-program flags (copied in by the program's main).
  // The program's own flags that every process of a job must agree on.
  std::vector<std::pair<std::string, std::string>> program_agreed;
  int epochs = 1;
  int batch_size = 1;  // per rank
  // --batch_size was on the command line (not from a --flagfile): set by
  // ParseFlagsOrExit, read by ValidateOrExit's rank_per_core.
  bool batch_size_given = false;
  double lr = 1e-3;
  // "constant", or "cosine": lr * (1 + cos(pi * step / total_steps)) / 2
  // (optim::CosineAnnealingLR), set before every step from the global step count
  // (so a resumed run continues it).
  std::string lr_schedule = "constant";
  std::string optimizer = "adam";
  std::string data_dir;
  // Filled by ValidateOrExit: one device per rank.
  std::vector<nn::Device> devices;
  int world_size() const { return static_cast<int>(devices.size()); }
};

// Parses argv with Abseil flags through ParseCommandLineOrExit (--help lists
// every flag of apps/ with its help text on stdout and exits 0) and returns the
// common flags. `usage` is the first paragraph of --help. Exits 2 with one line on
// an unknown flag (naming the nearest one), an unparsable value or a positional
// argument.
RunFlags ParseFlagsOrExit(int argc, char** argv, absl::string_view usage);

struct Validation {
  bool uses_optimizer = true;  // check --optimizer
  bool uses_epochs = true;     // check --epochs, --batch_size
  bool uses_model_files = true;  // --init_from, --save_safetensors (else they are refused)
  // "required": --data_dir must name a directory; "optional": an empty
  // --data_dir is allowed, a non-empty one must name a directory; "unused".
  enum class DataDir { kRequired, kOptional, kUnused } data_dir = DataDir::kUnused;
  // The default run on a machine without GPUs (--gpus and --nprocs unset, no GPU
  // visible): one CPU rank per usable core (cores / (1 + num_workers)), each
  // with one kernel thread, instead of one rank with every core's threads
  // (measured faster: docs/benchmarks.md). Without --batch_size on the command
  // line the per-rank batch becomes batch_size / ranks (ranks lowered until it
  // divides), so the global batch, and with it the job, stay the default's.
  bool rank_per_core = false;
};

// Checks every value (optimizer name, gpus/nprocs against the visible GPUs,
// positive sizes, the metrics extension, the data directory, --resume without
// --checkpoint_dir) and fills flags.devices. On the first bad value prints
// "<program>: error: <flag> <value>: <why>" to stderr and exits 2.
void ValidateOrExit(RunFlags& flags, const Validation& validation);

// Prints "<program>: error: <message>" (one line) and exits 2.
[[noreturn]] void FlagErrorExit(const RunFlags& flags, const std::string& message);

// Creates directory `dir` (the value of `flag`) and its parents, or exits 2
// through FlagErrorExit naming the flag, the directory and why.
void CreateDirectoryOrExit(const RunFlags& flags, const char* flag, const std::string& dir);

// "sgd" (plain SGD), "momentum" (SGD, momentum 0.9), "adagrad", "adam" or "adamw"
// (decoupled weight decay 0.01).
// Throws tandem::Error on another name (ValidateOrExit has already rejected it).
std::unique_ptr<optim::Optimizer> MakeOptimizer(const std::string& name,
                                                std::vector<nn::Tensor> params, double lr);

// spawn options of a run: log_dir, seed, and the flags every process of a
// multi-process job must agree on (SpawnOptions::must_agree).
dist::SpawnOptions MakeSpawnOptions(const RunFlags& flags);

// dist::CheckpointManager options of --checkpoint_dir, --keep_checkpoints,
// --checkpoint_every_steps, --checkpoint_every_minutes.
dist::CheckpointManagerOptions CheckpointOptions(const RunFlags& flags);

// --tensorboard_dir: global rank 0's event-file writer; null on the other ranks
// and without the flag. Throws tandem::Error naming the directory when it cannot
// be created (the run then fails on rank 0 with that line).
std::unique_ptr<dist::SummaryWriter> OpenTensorBoard(const dist::Context& ctx,
                                                     const RunFlags& flags);

// The distributed-environment table printed at start (several lines, to stderr).
void PrintEnvironment(const RunFlags& flags, const std::vector<std::string>& extra_rows);

// Maps spawn's status to the program's exit status, printing one line for an
// error ("<program>: rank 1 (cpu): ...") or a stop.
int ExitStatusOf(const RunFlags& flags, const absl::Status& status);

// The end of a run that --stop_at_step ended: prints the one line
// "<program>: stopped after step <step> as --stop_at_step asks ..." and returns
// kExitStopped. The training functions return normally at that step (every rank
// at the same one, nothing left in flight), so that spawn, and in a job of
// several processes every process, ends as after a finished run: --stop_at_step
// is a planned stop, not a failure.
int StoppedAtStepExit(const RunFlags& flags, int64_t step);

// --- Classifier training -------------------------------------------------------

struct ClassifierData {
  // Examples: images (C, H, W) in their stored dtype (uint8 for the real
  // datasets, so they stay in memory at 1 byte a pixel), int64 labels.
  std::shared_ptr<const data::Dataset> train;
  std::shared_ptr<const data::Dataset> test;
  // Turns a collated batch (B, C, H, W) of those images into the model's float
  // input (data::ToFloatNormalize); applied per batch in training and evaluation.
  std::shared_ptr<const data::Transform> batch_transform;
  std::string name;  // "Fashion-MNIST", "CIFAR-10 (synthetic)": used in every report
};

// What a run did (every rank returns the same values).
struct TrainResult {
  double best_accuracy = 0;   // best test accuracy over the epochs run (incl. before a resume)
  double final_accuracy = 0;  // after the last epoch
  double final_loss = 0;      // mean training loss of the last epoch (all ranks)
  int64_t steps = 0;          // optimizer steps in total (incl. before a resume)
  int epochs_done = 0;
  double seconds = 0;         // wall time of this process's part of the run
  double samples_per_s = 0;   // global training samples per second of this process
  int world_size = 0;         // global ranks (every process of an mpirun/srun job)
  int process_index = 0;      // this process in such a job (0: the one that prints the summary)
  int64_t stopped_at_step = 0;  // > 0: --stop_at_step ended the run after this step
  bool evaluated_only = false;  // --epochs=0: final_accuracy is --init_from's weights'
};

// Trains the model that make_model() builds (on ctx.device(); called once per
// rank after the rank's generator is seeded, so every rank builds the same
// initial model; DataParallel broadcasts rank 0's anyway) with cross-entropy,
// flags.optimizer and flags.lr, per-rank batch flags.batch_size, for
// flags.epochs epochs. After each epoch every rank evaluates a contiguous shard
// of the test set and the counts are summed over ranks (exact, no padding).
// Rank 0 shows progress (a bar on a terminal, plain lines otherwise), logs each
// epoch, appends a row per epoch to --metrics, and with --checkpoint_dir writes
// <dir>/step-<S>.ckpt through a dist::CheckpointManager (model, optimizer,
// sampler position, every rank's generator, step, epoch progress and loss sum,
// best accuracy, elapsed time) after each epoch, every --checkpoint_every_steps
// / --checkpoint_every_minutes (mid-epoch: a resumed run continues bit for bit,
// metrics rows included), and at a stop signal, keeping --keep_checkpoints.
// With --resume every rank loads the newest checkpoint that loads before
// training. At --stop_at_step it returns right after that step (stopped_at_step
// set; no metrics row or checkpoint for the partial epoch, but an earlier
// checkpoint's write in flight completes and the --trace file is written).
// --init_from loads weights after the model is built; --epochs=0 evaluates
// them only; --save_safetensors writes the model at the end (global rank 0).
// Throws tandem::Error on a failure, dist::StoppedError after a stop signal
// (every rank at the same step, after the checkpoint is complete).
TrainResult TrainClassifier(dist::Context& ctx, const RunFlags& flags, const ClassifierData& data,
                            const std::function<std::shared_ptr<nn::Module>()>& make_model,
                            dist::TraceRecorder* trace = nullptr);

// Runs TrainClassifier on every rank through dist::spawn, prints the final summary
// (best test accuracy, time, samples/s), or StoppedAtStepExit's line, and returns
// the exit status.
int RunClassifier(const RunFlags& flags, const ClassifierData& data,
                  const std::function<std::shared_ptr<nn::Module>()>& make_model,
                  const std::vector<std::string>& extra_rows);

}  // namespace tandem::apps

#endif  // TANDEM_APPS_COMMON_H_
