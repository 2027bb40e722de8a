// dist::CheckpointManager: periodic, rotated, preemption-safe checkpoints of a
// training function, on top of SaveTrainingCheckpoint / LoadTrainingCheckpoint.
//
//   dist::CheckpointManager checkpoints(ctx, {.dir = "ck", .keep = 3, .every_steps = 500});
//   int64_t step = 0;
//   dist::TrainingState state{.model = &net, .optimizer = &adam, .loader = &loader, .step = &step};
//   absl::StatusOr<std::string> from = checkpoints.Restore(state);   // "" when there is none
//   while (step < total_steps) {
//     ... one step ...;  ++step;
//     RETURN_IF_ERROR(checkpoints.AtStepBoundary(state));   // may throw dist::StoppedError
//   }
//   RETURN_IF_ERROR(checkpoints.Save(state));
//   RETURN_IF_ERROR(checkpoints.Finish());
//
// Files: <dir>/step-<S>.ckpt, S = *state.step at the save (epoch-<E>.ckpt files
// of earlier versions are read too, as older than every step file). Every
// write is atomic (nn::WriteCheckpointBytes: temporary file, fsync, rename,
// fsync of the directory): a SIGKILL at any instant leaves the previous files
// whole.
//
// Every rank constructs one with the same options and calls every method at the
// same point of its program (they run collectives); the ranks' outcomes agree.
//
// Stall: a save serialises the state to host memory on the rank threads (the
// step waits for this copy and two small collectives) and rank 0 writes the
// bytes on a background thread while training goes on. The write's outcome is
// shared with every rank at the next save or at Finish(): a failed write is an
// error there, on every rank. At most one write is in flight; the next save
// waits for it.
//
// Stops (spawn/signals.h): AtStepBoundary asks the ranks' step agreement at
// every step; when a stop signal has arrived every rank reaches the same step,
// writes the checkpoint and waits until it is complete, and throws StoppedError
// (spawn then returns an IsStopped() status).
//
// Rotation (keep > 0): after step-<S> is written, rank 0 deletes the step files
// older than S beyond the newest `keep` (S's own counts). Files of a later step
// (a damaged file that Restore skipped, another run's) and epoch-<E>.ckpt
// files are never deleted. Give each run its own directory.
//
// Thread-safety: one manager per rank thread; its writer thread is internal.
#ifndef TANDEM_SPAWN_TRAIN_CHECKPOINT_MANAGER_H_
#define TANDEM_SPAWN_TRAIN_CHECKPOINT_MANAGER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spawn/train/checkpoint.h"
#include "spawn/context.h"
#include "spawn/signals.h"

namespace tandem::dist {

struct CheckpointManagerOptions {
  std::string dir;
  int keep = 0;              // newest step files kept; 0: all
  int64_t every_steps = 0;   // save when the step is a multiple; 0: never
  double every_minutes = 0;  // save when this long passed since the last save
                             // (rank 0's clock; the ranks agree on the step); 0: never
  bool background = true;    // write on a background thread (false: the save waits)
  double write_delay_s = 0;  // tests only: the writer sleeps this long first
};

class CheckpointManager {
 public:
  // InvalidArgument naming the field: an empty dir, a negative value.
  static absl::Status Validate(const CheckpointManagerOptions& options);
  // Rank 0 creates the directory (throws tandem::Error naming it when it
  // cannot) and removes temporary files of a write cut short (<name>.ckpt.tmp.<pid>.<n>
  // of a process that no longer runs). Options must pass Validate (throws
  // tandem::Error otherwise).
  CheckpointManager(Context& ctx, CheckpointManagerOptions options);
  // Waits for a write in flight; an error not collected by Finish is logged,
  // or written to stderr when the manager is destroyed off its rank's thread
  // (held past spawn's return: the Context and the run's logger are gone). A
  // manager that outlives its rank's function has its write in flight finished
  // when the rank thread ends, before spawn returns (its outcome stays for
  // Finish or the destructor). It may be destroyed on any thread.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Checkpoint files of `dir`, newest first: step-<S>.ckpt by S, then
  // epoch-<E>.ckpt by E. Temporary files are not listed.
  static std::vector<std::string> List(const std::string& dir);
  // <dir>/step-<step>.ckpt
  static std::string PathFor(const std::string& dir, int64_t step);

  // Every rank: loads the newest file of List() that loads on every rank
  // (LoadTrainingCheckpoint). Each file skipped is reported by rank 0 in one
  // warning line naming the file and the reason; the next older is tried.
  // Returns the file loaded, "" when the directory has no checkpoint, or the
  // newest file's error (naming it) when none could be loaded.
  absl::StatusOr<std::string> Restore(TrainingState& state, const LoadOptions& options = {});

  // Every rank, after every training step, *state.step = steps done
  // (consecutive values). Saves when a save is due (every_steps,
  // every_minutes). On a stop signal: saves, waits for the write, and throws
  // StoppedError. before_save (optional) runs on every rank right before a save
  // (the same step on every rank, so it may run collectives, e.g. gather a
  // per-rank value) to refresh app entries of state.extra; not at the other
  // steps. Returns the
  // error of a failed save (or of the previous write).
  absl::Status AtStepBoundary(TrainingState& state,
                              const std::function<void(TrainingState&)>& before_save = nullptr);

  // Every rank: saves step-<*state.step> now (in the background when
  // options.background; then the outcome comes with the next save or Finish).
  absl::Status Save(const TrainingState& state);
  // Every rank: waits for the write in flight; its outcome, on every rank.
  absl::Status Finish();

  // The path of the newest save started ("" before the first).
  const std::string& last_path() const { return last_path_; }

 private:
  using Clock = std::chrono::steady_clock;
  // Rank 0: waits for the writer thread; the last write's status (OK when
  // none ran), then cleared.
  absl::Status JoinWriter();
  // Rank 0's status to every rank (a broadcast); `path` for the others' message.
  absl::Status Share(const absl::Status& status, const std::string& path);
  // Rank 0, after step-<written_step> is written (see the file comment).
  void Rotate(int64_t written_step, const RankLogger& log) const;

  Context& ctx_;
  const CheckpointManagerOptions options_;
  std::string last_path_;
  std::string writing_path_;  // rank 0: the file the writer thread writes
  Clock::time_point last_save_;
  std::thread writer_;
  std::atomic<bool> writer_busy_{false};
  absl::Status writer_status_;  // written by the writer thread, read after join
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_TRAIN_CHECKPOINT_MANAGER_H_
