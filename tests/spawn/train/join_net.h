// The models and loop of DataParallel::join()'s equivalence tests, shared by the
// in-process tests (join_test.cc) and the multi-process ones
// (sync_bn_join_mpi_test.cc): ranks with different numbers of batches of
// unequal size train as one rank on the union of each step's batches.
#ifndef TANDEM_TESTS_SPAWN_TRAIN_JOIN_NET_H_
#define TANDEM_TESTS_SPAWN_TRAIN_JOIN_NET_H_

#include <utility>
#include <vector>

#include "nn/nn.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/sync_bn_net.h"

namespace tandem::dist {
namespace {

// x: (N, 2, 5, 5) -> (N, 2), no BatchNorm.
struct PlainNet : nn::Module {
  PlainNet()
      : conv(register_module("conv", nn::Conv2d(2, 3, 3))),
        fc(register_module("fc", nn::Linear(3 * 3 * 3, 2))) {}
  Tensor forward(const Tensor& x) override { return fc(nn::relu(conv(x)).flatten(1)); }
  nn::Conv2d conv;
  nn::Linear fc;
};

// Rank r runs StepsOf(r, world) steps: 10, and 7 for the last rank (3 ranks:
// 10, 10, 7). Step s of rank r holds BatchRows(r, s) rows (1 or 2); the active
// ranks' rows of a step are contiguous, in rank order.
inline int StepsOf(int rank, int world) { return rank == world - 1 ? 7 : 10; }
inline int64_t BatchRows(int rank, int step) { return 1 + (rank + step) % 2; }

struct Plan {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows;  // [step][rank]: [lo, hi)
  int64_t total = 0;
};
inline Plan MakePlan(int world) {
  Plan plan;
  const int steps = StepsOf(0, world);
  for (int s = 0; s < steps; ++s) {
    plan.rows.emplace_back();
    for (int r = 0; r < world; ++r) {
      const int64_t n = s < StepsOf(r, world) ? BatchRows(r, s) : 0;
      plan.rows.back().push_back({plan.total, plan.total + n});
      plan.total += n;
    }
  }
  return plan;
}

struct JoinRun {
  Tensor params, buffers;
  std::vector<double> step_samples;  // the step's sample count, summed through the guard
};

// world ranks with join (or, one_rank, a single rank on each step's union);
// sync: ConvertSyncBatchNorm first. SGD, lr 0.1.
template <typename Net>
JoinRun TrainUneven(Context& ctx, int world, bool one_rank, bool sync) {
  const Plan plan = MakePlan(world);
  nn::manual_seed(77);
  const Tensor x_all = nn::add_scalar(nn::randn({plan.total, 2, 5, 5}), 0.5);
  const Tensor y_all = nn::randn({plan.total, 2});
  Net net;
  if (sync) ConvertSyncBatchNorm(net);
  DataParallel dp(net, ctx);
  JoinRun run;
  auto step = [&](int64_t lo, int64_t hi) {
    Tensor loss = nn::mse_loss(dp(x_all.slice(lo, hi)), y_all.slice(lo, hi));
    loss.backward();
    nn::NoGradGuard no_grad;
    for (Tensor p : dp.parameters()) {
      p.add_(p.grad(), -0.1);
      p.set_grad(Tensor());
    }
  };
  if (one_rank) {
    for (const auto& ranks : plan.rows) step(ranks.front().first, ranks.back().second);
  } else {
    auto join = dp.join();
    for (int s = 0; s < StepsOf(ctx.rank(), world); ++s) {
      const auto [lo, hi] = plan.rows[s][ctx.rank()];
      step(lo, hi);
      Tensor n = nn::full({1}, static_cast<double>(hi - lo));
      join.all_reduce(n);
      run.step_samples.push_back(n.item());
    }
  }
  run.params = Flat(net.parameters());
  run.buffers = Flat(RunningStatistics(net));
  return run;
}

}  // namespace
}  // namespace tandem::dist

#endif  // TANDEM_TESTS_SPAWN_TRAIN_JOIN_NET_H_
