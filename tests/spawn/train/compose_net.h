// The model and loop of compose_test.cc's pairs of features, shared with the
// multi-process test (sync_bn_join_mpi_test.cc): a Combo of DataParallel's
// features trained on `world` ranks, or on one rank on the union of the ranks'
// rows, step by step.
#ifndef TANDEM_TESTS_SPAWN_TRAIN_COMPOSE_NET_H_
#define TANDEM_TESTS_SPAWN_TRAIN_COMPOSE_NET_H_

#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/autocast.h"
#include "nn/nn.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint.h"
#include "spawn/train/comm_hooks.h"
#include "spawn/train/zero_redundancy_optimizer.h"
#include "tests/spawn/train/join_net.h"
#include "tests/spawn/train/sync_bn_net.h"

namespace tandem::dist {
namespace {

// world ranks, 4 steps of SGD with momentum (with join() the last rank runs
// 3); rank r's micro-batch i of a step holds B = 2 rows and the one-rank run
// takes the union of the active ranks' micro-batch i as its micro-batch i (so
// SyncBatchNorm normalises over the same rows in both).
template <typename Net>
struct WithSpare : nn::Module {
  // use_spare false: `spare` gets no gradient (find_unused_parameters).
  explicit WithSpare(bool use_spare)
      : inner(register_module("inner", std::make_shared<Net>())),
        spare(register_module("spare", nn::Linear(2, 2))),
        use_spare_(use_spare) {}
  Tensor forward(const Tensor& x) override {
    Tensor out = inner->forward(x);
    return use_spare_ ? out + spare(out) * 0.0 : out;
  }
  std::shared_ptr<Net> inner;
  nn::Linear spare;
  bool use_spare_;
};

struct Combo {
  const char* name;
  bool zero = false;      // ZeroRedundancyOptimizer around the SGD
  bool hook = false;      // Bf16CompressHook
  int accum = 1;          // micro-batches per step, all but the last under NoSyncGuard
  bool sync_bn = false;   // BnNet with ConvertSyncBatchNorm (else PlainNet)
  bool unused = false;    // a parameter without gradient, find_unused_parameters
  bool autocast = false;  // forward and loss under AutocastGuard(kBFloat16)
  bool join = false;      // inside DataParallel::join(), the last rank one step short
  // With join: after each step every active rank evaluates its step's last
  // micro-batch through the module in eval mode (no gradient; under bf16
  // autocast when `autocast` is on) and sums its row
  // count through join.all_reduce; Train() throws unless each sum counts the
  // rows of the ranks active in that step.
  bool evaluate = false;
  // With evaluate: the evaluation runs in training mode, so SyncBatchNorm layers
  // normalise with the statistics of the active ranks' evaluation rows (a
  // collective each, which a joined rank answers with zeros) and move their
  // running statistics; the one-rank run evaluates the union of those rows.
  bool evaluate_in_training_mode = false;
};

// One run of a Combo: the model, DataParallel and optimizer of a rank, and its steps.
template <typename Net>
class ComboRun {
 public:
  static constexpr int kSteps = 4;
  static constexpr int64_t kRows = 2;

  ComboRun(Context& ctx, const Combo& c, int world, bool one_rank)
      : ctx_(ctx), c_(c), world_(world), one_rank_(one_rank),
        global_(world * c.accum * kRows), net_(!c.unused) {
    nn::manual_seed(5);
    x_ = nn::add_scalar(nn::randn({kSteps * global_, 2, 5, 5}), 0.5);
    y_ = nn::randn({kSteps * global_, 2});
    if (c.sync_bn) ConvertSyncBatchNorm(net_);
    DataParallelOptions options{.bucket_bytes = 256, .first_bucket_bytes = 128,
                                .find_unused_parameters = c.unused};
    if (c.hook && !one_rank) options.comm_hook = Bf16CompressHook();
    dp_ = std::make_unique<DataParallel>(net_, ctx, options);
    if (c.zero && !one_rank) {
      zero_ = std::make_unique<ZeroRedundancyOptimizer>(*dp_, [](std::vector<Tensor> shard) {
        return MakeJoinOptimizer("momentum", std::move(shard));
      });
    } else {
      plain_ = MakeJoinOptimizer("momentum", dp_->parameters());
    }
  }

  // With join the last rank skips the last step; the others' rows stay where they are.
  int Active(int s) const { return c_.join && s == kSteps - 1 ? world_ - 1 : world_; }
  int Steps() const {
    return one_rank_ || Active(kSteps - 1) > ctx_.rank() ? kSteps : kSteps - 1;
  }

  void Step(int s) {
    if (zero_) zero_->zero_grad();
    if (plain_) plain_->zero_grad();
    for (int i = 0; i < c_.accum; ++i) {
      const int64_t union_lo = s * global_ + i * world_ * kRows;
      const int64_t lo = one_rank_ ? union_lo : union_lo + ctx_.rank() * kRows;
      const int64_t hi = one_rank_ ? union_lo + Active(s) * kRows : lo + kRows;
      std::optional<DataParallel::NoSyncGuard> no_sync;
      if (i + 1 < c_.accum) no_sync.emplace(dp_.get());
      Tensor loss;
      {
        nn::AutocastGuard autocast(c_.autocast ? nn::kBFloat16 : nn::kFloat32);
        loss = nn::mse_loss((*dp_)(x_.slice(lo, hi)), y_.slice(lo, hi));
      }
      (c_.accum > 1 ? loss / static_cast<double>(c_.accum) : loss).backward();
    }
    if (zero_) zero_->step();
    if (plain_) plain_->step();
  }

  Tensor Train() { return TrainSteps(0, Steps()); }

  // Steps [from, to) inside one guard (with join), then the guard's finish.
  Tensor TrainSteps(int from, int to) {
    std::optional<DataParallel::JoinGuard> join;
    if (c_.join && !one_rank_) join.emplace(dp_.get());
    for (int s = from; s < to; ++s) {
      Step(s);
      if (c_.evaluate && join) Evaluate(s, *join);
      if (c_.evaluate && c_.evaluate_in_training_mode && one_rank_) EvaluateUnion(s);
    }
    if (join) ThrowIfError(join->finish(), "finish: ");
    return Params();
  }

  // The evaluation of Combo::evaluate after step s.
  void Evaluate(int s, DataParallel::JoinGuard& join) {
    const int64_t lo = s * global_ + (c_.accum - 1) * world_ * kRows + ctx_.rank() * kRows;
    double rows = 0;
    {
      nn::NoGradGuard no_grad;
      nn::AutocastGuard autocast(c_.autocast ? nn::kBFloat16 : nn::kFloat32);
      if (!c_.evaluate_in_training_mode) net_.eval();
      rows = static_cast<double>(net_.forward(x_.slice(lo, lo + kRows)).size(0));
      net_.train();
    }
    Tensor count = nn::full({1}, rows);
    join.all_reduce(count);
    const double expected = static_cast<double>(Active(s) * kRows);
    if (count.item() != expected) {
      throw std::runtime_error(absl::StrCat("evaluation after step ", s, ": the sum counts ",
                                            count.item(), " rows, expected ", expected));
    }
  }

  // The one-rank run's side of Combo::evaluate_in_training_mode after step s:
  // the union of the active ranks' evaluation rows through the module.
  void EvaluateUnion(int s) {
    const int64_t lo = s * global_ + (c_.accum - 1) * world_ * kRows;
    nn::NoGradGuard no_grad;
    nn::AutocastGuard autocast(c_.autocast ? nn::kBFloat16 : nn::kFloat32);
    (void)net_.forward(x_.slice(lo, lo + Active(s) * kRows));
  }

  Tensor Params() const { return Flat(net_.parameters()); }
  Tensor Buffers() const { return Flat(RunningStatistics(net_)); }
  TrainingState State(int64_t* step) {
    return {.model = &net_, .optimizer = plain_.get(), .step = step};
  }

 private:
  Context& ctx_;
  Combo c_;
  int world_;
  bool one_rank_;
  int64_t global_;
  Tensor x_, y_;
  WithSpare<Net> net_;
  std::unique_ptr<DataParallel> dp_;
  std::unique_ptr<ZeroRedundancyOptimizer> zero_;
  std::unique_ptr<optim::Optimizer> plain_;
};

template <typename Net>
Tensor TrainCombo(Context& ctx, const Combo& c, int world, bool one_rank) {
  return ComboRun<Net>(ctx, c, world, one_rank).Train();
}

}  // namespace
}  // namespace tandem::dist

#endif  // TANDEM_TESTS_SPAWN_TRAIN_COMPOSE_NET_H_
