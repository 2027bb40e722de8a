// Training-state checkpoints: everything a run needs to continue bit for bit,
// in one nn checkpoint file (nn/checkpoint.h: header, CRC-32, atomic write).
//
//   int64_t step = 0;
//   dist::TrainingState state{.model = &net, .optimizer = &adam, .scheduler = &sched,
//                             .loader = &loader, .step = &step};
//   state.extra["program"] = std::string("train_mnist");
//   RETURN_IF_ERROR(dist::SaveTrainingCheckpoint(ctx, path, state));   // every rank calls
//   ...
//   RETURN_IF_ERROR(dist::LoadTrainingCheckpoint(ctx, path, state));   // every rank calls
//
// Under spawn every rank calls both functions at the same point of its program
// (they run collectives). Save: every rank's generator state is gathered, rank 0
// writes the file, and no rank returns before the file is complete (rank 0
// broadcasts its outcome after the write, which is also the barrier). Load:
// every rank loads the file into its own objects (in a job of several processes
// rank 0 reads it and broadcasts its bytes); the ranks then
// exchange their outcomes, so either every rank returns OK or every rank
// returns an error. What is saved comes from rank 0 except the generators
// (DataParallel keeps the model, optimizer, schedule, sampler position and step
// the same on every rank).
//
// File entries (on top of nn/checkpoint.h's layout):
//   tensors   "model.<name>"              model.state_dict()
//             "optim.<name>"              optimizer state tensors
//   metadata  "optim.<key>"    double     optimizer scalars (groups, hyper-parameters, steps)
//             "sched.<key>"    double     scheduler.state_dict()
//             "sampler.epoch", "sampler.position"  int64   SamplerState
//             "step"           int64      *step
//             "world_size"     int64      ranks of the run that wrote it
//             "rng.<r>.seed", "rng.<r>.stream", "rng.<r>.offset"  int64 (uint64 bits)
//                                          rank r's nn::thread_generator()
//             "training_state.version" int64 (1)
//             "training_state.buffers"  int64   how many model buffers the file states
//             "training_state.buffer.<name>" string  how model buffer <name> relates to
//                                          the other ranks' (BufferSync's code, below)
//             <any other key>             TrainingState::extra
// An object whose pointer is null is neither saved nor loaded.
//
// Generators and world size: a file written by the same number of ranks
// restores every rank's generator (seed, stream, offset), so dropout and any
// other draw continue exactly. A file written by a different number of ranks
// is still loaded (model, optimizer, schedule, sampler, step, extra), the
// generators keep their current state and rank 0 logs a warning saying so,
// because resuming on another machine size is a legitimate, merely not
// bitwise-reproducible, use; LoadOptions::require_same_world_size turns it
// into an error instead.
//
// Errors are absl::Status naming the file and the entry: I/O, magic, version,
// checksum, truncation (nn::LoadCheckpoint); a missing entry (NotFound), an
// entry of the wrong type or out of range (InvalidArgument), the model's or
// optimizer's own mismatch message (key and both shapes) behind "model: " /
// "optimizer: ", an expectation of LoadOptions::expect not met
// (FailedPrecondition). Before applying anything Load checks every metadata
// entry it will need; the model and the optimizer check their own tensors and
// are each left unchanged on error, but a later failure (e.g. the optimizer's)
// leaves the earlier objects (the model) loaded: treat the state as unusable
// after an error. Failures of the collectives themselves (another rank failed,
// the run is stopping) throw, as every collective does.
//
// Thread-safety: each rank's thread calls with its own Context and objects.
// CUDA: tensors are copied to the host on the calling thread's stream (a sync).
#ifndef TANDEM_SPAWN_TRAIN_CHECKPOINT_H_
#define TANDEM_SPAWN_TRAIN_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "nn/checkpoint.h"
#include "nn/module.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"
#include "spawn/context.h"

namespace tandem::dist {

// What a checkpoint holds. Pointers are not owned and may be null where unused.
struct TrainingState {
  nn::Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  optim::LRScheduler* scheduler = nullptr;  // built on `optimizer`
  // The sampler's epoch and position: from the loader (batches handed out so
  // far; prefetched ones do not count, see DataLoader::get_state) or, without a
  // loader, from a sampler. At most one of the two.
  data::DataLoader* loader = nullptr;
  data::BatchSampler* sampler = nullptr;
  int64_t* step = nullptr;  // the global step counter
  // App metadata (program name, best accuracy, ...). Save writes it; Load
  // replaces it with every entry of the file that is not one of the library's
  // (see the file comment). Keys must not be a library key or start with
  // "model.", "optim.", "sched.", "sampler.", "rng." or "training_state.".
  std::map<std::string, nn::CheckpointValue> extra;
};

struct LoadOptions {
  // Entries of `extra` the file must hold with exactly these values, checked
  // before anything is loaded (e.g. {"program", "train_mnist"}).
  std::map<std::string, nn::CheckpointValue> expect;
  // A file written by another number of ranks: false (default) loads it
  // without the generators and rank 0 logs a warning; true fails
  // (FailedPrecondition) with both world sizes in the message.
  bool require_same_world_size = false;
};

// What a checkpoint's model buffers (BatchNorm's running statistics and batch
// count) are, written by rank 0 for each buffer of TrainingState::model:
//   kOneRank             a run of one rank: its own values
//   kSyncBatchNorm       a BatchNorm2d with a SyncBatchNormReducer: the statistics
//                        of every rank's batch, the same on every rank
//   kBroadcastFromRank0  a live DataParallel over the model with broadcast_buffers
//                        on: every rank began each synchronised step from rank 0's
//                        values; the file holds rank 0's after its own last forward
//   kRank0Only           a live DataParallel with broadcast_buffers off: rank 0's
//                        statistics of its own slices; the other ranks' differ
//   kUnknown             several ranks and no DataParallel over the model on rank 0
//                        (a model saved without one): rank 0's values, nothing said
//                        of the others'
// A file written before checkpoints stated their buffers has no statement
// (stated false); it loads as before.
enum class BufferSync { kOneRank, kSyncBatchNorm, kBroadcastFromRank0, kRank0Only, kUnknown };
// The code stored in the file ("one_rank", "sync_batch_norm",
// "broadcast_from_rank0", "rank0_only", "unknown").
const char* BufferSyncCode(BufferSync sync);
struct SavedBuffer {
  std::string name;  // as in model.state_dict() (without the file's "model." prefix)
  BufferSync sync = BufferSync::kUnknown;
};
struct SavedBuffers {
  bool stated = false;  // false: the file does not say (written before the statement)
  std::vector<SavedBuffer> buffers;
};
// The statement of a parsed checkpoint (nn::LoadCheckpoint), or of a file.
// InvalidArgument naming the entry when an entry is not what Save writes.
absl::StatusOr<SavedBuffers> SavedBuffersOf(const nn::Checkpoint& checkpoint,
                                            const std::string& path);
absl::StatusOr<SavedBuffers> ReadSavedBuffers(const std::string& path);
// What a save of `state` by this rank as rank 0 of `world_size` ranks states
// (empty and stated when state.model is null). Not a collective.
SavedBuffers SavedBuffersFor(const TrainingState& state, int world_size);
// One line: "2 buffers, broadcast from rank 0 at every synchronised step
// (broadcast_buffers on): bn.running_mean, bn.running_var", several groups
// joined by "; ", "no buffers", or "not stated (written before checkpoints
// stated their buffers)". CheckpointManager's "written" log line ends with it.
std::string DescribeSavedBuffers(const SavedBuffers& buffers);

// Writes `state` to `path` (see the file comment). Every rank calls it; every
// rank returns rank 0's outcome (the other ranks' errors say that rank 0 could
// not write the file; rank 0's names the cause).
absl::Status SaveTrainingCheckpoint(Context& ctx, const std::string& path,
                                    const TrainingState& state);

// The first half of SaveTrainingCheckpoint, for a caller that writes the file
// itself (dist::CheckpointManager writes on a background thread). Every rank
// calls it (every rank's generator is gathered: a collective). Rank 0 returns
// the file's bytes (nn::SerializeCheckpoint: a copy, so training may go on at
// once; nn::WriteCheckpointBytes writes them atomically); the other ranks
// return "". Errors (a reserved extra key, a tensor that cannot be copied) on
// rank 0 only: the caller shares rank 0's outcome with the other ranks.
absl::StatusOr<std::string> SnapshotTrainingCheckpoint(Context& ctx, const std::string& path,
                                                       const TrainingState& state);
// Rank 0's `value` on every rank (every rank calls it; the others' `value` is
// ignored), e.g. the newest checkpoint's path when only rank 0's host has the
// checkpoint directory.
std::string BroadcastString(Context& ctx, const std::string& value);

// Loads `path` into the objects of `state` and replaces state.extra with the
// file's app entries. Every rank calls it; a rank whose own load succeeded
// returns an error naming the first rank that failed and quoting its message,
// if one did (marked MarkPeerFailure, so spawn reports the failing rank's own
// error first). In a job of several processes only rank 0 reads the file and
// its bytes are broadcast, so the checkpoint directory need not be shared
// between hosts; every rank takes the same collectives whichever rank fails
// (rank 0's read, a rank out of memory for the bytes: the ranks agree on the
// outcome before the bytes travel). Test only: TANDEM_TEST_CHECKPOINT_LOAD_FAULT
// =<point>:<rank> (point read or buffer) makes that global rank throw
// std::bad_alloc there (checkpoint.cc, InjectLoadFault).
absl::Status LoadTrainingCheckpoint(Context& ctx, const std::string& path, TrainingState& state,
                                    const LoadOptions& options = {});

// The optimizer's entries of a checkpoint ("optim.<name>" tensors,
// "optim.<key>" scalars, as above): `state` into `checkpoint`, and back out of
// a parsed file (NotFound naming `path` when it has no "optim.num_groups",
// InvalidArgument naming the entry when a scalar is not a double). Whether
// the state fits an optimizer is its load_state_dict's to say. Not collectives.
void PutOptimizerEntries(const optim::StateDict& state, nn::Checkpoint& checkpoint);
absl::StatusOr<optim::StateDict> OptimizerEntriesOf(const nn::Checkpoint& checkpoint,
                                                    const std::string& path);

// In-memory snapshots for restarts (SpawnOptions::restart, spawn/restart.h).
// The same entries as a checkpoint file, but this rank's own state only (its
// generator included), kept as bytes in the run's host memory: no collective,
// no file. Every rank calls SaveSnapshot at the same steps (every K steps);
// on a later attempt every rank calls RestoreSnapshot once its objects exist.
//
//   int64_t step = 0;
//   dist::TrainingState state{.model = &net, .optimizer = &sgd, .loader = &loader, .step = &step};
//   ASSIGN_OR_RETURN(bool restored, dist::RestoreSnapshot(ctx, state));  // attempt > 0
//   for (; step < steps;) {
//     ...; ++step;
//     if (step % K == 0) RETURN_IF_ERROR(dist::SaveSnapshot(ctx, state));
//   }
//
// SaveSnapshot: `state` at step *state.step (step must not be null) into the
// run's store; OK at once, storing nothing, in a run that cannot restart
// (max_restarts == 0, or not under spawn). ResourceExhausted naming the size
// when the snapshot cannot be allocated or exceeds
// RestartPolicy::max_snapshot_bytes; the other errors as Save's.
// RestoreSnapshot: on an attempt after a restart, loads the snapshot of the
// step every rank resumes from (AttemptInfo::resume_step) into `state`'s
// objects (the step, the sampler position and this rank's generator included;
// after a world shrink, RestartPolicy::leave_out_failed_rank, the snapshot of
// the rank this one was, without the generator, rank 0 logging a warning)
// and returns true; false, loading nothing, on the first attempt or when no
// step was stored by every rank (start from scratch). Errors as Load's.
absl::Status SaveSnapshot(Context& ctx, const TrainingState& state);
absl::StatusOr<bool> RestoreSnapshot(Context& ctx, TrainingState& state);

// extra[key] as T (std::string, int64_t or double). NotFound / InvalidArgument
// naming `path` (the file it came from) and the key.
template <typename T>
absl::StatusOr<T> ExtraValue(const std::map<std::string, nn::CheckpointValue>& extra,
                             const std::string& key, const std::string& path) {
  auto it = extra.find(key);
  if (it == extra.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": missing entry \"", key, "\""));
  }
  const T* value = std::get_if<T>(&it->second);
  if (value == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", path, ": entry \"", key, "\" has the wrong type"));
  }
  return *value;
}

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_TRAIN_CHECKPOINT_H_
