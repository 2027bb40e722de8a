// DataParallelOptions::global_batch_size on CPU ranks: 3 ranks taking a global
// batch of 64 from DistributedBatchSampler (22, 21 and 21 rows) compute the
// gradient of one rank with batch 64, step after step; without the option
// (the plain mean over ranks) they do not. Equal batches keep the bits of the
// run without it; the uses that cannot work are refused.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "data/sampler.h"
#include "gtest/gtest.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/index.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/sync_bn_net.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;
using ::tandem::testing::ScaledError;

// x: (N, 6) -> (N, 1).
struct Net : nn::Module {
  Net()
      : l1(register_module("l1", nn::Linear(6, 16))), l2(register_module("l2", nn::Linear(16, 1))) {}
  Tensor forward(const Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

constexpr int64_t kRows = 192;  // 3 global batches of 64
constexpr int kSteps = 6;       // two epochs

struct RankRun {
  std::vector<std::vector<float>> grads;  // after each step's backward (reduced)
  std::vector<float> params;              // at the end
  std::vector<int64_t> rows;              // this rank's rows per step
};

// The largest relative difference of `run`'s gradients from `ref`'s over the steps.
double WorstGradientError(const RankRun& run, const RankRun& ref) {
  double worst = 0;
  for (size_t s = 0; s < ref.grads.size(); ++s) {
    worst = std::max(worst, ScaledError(run.grads[s], ref.grads[s]));
  }
  return worst;
}

// `global`: the sampler's global batch; `weigh`: DataParallelOptions::global_batch_size.
// sync_bn: BnNet (tests/spawn/train/sync_bn_net.h) with SyncBatchNorm layers on
// (N, 2, 5, 5) inputs instead of Net.
RankRun Train(Context& ctx, int64_t global, int64_t weigh, bool sync_bn = false) {
  nn::manual_seed(77);
  const Tensor x_all = sync_bn ? nn::randn({kRows, 2, 5, 5}) : nn::randn({kRows, 6});
  const Tensor y_all = nn::randn({kRows, sync_bn ? 2 : 1});
  Net plain_net;
  BnNet bn_net;
  if (sync_bn) ConvertSyncBatchNorm(bn_net);
  nn::Module& net = sync_bn ? static_cast<nn::Module&>(bn_net) : plain_net;
  DataParallel dp(net, ctx, {.global_batch_size = weigh});
  optim::SGD sgd(net.parameters(), {.lr = 0.1, .momentum = 0.9});
  data::DistributedBatchSampler sampler({.dataset_size = kRows,
                                         .global_batch_size = global,
                                         .num_replicas = ctx.world_size(),
                                         .rank = ctx.rank(),
                                         .seed = 3});
  RankRun run;
  for (int step = 0; step < kSteps;) {
    std::optional<std::vector<int64_t>> batch = sampler.next();
    if (!batch.has_value()) {
      sampler.reset();
      continue;
    }
    const int64_t n = static_cast<int64_t>(batch->size());
    const Tensor rows = nn::from_vector<int64_t>(*batch, {n}, {.dtype = nn::kInt64});
    nn::mse_loss(dp(nn::index_select(x_all, rows)), nn::index_select(y_all, rows)).backward();
    std::vector<float> grads;
    for (const Tensor& p : net.parameters()) {
      for (const float v : p.grad().to_vector<float>()) grads.push_back(v);
    }
    run.grads.push_back(std::move(grads));
    run.rows.push_back(n);
    sgd.step();
    sgd.zero_grad();
    ++step;
  }
  run.params = ::tandem::testing::FlatParams(net);
  return run;
}

class GlobalBatchTest : public ::testing::Test {
 protected:
  SpawnOptions options_{.timeout_s = 60, .seed = 7, .console = &console_};
  std::ostringstream console_;
};

TEST_F(GlobalBatchTest, UnevenBatchesGiveTheGradientOfOneRankWithTheGlobalBatch) {
  auto one = spawn([](Context& ctx) { return Train(ctx, 64, 0); }, 1, "cpu", options_);
  auto weighed = spawn([](Context& ctx) { return Train(ctx, 64, 64); }, 3, "cpu", options_);
  auto plain = spawn([](Context& ctx) { return Train(ctx, 64, 0); }, 3, "cpu", options_);
  ASSERT_TRUE(one.ok() && weighed.ok() && plain.ok())
      << one.status() << weighed.status() << plain.status();
  const RankRun& ref = (*one)[0];
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ((*weighed)[r].rows, std::vector<int64_t>(kSteps, r == 0 ? 22 : 21)) << "rank " << r;
    const double worst_grad = WorstGradientError((*weighed)[r], ref);
    const double params = ScaledError((*weighed)[r].params, ref.params);
    std::printf("global batch 64 on 3 ranks (22, 21, 21) vs 1 rank with 64, rank %d: max "
                "relative difference of the gradients over %d steps %.3g, of the final "
                "parameters %.3g\n",
                r, kSteps, worst_grad, params);
    EXPECT_LE(worst_grad, 2e-6) << "rank " << r;
    EXPECT_LE(params, 2e-6) << "rank " << r;
  }
  // The plain mean over ranks weighs rank 0's 22 rows like the others' 21.
  const double unweighed = ScaledError((*plain)[0].grads[0], ref.grads[0]);
  std::printf("the same without global_batch_size (mean over ranks), step 1's gradient: %.3g\n",
              unweighed);
  EXPECT_GT(unweighed, 1e-4);
}

// SyncBatchNorm's gradient sums are weighted as the parameters' gradients are
// (n_r / G): every layer upstream of a SyncBatchNorm gets the gradient of one
// rank with the global batch and BatchNorm.
TEST_F(GlobalBatchTest, UnevenBatchesWithSyncBatchNormGiveTheGradientOfOneRank) {
  auto one = spawn([](Context& ctx) { return Train(ctx, 64, 0, true); }, 1, "cpu", options_);
  auto weighed = spawn([](Context& ctx) { return Train(ctx, 64, 64, true); }, 3, "cpu", options_);
  ASSERT_TRUE(one.ok() && weighed.ok()) << one.status() << weighed.status();
  const RankRun& ref = (*one)[0];
  for (int r = 0; r < 3; ++r) {
    const double worst_grad = WorstGradientError((*weighed)[r], ref);
    const double params = ScaledError((*weighed)[r].params, ref.params);
    std::printf("SyncBatchNorm, global batch 64 on 3 ranks (22, 21, 21) vs 1 rank with 64, rank "
                "%d: max relative difference of the gradients over %d steps %.3g, of the final "
                "parameters %.3g\n",
                r, kSteps, worst_grad, params);
    EXPECT_LE(worst_grad, 2e-6) << "rank " << r;
    EXPECT_LE(params, 2e-6) << "rank " << r;
  }
}

// One step of BnNet with SyncBatchNorm layers, rank r taking shares[r] rows of
// 12 (one rank: all 12, with BatchNorm); `micro` > 1: that many no_sync()
// micro-batches, each the same part of every rank's rows (micro-batch j of
// rank r: its j-th slice of shares[r] / micro rows), the loss scaled by
// 1 / micro. Returns every gradient.
std::vector<float> SyncBnStep(Context& ctx, const std::vector<int64_t>& shares, int micro) {
  nn::manual_seed(77);
  const Tensor x_all = nn::randn({12, 2, 5, 5});
  const Tensor y_all = nn::randn({12, 2});
  BnNet net;
  if (ctx.world_size() > 1) ConvertSyncBatchNorm(net);
  DataParallel dp(net, ctx, {.global_batch_size = ctx.world_size() > 1 ? 12 : 0});
  for (int j = 0; j < micro; ++j) {
    // The one rank's micro-batch j: the union of the ranks' micro-batches j, in rank order.
    std::vector<int64_t> rows;
    int64_t begin = 0;
    for (int r = 0; r < static_cast<int>(shares.size()); ++r) {
      const int64_t part = shares[r] / micro;
      if (ctx.world_size() == 1 || r == ctx.rank()) {
        for (int64_t i = begin + j * part; i < begin + (j + 1) * part; ++i) rows.push_back(i);
      }
      begin += shares[r];
    }
    const Tensor index = nn::from_vector<int64_t>(rows, {static_cast<int64_t>(rows.size())},
                                                  {.dtype = nn::kInt64});
    std::optional<DataParallel::NoSyncGuard> accumulate;
    if (j + 1 < micro) accumulate.emplace(&dp);
    Tensor loss = nn::mse_loss(dp(nn::index_select(x_all, index)), nn::index_select(y_all, index));
    (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
  }
  std::vector<float> grads;
  for (const Tensor& p : net.parameters()) {
    for (const float v : p.grad().to_vector<float>()) grads.push_back(v);
  }
  return grads;
}

// Every rank weighs SyncBatchNorm's gradient sums, also one whose share is
// G / N among uneven ones (4 of 12 next to 5 and 3), and each no_sync()
// micro-batch's sums are weighed by its own rows (shares 8, 2, 2 in two
// micro-batches of 4, 1, 1), on the first step as on any.
TEST_F(GlobalBatchTest, SyncBatchNormWeighsEveryRankAndEveryMicroBatch) {
  struct Case {
    std::vector<int64_t> shares;
    int micro;
  };
  for (const Case& c : {Case{{4, 5, 3}, 1}, Case{{6, 4, 2}, 1}, Case{{8, 2, 2}, 2},
                        Case{{4, 4, 4}, 2}}) {
    auto one = spawn([&](Context& ctx) { return SyncBnStep(ctx, c.shares, c.micro); }, 1, "cpu",
                     options_);
    auto three = spawn([&](Context& ctx) { return SyncBnStep(ctx, c.shares, c.micro); }, 3, "cpu",
                       options_);
    ASSERT_TRUE(one.ok() && three.ok()) << one.status() << three.status();
    for (int r = 0; r < 3; ++r) {
      const double error = ScaledError((*three)[r], (*one)[0]);
      std::printf("SyncBatchNorm, shares %lld, %lld, %lld of 12 in %d micro-batch(es), rank %d vs "
                  "one rank: gradients within %.3g\n",
                  static_cast<long long>(c.shares[0]), static_cast<long long>(c.shares[1]),
                  static_cast<long long>(c.shares[2]), c.micro, r, error);
      EXPECT_LE(error, 2e-6) << "rank " << r;
    }
  }
}

TEST_F(GlobalBatchTest, EqualBatchesKeepTheBitsOfThePlainMean) {
  auto weighed = spawn([](Context& ctx) { return Train(ctx, 63, 63); }, 3, "cpu", options_);
  auto plain = spawn([](Context& ctx) { return Train(ctx, 63, 0); }, 3, "cpu", options_);
  ASSERT_TRUE(weighed.ok() && plain.ok()) << weighed.status() << plain.status();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ((*weighed)[r].rows, std::vector<int64_t>(kSteps, 21));
    EXPECT_EQ((*weighed)[r].params, (*plain)[r].params) << "rank " << r;
  }
}

TEST_F(GlobalBatchTest, RefusesWhatCannotWork) {
  auto errors = spawn([](Context& ctx) {
    Net net;
    std::vector<std::string> e;
    e.push_back(::tandem::testing::ErrorOf(
        [&] { DataParallel dp(net, ctx, {.global_batch_size = -2}); }));
    e.push_back(::tandem::testing::ErrorOf([&] {
      DataParallel dp(net, ctx, {.reduce_in_backward = false, .global_batch_size = 8});
    }));
    DataParallel dp(net, ctx, {.global_batch_size = 8});
    e.push_back(::tandem::testing::ErrorOf([&] { auto join = dp.join(); }));
    e.push_back(::tandem::testing::ErrorOf([&] { dp(nn::randn({9, 6})); }));
    e.push_back(::tandem::testing::ErrorOf([&] {
      nn::NoGradGuard evaluation;  // not a step: any number of rows
      dp(nn::randn({100, 6}));
    }));
    {
      auto accumulate = dp.no_sync();
      dp(nn::randn({5, 6}));
    }
    e.push_back(::tandem::testing::ErrorOf([&] { dp(nn::randn({4, 6})); }));
    // A step abandoned by an exception inside no_sync(): its rows do not carry
    // into the next step (8 rows then pass).
    e.push_back(::tandem::testing::ErrorOf([&] {
      auto accumulate = dp.no_sync();
      dp(nn::randn({5, 6}));
      throw Error("abandoned");
    }));
    e.push_back(::tandem::testing::ErrorOf([&] { dp(nn::randn({8, 6})); }));
    return e;
  }, 1, "cpu", options_);
  ASSERT_TRUE(errors.ok()) << errors.status();
  const std::vector<std::string>& e = (*errors)[0];
  EXPECT_NE(e[0].find("negative global_batch_size -2"), std::string::npos) << e[0];
  EXPECT_NE(e[1].find("global_batch_size 8 weighs the gradients reduced in backward"),
            std::string::npos)
      << e[1];
  EXPECT_NE(e[2].find("join() with DataParallelOptions::global_batch_size 8"), std::string::npos)
      << e[2];
  EXPECT_NE(e[3].find("rank 0's step has 9 rows, more than global_batch_size 8"),
            std::string::npos)
      << e[3];
  EXPECT_EQ(e[4], "");
  EXPECT_NE(e[5].find("step has 9 rows"), std::string::npos) << e[5];  // 5 accumulated + 4
  EXPECT_NE(e[6].find("abandoned"), std::string::npos) << e[6];
  EXPECT_EQ(e[7], "");
}

}  // namespace
}  // namespace tandem::dist
