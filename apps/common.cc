// Flags, validation, optimizer choice, environment table and exit statuses of
// the training programs (see common.h). The training loop is in classifier.cc.
#include "apps/common.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "apps/flag_check.h"
#include "apps/test_hooks.h"
#include "nn/error.h"
#include "nn/ops/conv.h"
#include "nn/ops/cpu_settings.h"
#include "nn/ops/matmul.h"
#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/sgd.h"

ABSL_FLAG(std::string, gpus, "",
          "Devices of the run: \"\" = every visible GPU (CPU ranks when none is visible: with "
          "--nprocs unset, train_mnist and train_cifar10 then run one rank per core and split "
          "the default batch over them), \"cpu\" = CPU ranks, \"0,1,3\" = those CUDA ordinals "
          "(rank i on the i-th); PyTorch's names too: \"cuda:0,cuda:1\", \"cpu:0,cpu:1\" (one "
          "CPU rank each).");
ABSL_FLAG(int, nprocs, -1,
          "Number of ranks: -1 = one per listed device (1 for --gpus=cpu; one per usable core "
          "for the classifier programs' default run without GPUs, see --gpus); N = the first N "
          "listed devices, or N CPU ranks with --gpus=cpu.");
ABSL_FLAG(bool, share_devices, false,
          "Allow one GPU to be listed twice (--gpus=0,0): those ranks share it through the "
          "in-process communicator.");
ABSL_FLAG(uint64_t, seed, 0,
          "Random seed: model initialisation (the same on every rank), data order and "
          "rank r's generator stream r.");
ABSL_FLAG(int, num_workers, 0,
          "DataLoader worker threads per rank (0: the rank thread builds each batch, enough for "
          "these programs' in-memory datasets, and no core is held for loading). The batch "
          "order does not depend on it.");
ABSL_FLAG(std::string, log_dir, "",
          "When set, rank r also writes its log lines to <log_dir>/workerlog.r.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "When set, checkpoints <dir>/step-<S>.ckpt (S: the global step; model, optimizer, "
          "sampler position, generators, progress) are written after each epoch (train_linear: "
          "at the end), every --checkpoint_every_steps / --checkpoint_every_minutes, and when "
          "SIGTERM or SIGUSR1 asks the run to stop. Each write is atomic (a SIGKILL at any "
          "moment leaves the earlier files whole).");
ABSL_FLAG(bool, resume, false,
          "Continue from the newest checkpoint of --checkpoint_dir that loads (start fresh when "
          "it has none). A damaged file is skipped with one warning naming it and the reason, "
          "and the next older one is used.");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0,
          "Also write a checkpoint every N global steps, mid-epoch too (0: off). The state is "
          "copied to host memory at the step and written by a background thread while "
          "training goes on. Needs --checkpoint_dir.");
ABSL_FLAG(double, checkpoint_every_minutes, 0,
          "Also write a checkpoint when this many minutes have passed since the last one "
          "(rank 0's clock; every rank saves at the same step). 0: off. Needs "
          "--checkpoint_dir.");
ABSL_FLAG(int, keep_checkpoints, 0,
          "Keep only the newest K step-<S>.ckpt files of --checkpoint_dir (older ones are "
          "deleted after each successful write; 0: keep all). K >= 2 leaves --resume an older "
          "file to fall back on when the newest is damaged.");
ABSL_FLAG(std::string, metrics, "",
          "Metrics file of train_mnist and train_cifar10, one row per epoch (dataset, epoch, "
          "step, loss, accuracy, samples/s, "
          "wall time, learning rate): CSV when it ends in .csv, JSON lines when it ends in "
          ".jsonl (scripts/plot_metrics.py draws it). Appended "
          "to with --resume, replaced otherwise.");
ABSL_FLAG(std::string, tensorboard_dir, "",
          "Write TensorBoard scalars here (global rank 0: an events.out.tfevents.* file, "
          "open with `tensorboard --logdir DIR`): training loss, learning rate, samples/s and "
          "each rank's step time every --log_every steps; loss, test accuracy and samples/s "
          "per epoch. Empty: off (nothing is recorded).");
ABSL_FLAG(std::string, trace, "",
          "Write a Chrome trace-event JSON file here (global rank 0; opens in Perfetto, "
          "ui.perfetto.dev, and chrome://tracing): one track per rank (grouped by process "
          "and host under mpirun) with spans for data wait, forward, backward, each bucket's "
          "all-reduce (bytes), the optimizer step, checkpoints and evaluation, for the steps "
          "of --trace_steps. Empty: off (nothing is recorded).");
ABSL_FLAG(std::string, trace_steps, "10:20",
          "The steps --trace records: K:N (N steps from global step K) or K: (every step "
          "from K on: the file and the memory grow with the run). Every step adds a few "
          "hundred bytes per rank.");
ABSL_FLAG(bool, deterministic, true,
          "Keep float32 matmuls/convolutions exact (TF32 off). --nodeterministic lets CUDA "
          "use TF32 tensor cores. CPU runs with the same flags are reproducible either way.");
ABSL_FLAG(bool, bf16, false,
          "bfloat16 mixed precision: each training and evaluation forward (and the loss) runs "
          "under nn::AutocastGuard(kBFloat16), so GEMMs and convolutions take bfloat16 "
          "operands with float32 accumulation; parameters, gradients, the all-reduce and the "
          "optimizer stay float32. On the CPU, convolutions run on oneDNN's bfloat16 "
          "primitives where the CPU has avx512_bf16 or AMX (the startup table's precision "
          "row says which); elsewhere it is emulated (slower than float32).");
ABSL_FLAG(int, cpu_threads, 0,
          "Threads of each CPU GEMM (OpenBLAS, one pool for the process) and each CPU "
          "convolution (oneDNN, a team per rank) when the ranks run on the CPU. 0: usable cores "
          "(this process's share, when a launcher runs several on the host) minus the loader "
          "workers of all ranks, divided by the ranks, at least 1 (so workers, ranks, "
          "processes and kernel threads do not oversubscribe the cores).");
ABSL_FLAG(int64_t, log_every, 100,
          "Steps between the plain progress lines when the output is not a terminal.");
ABSL_FLAG(int64_t, max_steps_per_epoch, 0,
          "Stop each epoch after this many steps (0: whole epochs). For smoke runs.");
ABSL_FLAG(int64_t, train_limit, 0,
          "Train on the first N training examples only (0: all).");
ABSL_FLAG(int64_t, test_limit, 0, "Evaluate on the first N test examples only (0: all).");
ABSL_FLAG(int64_t, stop_at_step, 0,
          "End the run after this global step (exit status 130 and one line on every "
          "process; no checkpoint beyond the periodic ones); for testing --resume. 0: never.");
ABSL_FLAG(double, timeout_s, 300, tandem::apps::kTimeoutHelp);
ABSL_FLAG(int, grad_accum_steps, 1,
          "Gradient accumulation: each optimizer step runs this many micro-batches of "
          "--batch_size per rank, reducing the gradients once, after the last (the others run "
          "under DataParallel::no_sync()); each micro-batch's loss is divided by their count, "
          "so K micro-batches of B step like one batch of K*B. Steps, the learning-rate "
          "schedule and checkpoints count optimizer steps.");
ABSL_FLAG(std::string, comm_hook, "allreduce",
          "How DataParallel reduces each gradient bucket: allreduce (float32 all-reduce), "
          "bf16 (dist::Bf16CompressHook: the bucket travels as bfloat16, half the bytes; the "
          "in-process and MPI paths add in float32, NCCL in bfloat16) or fp16 "
          "(dist::Fp16CompressHook: likewise as float16, finer than bfloat16 but gradients or "
          "sums of 65520 or more become infinite).");
ABSL_FLAG(bool, zero, false,
          "Shard the optimizer state over the ranks (dist::ZeroRedundancyOptimizer, ZeRO-1): "
          "each rank keeps 1/N of it, gradients are reduce-scattered during backward and the "
          "parameters all-gathered after each step; the same parameters as without it. "
          "Checkpoints hold the unsharded state (gathered on save) and resume with or without "
          "--zero on any number of ranks.");
ABSL_FLAG(int, max_restarts, 0,
          "Restart the training in the process after a failure (a rank's exception or error, a "
          "communicator's error, a collective past --timeout_s), at most this many times "
          "(dist::SpawnOptions::restart): every rank continues from the newest in-memory "
          "snapshot all ranks hold (--snapshot_every). Once they are used up the next failure "
          "ends the run with exit status 1, as without restarts. 0: a failure ends the run. "
          "train_mnist and train_cifar10 only; refused at start-up under mpirun or srun.");
ABSL_FLAG(int64_t, snapshot_every, 1,
          "With --max_restarts: every rank keeps a snapshot of its training state (model, "
          "optimizer, loader position, step, generator, the epoch's progress) in host memory "
          "every this many optimizer steps (hapi::FitOptions::snapshot_every_steps), so a "
          "restart runs at most this many steps again; on CPU ranks the run then ends as the "
          "uninterrupted one. A snapshot is a copy of the model and the optimizer state per "
          "rank (up to two kept). 0: none (a restart trains from the start).");
ABSL_FLAG(std::string, init_from, "",
          "A safetensors file of the model's weights (PyTorch state-dict names, e.g. saved by "
          "--save_safetensors or by PyTorch) to start from; names, shapes and dtypes must "
          "match. With --epochs=0 the program only evaluates them on the test set. "
          "train_mnist and train_cifar10 only.");
ABSL_FLAG(std::string, save_safetensors, "",
          "Write the trained model's parameters and buffers to this safetensors file at the "
          "end (rank 0; atomic), for PyTorch's load_state_dict or --init_from. train_mnist and "
          "train_cifar10 only.");
ABSL_FLAG(bool, cuda_graph, false,
          "CUDA ranks only (one GPU each): capture the whole training step (zero_grad, "
          "forward, loss, backward with DataParallel's gradient all-reduce, optimizer step) "
          "once in a CUDA graph (nn::CudaGraph) after one eager step on the first full batch, then "
          "run every full batch by copying it into the step's static input and label tensors "
          "and replaying the graph (one launch a step). A partial last batch of an epoch runs "
          "eagerly through the same model and optimizer; evaluation stays eager. The "
          "learning-rate schedule is honoured; --resume loads before the capture. Refused "
          "(exit status 2) on CPU ranks, on ranks sharing a GPU (--gpus=0,0: the in-process "
          "communicator cannot be captured) and with --grad_accum_steps > 1, --zero, --trace "
          "and train_cifar10's --sync_bn. train_mnist and train_cifar10 only.");

namespace tandem::apps {
namespace {

// SIGTERM / SIGUSR1 from the start of main to its end: one that arrives before
// spawn (while the dataset loads) neither kills the program nor is missed: the
// run then stops before its first step (spawn/signals.h).
const dist::StopSignalScope& ProgramStopSignals() {
  static const auto* scope = new dist::StopSignalScope({SIGTERM, SIGUSR1});
  return *scope;
}
// As early as the program's static initialisation (before main): the window
// in which SIGTERM still kills the process is its loading only.
[[maybe_unused]] const bool kStopSignalsInstalled = (ProgramStopSignals(), true);

// Whether argv sets flag `name` (--name=v, -name=v, --name v), before any "--".
bool OnCommandLine(int argc, char** argv, absl::string_view name) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--")) {
      if (!absl::ConsumePrefix(&arg, "-")) continue;
    }
    if (arg.substr(0, arg.find('=')) == name) return true;
  }
  return false;
}

// The test-only flags (apps/test_hooks.h) into flags; a malformed value exits 2.
void ReadTestHooks(RunFlags& flags) {
  const std::string slow = absl::GetFlag(FLAGS_test_slow_rank);
  if (!slow.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(slow, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &flags.test_slow_rank) ||
        !absl::SimpleAtoi(parts[1], &flags.test_slow_ms) || flags.test_slow_rank < 0 ||
        flags.test_slow_ms < 0) {
      FlagErrorExit(flags, absl::StrCat("--test_slow_rank \"", slow,
                                        "\": expected R:MS (rank R sleeps MS ms in every step)"));
    }
  }
  const std::string fail = absl::GetFlag(FLAGS_test_fail_at);
  if (!fail.empty()) {
    const std::vector<std::string> parts = absl::StrSplit(fail, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &flags.test_fail_rank) ||
        !absl::SimpleAtoi(parts[1], &flags.test_fail_step) || flags.test_fail_rank < 0 ||
        flags.test_fail_step < 1) {
      FlagErrorExit(flags, absl::StrCat("--test_fail_at \"", fail,
                                        "\": expected R:S (rank R throws after step S >= 1)"));
    }
  }
  flags.test_checkpoint_write_delay_ms = absl::GetFlag(FLAGS_test_checkpoint_write_delay_ms);
  if (!(flags.test_checkpoint_write_delay_ms >= 0)) {
    FlagErrorExit(flags, absl::StrCat("--test_checkpoint_write_delay_ms ",
                                      flags.test_checkpoint_write_delay_ms, ": must be >= 0"));
  }
}

}  // namespace

RunFlags ParseFlagsOrExit(int argc, char** argv, absl::string_view usage) {
  ProgramStopSignals();
  RunFlags flags;
  std::string program = argv[0];
  const size_t slash = program.rfind('/');
  flags.program = slash == std::string::npos ? program : program.substr(slash + 1);
  SetUpHelp(flags.program, usage, kExitStatusHelp);
  std::vector<char*> positional = ParseCommandLineOrExit(flags.program, argc, argv);
  if (positional.size() > 1) {
    FlagErrorExit(flags, absl::StrCat("unexpected argument \"", positional[1],
                                      "\" (flags look like --name=value; see --help)"));
  }
  flags.gpus = absl::GetFlag(FLAGS_gpus);
  flags.nprocs = absl::GetFlag(FLAGS_nprocs);
  flags.share_devices = absl::GetFlag(FLAGS_share_devices);
  flags.seed = absl::GetFlag(FLAGS_seed);
  flags.num_workers = absl::GetFlag(FLAGS_num_workers);
  flags.log_dir = absl::GetFlag(FLAGS_log_dir);
  flags.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  flags.resume = absl::GetFlag(FLAGS_resume);
  flags.metrics = absl::GetFlag(FLAGS_metrics);
  flags.tensorboard_dir = absl::GetFlag(FLAGS_tensorboard_dir);
  flags.trace = absl::GetFlag(FLAGS_trace);
  flags.trace_steps = absl::GetFlag(FLAGS_trace_steps);
  flags.deterministic = absl::GetFlag(FLAGS_deterministic);
  flags.bf16 = absl::GetFlag(FLAGS_bf16);
  flags.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  flags.log_every = absl::GetFlag(FLAGS_log_every);
  flags.max_steps_per_epoch = absl::GetFlag(FLAGS_max_steps_per_epoch);
  flags.train_limit = absl::GetFlag(FLAGS_train_limit);
  flags.test_limit = absl::GetFlag(FLAGS_test_limit);
  flags.stop_at_step = absl::GetFlag(FLAGS_stop_at_step);
  flags.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  flags.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  flags.checkpoint_every_minutes = absl::GetFlag(FLAGS_checkpoint_every_minutes);
  flags.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  flags.init_from = absl::GetFlag(FLAGS_init_from);
  flags.save_safetensors = absl::GetFlag(FLAGS_save_safetensors);
  flags.batch_size_given = OnCommandLine(argc, argv, "batch_size");
  flags.grad_accum_steps = absl::GetFlag(FLAGS_grad_accum_steps);
  flags.comm_hook = absl::GetFlag(FLAGS_comm_hook);
  flags.zero = absl::GetFlag(FLAGS_zero);
  flags.cuda_graph = absl::GetFlag(FLAGS_cuda_graph);
  flags.max_restarts = absl::GetFlag(FLAGS_max_restarts);
  flags.snapshot_every = absl::GetFlag(FLAGS_snapshot_every);
  ReadTestHooks(flags);
  return flags;
}

namespace {

// The cores this process may run on (its CPU affinity, which containers and
// taskset narrow), else what the hardware reports.
// Processes of this job on this host, as the launcher says (mpirun, PMIx, MPICH);
// 1 when not started by one.
int64_t LocalProcesses() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    int64_t n = 0;
    const char* value = std::getenv(name);
    if (value != nullptr && absl::SimpleAtoi(value, &n) && n > 0) return n;
  }
  return 1;
}

// This process's share of the cores of its CPU affinity (containers, taskset):
// processes of one job on one host (mpirun --bind-to none) split them.
int64_t UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) cores = CPU_COUNT(&set);
  return std::max<int64_t>(1, cores / LocalProcesses());
}

}  // namespace

void FlagErrorExit(const RunFlags& flags, const std::string& message) {
  std::string line = absl::StrReplaceAll(message, {{"\n", " "}});
  std::cerr << flags.program << ": error: " << line << "\n";
  std::exit(kExitBadFlag);
}

void CreateDirectoryOrExit(const RunFlags& flags, const char* flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    FlagErrorExit(flags, absl::StrCat(flag, " \"", dir, "\": cannot create it: ", ec.message()));
  }
}

namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

const std::vector<std::string>& OptimizerNames() {
  static const auto* names = new std::vector<std::string>{"sgd", "momentum", "adagrad", "adam", "adamw"};
  return *names;
}

// --init_from names a readable file; --save_safetensors a file in an existing directory;
// neither is given to a program without model files.
void CheckSafetensorsPaths(const RunFlags& flags, const Validation& v) {
  if (!v.uses_model_files && (!flags.init_from.empty() || !flags.save_safetensors.empty())) {
    FlagErrorExit(flags, absl::StrCat(flags.init_from.empty() ? "--save_safetensors" : "--init_from",
                                      ": ", flags.program, " has no model file to read or write "
                                      "(train_mnist and train_cifar10 do)"));
  }
  if (!flags.init_from.empty()) {
    struct stat st;
    if (::stat(flags.init_from.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      FlagErrorExit(flags, absl::StrCat("--init_from \"", flags.init_from,
                                        "\": not a readable file"));
    }
  }
  if (!flags.save_safetensors.empty()) {
    const std::filesystem::path parent =
        std::filesystem::path(flags.save_safetensors).parent_path();
    if (IsDirectory(flags.save_safetensors) || (!parent.empty() && !IsDirectory(parent))) {
      FlagErrorExit(flags, absl::StrCat("--save_safetensors \"", flags.save_safetensors,
                                        "\": not a file path in an existing directory"));
    }
  }
}

// --optimizer, --lr_schedule, --epochs, --batch_size, --lr.
void CheckHyperParameters(RunFlags& flags, const Validation& v) {
  if (v.uses_optimizer) {
    flags.optimizer = absl::AsciiStrToLower(flags.optimizer);
    const auto& names = OptimizerNames();
    if (std::find(names.begin(), names.end(), flags.optimizer) == names.end()) {
      FlagErrorExit(flags, absl::StrCat("--optimizer \"", flags.optimizer,
                                        "\": unknown optimizer (sgd, momentum, adagrad, adam, adamw)"));
    }
  }
  if (v.uses_epochs && flags.lr_schedule != "constant" && flags.lr_schedule != "cosine") {
    FlagErrorExit(flags, absl::StrCat("--lr_schedule \"", flags.lr_schedule,
                                      "\": unknown schedule (constant, cosine)"));
  }
  if (v.uses_epochs && flags.epochs < (flags.init_from.empty() ? 1 : 0)) {
    FlagErrorExit(flags, absl::StrCat("--epochs ", flags.epochs, ": must be at least 1 (0 ",
                                      "evaluates --init_from's weights only)"));
  }
  if (flags.batch_size < 1) {
    FlagErrorExit(flags, absl::StrCat("--batch_size ", flags.batch_size, ": must be at least 1"));
  }
  if (flags.grad_accum_steps < 1) {
    FlagErrorExit(flags, absl::StrCat("--grad_accum_steps ", flags.grad_accum_steps,
                                      ": must be at least 1"));
  }
  if (!v.uses_epochs &&
      (flags.grad_accum_steps != 1 || flags.comm_hook != "allreduce" || flags.zero)) {
    FlagErrorExit(flags, absl::StrCat("--grad_accum_steps ", flags.grad_accum_steps,
                                      " --comm_hook ", flags.comm_hook, " --zero ",
                                      flags.zero ? "true" : "false",
                                      ": only the classifier programs (train_mnist, "
                                      "train_cifar10) take these"));
  }
  if (!v.uses_epochs && !flags.metrics.empty()) {  // it was accepted and nothing was written
    FlagErrorExit(flags, absl::StrCat("--metrics \"", flags.metrics, "\": ", flags.program,
                                      " writes no per-epoch rows (only the classifier programs, "
                                      "train_mnist and train_cifar10, do)"));
  }
  if (flags.comm_hook != "allreduce" && flags.comm_hook != "bf16" && flags.comm_hook != "fp16") {
    FlagErrorExit(flags, absl::StrCat("--comm_hook \"", flags.comm_hook,
                                      "\": unknown hook (allreduce, bf16, fp16)"));
  }
  if (!(flags.lr > 0) || !std::isfinite(flags.lr)) {  // inf trains to NaN at the first step
    FlagErrorExit(flags, absl::StrCat("--lr ", flags.lr, ": must be a positive, finite number"));
  }
}

// Thread and step counts, limits and intervals: --num_workers, --cpu_threads,
// --log_every, the counts that must be >= 0, --timeout_s,
// --checkpoint_every_minutes.
void CheckCountsAndLimits(const RunFlags& flags) {
  if (flags.num_workers < 0) {
    FlagErrorExit(flags, absl::StrCat("--num_workers ", flags.num_workers, ": must be >= 0"));
  }
  if (flags.cpu_threads < 0) {
    FlagErrorExit(flags, absl::StrCat("--cpu_threads ", flags.cpu_threads,
                                      ": must be >= 0 (0: automatic)"));
  }
  if (flags.log_every < 1) {
    FlagErrorExit(flags, absl::StrCat("--log_every ", flags.log_every, ": must be at least 1"));
  }
  for (const auto& [name, value] :
       std::vector<std::pair<const char*, int64_t>>{{"--max_steps_per_epoch", flags.max_steps_per_epoch},
                                                    {"--train_limit", flags.train_limit},
                                                    {"--test_limit", flags.test_limit},
                                                    {"--stop_at_step", flags.stop_at_step},
                                                    {"--checkpoint_every_steps", flags.checkpoint_every_steps},
                                                    {"--keep_checkpoints", flags.keep_checkpoints}}) {
    if (value < 0) FlagErrorExit(flags, absl::StrCat(name, " ", value, ": must be >= 0"));
  }
  if (std::optional<std::string> bad = CheckTimeout(flags.timeout_s)) FlagErrorExit(flags, *bad);
  if (!(flags.checkpoint_every_minutes >= 0)) {
    FlagErrorExit(flags, absl::StrCat("--checkpoint_every_minutes ", flags.checkpoint_every_minutes,
                                      ": must be >= 0"));
  }
}

// What the run writes and reads back: --trace_steps (parsed into
// flags.trace_window), the checkpoint flags that need --checkpoint_dir,
// --tensorboard_dir (created here), the --metrics name, --resume.
void CheckOutputsAndResume(RunFlags& flags) {
  if (const absl::Status parsed = dist::ParseTraceWindow(flags.trace_steps, &flags.trace_window);
      !parsed.ok()) {
    FlagErrorExit(flags, std::string(parsed.message()));
  }
  if (flags.checkpoint_dir.empty()) {
    for (const auto& [name, set] : std::vector<std::pair<const char*, bool>>{
             {"--checkpoint_every_steps", flags.checkpoint_every_steps > 0},
             {"--checkpoint_every_minutes", flags.checkpoint_every_minutes > 0},
             {"--keep_checkpoints", flags.keep_checkpoints > 0}}) {
      if (set) FlagErrorExit(flags, absl::StrCat(name, " needs --checkpoint_dir (where to write)"));
    }
  }
  if (!flags.tensorboard_dir.empty()) {
    // Made here, before any rank runs: a directory rank 0 could not create would
    // otherwise fail rank 0 alone while the others wait in a collective.
    CreateDirectoryOrExit(flags, "--tensorboard_dir", flags.tensorboard_dir);
  }
  if (!flags.metrics.empty() && !absl::EndsWith(flags.metrics, ".csv") &&
      !absl::EndsWith(flags.metrics, ".jsonl")) {
    FlagErrorExit(flags, absl::StrCat("--metrics \"", flags.metrics,
                                      "\": the name must end in .csv or .jsonl"));
  }
  if (flags.resume && flags.checkpoint_dir.empty()) {
    FlagErrorExit(flags, "--resume needs --checkpoint_dir (where the checkpoints are)");
  }
}

// --data_dir, as Validation::data_dir asks.
void CheckDataDir(const RunFlags& flags, const Validation& v) {
  using DataDir = Validation::DataDir;
  if (v.data_dir == DataDir::kRequired && flags.data_dir.empty()) {
    FlagErrorExit(flags, "--data_dir is empty: name the directory of the dataset files");
  }
  if (v.data_dir != DataDir::kUnused && !flags.data_dir.empty() && !IsDirectory(flags.data_dir)) {
    FlagErrorExit(flags, absl::StrCat("--data_dir \"", flags.data_dir, "\": no such directory"));
  }
}

// --cuda_graph: the options a captured step cannot hold (before the devices are
// chosen) and, after them, the devices it needs: one GPU per rank.
[[noreturn]] void RefuseSharedGpu(const RunFlags& flags) {
    FlagErrorExit(flags, absl::StrCat("--cuda_graph: ranks share a GPU (--gpus \"", flags.gpus,
                                      "\"): the in-process communicator they use cannot be "
                                      "captured in a CUDA graph; give each rank its own GPU"));
}

void CheckCudaGraphOptions(const RunFlags& flags, const Validation& v) {
  if (!flags.cuda_graph) return;
  if (!v.uses_epochs) {
    FlagErrorExit(flags, "--cuda_graph: only the classifier programs (train_mnist, "
                         "train_cifar10) take it");
  }
  if (flags.grad_accum_steps != 1) {
    FlagErrorExit(flags, absl::StrCat("--cuda_graph with --grad_accum_steps ",
                                      flags.grad_accum_steps,
                                      ": a captured step holds one batch; use "
                                      "--grad_accum_steps=1 or drop --cuda_graph"));
  }
  if (flags.zero) {
    FlagErrorExit(flags, "--cuda_graph with --zero: the sharded optimizer's collectives are not "
                         "captured in a CUDA graph; drop one of them");
  }
  // Checked on the text too, so that the reason is the same where the GPUs are missing:
  // an ordinal listed twice, as "0" or "cuda:0" alike. A list that does not parse
  // is left to dist::SelectDevices, whose error names it. CPU ranks ("cpu",
  // "cpu:0,cpu:1") name no ordinal: they are refused below as CPU ranks.
  absl::StatusOr<std::vector<int>> ordinals = dist::ParseGpuOrdinals(flags.gpus, 0);
  if (ordinals.ok()) {
    std::sort(ordinals->begin(), ordinals->end());
    if (std::adjacent_find(ordinals->begin(), ordinals->end()) != ordinals->end()) {
      RefuseSharedGpu(flags);
    }
  }
  if (!flags.trace.empty()) {
    FlagErrorExit(flags, "--cuda_graph with --trace: the trace's CUDA events and host "
                         "synchronisation cannot be recorded in a captured step; drop one of "
                         "them");
  }
}

void CheckCudaGraphDevices(const RunFlags& flags) {
  if (!flags.cuda_graph) return;
  if (flags.devices.empty() || !flags.devices[0].is_cuda()) {
    FlagErrorExit(flags, absl::StrCat("--cuda_graph: needs one GPU per rank, but the ranks run "
                                      "on the CPU (--gpus \"", flags.gpus, "\"",
                                      flags.gpus.empty() ? ": no GPU visible" : "",
                                      "); CUDA graphs capture GPU work only"));
  }
  if (dist::HasSharedGpu(flags.devices)) {
    RefuseSharedGpu(flags);
  }
}

// flags.devices from --gpus, --nprocs and --share_devices; then, for
// Validation::rank_per_core, one CPU rank per usable core (see there).
void SelectDevicesOrExit(RunFlags& flags, const Validation& v) {
  absl::StatusOr<std::vector<nn::Device>> devices =
      dist::SelectDevices(flags.gpus, flags.nprocs, flags.share_devices);
  if (!devices.ok()) {
    FlagErrorExit(flags, absl::StrCat("--gpus \"", flags.gpus, "\" --nprocs ", flags.nprocs, ": ",
                                      devices.status().message()));
  }
  flags.devices = *std::move(devices);
  CheckCudaGraphDevices(flags);
  if (v.rank_per_core && flags.gpus.empty() && flags.nprocs == -1 && flags.devices.size() == 1 &&
      flags.devices[0].is_cpu()) {
    const bool batch_given = flags.batch_size_given;
    int64_t ranks = std::max<int64_t>(1, UsableCores() / (1 + flags.num_workers));
    if (!batch_given) {
      ranks = std::min<int64_t>(ranks, flags.batch_size);
      while (ranks > 1 && flags.batch_size % ranks != 0) --ranks;
    }
    if (ranks > 1) {
      absl::StatusOr<std::vector<nn::Device>> cpu_ranks =
          dist::SelectDevices("cpu", static_cast<int>(ranks), flags.share_devices);
      TANDEM_CHECK(cpu_ranks.ok(), "choosing ", ranks, " CPU ranks: ", cpu_ranks.status().ToString());
      flags.devices = *std::move(cpu_ranks);
      flags.gpus = "cpu";
      flags.nprocs = static_cast<int>(ranks);
      if (!batch_given) flags.batch_size /= static_cast<int>(ranks);
    }
  }
}

// TF32 (--deterministic) and, on CPU ranks, the kernel threads (--cpu_threads,
// 0: this process's share of the cores per rank).
void ConfigureKernels(RunFlags& flags) {
  nn::set_allow_tf32(!flags.deterministic);
  if (!flags.devices.empty() && flags.devices[0].is_cpu()) {
    if (flags.cpu_threads == 0) {
      const int64_t cores = UsableCores();
      const int64_t ranks = flags.world_size();
      flags.cpu_threads = static_cast<int>(
          std::clamp<int64_t>((cores - ranks * flags.num_workers) / ranks, 1, cores));
    }
    nn::set_cpu_blas_threads(flags.cpu_threads);
  }
}

// --max_restarts, --snapshot_every.
void CheckRestartFlags(const RunFlags& flags, const Validation& v) {
  if (flags.max_restarts < 0) {
    FlagErrorExit(flags, absl::StrCat("--max_restarts ", flags.max_restarts, ": must be >= 0"));
  }
  if (flags.snapshot_every < 0) {
    FlagErrorExit(flags, absl::StrCat("--snapshot_every ", flags.snapshot_every, ": must be >= 0"));
  }
  if (flags.max_restarts > 0 && !v.uses_epochs) {
    FlagErrorExit(flags, absl::StrCat("--max_restarts ", flags.max_restarts,
                                      ": only the classifier programs (train_mnist, "
                                      "train_cifar10) take it"));
  }
  if (flags.max_restarts == 0 && flags.snapshot_every != 1) {
    FlagErrorExit(flags, absl::StrCat("--snapshot_every ", flags.snapshot_every,
                                      ": only with --max_restarts > 0 (a run without restarts "
                                      "keeps no snapshots)"));
  }
}

}  // namespace

void ValidateOrExit(RunFlags& flags, const Validation& v) {
  CheckHyperParameters(flags, v);
  CheckCountsAndLimits(flags);
  CheckRestartFlags(flags, v);
  CheckOutputsAndResume(flags);
  CheckSafetensorsPaths(flags, v);
  CheckCudaGraphOptions(flags, v);
  CheckDataDir(flags, v);
  SelectDevicesOrExit(flags, v);
  ConfigureKernels(flags);
}

std::unique_ptr<optim::Optimizer> MakeOptimizer(const std::string& name,
                                                std::vector<nn::Tensor> params, double lr) {
  if (name == "sgd") return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = lr});
  if (name == "momentum") {
    return std::make_unique<optim::SGD>(std::move(params),
                                        optim::SGDOptions{.lr = lr, .momentum = 0.9});
  }
  if (name == "adagrad") {
    return std::make_unique<optim::Adagrad>(std::move(params), optim::AdagradOptions{.lr = lr});
  }
  if (name == "adam") {
    return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = lr});
  }
  if (name == "adamw") {  // decoupled weight decay 0.01, torch.optim.AdamW's default
    return std::make_unique<optim::AdamW>(std::move(params), optim::AdamWOptions{.lr = lr});
  }
  TANDEM_CHECK(false, "MakeOptimizer: unknown optimizer \"", name,
               "\" (sgd, momentum, adagrad, adam, adamw)");
  return nullptr;
}

dist::SpawnOptions MakeSpawnOptions(const RunFlags& flags) {
  dist::SpawnOptions options;
  options.share_devices = flags.share_devices;
  options.log_dir = flags.log_dir;
  options.seed = flags.seed;
  options.timeout_s = flags.timeout_s;
  options.stop_signal_source = &ProgramStopSignals();
  options.restart.max_restarts = flags.max_restarts;
  // Several processes (mpirun, srun): what every process must run with, or all
  // stop before training with the value and the hosts that differ. Devices,
  // loader workers, threads and paths may differ per host.
  options.must_agree = {
      {"program", flags.program},
      {"--epochs", absl::StrCat(flags.epochs)},
      {"--batch_size", absl::StrCat(flags.batch_size)},
      {"--lr", absl::StrCat(flags.lr)},
      {"--lr_schedule", flags.lr_schedule},
      {"--optimizer", flags.optimizer},
      {"--seed", absl::StrCat(flags.seed)},
      {"--deterministic", flags.deterministic ? "true" : "false"},
      {"--bf16", flags.bf16 ? "true" : "false"},
      {"--resume", flags.resume ? "true" : "false"},
      {"--max_steps_per_epoch", absl::StrCat(flags.max_steps_per_epoch)},
      {"--train_limit", absl::StrCat(flags.train_limit)},
      {"--test_limit", absl::StrCat(flags.test_limit)},
      {"--stop_at_step", absl::StrCat(flags.stop_at_step)},
      // A process whose watchdog fires sooner would end the job while the others
      // still wait; spawn compares SpawnOptions::timeout_s too, this names the flag.
      {"--timeout_s", absl::StrCat(flags.timeout_s)},
      {"--checkpoint_every_steps", absl::StrCat(flags.checkpoint_every_steps)},
      {"--checkpoint_every_minutes", absl::StrCat(flags.checkpoint_every_minutes)},
      // Every rank takes part in the gathers of TensorBoard's step times and of the trace.
      {"--tensorboard_dir", flags.tensorboard_dir.empty() ? "(off)" : "(on)"},
      // Paths may differ, but not whether they are given: every rank takes part in a
      // checkpoint's save (a process without --checkpoint_dir paired other collectives
      // with it, and OpenMPI aborted); global rank 0's --init_from weights reach every
      // rank (DataParallel's broadcast) and rank 0 alone writes --metrics and
      // --save_safetensors, so these on another process only would do nothing.
      {"--checkpoint_dir", flags.checkpoint_dir.empty() ? "(off)" : "(on)"},
      {"--metrics", flags.metrics.empty() ? "(off)" : "(on)"},
      {"--init_from", flags.init_from.empty() ? "(off)" : "(on)"},
      {"--save_safetensors", flags.save_safetensors.empty() ? "(off)" : "(on)"},
      {"--log_every", absl::StrCat(flags.log_every)},
      {"--trace", flags.trace.empty() ? "(off)" : "(on)"},
      {"--trace_steps", flags.trace_steps},
      {"--grad_accum_steps", absl::StrCat(flags.grad_accum_steps)},
      {"--comm_hook", flags.comm_hook},
      {"--zero", flags.zero ? "true" : "false"},
      {"--cuda_graph", flags.cuda_graph ? "true" : "false"},
  };
  for (const auto& entry : flags.program_agreed) options.must_agree.push_back(entry);
  return options;
}

namespace {

// PrintEnvironment's table: (name, value) rows.
using EnvironmentRows = std::vector<std::pair<std::string, std::string>>;

// Where the run runs: the program, its processes or world, devices, GPUs and communicator.
void AddPlacementRows(const RunFlags& flags, const dist::LaunchInfo& launch, bool cpu,
                      EnvironmentRows& rows) {
  std::string devices;
  for (size_t r = 0; r < flags.devices.size(); ++r) {
    absl::StrAppend(&devices, r ? " " : "", flags.devices[r].ToString());
  }
  rows.emplace_back("program", flags.program);
  if (launch.processes > 1) {
    rows.emplace_back("processes", absl::StrCat(launch.processes, " (", launch.evidence,
                                                "): spawn's header lists them"));
    rows.emplace_back("ranks in process 0", absl::StrCat(flags.world_size()));
  } else {
    rows.emplace_back("world size", absl::StrCat(flags.world_size()));
  }
  rows.emplace_back("devices (rank order)", devices);
  rows.emplace_back("visible GPUs", dist::DescribeVisibleGpus(nn::cuda_device_count()));
  rows.emplace_back("communicator",
                    launch.processes > 1 && cpu ? "hierarchical: in-process + MPI"
                    : cpu || dist::HasSharedGpu(flags.devices) ? "in-process"
                                                               : "nccl");
}

// The program's own rows, "name=value" each ("name" alone: an empty value).
void AddProgramRows(const std::vector<std::string>& extra_rows, EnvironmentRows& rows) {
  for (const std::string& row : extra_rows) {
    const size_t colon = row.find('=');
    rows.emplace_back(row.substr(0, colon), colon == std::string::npos ? "" : row.substr(colon + 1));
  }
}

// How it computes: the seed, the CPU's kernel threads and the precision.
void AddNumericsRows(const RunFlags& flags, bool cpu, EnvironmentRows& rows) {
  rows.emplace_back("seed", absl::StrCat(flags.seed));
  if (cpu) {
    rows.emplace_back("CPU kernel threads",
                      absl::StrCat(nn::cpu_blas_threads(), " per rank (float32 GEMM and conv: ",
                                   nn::cpu_conv_backend(), ")"));
  }
  // On the CPU, bfloat16 convolutions and GEMMs (linear) run on oneDNN's bfloat16
  // primitives where the CPU has bfloat16 instructions (nn::cpu_bf16_native());
  // elsewhere they are emulated (converted to float32), and the run says it will be
  // slower rather than let --bf16 pass for a speed-up there.
  std::string precision = flags.deterministic ? "float32" : "float32 (TF32 allowed on CUDA)";
  if (flags.bf16 && !cpu) precision = "bfloat16 autocast (float32 parameters)";
  if (flags.bf16 && cpu) {
    precision = nn::cpu_bf16_native()
                    ? absl::StrCat("bfloat16 autocast (float32 parameters), CPU convolutions and "
                                   "GEMMs on ",
                                   nn::cpu_bf16_backend())
                    : absl::StrCat("bfloat16 autocast (float32 parameters), ",
                                   nn::cpu_bf16_backend(), " on the CPU: slower than float32");
  }
  rows.emplace_back("precision", precision);
  if (flags.cuda_graph) {
    rows.emplace_back("CUDA graph", "training step captured once, replayed per full batch "
                                    "(partial batches and evaluation eager)");
  }
}

// Where it writes: logs, checkpoints, metrics (each when given).
void AddOutputRows(const RunFlags& flags, EnvironmentRows& rows) {
  if (!flags.log_dir.empty()) rows.emplace_back("log dir", flags.log_dir);
  if (!flags.checkpoint_dir.empty()) {
    rows.emplace_back("checkpoint dir", absl::StrCat(flags.checkpoint_dir,
                                                     flags.resume ? " (resume)" : ""));
  }
  if (!flags.metrics.empty()) rows.emplace_back("metrics", flags.metrics);
}

// The rows between two rules, their names padded to one width.
std::string FormatTable(const EnvironmentRows& rows) {
  size_t width = 0;
  for (const auto& row : rows) width = std::max(width, row.first.size());
  std::string rule(width + 40, '-');
  std::string out = absl::StrCat(rule, "\n");
  for (const auto& [key, value] : rows) {
    absl::StrAppend(&out, "  ", key, std::string(width - key.size(), ' '), " : ", value, "\n");
  }
  absl::StrAppend(&out, rule, "\n");
  return out;
}

}  // namespace

void PrintEnvironment(const RunFlags& flags, const std::vector<std::string>& extra_rows) {
  // Several processes (mpirun, srun): process 0 prints the header; spawn's own
  // header then lists every process's host and devices and the global world.
  const dist::LaunchInfo launch = dist::DetectLaunch();
  if (launch.index != 0) return;
  const bool cpu = flags.devices.empty() || !flags.devices[0].is_cuda();
  EnvironmentRows rows;
  AddPlacementRows(flags, launch, cpu, rows);
  AddProgramRows(extra_rows, rows);
  AddNumericsRows(flags, cpu, rows);
  AddOutputRows(flags, rows);
  std::cerr << FormatTable(rows) << std::flush;
}

dist::CheckpointManagerOptions CheckpointOptions(const RunFlags& flags) {
  dist::CheckpointManagerOptions options{.dir = flags.checkpoint_dir,
                                         .keep = flags.keep_checkpoints,
                                         .every_steps = flags.checkpoint_every_steps,
                                         .every_minutes = flags.checkpoint_every_minutes};
  // For the tests of a stop during a write: the writer thread sleeps this long first.
  if (flags.test_checkpoint_write_delay_ms > 0) {
    options.write_delay_s = flags.test_checkpoint_write_delay_ms / 1000;
  }
  return options;
}

std::unique_ptr<dist::SummaryWriter> OpenTensorBoard(const dist::Context& ctx,
                                                     const RunFlags& flags) {
  if (flags.tensorboard_dir.empty() || ctx.rank() != 0) return nullptr;
  absl::StatusOr<std::unique_ptr<dist::SummaryWriter>> writer =
      dist::SummaryWriter::Open(flags.tensorboard_dir);
  TANDEM_CHECK(writer.ok(), "--tensorboard_dir: ", writer.status().message());
  return *std::move(writer);
}

int StoppedAtStepExit(const RunFlags& flags, int64_t step) {
  // One write: see ExitStatusOf.
  std::cerr << absl::StrCat(flags.program, ": stopped after step ", step,
                            " as --stop_at_step asks",
                            flags.checkpoint_dir.empty()
                                ? std::string(" (no --checkpoint_dir: nothing saved)")
                                : absl::StrCat("; run again with --resume --checkpoint_dir=",
                                               flags.checkpoint_dir,
                                               " to continue from its newest checkpoint"),
                            "\n")
            << std::flush;
  return kExitStopped;
}

int ExitStatusOf(const RunFlags& flags, const absl::Status& status) {
  if (status.ok()) return kExitOk;
  const std::string message = absl::StrReplaceAll(status.message(), {{"\n", " "}});
  // One write per line: under mpirun the processes' stderr is forwarded in the
  // chunks each write makes, and piecewise writes interleave between processes.
  auto line = [](const std::string& text) { std::cerr << text << std::flush; };
  if (dist::IsStopped(status)) {
    if (flags.checkpoint_dir.empty()) {
      line(absl::StrCat(flags.program, ": stopped: ", message,
                        " (no --checkpoint_dir: nothing saved)\n"));
      return kExitStopped;
    }
    line(absl::StrCat(flags.program, ": ", message, "; run again with --resume --checkpoint_dir=",
                      flags.checkpoint_dir, " to continue\n"));
    return kExitStoppedResumable;
  }
  if (status.code() == absl::StatusCode::kCancelled) {
    line(absl::StrCat(flags.program, ": stopped: ", message, "\n"));
    return kExitStopped;
  }
  line(absl::StrCat(flags.program, ": error: ", message, "\n"));
  return kExitFailure;
}

}  // namespace tandem::apps
