// restart_bench: recovery time after a rank's failure, fault to the first
// training step completed after it, on CPU ranks (--model=mlp: a small MLP on
// random data; --model=lenet: apps::MakeLeNet on the first --train_size images
// of Fashion-MNIST (--data_dir) through a DataLoader; DataParallel, SGD with
// momentum, a snapshot every --every steps).
//
//   restart_bench --mode=inprocess --ranks=2,4 --repetitions=5
//       spawn restarts the function in the process (SpawnOptions::restart):
//       stop, abort, joins, new communicators, the model built again and its
//       in-memory snapshot restored (dist::RestoreSnapshot), then one step.
//   bench/restart_bench.sh 2       (uses --mode=disk twice)
//       today's path: the process ends with the failure, a new process starts,
//       spawn starts, the model is built and the newest checkpoint file loaded
//       (dist::LoadTrainingCheckpoint), then one step. --mode=disk without
//       --resume prints fault_unix_ns and exits 1; with --resume it prints
//       first_step_unix_ns (and, with --model=lenet, start_unix_ns and
//       data_unix_ns: the process's start and its data set loaded).
//   restart_bench --model=lenet --mode=accuracy --seeds=1,2,3,4,5
//       per seed: the test accuracy (the first --test_size test images) of a
//       run without a fault and of one with the fault and a restart, and
//       whether their final parameters are the same bits.
//   restart_bench --model=lenet --mode=accuracy --ranks=4 --global_batch=64 \
//       --fault_rank=2 --leave_out
//       the same with a world shrink (RestartPolicy::leave_out_failed_rank):
//       the run with the fault finishes on one rank fewer with the same global
//       batch (the sampler's and DataParallel's global_batch_size: 64 over 3
//       ranks is 22, 21, 21 images, the gradients weighed by rows), and per
//       seed a third run without the fault on one rank fewer throughout; the
//       summary gives each kind's mean and standard deviation and how many
//       shrunk runs lie within the spread (min-max) of the runs without the
//       fault, of the first three seeds and of all.
//
// In-process, the data set is loaded once, outside spawn's function (the
// caller's object, kept by every attempt); a new process loads it again.
// The fault: rank --fault_rank (the last rank by default) fails after step
// --fault_step of the first attempt.
// Exit statuses: 0 ok, 1 the run failed (disk mode's planned failure too), 2 a bad flag.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "apps/models.h"
#include "data/dataloader.h"
#include "data/readers.h"
#include "data/sampler.h"
#include "data/transforms.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint.h"

ABSL_FLAG(std::string, mode, "inprocess", "inprocess, disk or accuracy (--model=lenet).");
ABSL_FLAG(std::string, model, "mlp", "mlp (random data) or lenet (Fashion-MNIST).");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist", "lenet: the data set.");
ABSL_FLAG(int, train_size, 4096, "lenet: the first this many training images.");
ABSL_FLAG(int, test_size, 10000, "lenet, accuracy: the first this many test images.");
ABSL_FLAG(double, lr, 0.05, "lenet: SGD's learning rate (momentum 0.9).");
ABSL_FLAG(int, cpu_threads, 0,
          "Kernel threads per rank (nn::set_cpu_blas_threads; train_mnist sets 1 for 2 ranks "
          "on 2 cores); 0: the library's default.");
ABSL_FLAG(bool, check_stop, true,
          "Call ctx.check_stop() before each step: a rank whose peer failed stops there "
          "instead of at its next collective (after the step's forward and backward).");
ABSL_FLAG(std::string, seeds, "1,2,3,4,5", "accuracy: spawn's and the sampler's seeds.");
ABSL_FLAG(std::string, ranks, "2,4", "inprocess: comma-separated rank counts; disk: one.");
ABSL_FLAG(int, steps, 30, "Training steps.");
ABSL_FLAG(int, fault_step, 15,
          "The last rank fails after this step (first attempt only); at least 6.");
ABSL_FLAG(int, every, 1, "A snapshot (inprocess) or checkpoint (disk) every this many steps.");
ABSL_FLAG(int, batch, 32, "Samples per rank and step (unless --global_batch).");
ABSL_FLAG(int, global_batch, 0,
          "lenet: samples per step over every rank, each rank taking global_batch / ranks, "
          "the first global_batch % ranks one more (kept when the world shrinks); 0: --batch "
          "per rank.");
ABSL_FLAG(int, fault_rank, -1, "The rank that fails; -1: the last.");
ABSL_FLAG(bool, leave_out, false,
          "RestartPolicy::leave_out_failed_rank: the attempt after the fault runs without "
          "the failed rank (one rank fewer).");
ABSL_FLAG(int, repetitions, 5, "inprocess: runs per rank count.");
ABSL_FLAG(std::string, checkpoint, "/tmp/restart_bench.ckpt", "disk: the checkpoint file.");
ABSL_FLAG(bool, resume, false, "disk: load --checkpoint first, report the first step, no fault.");

namespace tandem {
namespace {

int64_t UnixNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// x: (N, 64) -> (N, 10).
struct Mlp : nn::Module {
  Mlp()
      : l1(register_module("l1", nn::Linear(64, 256))),
        l2(register_module("l2", nn::Linear(256, 256))),
        l3(register_module("l3", nn::Linear(256, 10))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l3(nn::relu(l2(nn::relu(l1(x))))); }
  nn::Linear l1, l2, l3;
};

// The rank that fails in a world of `ranks`.
int FaultRank(int ranks) {
  const int r = absl::GetFlag(FLAGS_fault_rank);
  return r < 0 ? ranks - 1 : r;
}

// Samples per step over every rank in a world of `ranks`: --global_batch, or
// --batch per rank.
int64_t GlobalBatch(int ranks) {
  const int global = absl::GetFlag(FLAGS_global_batch);
  return global > 0 ? global : int64_t{absl::GetFlag(FLAGS_batch)} * ranks;
}

struct Times {
  int64_t fault_ns = 0;       // when the last rank threw
  int64_t restored_ns = 0;    // rank 0 resumed: objects built, snapshot or checkpoint loaded
  int64_t first_step_ns = 0;  // rank 0's first step completed after it
  // Rank 0's first attempt: when steps --fault_step - 5 and --fault_step ended
  // (a step's time before the fault: (b - a) / 5).
  int64_t steady_a_ns = 0, steady_b_ns = 0;
};

// Restores `state` as the mode asks: disk, the --checkpoint file with
// --resume; in the process, the run's snapshot on a later attempt. True when
// this rank resumed (rank 0 then notes Times::restored_ns).
absl::StatusOr<bool> Resume(dist::Context& ctx, bool disk, dist::TrainingState& state,
                            Times* times) {
  bool resumed = false;
  if (disk && absl::GetFlag(FLAGS_resume)) {
    RETURN_IF_ERROR(dist::LoadTrainingCheckpoint(ctx, absl::GetFlag(FLAGS_checkpoint), state));
    resumed = true;
  } else if (!disk) {
    ASSIGN_OR_RETURN(resumed, dist::RestoreSnapshot(ctx, state));
    resumed = resumed || ctx.attempt() > 0;
  }
  if (resumed && ctx.rank() == 0) times->restored_ns = UnixNs();
  return resumed;
}

// One rank. inprocess: restores the snapshot on a later attempt; disk: loads
// the checkpoint with --resume and writes one every --every steps.
absl::Status Train(dist::Context& ctx, bool disk, Times* times) {
  const int steps = absl::GetFlag(FLAGS_steps);
  const int every = absl::GetFlag(FLAGS_every);
  const std::string path = absl::GetFlag(FLAGS_checkpoint);
  const bool resume = absl::GetFlag(FLAGS_resume);
  Mlp net;
  dist::DataParallel dp(net, ctx);
  optim::SGD sgd(net.parameters(), {.lr = 0.01, .momentum = 0.9});
  int64_t step = 0;
  dist::TrainingState state{.model = &net, .optimizer = &sgd, .step = &step};
  ASSIGN_OR_RETURN(const bool resumed, Resume(ctx, disk, state, times));
  const int batch = absl::GetFlag(FLAGS_batch);
  for (bool first = true; step < steps; first = false) {
    if (absl::GetFlag(FLAGS_check_stop)) ctx.check_stop();
    nn::Tensor x = nn::randn({batch, 64});
    nn::Tensor y = nn::randn({batch, 10});
    nn::Tensor loss = nn::mse_loss(dp(x), y);
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    if (first && resumed && ctx.rank() == 0) times->first_step_ns = UnixNs();
    if (ctx.rank() == 0 && ctx.attempt() == 0 && !resumed) {
      if (step == absl::GetFlag(FLAGS_fault_step) - 5) times->steady_a_ns = UnixNs();
      if (step == absl::GetFlag(FLAGS_fault_step)) times->steady_b_ns = UnixNs();
    }
    if (step % every == 0) {
      RETURN_IF_ERROR(disk ? dist::SaveTrainingCheckpoint(ctx, path, state)
                           : dist::SaveSnapshot(ctx, state));
    }
    const bool fault = !resume && ctx.attempt() == 0 && step == absl::GetFlag(FLAGS_fault_step) &&
                       ctx.rank() == FaultRank(ctx.world_size());
    if (fault) {
      times->fault_ns = UnixNs();
      return absl::InternalError(absl::StrFormat("planned fault after step %d", step));
    }
  }
  return absl::OkStatus();
}

// LeNet's data: the first --train_size training images and --test_size test
// images (uint8; the loader scales and standardises each batch).
struct LeNetData {
  std::shared_ptr<const data::Dataset> train;
  std::shared_ptr<const data::TensorDataset> test;
};

std::shared_ptr<const data::Transform> Normalize() {
  return std::make_shared<data::ToFloatNormalize>(1.0 / 255, std::vector<double>{0.2860},
                                                  std::vector<double>{0.3530});
}

absl::StatusOr<LeNetData> LoadLeNetData(bool with_test) {
  const std::string dir = absl::GetFlag(FLAGS_data_dir);
  ASSIGN_OR_RETURN(data::TensorDataset train, data::LoadMnist(dir, /*train=*/true));
  const int64_t n = std::min<int64_t>(absl::GetFlag(FLAGS_train_size), train.size());
  LeNetData d;
  d.train = std::make_shared<data::TensorDataset>(train.data().slice(0, n).clone(),
                                                  train.targets().slice(0, n).clone());
  if (with_test) {
    ASSIGN_OR_RETURN(data::TensorDataset test, data::LoadMnist(dir, /*train=*/false));
    const int64_t m = std::min<int64_t>(absl::GetFlag(FLAGS_test_size), test.size());
    d.test = std::make_shared<data::TensorDataset>(test.data().slice(0, m).clone(),
                                                   test.targets().slice(0, m).clone());
  }
  return d;
}

// What a run ends with (accuracy mode), from rank 0.
struct Outcome {
  uint64_t parameters_fnv = 0;  // FNV-1a of every parameter's float32 bits
  double accuracy = 0;          // on LeNetData::test
  int ranks = 0;                // the world size of the attempt that finished
};

uint64_t ParametersFnv(const nn::Module& model) {
  uint64_t h = 1469598103934665603ull;
  for (const nn::Tensor& p : model.parameters()) {
    for (const float v : p.to(nn::kFloat32).to_vector<float>()) {
      uint32_t bits = 0;
      std::memcpy(&bits, &v, sizeof bits);
      for (int b = 0; b < 4; ++b) {
        h ^= (bits >> (8 * b)) & 0xffu;
        h *= 1099511628211ull;
      }
    }
  }
  return h;
}

double Evaluate(nn::Module& model, const data::TensorDataset& test) {
  nn::NoGradGuard no_grad;
  model.eval();
  const std::shared_ptr<const data::Transform> normalize = Normalize();
  double correct = 0;
  constexpr int64_t kBatch = 500;
  for (int64_t begin = 0; begin < test.size(); begin += kBatch) {
    const int64_t end = std::min(test.size(), begin + kBatch);
    nn::Generator unused{};
    const nn::Tensor x = (*normalize)(test.data().slice(begin, end), unused);
    correct += nn::accuracy(model.forward(x), test.targets().slice(begin, end)).item() *
               static_cast<double>(end - begin);
  }
  model.train();
  return test.size() > 0 ? correct / static_cast<double>(test.size()) : 0.0;
}

// One rank of LeNet, as Train above; `fault`: the last rank fails after
// --fault_step on the first attempt; `outcome` (rank 0, may be null): the
// final parameters' FNV and the test accuracy.
absl::Status TrainLeNet(dist::Context& ctx, const LeNetData& d, uint64_t seed, bool disk,
                        bool fault_planned, Times* times, Outcome* outcome) {
  const int steps = absl::GetFlag(FLAGS_steps);
  const int every = absl::GetFlag(FLAGS_every);
  const std::string path = absl::GetFlag(FLAGS_checkpoint);
  const bool resume = absl::GetFlag(FLAGS_resume);
  std::shared_ptr<nn::Module> net = apps::MakeLeNet();
  // The global batch kept whatever the world size: uneven shares weighed by rows.
  const int64_t global_batch = GlobalBatch(ctx.world_size());
  dist::DataParallel dp(*net, ctx, {.global_batch_size = global_batch});
  optim::SGD sgd(net->parameters(), {.lr = absl::GetFlag(FLAGS_lr), .momentum = 0.9});
  auto sampler = std::make_shared<data::DistributedBatchSampler>(
      data::DistributedOptions{.dataset_size = d.train->size(),
                               .global_batch_size = global_batch,
                               .num_replicas = ctx.world_size(),
                               .rank = ctx.rank(),
                               .seed = seed});
  data::DataLoader loader(d.train, sampler,
                          {.num_workers = 1, .prefetch = 2, .batch_transform = Normalize()});
  int64_t step = 0;
  dist::TrainingState state{.model = net.get(), .optimizer = &sgd, .loader = &loader, .step = &step};
  ASSIGN_OR_RETURN(const bool resumed, Resume(ctx, disk, state, times));
  loader.start_epoch();
  for (bool first = true; step < steps;) {
    if (absl::GetFlag(FLAGS_check_stop)) ctx.check_stop();
    std::optional<data::Batch> batch = loader.next();
    if (!batch.has_value()) {
      loader.start_epoch();
      continue;
    }
    nn::Tensor loss = nn::cross_entropy(dp(batch->data), batch->target);
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    if (first && resumed && ctx.rank() == 0) times->first_step_ns = UnixNs();
    if (ctx.rank() == 0 && ctx.attempt() == 0 && !resumed) {
      if (step == absl::GetFlag(FLAGS_fault_step) - 5) times->steady_a_ns = UnixNs();
      if (step == absl::GetFlag(FLAGS_fault_step)) times->steady_b_ns = UnixNs();
    }
    first = false;
    if (step % every == 0) {
      RETURN_IF_ERROR(disk ? dist::SaveTrainingCheckpoint(ctx, path, state)
                           : dist::SaveSnapshot(ctx, state));
    }
    const bool fault = fault_planned && !resume && ctx.attempt() == 0 &&
                       step == absl::GetFlag(FLAGS_fault_step) &&
                       ctx.rank() == FaultRank(ctx.world_size());
    if (fault) {
      times->fault_ns = UnixNs();
      return absl::InternalError(absl::StrFormat("planned fault after step %d", step));
    }
  }
  if (outcome != nullptr && ctx.rank() == 0) {
    outcome->parameters_fnv = ParametersFnv(*net);
    outcome->ranks = ctx.world_size();
    if (d.test != nullptr) outcome->accuracy = Evaluate(*net, *d.test);
  }
  return absl::OkStatus();
}

bool IsLeNet() { return absl::GetFlag(FLAGS_model) == "lenet"; }

dist::SpawnOptions Options(int max_restarts, uint64_t seed = 0) {
  dist::SpawnOptions options;
  options.restart.max_restarts = max_restarts;
  options.restart.leave_out_failed_rank = absl::GetFlag(FLAGS_leave_out);
  options.handle_sigint = false;
  options.processes = dist::Processes::kOff;
  options.timeout_s = 60;
  options.seed = seed;
  static std::ostringstream quiet;  // the log is not the point here
  if (!getenv("RESTART_BENCH_LOG")) options.console = &quiet;
  return options;
}

int InProcess(const std::vector<int>& rank_counts) {
  std::optional<LeNetData> lenet;
  if (IsLeNet()) {
    absl::StatusOr<LeNetData> d = LoadLeNetData(/*with_test=*/false);
    if (!d.ok()) {
      std::cerr << "restart_bench: " << d.status() << "\n";
      return 1;
    }
    lenet = *std::move(d);
  }
  std::cout << "ranks  recovery_ms to the first step (median, min, max over repetitions)  "
               "to resumed (objects built, snapshot restored; median, min, max)  "
               "step_ms before the fault (median)\n";
  for (const int ranks : rank_counts) {
    std::vector<double> ms, resumed_ms, step_ms;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repetitions); ++rep) {
      Times times;
      absl::Status s = dist::spawn(
          [&](dist::Context& ctx) {
            return lenet ? TrainLeNet(ctx, *lenet, /*seed=*/0, /*disk=*/false,
                                      /*fault_planned=*/true, &times, nullptr)
                         : Train(ctx, /*disk=*/false, &times);
          },
          ranks, "cpu", Options(/*max_restarts=*/1));
      if (!s.ok()) {
        std::cerr << "restart_bench: " << s << "\n";
        return 1;
      }
      ms.push_back(static_cast<double>(times.first_step_ns - times.fault_ns) * 1e-6);
      resumed_ms.push_back(static_cast<double>(times.restored_ns - times.fault_ns) * 1e-6);
      step_ms.push_back(static_cast<double>(times.steady_b_ns - times.steady_a_ns) * 1e-6 / 5);
    }
    std::sort(ms.begin(), ms.end());
    std::sort(resumed_ms.begin(), resumed_ms.end());
    std::sort(step_ms.begin(), step_ms.end());
    std::cout << absl::StrFormat("%5d  %.1f  %.1f  %.1f  %.1f  %.1f  %.1f  %.1f\n", ranks,
                                 ms[ms.size() / 2], ms.front(), ms.back(),
                                 resumed_ms[resumed_ms.size() / 2], resumed_ms.front(),
                                 resumed_ms.back(), step_ms[step_ms.size() / 2]);
  }
  return 0;
}

int Disk(int ranks, int64_t start_ns) {
  std::optional<LeNetData> lenet;
  if (IsLeNet()) {
    absl::StatusOr<LeNetData> d = LoadLeNetData(/*with_test=*/false);
    if (!d.ok()) {
      std::cerr << "restart_bench: " << d.status() << "\n";
      return 1;
    }
    lenet = *std::move(d);
    std::cout << "start_unix_ns=" << start_ns << "\ndata_unix_ns=" << UnixNs() << "\n";
  }
  Times times;
  absl::Status s = dist::spawn(
      [&](dist::Context& ctx) {
        return lenet ? TrainLeNet(ctx, *lenet, /*seed=*/0, /*disk=*/true, /*fault_planned=*/true,
                                  &times, nullptr)
                     : Train(ctx, /*disk=*/true, &times);
      },
      ranks, "cpu", Options(/*max_restarts=*/0));
  if (times.fault_ns != 0) std::cout << "fault_unix_ns=" << times.fault_ns << "\n";
  if (times.restored_ns != 0) std::cout << "restored_unix_ns=" << times.restored_ns << "\n";
  if (times.first_step_ns != 0) std::cout << "first_step_unix_ns=" << times.first_step_ns << "\n";
  if (!s.ok()) {
    std::cerr << "restart_bench: " << s << "\n";
    return 1;
  }
  return 0;
}

// min-max, mean and sample standard deviation of `v` (non-empty).
struct Spread {
  double lo = 0, hi = 0, mean = 0, sd = 0;
};
Spread SpreadOf(const std::vector<double>& v) {
  Spread s{*std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end())};
  for (const double a : v) s.mean += a / static_cast<double>(v.size());
  for (const double a : v) s.sd += (a - s.mean) * (a - s.mean);
  s.sd = v.size() > 1 ? std::sqrt(s.sd / static_cast<double>(v.size() - 1)) : 0.0;
  return s;
}

int CountInside(const std::vector<double>& v, const Spread& s) {
  int inside = 0;
  for (const double a : v) inside += a >= s.lo && a <= s.hi ? 1 : 0;
  return inside;
}

// Per seed: a run without a fault and one with it (and a restart), each
// ending with the test accuracy and rank 0's parameters' FNV; with
// --leave_out also a run without the fault on one rank fewer throughout.
int Accuracy(int ranks, const std::vector<int>& seeds) {
  absl::StatusOr<LeNetData> d = LoadLeNetData(/*with_test=*/true);
  if (!d.ok()) {
    std::cerr << "restart_bench: " << d.status() << "\n";
    return 1;
  }
  const bool shrink = absl::GetFlag(FLAGS_leave_out);
  std::cout << "seed  accuracy_without_fault  accuracy_with_fault_and_restart  same_bits  "
               "ranks_at_the_end"
            << (shrink ? "  accuracy_without_fault_on_one_rank_fewer" : "") << "\n";
  std::vector<double> without, with, fewer;
  for (const int seed : seeds) {
    Outcome outcomes[3];
    for (int kind = 0; kind < (shrink ? 3 : 2); ++kind) {
      Times times;
      absl::Status s = dist::spawn(
          [&](dist::Context& ctx) {
            return TrainLeNet(ctx, *d, static_cast<uint64_t>(seed), /*disk=*/false, kind == 1,
                              &times, &outcomes[kind]);
          },
          kind == 2 ? ranks - 1 : ranks, "cpu",
          Options(/*max_restarts=*/1, static_cast<uint64_t>(seed)));
      if (!s.ok()) {
        std::cerr << "restart_bench: " << s << "\n";
        return 1;
      }
    }
    without.push_back(outcomes[0].accuracy);
    with.push_back(outcomes[1].accuracy);
    if (shrink) fewer.push_back(outcomes[2].accuracy);
    std::cout << absl::StrFormat("%4d  %.4f  %.4f  %s  %d", seed, outcomes[0].accuracy,
                                 outcomes[1].accuracy,
                                 outcomes[0].parameters_fnv == outcomes[1].parameters_fnv ? "yes"
                                                                                          : "no",
                                 outcomes[1].ranks)
              << (shrink ? absl::StrFormat("  %.4f", outcomes[2].accuracy) : "") << std::endl;
  }
  const Spread all = SpreadOf(without), faulty = SpreadOf(with);
  std::cout << absl::StrFormat(
      "without: %.4f-%.4f, mean %.4f, sd %.4f; with: %.4f-%.4f, mean %.4f, sd %.4f\n", all.lo,
      all.hi, all.mean, all.sd, faulty.lo, faulty.hi, faulty.mean, faulty.sd);
  if (shrink) {
    const Spread f = SpreadOf(fewer);
    std::cout << absl::StrFormat("without, on %d ranks: %.4f-%.4f, mean %.4f, sd %.4f\n",
                                 ranks - 1, f.lo, f.hi, f.mean, f.sd);
    // The difference of the means against the seed noise: its standard error.
    const double se = std::sqrt(all.sd * all.sd / static_cast<double>(without.size()) +
                                faulty.sd * faulty.sd / static_cast<double>(with.size()));
    std::cout << absl::StrFormat(
        "with minus without: mean %+.4f, standard error of that difference %.4f\n",
        faulty.mean - all.mean, se);
  }
  std::cout << absl::StrFormat("with the fault, within the spread without it: %d of %zu\n",
                               CountInside(with, all), with.size());
  if (without.size() > 3) {
    const Spread first3 = SpreadOf(std::vector<double>(without.begin(), without.begin() + 3));
    std::cout << absl::StrFormat(
        "with the fault, within the spread of the first three seeds without it (%.4f-%.4f): %d "
        "of %zu\n",
        first3.lo, first3.hi, CountInside(with, first3), with.size());
  }
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  const int64_t start_ns = tandem::UnixNs();
  absl::ParseCommandLine(argc, argv);
  std::vector<int> ranks, seeds;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1) {
      std::cerr << "restart_bench: --ranks: \"" << part << "\" is not a rank count\n";
      return 2;
    }
    ranks.push_back(n);
  }
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_seeds), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 0) {
      std::cerr << "restart_bench: --seeds: \"" << part << "\" is not a seed\n";
      return 2;
    }
    seeds.push_back(n);
  }
  if (absl::GetFlag(FLAGS_cpu_threads) > 0) {
    tandem::nn::set_cpu_blas_threads(absl::GetFlag(FLAGS_cpu_threads));
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const std::string model = absl::GetFlag(FLAGS_model);
  if (absl::GetFlag(FLAGS_every) < 1 || absl::GetFlag(FLAGS_fault_step) < 6 ||
      absl::GetFlag(FLAGS_fault_step) >= absl::GetFlag(FLAGS_steps)) {
    std::cerr << "restart_bench: need --every >= 1 and 6 <= --fault_step < --steps\n";
    return 2;
  }
  const int global_batch = absl::GetFlag(FLAGS_global_batch);
  if (global_batch < 0 || (global_batch > 0 && model != "lenet")) {
    std::cerr << "restart_bench: --global_batch=" << global_batch
              << " needs --model=lenet and a positive value\n";
    return 2;
  }
  for (const int n : ranks) {
    if (global_batch > 0 && global_batch < n) {
      std::cerr << "restart_bench: --global_batch=" << global_batch << " is smaller than " << n
                << " ranks (a rank would get no image)\n";
      return 2;
    }
    if (absl::GetFlag(FLAGS_leave_out) && n < 2) {
      std::cerr << "restart_bench: --leave_out needs --ranks of at least 2, not " << n << "\n";
      return 2;
    }
  }
  for (const int n : ranks) {
    if (absl::GetFlag(FLAGS_fault_rank) >= n) {
      std::cerr << "restart_bench: --fault_rank=" << absl::GetFlag(FLAGS_fault_rank)
                << " is not a rank of " << n << "\n";
      return 2;
    }
  }
  if (model != "mlp" && model != "lenet") {
    std::cerr << "restart_bench: --model must be mlp or lenet\n";
    return 2;
  }
  if (mode == "inprocess") return tandem::InProcess(ranks);
  if (mode == "disk" && ranks.size() == 1) return tandem::Disk(ranks[0], start_ns);
  if (mode == "accuracy" && model == "lenet" && ranks.size() == 1) {
    return tandem::Accuracy(ranks[0], seeds);
  }
  std::cerr << "restart_bench: --mode must be inprocess, disk with one --ranks value, or "
               "accuracy with --model=lenet and one --ranks value\n";
  return 2;
}
