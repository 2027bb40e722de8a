#include "hapi/internal/fit_state.h"

#include <algorithm>
#include <utility>
#include <variant>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "nn/error.h"
#include "nn/status_macros.h"
#include "spawn/signals.h"

namespace tandem::hapi::internal {

FitPosition Restore(dist::Context& ctx, dist::CheckpointManager& checkpoints,
                    dist::TrainingState& state, const FitOptions& options,
                    int64_t global_batch) {
  FitPosition at;
  absl::StatusOr<std::string> path = checkpoints.Restore(state);
  dist::ThrowIfError(path.status(), "fit: resume: ");
  if (path->empty()) {
    if (ctx.rank() == 0) ctx.log().Info("fit: resume: no checkpoint yet; starting from the beginning");
    return at;
  }
  if (!state.extra.contains(kEpochKey) && options.resume_position) {
    // Another loop's file: its own entries say where it stands.
    absl::StatusOr<ResumePosition> p = options.resume_position(state.extra, *path);
    dist::ThrowIfError(p.status(), "fit: resume: ");
    at.restored = true;
    at.path = *path;
    at.epoch = p->epoch;
    at.resumed_inside_epoch = p->epoch_steps > 0;
    at.epoch_steps = std::max<int64_t>(p->epoch_steps, 0);
    at.epoch_loss_sum = p->epoch_loss_sum;
    return at;
  }
  auto epoch = dist::ExtraValue<int64_t>(state.extra, kEpochKey, *path);
  auto steps = dist::ExtraValue<int64_t>(state.extra, kEpochStepsKey, *path);
  auto loss = dist::ExtraValue<double>(state.extra, kEpochLossKey, *path);
  dist::ThrowIfError(epoch.status(), "fit: resume: ");
  dist::ThrowIfError(steps.status(), "fit: resume: ");
  dist::ThrowIfError(loss.status(), "fit: resume: ");
  at.restored = true;
  at.path = *path;
  at.epoch = static_cast<int>(*epoch);
  // -1: written at the end of a fit, at an epoch boundary.
  at.resumed_inside_epoch = *steps >= 0;
  at.epoch_steps = std::max<int64_t>(*steps, 0);
  at.epoch_loss_sum = *loss;
  auto saved_global = state.extra.find(kGlobalBatchKey);
  TANDEM_CHECK(saved_global == state.extra.end() ||
                   std::holds_alternative<int64_t>(saved_global->second),
               "fit: resume: ", *path, ": ", kGlobalBatchKey, " is not an integer");
  if (at.epoch_steps > 0 && saved_global != state.extra.end()) {
    const int64_t saved = std::get<int64_t>(saved_global->second);
    TANDEM_CHECK(saved == global_batch, "fit: resume: ", *path, " stopped after ", at.epoch_steps,
                 " steps of epoch ", at.epoch + 1, " with a global batch of ", saved,
                 " rows; this fit's global batch is ", global_batch, " rows (batch_size ",
                 options.batch_size, " on ", ctx.world_size(), " rank",
                 ctx.world_size() == 1 ? "" : "s", "), with which the rest ",
                 "of that epoch would train other samples: resume it with a batch_size of ",
                 "that global batch over the ranks, or from a checkpoint at an epoch's end ",
                 "(checkpoint_each_epoch)");
  }
  if (at.epoch_steps > 0 && state.loader != nullptr) {
    // Each step took grad_accum_steps loader batches (the epoch's last one
    // what was left): the loop goes on from at.epoch_steps * grad_accum_steps,
    // which must be where the loader stopped.
    const int64_t accum = options.grad_accum_steps;
    const int64_t n = state.loader->num_batches();
    const int64_t expect = std::min(at.epoch_steps * accum, n);
    const data::SamplerState loader = state.loader->get_state();
    // The loader's state after the epoch's last batch is the next epoch's start.
    const bool same_epoch = loader.epoch == at.epoch;
    const bool epoch_done = loader.epoch == at.epoch + 1 && loader.position == 0;
    const int64_t stopped = same_epoch ? loader.position : epoch_done ? n : -1;
    TANDEM_CHECK(stopped == expect, "fit: resume: ", *path, " stopped after ", at.epoch_steps,
                 " steps of epoch ", at.epoch + 1, " with the loader at ",
                 same_epoch || epoch_done ? "" : absl::StrCat("epoch ", loader.epoch + 1, " "),
                 "batch ", same_epoch || epoch_done ? stopped : loader.position, " of ", n,
                 "; with grad_accum_steps = ", accum, " those steps end at batch ", expect,
                 ", so the rest of that epoch would train other batches: resume it with the ",
                 "grad_accum_steps it was written with, or from a checkpoint at an epoch's end ",
                 "(checkpoint_each_epoch)");
  }
  if (ctx.rank() == 0)
    ctx.log().Info("fit: resumed from {}: epoch {}, step {} ({} of the epoch)", *path, at.epoch + 1,
                   *state.step, at.epoch_steps);
  return at;
}
void PutSnapshotEntries(CheckpointExtra& extra, int epoch, int64_t epoch_steps, double rank_loss,
                        bool stop_training, const History& history, int64_t global_batch) {
  extra[kEpochKey] = int64_t{epoch};
  extra[kEpochStepsKey] = epoch_steps;
  extra[kRankEpochLossKey] = rank_loss;
  extra[kStopTrainingKey] = int64_t{stop_training ? 1 : 0};
  extra[kSnapshotsKey] = history.snapshots;
  extra[kGlobalBatchKey] = global_batch;
  extra[kHistoryEpochsKey] = static_cast<int64_t>(history.epochs.size());
  for (size_t e = 0; e < history.epochs.size(); ++e) {
    for (const auto& [name, value] : history.epochs[e])
      extra[absl::StrCat(kHistoryPrefix, e, ".", name)] = value;
  }
}


absl::StatusOr<SnapshotEntries> ReadSnapshotEntries(const CheckpointExtra& extra,
                                                    const std::string& name) {
  SnapshotEntries out;
  ASSIGN_OR_RETURN(const int64_t epoch, dist::ExtraValue<int64_t>(extra, kEpochKey, name));
  ASSIGN_OR_RETURN(out.at.epoch_steps, dist::ExtraValue<int64_t>(extra, kEpochStepsKey, name));
  ASSIGN_OR_RETURN(out.at.rank_epoch_loss, dist::ExtraValue<double>(extra, kRankEpochLossKey, name));
  ASSIGN_OR_RETURN(const int64_t stop, dist::ExtraValue<int64_t>(extra, kStopTrainingKey, name));
  ASSIGN_OR_RETURN(out.history.snapshots, dist::ExtraValue<int64_t>(extra, kSnapshotsKey, name));
  ASSIGN_OR_RETURN(out.global_batch, dist::ExtraValue<int64_t>(extra, kGlobalBatchKey, name));
  ASSIGN_OR_RETURN(const int64_t epochs, dist::ExtraValue<int64_t>(extra, kHistoryEpochsKey, name));
  out.at.epoch = static_cast<int>(epoch);
  out.at.resumed_inside_epoch = true;  // a snapshot is taken after a step, before the epoch's end
  out.at.restored = true;
  out.at.from_snapshot = true;
  out.at.path = name;
  out.stop_training = stop != 0;
  out.history.epochs.resize(static_cast<size_t>(epochs));
  for (const auto& [key, value] : extra) {
    if (!key.starts_with(kHistoryPrefix) || key == kHistoryEpochsKey) continue;
    const std::string rest = key.substr(sizeof(kHistoryPrefix) - 1);
    const size_t dot = rest.find('.');
    size_t e = 0;
    if (dot == std::string::npos || !absl::SimpleAtoi(rest.substr(0, dot), &e) ||
        e >= out.history.epochs.size() || !std::holds_alternative<double>(value))
      return absl::InvalidArgumentError(absl::StrCat(name, ": entry \"", key, "\" is not ",
                                                     "one of the ", epochs, " epochs' logs"));
    out.history.epochs[e][rest.substr(dot + 1)] = std::get<double>(value);
  }
  return out;
}

// The global batch every rank keeps over a world shrink: FitOptions::batch_size
// rows per rank of the first attempt's world, split over the ranks left in
// shares that differ by at most one row when they do not divide it (then
// weighed by DataParallelOptions::global_batch_size, or with uneven by the
// join). Throws (every rank alike) for such shares with grad_accum_steps > 1
// outside a join, whose short last group of an epoch the fixed weighing would
// misweigh.
RankBatch RankBatchOf(const dist::Context& ctx, const FitOptions& options) {
  const dist::AttemptInfo& info = ctx.attempt_info();
  const int world = ctx.world_size();
  const int64_t global =
      options.batch_size * (info.world_shrunk ? info.first_world_size : world);
  RankBatch out{.global = global,
                .rows = global / world + (ctx.rank() < global % world ? 1 : 0),
                .uneven_shares = global % world != 0};
  TANDEM_CHECK(!out.uneven_shares || options.grad_accum_steps == 1 || options.uneven,
               "fit: batch_size = ", options.batch_size,
               " with RestartPolicy::leave_out_failed_rank and grad_accum_steps = ",
               options.grad_accum_steps, ": the world shrank from ", info.first_world_size,
               " to ", world, " ranks, which share the global batch of ", global,
               " rows unevenly; uneven shares are weighed for one micro-batch a step only");
  return out;
}


// A fit from main under LaunchOptions::spawn.restart: what the snapshots
// cannot hold, refused before any rank starts (inside a rank's function the
// same refusals come from FitOnRank, on every rank).
absl::Status CheckRestartOptions(const FitOptions& o, const LaunchOptions& launch) {
  const dist::RestartPolicy& policy = launch.spawn.restart;
  if (policy.max_restarts <= 0) return absl::OkStatus();
  if (o.uneven && o.snapshot_every_steps > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "fit: uneven = true with snapshot_every_steps = ", o.snapshot_every_steps,
        " under a restart policy (SpawnOptions::restart.max_restarts = ", policy.max_restarts,
        "): the state of a join (the ranks that have joined, the steps they answer) is not "
        "snapshotted; set snapshot_every_steps = 0 (a restart then starts the fit again)"));
  if (policy.leave_out_failed_rank && launch.nprocs > 0 && o.grad_accum_steps > 1 && !o.uneven) {
    // Each restart may leave one rank out: with accumulation every smaller
    // world must divide the global batch (RankBatchOf).
    const int64_t global = o.batch_size * launch.nprocs;
    for (int w = launch.nprocs - 1; w >= std::max(1, launch.nprocs - policy.max_restarts); --w) {
      if (global % w != 0)
        return absl::InvalidArgumentError(absl::StrCat(
            "fit: batch_size = ", o.batch_size, " on ", launch.nprocs,
            " ranks with RestartPolicy::leave_out_failed_rank and grad_accum_steps = ",
            o.grad_accum_steps, ": a world of ", w, " ranks would share the global batch of ",
            global, " rows unevenly (", global, " % ", w, " != 0), which is weighed for one ",
            "micro-batch a step only; choose a batch_size whose global batch every smaller "
            "world divides"));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::hapi::internal
