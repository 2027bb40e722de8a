// The models and the training loop of DataParallel's equivalence tests, shared by
// the single-process tests (data_parallel_test.cc) and the multi-process ones
// (mpi_test.cc): N ranks on per-rank batch B must end where 1 rank on N*B ends.
#ifndef TANDEM_TESTS_SPAWN_TRAIN_DP_MODELS_H_
#define TANDEM_TESTS_SPAWN_TRAIN_DP_MODELS_H_

#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "nn/autocast.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "spawn/train/data_parallel.h"
#include "spawn/spawn.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

struct LinearNet : nn::Module {
  LinearNet()
      : l1(register_module("l1", nn::Linear(10, 10))), l2(register_module("l2", nn::Linear(10, 1))) {}
  Tensor forward(const Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

// x: (N, 1, 6, 6) -> (N, 2).
struct ConvNet : nn::Module {
  ConvNet()
      : conv(register_module("conv", nn::Conv2d(1, 3, 3))),
        fc(register_module("fc", nn::Linear(3 * 4 * 4, 2))) {}
  Tensor forward(const Tensor& x) override { return fc(nn::relu(conv(x)).flatten(1)); }
  nn::Conv2d conv;
  nn::Linear fc;
};

using ::tandem::testing::FlatParams;

void SgdStep(const std::vector<Tensor>& params, double lr) {
  nn::NoGradGuard no_grad;
  for (Tensor p : params) {
    p.add_(p.grad(), -lr);
    p.set_grad(Tensor());  // like optim's zero_grad
  }
}

// K steps of SGD; rank r uses rows [r*B, (r+1)*B) of each step's batch of world*B.
// bf16: forward and loss under nn::AutocastGuard(kBFloat16).
template <typename Net>
std::vector<float> Train(Context& ctx, nn::Shape sample, int64_t out_dim, int64_t per_rank,
                         int steps, bool bf16 = false) {
  Net net;  // rank 0's init (seed 7, stream 0) is the same for every world size
  DataParallel dp(net, ctx, {.bucket_bytes = 1024, .first_bucket_bytes = 256});
  const int64_t batch = per_rank * ctx.world_size();
  for (int step = 0; step < steps; ++step) {
    nn::manual_seed(1000 + step);  // the same full batch on every rank
    nn::Shape xs = sample;
    xs.insert(xs.begin(), batch);
    Tensor x = nn::randn(xs);
    Tensor y = nn::randn({batch, out_dim});
    const int64_t lo = ctx.rank() * per_rank;
    Tensor loss;
    {
      nn::AutocastGuard autocast(bf16 ? nn::kBFloat16 : nn::kFloat32);
      loss = nn::mse_loss(dp(x.slice(lo, lo + per_rank)), y.slice(lo, lo + per_rank));
    }
    loss.backward();
    SgdStep(dp.parameters(), 0.1);
  }
  return FlatParams(net);
}

void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, const char* what,
                 double rtol = 1e-5) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], rtol * std::max(1.0f, std::fabs(b[i]))) << what << " element " << i;
  }
}

}  // namespace
}  // namespace tandem::dist

#endif  // TANDEM_TESTS_SPAWN_TRAIN_DP_MODELS_H_
