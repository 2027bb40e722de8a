// internal::JoinState: the bookkeeping behind DataParallel::join() (see
// data_parallel.h for the contract). Inside a join, every step of a rank that
// still has data starts with a step agreement (one all_gather of each rank's
// state: active, samples in its batch, collectives it made last step that no
// joined rank could answer); the joinable collectives of the step are
// recorded in order. A rank whose data ran out replays its last step's record
// until the agreement says every rank has joined. Two kinds of record:
//   - a collective whose answer is zeros (SyncBatchNorm's statistics and
//     gradient sums, JoinGuard::all_reduce, DataParallel's weighted bucket sums
//     without a comm hook): replayed as the same collective on zeros of the same
//     shape and dtype (zero gradients, a sample count of 0); broadcast_buffers'
//     broadcasts, replayed as a receiver of the step's lowest active rank;
//   - a replay function covering some number of collectives, for work whose
//     answer is not zeros alone: a bucket reduced by a comm hook (the joined rank
//     runs the hook on its zeroed bucket, so it makes the hook's collectives,
//     compressed or reduce-scattered, whatever they are) and
//     ZeroRedundancyOptimizer's step and clip_grad_norm_ (the joined rank owns a
//     shard: it steps its shard's optimizer with the reduced gradient and sends
//     the updated block to the others' all-gathers). The function must make the
//     same collectives, in the same order, as the recorded call did; it runs
//     on the joined rank's own objects, which must outlive the join.
// The step's collectives that no record covers are counted, and any count but
// zero is one error on every rank at the next agreement.
//
// Thread-safety: belongs to its rank's thread, like the DataParallel that owns it.
#ifndef TANDEM_SPAWN_TRAIN_JOIN_H_
#define TANDEM_SPAWN_TRAIN_JOIN_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "nn/tensor.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist::internal {

class JoinState {
 public:
  enum class Kind { kAllReduce, kAllReduceAsync, kAllGather, kBroadcast };

  bool joining() const { return comm_ != nullptr; }
  // Enters join mode on `comm` (no collective). resumed_from: the snapshot
  // step this attempt of a restarted run resumed from, if any (the same on
  // every rank), which the error for a rank without a step then names.
  void Begin(Communicator& comm, std::optional<int64_t> resumed_from = std::nullopt);
  // An active rank's step begins (DataParallel::forward): closes the previous
  // step's record and runs the step agreement. samples: the rows of this rank's
  // batch. Throws tandem::Error, the same on every rank, when a rank made
  // collectives that are not joinable or joined before its first step.
  void BeginStep(int64_t samples);
  // A joinable collective of the current step, on `t` (its shape and dtype are
  // what a joined rank replays). once: made only in this step (SyncBatchNorm's
  // first-use check), not replayed.
  void Record(Kind kind, const nn::Tensor& t, bool once = false);
  // Joinable work of the current step: the collectives the communicator entered
  // since it counted `entered_before` (Communicator::collectives_entered()). A
  // joined rank answers them by calling `replay`, which must make the same ones.
  void RecordReplay(uint64_t entered_before, std::function<void()> replay);
  // This rank's data ran out: answers the other ranks' steps until every rank
  // has joined, then leaves join mode. Returns the lowest rank that was active
  // in the last step any rank ran (one of the last to join: its model is the
  // trained one), the same on every rank.
  int Shadow();
  // Leaves join mode without a collective (an exception is leaving the loop).
  void Abandon();
  // This rank's share of the current step's samples, n_r / sum of n (0 once joined).
  double sample_weight() const { return weight_; }
  // n_r * N / sum of n (N: the world size; 0 once joined): the factor that makes
  // a mean over the ranks the sample-weighted sum. Exactly 1 when every rank's
  // batch has the same rows, so a hook's mean then has the bits of no join.
  double sample_scale() const { return scale_; }
  // The lowest rank active in the current step (after BeginStep or, on a
  // joined rank, the last agreement): the root of a step's broadcast, which a
  // joined rank replays (Kind::kBroadcast) as a receiver.
  int lowest_active() const { return last_active_; }

 private:
  struct Entry {
    Kind kind;
    nn::Shape shape;
    nn::DType dtype;
    bool once;
    int collectives = 1;           // the collectives it stands for
    std::function<void()> replay;  // set: how a joined rank answers it
  };
  void CloseStep();
  // The step agreement; returns the number of ranks still active.
  int Agree(bool active, int64_t samples);
  void Replay();

  Communicator* comm_ = nullptr;
  std::vector<Entry> step_;       // the current step's joinable collectives
  std::vector<Entry> last_step_;  // the last finished step's
  bool in_step_ = false;
  bool stepped_ = false;          // at least one step inside this join
  uint64_t step_start_ = 0;       // collectives entered when the step began
  int64_t unjoinable_ = 0;        // collectives of the last step not recorded
  double weight_ = 0;
  double scale_ = 0;
  int last_active_ = 0;           // lowest active rank of the last step any rank ran
  std::optional<int64_t> resumed_from_;
};

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_TRAIN_JOIN_H_
