// tandem_ddp_bench: the data-parallel training step of tandem, for the comparison
// with PyTorch's DistributedDataParallel on gloo (the PyTorch side is
// bench/torch_ddp_bench.py, the driver `scripts/bench.sh ddp`).
//
//   tests/spawn/mpirun.sh -np 2 build-cpu/bench/tandem_ddp_bench --import_dir=X \
//       --models=mlp,lenet --batch_sizes=32,64,128
//
// Started by mpirun as P processes, spawn joins them into one world (P x
// --nprocs ranks); alone, it runs --nprocs ranks in one process. X is an exchange
// directory written by `tandem_bench --export_dir=X` (bench/exchange.h):
// both sides start from its initial weights and train on its data. For every
// cell (model x global batch), every rank:
//  1. loads the initial weights, wraps the model in dist::DataParallel, makes a
//     plain SGD (lr 0.01, the exchange's);
//  2. step k trains on rows [k' B + r B / W, k' B + (r + 1) B / W) of the data,
//     k' = k mod 10 (B the global batch, W the world, r the rank): the global
//     batch split as DistributedSampler splits it, cross-entropy averaged over
//     the rank's rows, gradients averaged over the ranks (= the global batch's
//     mean loss);
//  3. the first 10 steps read the loss (not timed); the global loss of each is
//     the mean over the ranks;
//  4. --repetitions times: --warmup_steps steps, a barrier, the clock, --steps
//     steps, the clock (no host read inside the timed steps: the gradients'
//     all-reduce already makes every step wait for the slowest rank).
// Global rank 0 prints one CSV line per cell on stdout:
//   impl,model,global_batch,world,median_us,min_us,max_us,loss_1,...,loss_10
// and with --overlap (default) a second one, timed the same way:
//   tandem_overlap,model,global_batch,world,overlapped_us,sync_us,compute_us,hidden
// sync: the same buckets all-reduced after backward; compute: no reduction;
// hidden = (sync - overlapped) / (sync - compute), the fraction of the
// reduction's time that overlapping with backward took off the step.
//
// Exit statuses: 0 ok, 1 a failure, 2 a bad flag value (one line naming it).
#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/exchange.h"
#include "apps/flag_check.h"
#include "apps/models.h"
#include "nn/nn.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"

ABSL_FLAG(std::string, import_dir, "",
          "Exchange directory written by tandem_bench --export_dir (required): initial "
          "weights and data.");
ABSL_FLAG(std::string, models, "mlp,lenet", "Comma-separated models: mlp, lenet, convnet.");
ABSL_FLAG(std::string, batch_sizes, "32,64,128",
          "Comma-separated GLOBAL batch sizes, each a multiple of the world size.");
ABSL_FLAG(int, warmup_steps, 5, "Untimed steps before each repetition (>= 0).");
ABSL_FLAG(int, steps, 20, "Timed steps per repetition (>= 1).");
ABSL_FLAG(int, repetitions, 5, "Repetitions per cell (>= 1); the median is reported.");
ABSL_FLAG(int, threads, 1, "OpenBLAS/oneDNN threads of this process (>= 1).");
ABSL_FLAG(int, nprocs, 1, "CPU ranks in this process.");
ABSL_FLAG(double, timeout_s, 600, tandem::apps::kTimeoutHelp);
ABSL_FLAG(bool, overlap, true,
          "Also time each cell with the gradients reduced after backward (synchronously, "
          "the same buckets) and without any reduction, and print the fraction of the "
          "reduction hidden under backward.");

namespace tandem::apps {
namespace {

namespace dist = ::tandem::dist;

constexpr int64_t kLossSteps = 10;
constexpr int64_t kDataBatches = 10;
constexpr double kSgdLr = 0.01;

struct BadFlag {
  std::string message;
};
[[noreturn]] void Bad(const std::string& message) { throw BadFlag{message}; }

struct Model {
  std::string name;
  std::shared_ptr<nn::Module> (*make)();
  nn::Shape input;
};

Model FindModel(const std::string& name) {
  if (name == "mlp") return {name, MakeMlp, {1, 28, 28}};
  if (name == "lenet") return {name, MakeLeNet, {1, 28, 28}};
  if (name == "convnet") return {name, MakeConvNet, {3, 32, 32}};
  Bad(absl::StrCat("--models: unknown model \"", name, "\" (mlp, lenet, convnet)"));
}

void Check(const absl::Status& status) {
  TANDEM_CHECK(status.ok(), status.ToString());
}

struct Cell {
  int world = 0;
  double median_us = 0, min_us = 0, max_us = 0;
  std::vector<double> losses;
};

// kOverlap: DataParallel as users run it (bucket all-reduces during backward).
// kSync: the same buckets reduced after backward (apply_collective_grads).
// kCompute: no reduction at all (the ranks' models drift apart: timing only).
enum class Mode { kOverlap, kSync, kCompute };

Cell RunCell(dist::Context& ctx, const Model& spec, int64_t global_batch, const std::string& dir,
             Mode mode) {
  const int world = ctx.world_size(), rank = ctx.rank();
  const int64_t local = global_batch / world;
  std::shared_ptr<nn::Module> model = spec.make();
  Check(bench::ReadModelState(dir, spec.name, *model));
  absl::StatusOr<nn::Tensor> images =
      bench::ReadRawRows(absl::StrCat(dir, "/", spec.name, "/images.bin"), spec.input, nn::kFloat32);
  Check(images.status());
  const int64_t n = images->size(0);
  TANDEM_CHECK(n >= kDataBatches * global_batch, dir, "/", spec.name, "/images.bin: ", n,
               " images, but ", kDataBatches, " batches of ", global_batch, " need ",
               kDataBatches * global_batch, " (export with a larger --batch_sizes)");
  absl::StatusOr<nn::Tensor> labels =
      bench::ReadRawTensor(absl::StrCat(dir, "/", spec.name, "/labels.bin"), {n}, nn::kInt64);
  Check(labels.status());
  // This rank's rows of each of the 10 global batches, sliced once.
  std::vector<nn::Tensor> xs, ys;
  for (int64_t k = 0; k < kDataBatches; ++k) {
    const int64_t begin = k * global_batch + rank * local;
    xs.push_back(images->slice(begin, begin + local).clone());
    ys.push_back(labels->slice(begin, begin + local).clone());
  }
  dist::DataParallel dp(*model, ctx, {.reduce_in_backward = mode == Mode::kOverlap});
  optim::SGD sgd(dp.parameters(), optim::SGDOptions{.lr = kSgdLr});
  int64_t step = 0;
  auto train = [&] {
    sgd.zero_grad();
    nn::Tensor loss = nn::cross_entropy(dp(xs[step % kDataBatches]), ys[step % kDataBatches]);
    if (mode == Mode::kSync) {
      dp.scale_loss(loss).backward();
      dp.apply_collective_grads();
    } else {
      loss.backward();
    }
    sgd.step();
    ++step;
    return loss;
  };
  Cell cell;
  cell.world = world;
  if (mode == Mode::kOverlap) {
    std::vector<double> local_losses;
    for (int64_t i = 0; i < kLossSteps; ++i) local_losses.push_back(train().item());
    nn::Tensor mean = nn::from_vector<double>(local_losses, {kLossSteps}, {.dtype = nn::kFloat64});
    ctx.communicator().all_reduce(mean, dist::ReduceOp::kAvg);
    cell.losses = mean.to_vector<double>();
  }
  std::vector<double> times;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int rep = 0; rep < absl::GetFlag(FLAGS_repetitions); ++rep) {
    for (int i = 0; i < absl::GetFlag(FLAGS_warmup_steps); ++i) train();
    ctx.communicator().barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) train();
    times.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
        steps);
  }
  std::sort(times.begin(), times.end());
  cell.median_us = times[times.size() / 2];
  cell.min_us = times.front();
  cell.max_us = times.back();
  return cell;
}

// The checked flags: the cells to run and where their data is.
struct Config {
  std::string dir;
  std::vector<Model> models;
  std::vector<int64_t> batches;
};

// Reads and checks the flags; throws BadFlag naming the first bad value.
Config ParseConfig() {
  Config config;
  config.dir = absl::GetFlag(FLAGS_import_dir);
  if (config.dir.empty()) Bad("--import_dir is required (tandem_bench --export_dir writes one)");
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty())) {
    config.models.push_back(FindModel(std::string(m)));
  }
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',', absl::SkipEmpty())) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(b, &value) || value < 1) {
      Bad(absl::StrCat("--batch_sizes: \"", b, "\" is not an integer >= 1"));
    }
    config.batches.push_back(value);
  }
  if (config.models.empty() || config.batches.empty()) {
    Bad("--models and --batch_sizes must not be empty");
  }
  if (std::optional<std::string> bad = CheckTimeout(absl::GetFlag(FLAGS_timeout_s))) Bad(*bad);
  if (absl::GetFlag(FLAGS_steps) < 1 || absl::GetFlag(FLAGS_repetitions) < 1 ||
      absl::GetFlag(FLAGS_warmup_steps) < 0 || absl::GetFlag(FLAGS_threads) < 1) {
    Bad("--steps, --repetitions and --threads must be >= 1, --warmup_steps >= 0");
  }
  return config;
}

// One cell in `mode` on every rank of a spawned world; global rank 0's result,
// or nullopt after printing why the run failed.
std::optional<Cell> SpawnCell(const Model& model, int64_t batch, const std::string& dir,
                              Mode mode) {
  static std::ostream* quiet = new std::ostream(nullptr);  // spawn's table goes nowhere
  dist::SpawnOptions options;
  options.console = quiet;
  options.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  auto cells = dist::spawn(
      [&](dist::Context& ctx) {
        TANDEM_CHECK(batch % ctx.world_size() == 0, "--batch_sizes: ", batch,
                     " is not a multiple of the world size ", ctx.world_size());
        return RunCell(ctx, model, batch, dir, mode);
      },
      absl::GetFlag(FLAGS_nprocs), "cpu", options);
  if (!cells.ok()) {
    std::cerr << "tandem_ddp_bench: " << model.name << " batch " << batch << ": "
              << cells.status() << "\n";
    return std::nullopt;
  }
  return (*cells)[0];
}

// Times one (model, global batch) cell and prints its CSV lines (global rank 0
// only): the overlapped step, then with --overlap the sync and compute-only
// steps and the fraction of the reduction hidden. False when a run failed.
bool RunAndReport(const Model& model, int64_t batch, const std::string& dir) {
  const std::optional<Cell> c = SpawnCell(model, batch, dir, Mode::kOverlap);
  if (!c) return false;
  const bool report = dist::DetectLaunch().index == 0;  // global rank 0 reports
  if (report) {
    std::string line = absl::StrFormat("tandem,%s,%d,%d,%.1f,%.1f,%.1f", model.name, batch,
                                       c->world, c->median_us, c->min_us, c->max_us);
    for (double l : c->losses) absl::StrAppendFormat(&line, ",%.7g", l);
    std::cout << line << std::endl;
  }
  if (!absl::GetFlag(FLAGS_overlap)) return true;
  const std::optional<Cell> sync = SpawnCell(model, batch, dir, Mode::kSync);
  const std::optional<Cell> compute = SpawnCell(model, batch, dir, Mode::kCompute);
  if (!sync || !compute) return false;
  // The reduction's cost is sync - compute; what overlapping saved of it is
  // sync - overlapped.
  const double comm_us = sync->median_us - compute->median_us;
  const double hidden = comm_us > 0 ? (sync->median_us - c->median_us) / comm_us : 0;
  if (report) {
    std::cout << absl::StrFormat("tandem_overlap,%s,%d,%d,%.1f,%.1f,%.1f,%.3f", model.name, batch,
                                 c->world, c->median_us, sync->median_us, compute->median_us,
                                 hidden)
              << std::endl;
  }
  return true;
}

int Main(int argc, char** argv) {
  SetUpHelp("tandem_ddp_bench",
            "Times the data-parallel training step for the comparison with PyTorch DDP (see "
            "the header of bench/ddp_bench.cc).");
  ParseCommandLineOrExit("tandem_ddp_bench", argc, argv);
  try {
    const Config config = ParseConfig();
    nn::set_cpu_blas_threads(absl::GetFlag(FLAGS_threads));
    for (const Model& model : config.models) {
      for (int64_t batch : config.batches) {
        if (!RunAndReport(model, batch, config.dir)) return 1;
      }
    }
    return 0;
  } catch (const BadFlag& bad) {
    std::cerr << "tandem_ddp_bench: " << bad.message << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "tandem_ddp_bench: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace
}  // namespace tandem::apps

int main(int argc, char** argv) { return tandem::apps::Main(argc, argv); }
