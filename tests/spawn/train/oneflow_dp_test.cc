// The programs of OneFlow's data-parallel chapter on CPU ranks: its
// DDP regression example in-process, and SBP-style data parallelism with
// Context::split (every rank loads the global batch and trains on its part).
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "data/sampler.h"
#include "gtest/gtest.h"
#include "nn/nn.h"
#include "optim/sgd.h"
#include "spawn/train/data_parallel.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/dp_models.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

class OneFlowDpTest : public ::testing::Test {
 protected:
  SpawnOptions options_{.seed = 7, .console = &console_};
  std::ostringstream console_;
};

// The sampler's rows for rank r of a global batch of n, as split must give them.
std::vector<int64_t> SamplerShard(int64_t n, int world, int rank) {
  if (n == 0) return {};
  const int64_t per_rank = (n + world - 1) / world;
  data::DistributedBatchSampler sampler(n, per_rank, world, rank, /*shuffle=*/false);
  EXPECT_EQ(sampler.num_batches(), 1) << "n=" << n << " N=" << world;
  std::optional<std::vector<int64_t>> batch = sampler.next();
  return batch ? *batch : std::vector<int64_t>{};
}

const std::vector<int64_t> kSizes = {0, 1, 2, 3, 5, 7, 8, 10, 64, 101};

TEST_F(OneFlowDpTest, SplitPartsAreTheDistributedBatchSamplerShards) {
  for (int world : {1, 2, 3, 4, 8}) {
    auto parts = spawn([](Context& ctx) {
      std::vector<std::vector<int64_t>> out;
      for (int64_t n : kSizes) {
        std::vector<int64_t> rows(static_cast<size_t>(n));
        std::iota(rows.begin(), rows.end(), 0);
        out.push_back(ctx.split(nn::from_vector(rows, {n})).to_vector<int64_t>());
      }
      return out;
    }, world, "cpu", options_);
    ASSERT_TRUE(parts.ok()) << parts.status();
    for (int r = 0; r < world; ++r) {
      for (size_t k = 0; k < kSizes.size(); ++k) {
        EXPECT_EQ((*parts)[r][k], SamplerShard(kSizes[k], world, r))
            << "n=" << kSizes[k] << " N=" << world << " rank " << r;
      }
    }
  }
}

// x: (2, n, 3) holding 0, 1, ...: along dim 1 (or -2) rank r gets x[:, rows, :]
// with the sampler's rows; gradients flow back to the rows taken (twice for a
// wrapped row).
TEST_F(OneFlowDpTest, SplitAlongAnInnerDimGathersTheSamplersRows) {
  for (int world : {2, 3}) {
    for (int64_t n : {4, 5, 7}) {
      auto result = spawn([n](Context& ctx) {
        Tensor x = nn::arange(2 * n * 3, {.dtype = nn::kFloat64}).reshape({2, n, 3});
        x.set_requires_grad(true);
        Tensor part = ctx.split(x, 1);
        EXPECT_EQ(part.to_vector<double>(), ctx.split(x, -2).to_vector<double>());
        nn::sum(part).backward();
        return std::make_pair(part, x.grad());
      }, world, "cpu", options_);
      ASSERT_TRUE(result.ok()) << result.status();
      for (int r = 0; r < world; ++r) {
        const std::vector<int64_t> rows = SamplerShard(n, world, r);
        const int64_t b = static_cast<int64_t>(rows.size());
        const auto& [part, grad] = (*result)[r];
        ASSERT_EQ(part.shape(), (nn::Shape{2, b, 3}));
        std::vector<double> want, want_grad(static_cast<size_t>(2 * n * 3), 0.0);
        for (int64_t o = 0; o < 2; ++o) {
          for (int64_t row : rows) {
            for (int64_t i = 0; i < 3; ++i) {
              want.push_back(static_cast<double>((o * n + row) * 3 + i));
              want_grad[static_cast<size_t>((o * n + row) * 3 + i)] += 1.0;
            }
          }
        }
        EXPECT_EQ(part.to_vector<double>(), want) << "n=" << n << " N=" << world << " rank " << r;
        EXPECT_EQ(grad.to_vector<double>(), want_grad) << "n=" << n << " N=" << world;
      }
    }
  }
}

TEST_F(OneFlowDpTest, SplitBadDimIsAnErrorNamingItAndTheShape) {
  auto messages = spawn([](Context& ctx) {
    std::vector<std::string> out;
    for (auto call : {+[](Context& c) { c.split(nn::zeros({4, 3}), 2); },
                      +[](Context& c) { c.split(nn::zeros({4, 3}), -3); },
                      +[](Context& c) { c.split(nn::scalar_tensor(1.0)); },
                      +[](Context& c) { c.split(Tensor()); }}) {
      try {
        call(ctx);
        out.push_back("no error");
      } catch (const Error& e) {
        out.push_back(e.what());
      }
    }
    return out;
  }, 2, "cpu", options_);
  ASSERT_TRUE(messages.ok()) << messages.status();
  const std::vector<std::string>& m = (*messages)[1];
  EXPECT_NE(m[0].find("Context::split: dim 2 is out of range for a tensor of shape (4, 3)"),
            std::string::npos) << m[0];
  EXPECT_NE(m[0].find("expected -2..1"), std::string::npos) << m[0];
  EXPECT_NE(m[1].find("dim -3 is out of range"), std::string::npos) << m[1];
  EXPECT_NE(m[2].find("0-dim tensor"), std::string::npos) << m[2];
  EXPECT_NE(m[3].find("undefined"), std::string::npos) << m[3];
}

// The single-device loop with ctx.split on the global batch: N ranks end where
// one rank on the whole batch ends.
std::vector<float> TrainOnSplit(Context& ctx, int64_t global_batch, int steps) {
  LinearNet net;  // rank 0's init (seed 7, stream 0) is the same for every world size
  DataParallel dp(net, ctx, {.bucket_bytes = 1024, .first_bucket_bytes = 256});
  for (int step = 0; step < steps; ++step) {
    nn::manual_seed(1000 + step);  // the same global batch on every rank
    Tensor x = nn::randn({global_batch, 10});
    Tensor y = nn::randn({global_batch, 1});
    EXPECT_EQ(ctx.split(x).size(0), global_batch / ctx.world_size());  // not the whole batch
    Tensor loss = nn::mse_loss(dp(ctx.split(x)), ctx.split(y));
    loss.backward();
    SgdStep(dp.parameters(), 0.1);
  }
  return FlatParams(net);
}

TEST_F(OneFlowDpTest, SplitTrainingMatchesOneRankOnTheGlobalBatch) {
  const int64_t global_batch = 12;
  auto one = spawn([&](Context& ctx) { return TrainOnSplit(ctx, global_batch, 5); }, 1, "cpu",
                   options_);
  ASSERT_TRUE(one.ok()) << one.status();
  for (int world : {2, 3, 4}) {
    auto many = spawn([&](Context& ctx) { return TrainOnSplit(ctx, global_batch, 5); }, world,
                      "cpu", options_);
    ASSERT_TRUE(many.ok()) << many.status();
    for (int r = 0; r < world; ++r) ExpectClose((*many)[r], (*one)[0], "split", 1e-6);
  }
}

// OneFlow's DDP example: w (2x1) from zero; rank 0's x = [[1,2],[2,3]], y =
// [[8],[13]], rank 1's x = [[4,6],[3,1]], y = [[26],[9]]; MSE with reduction sum,
// SGD lr 0.01, 500 iterations. Returns {w0, w1, first loss}. With `global`
// every rank loads all four samples and takes its part with ctx.split.
std::vector<float> Regression(Context& ctx, bool global) {
  struct Model : nn::Module {
    Model() : w(register_parameter("w", nn::zeros({2, 1}))) {}
    Tensor forward(const Tensor& x) override { return nn::matmul(x, w); }
    Tensor w;
  };
  Tensor x, y;
  if (global) {
    x = ctx.split(nn::from_vector(std::vector<float>{1, 2, 2, 3, 4, 6, 3, 1}, {4, 2}));
    y = ctx.split(nn::from_vector(std::vector<float>{8, 13, 26, 9}, {4, 1}));
  } else {
    const bool rank0 = ctx.rank() == 0;
    x = nn::from_vector(rank0 ? std::vector<float>{1, 2, 2, 3} : std::vector<float>{4, 6, 3, 1},
                        {2, 2});
    y = nn::from_vector(rank0 ? std::vector<float>{8, 13} : std::vector<float>{26, 9}, {2, 1});
  }
  Model model;
  DataParallel dp(model, ctx);
  nn::MSELoss loss_fn(nn::Reduction::kSum);
  optim::SGD sgd(dp.parameters(), {.lr = 0.01});
  float first_loss = 0;
  for (int i = 0; i < 500; ++i) {
    Tensor loss = loss_fn(dp(x), y);
    if (i == 0) first_loss = loss.item<float>();
    loss.backward();
    sgd.step();
    sgd.zero_grad();
  }
  std::vector<float> out = model.w.to_vector<float>();
  out.push_back(first_loss);
  return out;
}

TEST_F(OneFlowDpTest, DdpRegressionEndsAtTwoThreeOnEveryRank) {
  auto local = spawn([](Context& ctx) { return Regression(ctx, false); }, 2, "cpu", options_);
  auto split = spawn([](Context& ctx) { return Regression(ctx, true); }, 2, "cpu", options_);
  ASSERT_TRUE(local.ok() && split.ok()) << local.status() << split.status();
  const float first_loss[2] = {8 * 8 + 13 * 13, 26 * 26 + 9 * 9};  // w = 0: sum of y^2
  for (int r = 0; r < 2; ++r) {
    const std::vector<float>& w = (*local)[r];
    EXPECT_NEAR(w[0], 2.0f, 1e-4) << "rank " << r;
    EXPECT_NEAR(w[1], 3.0f, 1e-4) << "rank " << r;
    EXPECT_EQ(w[2], first_loss[r]) << "rank " << r;
    EXPECT_EQ((*split)[r], w) << "rank " << r << ": ctx.split of the global data differs";
  }
}

}  // namespace
}  // namespace tandem::dist
