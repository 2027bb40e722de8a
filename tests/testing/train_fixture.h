// The training function that tandem::testing's own tests run: a small MLP
// with DataParallel and SGD on one global batch per step (drawn alike on every
// rank), each rank training on its ctx.split. Knobs make it deliberately wrong
// in one place, so that the tests can check what the library reports.
#ifndef TANDEM_TESTS_TESTING_TRAIN_FIXTURE_H_
#define TANDEM_TESTS_TESTING_TRAIN_FIXTURE_H_

#include <cstdint>
#include <optional>
#include <vector>
#include <string>

#include "absl/status/status.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "testing/run.h"
#include "testing/seed.h"

namespace tandem::testing {

// x: (N, 6) -> (N, 1).
struct Mlp : nn::Module {
  Mlp()
      : l1(register_module("l1", nn::Linear(6, 8))), l2(register_module("l2", nn::Linear(8, 1))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

struct TrainKnobs {
  int steps = 5;
  int64_t global_batch = 12;  // divisible by 1, 2, 3, 4 and 6
  bool data_parallel = true;  // false: no gradient averaging (not equivalent)
  // With more than one rank, after step perturb_step's update: add
  // perturb_by to element perturb_element of parameter perturb_name on
  // perturb_rank (-1: every rank).
  int perturb_step = -1;
  std::string perturb_name;
  int64_t perturb_element = 0;
  int perturb_rank = -1;
  double perturb_by = 0;
  // With more than one rank, stop after this many steps (-1: never).
  int n_rank_steps = -1;
  // With more than one rank, report the loss of this step times 1.01 (-1: none).
  int scale_loss_step = -1;
};

inline void Perturb(Mlp& net, const TrainKnobs& k) {
  nn::NoGradGuard no_grad;
  for (auto& [name, p] : net.named_parameters()) {
    if (name != k.perturb_name) continue;
    std::vector<double> delta(p.numel(), 0.0);
    delta[k.perturb_element] = k.perturb_by;
    nn::Tensor d = nn::from_vector(std::vector<float>(delta.begin(), delta.end()), p.shape());
    p.add_(d);
  }
}

inline absl::Status Train(dist::Context& ctx, StepLog& log, const TrainKnobs& k) {
  const bool many = ctx.world_size() > 1;
  Mlp net;
  std::optional<dist::DataParallel> dp;
  if (k.data_parallel) dp.emplace(net, ctx);
  optim::SGD sgd(net.parameters(), {.lr = 0.05});
  for (int step = 0; step < k.steps; ++step) {
    if (many && step == k.n_rank_steps) break;
    nn::Tensor x, y;
    {
      SameOnEveryRank shared(/*seed=*/11, step);
      x = nn::randn({k.global_batch, 6});
      y = nn::randn({k.global_batch, 1});
    }
    nn::Tensor out = dp ? (*dp)(ctx.split(x)) : net(ctx.split(x));
    nn::Tensor loss = nn::mse_loss(out, ctx.split(y));
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    if (many && step == k.perturb_step && (k.perturb_rank < 0 || k.perturb_rank == ctx.rank())) {
      Perturb(net, k);
    }
    double reported = loss.item();
    if (many && step == k.scale_loss_step) reported *= 1.01;
    RETURN_IF_ERROR(log.EndStep(reported, net));
  }
  return absl::OkStatus();
}

inline TrainingFunction TrainWith(TrainKnobs k) {
  return [k](dist::Context& ctx, StepLog& log) { return Train(ctx, log, k); };
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_TRAIN_FIXTURE_H_
