// The models and loop of DataParallel::join()'s equivalence tests, shared by the
// in-process tests (join_test.cc) and the multi-process ones
// (sync_bn_join_mpi_test.cc): ranks with different numbers of batches of
// unequal size train as one rank on the union of each step's batches.
#ifndef TANDEM_TESTS_SPAWN_TRAIN_JOIN_NET_H_
#define TANDEM_TESTS_SPAWN_TRAIN_JOIN_NET_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nn/nn.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/zero_redundancy_optimizer.h"
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
// ranks' rows of a step are contiguous, in rank order. even: every rank 10
// steps of 2 rows (the run that needs no join).
inline int StepsOf(int rank, int world, bool even = false) {
  return rank == world - 1 && !even ? 7 : 10;
}
inline int64_t BatchRows(int rank, int step, bool even = false) {
  return even ? 2 : 1 + (rank + step) % 2;
}

struct Plan {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> rows;  // [step][rank]: [lo, hi)
  int64_t total = 0;
};
inline Plan MakePlan(int world, bool even = false) {
  Plan plan;
  const int steps = StepsOf(0, world, even);
  for (int s = 0; s < steps; ++s) {
    plan.rows.emplace_back();
    for (int r = 0; r < world; ++r) {
      const int64_t n = s < StepsOf(r, world, even) ? BatchRows(r, s, even) : 0;
      plan.rows.back().push_back({plan.total, plan.total + n});
      plan.total += n;
    }
  }
  return plan;
}

struct JoinRun {
  Tensor params, buffers;
  std::vector<double> step_samples;  // the step's sample count, summed through the guard
  // The optimizer's state tensors by state-dict key (ZeRO: gathered into the
  // unsharded layout after the join); none for the loop's own SGD.
  std::map<std::string, Tensor> state;
  std::vector<double> norms;  // with clip: each step's gradient norm before clipping
};

struct JoinSetup {
  bool one_rank = false;  // a single rank on each step's union (no join)
  bool sync = false;      // ConvertSyncBatchNorm first
  bool even = false;      // MakePlan's even plan
  bool join = true;       // false: the ranks' loop without a join guard (even plans only)
  // "" the loop's own SGD (lr 0.1); "momentum": optim::SGD (lr 0.05, momentum
  // 0.9); "adam": optim::Adam (lr 0.01); sharded by ZeroRedundancyOptimizer
  // when zero (one_rank: never sharded).
  std::string optimizer;
  bool zero = false;
  double clip = 0;        // > 0: the gradients' global norm clipped to it before each step
  CommHook hook;          // DataParallelOptions::comm_hook (one_rank: none)
};

inline std::unique_ptr<optim::Optimizer> MakeJoinOptimizer(const std::string& name,
                                                           std::vector<Tensor> params) {
  if (name == "momentum") {
    return std::make_unique<optim::SGD>(std::move(params),
                                        optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  }
  TANDEM_CHECK(name == "adam", "join_net.h: no optimizer '", name, "'");
  return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = 0.01});
}

// Trains Net per `setup` on world ranks (or one): the rank's parameters and
// running statistics at the end, and each step's sample count.
template <typename Net>
JoinRun TrainJoin(Context& ctx, int world, const JoinSetup& setup) {
  const Plan plan = MakePlan(world, setup.even);
  nn::manual_seed(77);
  const Tensor x_all = nn::add_scalar(nn::randn({plan.total, 2, 5, 5}), 0.5);
  const Tensor y_all = nn::randn({plan.total, 2});
  Net net;
  if (setup.sync) ConvertSyncBatchNorm(net);
  DataParallelOptions options;
  if (setup.zero || setup.hook) {
    // Several buckets (ZeRO shards each), reduced as they fill.
    options = {.bucket_bytes = 256, .first_bucket_bytes = 128};
    if (!setup.one_rank) options.comm_hook = setup.hook;
  }
  DataParallel dp(net, ctx, options);
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> plain;
  if (setup.zero && !setup.one_rank) {
    zero = std::make_unique<ZeroRedundancyOptimizer>(dp, [&](std::vector<Tensor> shard) {
      return MakeJoinOptimizer(setup.optimizer, std::move(shard));
    });
  } else if (!setup.optimizer.empty()) {
    plain = MakeJoinOptimizer(setup.optimizer, dp.parameters());
  }
  JoinRun run;
  auto step = [&](int64_t lo, int64_t hi) {
    if (zero) zero->zero_grad();
    if (plain) plain->zero_grad();
    Tensor loss = nn::mse_loss(dp(x_all.slice(lo, hi)), y_all.slice(lo, hi));
    loss.backward();
    if (setup.clip > 0) {
      run.norms.push_back(zero ? zero->clip_grad_norm_(setup.clip)
                               : optim::clip_grad_norm_(dp.parameters(), setup.clip).item());
    }
    if (zero) {
      zero->step();
    } else if (plain) {
      plain->step();
    } else {
      nn::NoGradGuard no_grad;
      for (Tensor p : dp.parameters()) {
        p.add_(p.grad(), -0.1);
        p.set_grad(Tensor());
      }
    }
  };
  if (setup.one_rank) {
    for (const auto& ranks : plan.rows) step(ranks.front().first, ranks.back().second);
  } else if (!setup.join) {
    TANDEM_CHECK(setup.even, "join_net.h: uneven steps need the join");
    for (int s = 0; s < StepsOf(ctx.rank(), world, true); ++s) {
      step(plan.rows[s][ctx.rank()].first, plan.rows[s][ctx.rank()].second);
    }
  } else {
    auto join = dp.join();
    for (int s = 0; s < StepsOf(ctx.rank(), world, setup.even); ++s) {
      const auto [lo, hi] = plan.rows[s][ctx.rank()];
      step(lo, hi);
      Tensor n = nn::full({1}, static_cast<double>(hi - lo));
      join.all_reduce(n);
      run.step_samples.push_back(n.item());
    }
    ThrowIfError(join.finish(), "DataParallel::join: ");
  }
  run.params = Flat(net.parameters());
  run.buffers = Flat(RunningStatistics(net));
  if (zero || plain) {
    for (const auto& [key, t] : (zero ? zero->state_dict() : plain->state_dict()).tensors) {
      run.state[key] = t;
    }
  }
  return run;
}

// world ranks with join (or, one_rank, a single rank on each step's union);
// sync: ConvertSyncBatchNorm first. SGD, lr 0.1.
template <typename Net>
JoinRun TrainUneven(Context& ctx, int world, bool one_rank, bool sync) {
  return TrainJoin<Net>(ctx, world, {.one_rank = one_rank, .sync = sync});
}

}  // namespace
}  // namespace tandem::dist

#endif  // TANDEM_TESTS_SPAWN_TRAIN_JOIN_NET_H_
