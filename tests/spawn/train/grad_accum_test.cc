// Gradient accumulation (what --grad_accum_steps does in the programs): K
// micro-batches of B per rank, the first K-1 under DataParallel::no_sync() and
// each loss divided by K, step like one batch of K*B per rank, on 1 to 3 ranks,
// with SGD and Adam, to 1e-6 relative.
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>

#include "gtest/gtest.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/dp_models.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

std::unique_ptr<optim::Optimizer> MakeOptimizer(bool adam, std::vector<Tensor> params) {
  if (adam) return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = 1e-2});
  return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
}

// `steps` optimizer steps of ConvNet; each step's global batch holds
// world * micro * per_micro rows; rank r takes its contiguous share and runs it
// as `micro` micro-batches of per_micro rows.
std::vector<float> TrainAccumulating(Context& ctx, int micro, int64_t per_micro, int steps,
                                     bool adam) {
  ConvNet net;
  DataParallel dp(net, ctx, {.bucket_bytes = 512, .first_bucket_bytes = 256});
  std::unique_ptr<optim::Optimizer> optimizer = MakeOptimizer(adam, net.parameters());
  const int64_t per_rank = micro * per_micro;
  const int64_t batch = per_rank * ctx.world_size();
  for (int step = 0; step < steps; ++step) {
    nn::manual_seed(2000 + step);  // the same global batch on every rank
    Tensor x = nn::randn({batch, 1, 6, 6});
    Tensor y = nn::randn({batch, 2});
    optimizer->zero_grad();
    for (int i = 0; i < micro; ++i) {
      const int64_t lo = ctx.rank() * per_rank + i * per_micro;
      std::optional<DataParallel::NoSyncGuard> no_sync;
      if (i + 1 < micro) no_sync.emplace(&dp);
      Tensor loss = nn::mse_loss(dp(x.slice(lo, lo + per_micro)), y.slice(lo, lo + per_micro));
      (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
    }
    optimizer->step();
  }
  return testing::FlatParams(net);
}

double MaxRelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return err / scale;
}

// (ranks, micro-batches K, Adam)
class GradAccumTest : public ::testing::TestWithParam<std::tuple<int, int, bool>> {
 protected:
  std::ostringstream console_;
  SpawnOptions options_{.seed = 7, .console = &console_};
};

TEST_P(GradAccumTest, KMicroBatchesOfBStepLikeOneBatchOfKB) {
  // Named, not structured bindings: the lambdas capture them (clang before 16
  // cannot capture a structured binding).
  const auto ranks = std::get<0>(GetParam());
  const auto k = std::get<1>(GetParam());
  const auto adam = std::get<2>(GetParam());
  constexpr int64_t kPerMicro = 3;
  constexpr int kSteps = 4;
  auto accumulated = spawn(
      [&](Context& ctx) { return TrainAccumulating(ctx, k, kPerMicro, kSteps, adam); }, ranks,
      "cpu", options_);
  auto whole = spawn(
      [&](Context& ctx) { return TrainAccumulating(ctx, 1, k * kPerMicro, kSteps, adam); }, ranks,
      "cpu", options_);
  ASSERT_TRUE(accumulated.ok()) << accumulated.status();
  ASSERT_TRUE(whole.ok()) << whole.status();
  for (int r = 0; r < ranks; ++r) {
    // Every rank holds the same model, and it is the one-batch model.
    testing::ExpectSameBits((*accumulated)[r], (*accumulated)[0], "ranks agree");
    const double error = MaxRelativeError((*accumulated)[r], (*whole)[0]);
    EXPECT_LE(error, 1e-6) << ranks << " ranks, " << k << " micro-batches, "
                           << (adam ? "Adam" : "momentum SGD");
    if (r == 0) {
      std::ostringstream text;
      text << error;  // std::to_string's 6 decimals would print 0 for the 1e-8s this sees
      RecordProperty("max_relative_error", text.str());
    }
  }
  // The steps moved the model: a comparison of two untouched models proves nothing.
  auto initial = spawn([](Context&) { ConvNet net; return testing::FlatParams(net); }, 1, "cpu",
                       options_);
  ASSERT_TRUE(initial.ok()) << initial.status();
  EXPECT_GT(MaxRelativeError((*initial)[0], (*whole)[0]), 1e-3);
}

// Without the division by K the accumulated gradient is K times too large: the
// comparison above must see that, or it could not fail.
TEST(GradAccumNegativeTest, UndividedLossDoesNotMatch) {
  std::ostringstream console;
  SpawnOptions options{.seed = 7, .console = &console};
  auto run = [&](int micro, int64_t per_micro, bool divide) {
    return spawn(
        [&](Context& ctx) {
          ConvNet net;
          DataParallel dp(net, ctx);
          optim::SGD sgd(net.parameters(), {.lr = 0.1});
          nn::manual_seed(2000);
          Tensor x = nn::randn({micro * per_micro * 2, 1, 6, 6}), y = nn::randn({micro * per_micro * 2, 2});
          for (int i = 0; i < micro; ++i) {
            const int64_t lo = ctx.rank() * micro * per_micro + i * per_micro;
            std::optional<DataParallel::NoSyncGuard> no_sync;
            if (i + 1 < micro) no_sync.emplace(&dp);
            Tensor loss = nn::mse_loss(dp(x.slice(lo, lo + per_micro)), y.slice(lo, lo + per_micro));
            (divide ? loss / static_cast<double>(micro) : loss).backward();
          }
          sgd.step();
          return testing::FlatParams(net);
        },
        2, "cpu", options);
  };
  auto whole = run(1, 6, true), undivided = run(2, 3, false);
  ASSERT_TRUE(whole.ok() && undivided.ok()) << whole.status() << undivided.status();
  EXPECT_GT(MaxRelativeError((*undivided)[0], (*whole)[0]), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(RanksMicroBatchesOptimizers, GradAccumTest,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(2, 4),
                                            ::testing::Bool()));

}  // namespace
}  // namespace tandem::dist
