#include "spawn/train/join.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "nn/error.h"

namespace tandem::dist::internal {
namespace {

// One row per rank of the step agreement.
enum Column { kActive, kSamples, kUnjoinable, kStepped, kColumns };

}  // namespace

void JoinState::Begin(Communicator& comm, std::optional<int64_t> resumed_from) {
  comm_ = &comm;
  resumed_from_ = resumed_from;
  last_active_ = 0;
  step_.clear();
  last_step_.clear();
  in_step_ = false;
  stepped_ = false;
  unjoinable_ = 0;
  weight_ = 0;
  scale_ = 0;
}

void JoinState::CloseStep() {
  if (!in_step_) return;
  const uint64_t made = comm_->collectives_entered() - step_start_;
  int64_t covered = 0;
  for (const Entry& e : step_) covered += e.collectives;
  unjoinable_ = static_cast<int64_t>(made) - covered;
  last_step_ = std::move(step_);
  step_.clear();
  in_step_ = false;
}

// Names the step agreement in a collective mismatch: a rank whose data ran
// out waits in it, so a collective of the active ranks' own there (a
// checkpoint's, a stop signal's save, a logged sum) meets it.
constexpr char kAgreementLabel[] =
    "DataParallel::join's step agreement (a rank whose data ran out answers only the other "
    "ranks' DataParallel steps: a collective of their own inside join(), such as a "
    "checkpoint's save, cannot be answered; make it after the guard)";

int JoinState::Agree(bool active, int64_t samples) {
  nn::NoGradGuard no_grad;
  Communicator::Label label(*comm_, kAgreementLabel);
  const std::vector<double> mine = {active ? 1.0 : 0.0, static_cast<double>(samples),
                                    static_cast<double>(unjoinable_), stepped_ ? 1.0 : 0.0};
  const nn::Tensor sent =
      nn::from_vector(mine, {kColumns}, {.dtype = nn::kFloat64, .device = nn::Device::CPU()})
          .to(comm_->device());
  const std::vector<double> table = comm_->all_gather(sent).to_vector<double>();
  const int world = comm_->world_size();
  int active_ranks = 0;
  double total = 0;
  for (int r = world - 1; r >= 0; --r) {
    const double* row = &table[static_cast<size_t>(r) * kColumns];
    if (row[kActive] > 0) {
      ++active_ranks;
      last_active_ = r;
    }
    total += row[kSamples];
  }
  // Every rank reads the same table, so every rank throws the same error or none.
  for (int r = 0; r < world; ++r) {
    const double* row = &table[static_cast<size_t>(r) * kColumns];
    TANDEM_CHECK(row[kUnjoinable] == 0, "DataParallel::join: rank ", r, " made ",
                 row[kUnjoinable], " collective(s) in a step that a rank whose data ran out ",
                 "cannot answer; inside join() only DataParallel's gradient reductions (with or "
                 "without a comm hook), SyncBatchNorm's collectives (of layers converted "
                 "before the DataParallel was made), ZeroRedundancyOptimizer's step() and "
                 "clip_grad_norm_() and JoinGuard::all_reduce are joinable; make the others "
                 "outside the join, or through the guard");
    TANDEM_CHECK(row[kActive] > 0 || row[kStepped] > 0 || active_ranks == 0,
                 "DataParallel::join: rank ", r, " ran out of data before its first step ",
                 "inside join(), so it cannot answer the other ranks' steps; give every rank ",
                 "at least one batch (data::DistributedTail::kUneven does when the dataset ",
                 "has at least as many samples as ranks)",
                 resumed_from_.has_value()
                     ? absl::StrCat("; this attempt of a restarted run resumes from the "
                                    "snapshot of step ", *resumed_from_, ": a snapshot "
                                    "stored after a rank's last batch leaves it none (store "
                                    "snapshots at steps after which every rank still has one)")
                     : std::string());
  }
  weight_ = active && total > 0 ? static_cast<double>(samples) / total : 0.0;
  // From the integers, so that equal batches give exactly 1.
  scale_ = active && total > 0 ? static_cast<double>(samples) * world / total : 0.0;
  step_start_ = comm_->collectives_entered();
  return active_ranks;
}

void JoinState::BeginStep(int64_t samples) {
  CloseStep();
  Agree(/*active=*/true, samples);
  in_step_ = true;
  stepped_ = true;
}

void JoinState::Record(Kind kind, const nn::Tensor& t, bool once) {
  if (!in_step_) return;
  step_.push_back({.kind = kind, .shape = t.shape(), .dtype = t.dtype(), .once = once});
}

void JoinState::RecordReplay(uint64_t entered_before, std::function<void()> replay) {
  if (!in_step_) return;
  const int collectives = static_cast<int>(comm_->collectives_entered() - entered_before);
  step_.push_back({.kind = Kind::kAllReduce, .shape = {}, .dtype = nn::kFloat32, .once = false,
                   .collectives = collectives, .replay = std::move(replay)});
}

void JoinState::Replay() {
  nn::NoGradGuard no_grad;
  for (const Entry& e : last_step_) {
    if (e.once) continue;
    if (e.replay) {
      e.replay();
      continue;
    }
    nn::Tensor zeros = nn::zeros(e.shape, {.dtype = e.dtype, .device = comm_->device()});
    switch (e.kind) {
      case Kind::kAllReduce:
        comm_->all_reduce(zeros, ReduceOp::kSum);
        break;
      case Kind::kAllReduceAsync:
        comm_->all_reduce_async(zeros, ReduceOp::kSum)->wait();
        break;
      case Kind::kAllGather:
        comm_->all_gather(zeros);
        break;
      case Kind::kBroadcast:
        comm_->broadcast(zeros, last_active_);
        break;
    }
  }
}

int JoinState::Shadow() {
  CloseStep();
  while (Agree(/*active=*/false, 0) > 0) Replay();
  comm_ = nullptr;
  return last_active_;
}

void JoinState::Abandon() {
  comm_ = nullptr;
  in_step_ = false;
}

}  // namespace tandem::dist::internal
