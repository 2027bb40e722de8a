// restart_bench: recovery time after a rank's failure, fault to the first
// training step completed after it, on CPU ranks (a small MLP under
// DataParallel, SGD with momentum, a snapshot every --every steps).
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
//       first_step_unix_ns.
//
// The fault: the last rank throws after step --fault_step of the first attempt.
// Exit statuses: 0 ok, 1 the run failed (disk mode's planned failure too), 2 a bad flag.
#include <algorithm>
#include <chrono>
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
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint.h"

ABSL_FLAG(std::string, mode, "inprocess", "inprocess or disk.");
ABSL_FLAG(std::string, ranks, "2,4", "inprocess: comma-separated rank counts; disk: one.");
ABSL_FLAG(int, steps, 30, "Training steps.");
ABSL_FLAG(int, fault_step, 15, "The last rank throws after this step (first attempt only).");
ABSL_FLAG(int, every, 1, "A snapshot (inprocess) or checkpoint (disk) every this many steps.");
ABSL_FLAG(int, batch, 32, "Samples per rank and step.");
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

struct Times {
  int64_t fault_ns = 0;       // when the last rank threw
  int64_t first_step_ns = 0;  // rank 0's first step completed after it
};

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
  bool resumed = false;
  if (disk && resume) {
    RETURN_IF_ERROR(dist::LoadTrainingCheckpoint(ctx, path, state));
    resumed = true;
  } else if (!disk) {
    ASSIGN_OR_RETURN(resumed, dist::RestoreSnapshot(ctx, state));
    resumed = resumed || ctx.attempt() > 0;
  }
  const int batch = absl::GetFlag(FLAGS_batch);
  for (bool first = true; step < steps; first = false) {
    nn::Tensor x = nn::randn({batch, 64});
    nn::Tensor y = nn::randn({batch, 10});
    nn::Tensor loss = nn::mse_loss(dp(x), y);
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    if (first && resumed && ctx.rank() == 0) times->first_step_ns = UnixNs();
    if (step % every == 0) {
      RETURN_IF_ERROR(disk ? dist::SaveTrainingCheckpoint(ctx, path, state)
                           : dist::SaveSnapshot(ctx, state));
    }
    const bool fault = !resume && ctx.attempt() == 0 && step == absl::GetFlag(FLAGS_fault_step) &&
                       ctx.rank() == ctx.world_size() - 1;
    if (fault) {
      times->fault_ns = UnixNs();
      return absl::InternalError(absl::StrFormat("planned fault after step %d", step));
    }
  }
  return absl::OkStatus();
}

dist::SpawnOptions Options(int max_restarts) {
  dist::SpawnOptions options;
  options.restart.max_restarts = max_restarts;
  options.handle_sigint = false;
  options.processes = dist::Processes::kOff;
  options.timeout_s = 60;
  static std::ostringstream quiet;  // the log is not the point here
  if (!getenv("RESTART_BENCH_LOG")) options.console = &quiet;
  return options;
}

int InProcess(const std::vector<int>& rank_counts) {
  std::cout << "ranks  recovery_ms (median, min, max over repetitions)\n";
  for (const int ranks : rank_counts) {
    std::vector<double> ms;
    for (int rep = 0; rep < absl::GetFlag(FLAGS_repetitions); ++rep) {
      Times times;
      absl::Status s =
          dist::spawn([&](dist::Context& ctx) { return Train(ctx, /*disk=*/false, &times); }, ranks,
                      "cpu", Options(/*max_restarts=*/1));
      if (!s.ok()) {
        std::cerr << "restart_bench: " << s << "\n";
        return 1;
      }
      ms.push_back(static_cast<double>(times.first_step_ns - times.fault_ns) * 1e-6);
    }
    std::sort(ms.begin(), ms.end());
    std::cout << absl::StrFormat("%5d  %.1f  %.1f  %.1f\n", ranks, ms[ms.size() / 2], ms.front(),
                                 ms.back());
  }
  return 0;
}

int Disk(int ranks) {
  Times times;
  absl::Status s =
      dist::spawn([&](dist::Context& ctx) { return Train(ctx, /*disk=*/true, &times); }, ranks,
                  "cpu", Options(/*max_restarts=*/0));
  if (times.fault_ns != 0) std::cout << "fault_unix_ns=" << times.fault_ns << "\n";
  if (times.first_step_ns != 0) std::cout << "first_step_unix_ns=" << times.first_step_ns << "\n";
  if (!s.ok()) {
    std::cerr << "restart_bench: " << s << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> ranks;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1) {
      std::cerr << "restart_bench: --ranks: \"" << part << "\" is not a rank count\n";
      return 2;
    }
    ranks.push_back(n);
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (absl::GetFlag(FLAGS_every) < 1 || absl::GetFlag(FLAGS_fault_step) < 1 ||
      absl::GetFlag(FLAGS_fault_step) >= absl::GetFlag(FLAGS_steps)) {
    std::cerr << "restart_bench: need --every >= 1 and 1 <= --fault_step < --steps\n";
    return 2;
  }
  if (mode == "inprocess") return tandem::InProcess(ranks);
  if (mode == "disk" && ranks.size() == 1) return tandem::Disk(ranks[0]);
  std::cerr << "restart_bench: --mode must be inprocess, or disk with one --ranks value\n";
  return 2;
}
