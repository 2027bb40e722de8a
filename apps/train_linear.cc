// train_linear: the quick-start LinearNet (Linear(10, 10) -> Linear(10, 1)) with
// MSELoss and Adam (lr 1e-3) on random batches for 20 steps, data-parallel on
// every visible GPU or on CPU ranks through dist::spawn, printing
// "step:N loss:X" (rank 0's loss) per step to stdout as the Paddle seed does.
//
//   train_linear                          # all visible GPUs, else one CPU rank
//   train_linear --gpus=cpu --nprocs=2    # two CPU ranks
//
// Each rank draws its own random batches (rank r's generator is stream r of
// --seed); DataParallel averages the gradients, so every rank keeps the same
// weights. With --checkpoint_dir it saves through dist::CheckpointManager
// (periodic checkpoints, SIGTERM/SIGUSR1 stop at an agreed step, --resume
// continues bit for bit: the generators are in the file). --stop_at_step=S ends
// the run after step S, as in the classifier programs. Exit statuses as in
// apps/common.h.
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "apps/common.h"
#include "nn/error.h"
#include "nn/nn.h"
#include "spawn/train/checkpoint_manager.h"

ABSL_FLAG(int, steps, 20, "Optimizer steps.");
ABSL_FLAG(int, batch_size, 10, "Random examples per step on each rank.");
ABSL_FLAG(double, lr, 1e-3, "Learning rate.");
ABSL_FLAG(std::string, optimizer, "adam",
          "sgd | momentum (SGD with momentum 0.9) | adagrad | adam | adamw (weight decay 0.01).");

namespace {

namespace nn = ::tandem::nn;
namespace dist = ::tandem::dist;
namespace apps = ::tandem::apps;

struct LinearNet : nn::Module {
  LinearNet() : l1(register_module("l1", nn::Linear(10, 10))),
                l2(register_module("l2", nn::Linear(10, 1))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(l1(x)); }
  nn::Linear l1, l2;
};

// With --checkpoint_dir: a dist::CheckpointManager, as a user's own training
// function would use it (periodic checkpoints, stop signals); with --resume it
// first restores `state` from the newest checkpoint. (The manager is neither
// copied nor moved: it is made in place in `checkpoints`.)
void OpenCheckpoints(dist::Context& ctx, const apps::RunFlags& flags, dist::TrainingState& state,
                     std::optional<dist::CheckpointManager>& checkpoints) {
  if (flags.checkpoint_dir.empty()) return;
  checkpoints.emplace(ctx, apps::CheckpointOptions(flags));
  if (flags.resume) {
    const absl::StatusOr<std::string> from =
        checkpoints->Restore(state, {.expect = {{"program", flags.program}}});
    dist::ThrowIfError(from.status(), "--resume: ");
    if (ctx.rank() == 0 && !from->empty()) {
      ctx.log().Info("resumed from {} at step {}", *from, *state.step);
    }
  }
  state.extra["program"] = flags.program;
}

// One optimizer step on a fresh random batch; returns the loss.
nn::Tensor TrainStep(dist::DataParallel& dp, nn::MSELoss& loss_fn,
                     tandem::optim::Optimizer& optimizer, const apps::RunFlags& flags) {
  nn::Tensor x = nn::randn({flags.batch_size, 10});
  nn::Tensor y = nn::randn({flags.batch_size, 1});
  nn::Tensor loss;
  {
    nn::AutocastGuard autocast(flags.bf16 ? nn::kBFloat16 : nn::kFloat32);
    loss = loss_fn(dp(x), y);
  }
  optimizer.zero_grad();
  loss.backward();
  optimizer.step();
  return loss;
}

// Rank 0 prints "step:N loss:X" (and writes TensorBoard scalars with --tensorboard_dir).
void Report(dist::Context& ctx, const nn::Tensor& loss, int64_t step,
            const tandem::optim::Optimizer& optimizer, dist::SummaryWriter* tensorboard) {
  if (ctx.rank() != 0) return;
  const double value = loss.item();
  std::cout << "step:" << step << " loss:" << value << std::endl;
  if (tensorboard) {
    tensorboard->AddScalar("train/loss", value, step + 1);
    tensorboard->AddScalar("train/learning_rate", optimizer.lr(), step + 1);
  }
}

// The final state, for a later --resume with more --steps; none after
// --stop_at_step (no checkpoint of that step), none twice when a periodic save
// wrote this step already. Finish: a periodic write in flight completes.
void SaveFinal(dist::CheckpointManager& checkpoints, dist::TrainingState& state,
               const apps::RunFlags& flags, bool stopped_early) {
  const bool written = checkpoints.last_path() ==
                       dist::CheckpointManager::PathFor(flags.checkpoint_dir, *state.step);
  absl::Status saved = stopped_early || written ? absl::OkStatus() : checkpoints.Save(state);
  if (saved.ok()) saved = checkpoints.Finish();
  dist::ThrowIfError(saved, "saving the checkpoint: ");
}

// Returns the step after which --stop_at_step ended the run (every rank the
// same), or 0 when it ran all `steps`.
int64_t Train(dist::Context& ctx, const apps::RunFlags& flags, int steps) {
  LinearNet net;  // on ctx.device(), the same initial weights on every rank
  dist::DataParallel dp(net, ctx);
  std::unique_ptr<tandem::optim::Optimizer> optimizer =
      apps::MakeOptimizer(flags.optimizer, net.parameters(), flags.lr);
  nn::MSELoss loss_fn;
  int64_t step = 0;
  dist::TrainingState state{.model = &net, .optimizer = optimizer.get(), .step = &step};
  std::optional<dist::CheckpointManager> checkpoints;
  OpenCheckpoints(ctx, flags, state, checkpoints);
  std::unique_ptr<dist::SummaryWriter> tensorboard = apps::OpenTensorBoard(ctx, flags);
  int64_t stopped_at = 0;
  while (step < steps) {
    ctx.check_stop();
    const nn::Tensor loss = TrainStep(dp, loss_fn, *optimizer, flags);
    Report(ctx, loss, step, *optimizer, tensorboard.get());
    ++step;
    if (checkpoints) {
      const absl::Status saved = checkpoints->AtStepBoundary(state);  // may throw StoppedError
      dist::ThrowIfError(saved, "saving a checkpoint: ");
    } else if (ctx.AtStepBoundary(step).stop) {
      throw dist::StoppedError(absl::StrCat("stopped at step ", step, " (stop signal)"), step);
    }
    if (flags.stop_at_step > 0 && step == flags.stop_at_step) {
      stopped_at = step;  // every rank, after the same step: a planned end, not a failure
      break;
    }
  }
  if (checkpoints) SaveFinal(*checkpoints, state, flags, stopped_at > 0);
  return stopped_at;
}

}  // namespace

int main(int argc, char** argv) {
  apps::RunFlags flags = apps::ParseFlagsOrExit(
      argc, argv,
      "Trains a tiny linear model (Linear(10, 10), then Linear(10, 1); mean squared error; "
      "Adam) on random batches for --steps steps and prints rank 0's loss after each step as "
      "step:N loss:X. The smallest data-parallel program: a quick check that devices, ranks "
      "(one per visible GPU, else CPU ranks: --gpus, --nprocs) and processes (started by "
      "mpirun or srun) work together, and a fast way to try checkpoints, stop signals and "
      "--resume.\n\n"
      "Usage: train_linear [--flag=value ...]\n"
      "  train_linear --gpus=cpu --nprocs=2   # two CPU ranks");
  flags.batch_size = absl::GetFlag(FLAGS_batch_size);
  flags.lr = absl::GetFlag(FLAGS_lr);
  flags.optimizer = absl::GetFlag(FLAGS_optimizer);
  const int steps = absl::GetFlag(FLAGS_steps);
  apps::ValidateOrExit(flags, {.uses_epochs = false, .uses_model_files = false});
  if (steps < 1) apps::FlagErrorExit(flags, absl::StrCat("--steps ", steps, ": must be at least 1"));
  apps::PrintEnvironment(flags, {absl::StrCat("batch=", flags.batch_size, " per rank, ",
                                              flags.batch_size * flags.world_size(), " global"),
                                 absl::StrCat("optimizer=", flags.optimizer, ", lr ", flags.lr)});
  absl::StatusOr<std::vector<int64_t>> stopped_at = dist::spawn(
      [&](dist::Context& ctx) { return Train(ctx, flags, steps); }, flags.nprocs, flags.gpus,
      apps::MakeSpawnOptions(flags));
  if (!stopped_at.ok()) return apps::ExitStatusOf(flags, stopped_at.status());
  if (stopped_at->front() > 0) return apps::StoppedAtStepExit(flags, stopped_at->front());
  return apps::kExitOk;
}
