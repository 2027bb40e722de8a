// Internal to hapi (model.cc, fit_loop.cc): where a fit stands and how it is stored, in
// checkpoint files (FitOptions::checkpoint, resume) and in-memory snapshots
// for restarts (FitOptions::snapshot_every_steps), and the checks of the
// restart options. Not installed for other folders' use.
#ifndef TANDEM_HAPI_INTERNAL_FIT_STATE_H_
#define TANDEM_HAPI_INTERNAL_FIT_STATE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hapi/callbacks.h"
#include "hapi/model.h"
#include "spawn/context.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/checkpoint_manager.h"

namespace tandem::hapi::internal {

// Where a fit is: the epoch, the steps done in it and their summed loss over
// every rank (restored from a checkpoint, or zero).
struct FitPosition {
  int epoch = 0;
  int64_t epoch_steps = 0;
  double epoch_loss_sum = 0;  // over every rank: rank 0 adds it at the epoch's end
  bool resumed_inside_epoch = false;
  bool restored = false;  // a checkpoint loaded
  std::string path;       // its path
  // Restored from an in-memory snapshot after a restart: this rank's running
  // epoch loss (the device sum continues from it; epoch_loss_sum stays 0).
  bool from_snapshot = false;
  double rank_epoch_loss = 0;
};

// fit's own entries of a checkpoint file and of a snapshot.
inline constexpr char kEpochKey[] = "hapi.epoch";
inline constexpr char kEpochStepsKey[] = "hapi.epoch_steps";
inline constexpr char kEpochLossKey[] = "hapi.epoch_loss_sum";
inline constexpr char kGlobalBatchKey[] = "hapi.global_batch";  // rows per micro-batch, all ranks
// A snapshot's own entries (FitOptions::snapshot_every_steps): where the fit
// stands, this rank's running loss, the loop's counters and the history so far.
inline constexpr char kRankEpochLossKey[] = "hapi.rank_epoch_loss_sum";
inline constexpr char kStopTrainingKey[] = "hapi.stop_training";
inline constexpr char kSnapshotsKey[] = "hapi.snapshots";
inline constexpr char kHistoryEpochsKey[] = "hapi.history.epochs";
inline constexpr char kHistoryPrefix[] = "hapi.history.";  // "hapi.history.<epoch>.<log name>"

// Loads the newest checkpoint of `checkpoints` that loads into `state` (resume)
// and says where the fit stands; throws on a file that does not say it, and on
// one written inside an epoch with a global batch other than `global_batch`
// (the loader's position counts global batches; files without the entry,
// written before it existed, are taken as they come), or with a loader
// position other than its steps times options.grad_accum_steps.
FitPosition Restore(dist::Context& ctx, dist::CheckpointManager& checkpoints,
                    dist::TrainingState& state, const FitOptions& options,
                    int64_t global_batch);

// A snapshot's fit entries: epoch, steps done in it (a snapshot is taken after
// a step), this rank's running loss, stop_training, the snapshot count, the
// global batch and every epoch's logs so far.
void PutSnapshotEntries(CheckpointExtra& extra, int epoch, int64_t epoch_steps, double rank_loss,
                        bool stop_training, const History& history, int64_t global_batch);

struct SnapshotEntries {
  FitPosition at;
  bool stop_training = false;
  int64_t global_batch = 0;
  History history;
};

// InvalidArgument / NotFound naming `name` and the entry.
absl::StatusOr<SnapshotEntries> ReadSnapshotEntries(const CheckpointExtra& extra,
                                                    const std::string& name);

// This rank's batch: FitOptions::batch_size, or after a world shrink its share
// of the first attempt's global batch over the ranks left (G / W rows, one more
// for ranks below G mod W; weighed by DataParallelOptions::global_batch_size
// when the shares differ). Throws for uneven shares with grad_accum_steps > 1.
struct RankBatch {
  int64_t global = 0;          // rows per step over every rank
  int64_t rows = 0;            // this rank's rows per step
  bool uneven_shares = false;  // the ranks' rows differ (W does not divide global)
};
RankBatch RankBatchOf(const dist::Context& ctx, const FitOptions& options);

// From main, before spawn: InvalidArgument for restart options the snapshots
// cannot hold (uneven; a world shrink whose uneven shares meet accumulation).
absl::Status CheckRestartOptions(const FitOptions& o, const LaunchOptions& launch);

}  // namespace tandem::hapi::internal

#endif  // TANDEM_HAPI_INTERNAL_FIT_STATE_H_
