// dist::SyncBatchNorm2d / ConvertSyncBatchNorm on in-process CPU ranks: N ranks x
// batch B equal 1 rank x batch N*B with BatchNorm (losses, gradients, running
// statistics), unequal slices weigh by their counts, a float64 gradient check
// across ranks, a world of one is BatchNorm bit for bit, and mismatched layers are
// one error rather than a hang.
#include "spawn/train/sync_batch_norm.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/nn.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/sync_bn_net.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using ::tandem::testing::ScaledError;

class SyncBatchNormTest : public ::testing::Test {
 protected:
  SpawnOptions options_{.timeout_s = 60, .seed = 7, .console = &console_};
  std::ostringstream console_;
};

double LossError(const BnRun& a, const BnRun& b) {
  double worst = 0;
  for (size_t i = 0; i < a.losses.size(); ++i) {
    worst = std::max(worst, std::fabs(a.losses[i] - b.losses[i]) / std::fabs(b.losses[i]));
  }
  return worst;
}

TEST_F(SyncBatchNormTest, NRanksMatchOneRankOnTheWholeBatch) {
  constexpr int64_t kPerRank = 3;
  constexpr int kSteps = 4;
  for (int world : {2, 3}) {
    auto one = spawn([&](Context& ctx) { return TrainBn(ctx, kPerRank * world, kSteps, false); },
                     1, "cpu", options_);
    auto many = spawn([&](Context& ctx) { return TrainBn(ctx, kPerRank, kSteps, true); }, world,
                      "cpu", options_);
    ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
    const BnRun& ref = (*one)[0];
    for (int r = 0; r < world; ++r) {
      const BnRun& run = (*many)[r];
      const double loss = LossError(run, ref);
      const double grads = ScaledError(run.first_grads, ref.first_grads);
      const double params = ScaledError(run.params, ref.params);
      const double buffers = ScaledError(run.buffers, ref.buffers);
      std::printf("SyncBatchNorm %d ranks x %lld vs 1 rank x %lld, rank %d: max relative "
                  "difference loss %.3g, first gradients %.3g, parameters after %d steps %.3g, "
                  "running statistics %.3g\n",
                  world, static_cast<long long>(kPerRank),
                  static_cast<long long>(kPerRank * world), r, loss, grads, kSteps, params,
                  buffers);
      EXPECT_LE(loss, 1e-5) << world << " ranks, rank " << r;
      EXPECT_LE(grads, 1e-5) << world << " ranks, rank " << r;
      EXPECT_LE(params, 1e-5) << world << " ranks, rank " << r;
      EXPECT_LE(buffers, 1e-5) << world << " ranks, rank " << r;
    }
  }
}

// The control: the same run with per-rank BatchNorm is not the one-rank run.
TEST_F(SyncBatchNormTest, WithoutSyncTheSameRunDiffers) {
  auto one = spawn([&](Context& ctx) { return TrainBn(ctx, 6, 2, false); }, 1, "cpu", options_);
  auto many = spawn([&](Context& ctx) { return TrainBn(ctx, 3, 2, false); }, 2, "cpu", options_);
  ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
  EXPECT_GT(ScaledError((*many)[0].first_grads, (*one)[0].first_grads), 1e-3);
  EXPECT_GT(ScaledError((*many)[0].buffers, (*one)[0].buffers), 1e-3);
}

TEST_F(SyncBatchNormTest, WorldOfOneIsBatchNormBitForBit) {
  auto plain = spawn([&](Context& ctx) { return TrainBn(ctx, 4, 3, false); }, 1, "cpu", options_);
  auto sync = spawn([&](Context& ctx) { return TrainBn(ctx, 4, 3, true); }, 1, "cpu", options_);
  ASSERT_TRUE(plain.ok() && sync.ok()) << plain.status() << sync.status();
  EXPECT_EQ((*plain)[0].losses, (*sync)[0].losses);
  ::tandem::testing::ExpectSameBits((*sync)[0].params.to_vector<float>(),
                                    (*plain)[0].params.to_vector<float>(), "parameters");
  ::tandem::testing::ExpectSameBits((*sync)[0].buffers.to_vector<float>(),
                                    (*plain)[0].buffers.to_vector<float>(), "buffers");
}

// Rank 0 holds 3 images, rank 1 one: the statistics weigh each slice by its count.
// y, dx, the summed weight and bias gradients and the running statistics equal
// BatchNorm's on the 4 images (sum loss, no DataParallel).
TEST_F(SyncBatchNormTest, UnequalSlicesWeighByTheirCounts) {
  auto run = [](Context& ctx, int64_t lo, int64_t hi, bool sync) {
    nn::manual_seed(3);
    const Tensor all_x = nn::add_scalar(nn::randn({4, 3, 2, 3}), 1.5);
    const Tensor coeff = nn::randn({4, 3, 2, 3});
    SyncBatchNorm2d bn(3, 1e-5, 0.3);
    if (!sync) bn->reducer = nullptr;
    Tensor x = all_x.slice(lo, hi).clone();
    x.set_requires_grad(true);
    Tensor y = bn(x);
    nn::sum(nn::mul(y, coeff.slice(lo, hi))).backward();
    std::vector<Tensor> out = {y.detach(), x.grad(), bn->weight.grad().clone(),
                               bn->bias.grad().clone(), bn->running_mean.clone(),
                               bn->running_var.clone()};
    ctx.communicator().all_reduce(out[2], ReduceOp::kSum);
    ctx.communicator().all_reduce(out[3], ReduceOp::kSum);
    return out;
  };
  auto one = spawn([&](Context& ctx) { return run(ctx, 0, 4, false); }, 1, "cpu", options_);
  auto two = spawn([&](Context& ctx) {
    return ctx.rank() == 0 ? run(ctx, 0, 3, true) : run(ctx, 3, 4, true);
  }, 2, "cpu", options_);
  ASSERT_TRUE(one.ok() && two.ok()) << one.status() << two.status();
  const std::vector<Tensor>& ref = (*one)[0];
  for (int k : {0, 1}) {  // y and dx: the rows of each rank
    EXPECT_LE(ScaledError((*two)[0][k], ref[k].slice(0, 3)), 1e-5) << "output " << k;
    EXPECT_LE(ScaledError((*two)[1][k], ref[k].slice(3, 4)), 1e-5) << "output " << k;
  }
  for (int r : {0, 1}) {
    for (int k = 2; k < 6; ++k) EXPECT_LE(ScaledError((*two)[r][k], ref[k]), 1e-5) << "output " << k;
  }
}

// Central differences of the sum of every rank's loss in float64, all ranks in
// lockstep (each perturbation is a collective forward), against dx on each rank
// and the summed weight and bias gradients.
TEST_F(SyncBatchNormTest, Float64GradientCheckAcrossRanks) {
  auto check = spawn([](Context& ctx) {
    auto reducer = std::make_shared<SyncBatchNormReducer>();
    const nn::TensorOptions f64{.dtype = nn::kFloat64};
    nn::manual_seed(11 + ctx.rank());  // each rank its own slice
    const int64_t n = ctx.rank() == 0 ? 2 : 1;
    Tensor x = nn::add_scalar(nn::randn({n, 2, 2, 2}, f64), ctx.rank());
    const Tensor coeff = nn::randn({n, 2, 2, 2}, f64);
    nn::manual_seed(5);  // the same parameters everywhere
    Tensor w = nn::add_scalar(nn::rand({2}, f64), 0.5);
    Tensor b = nn::randn({2}, f64);
    auto total_loss = [&](const Tensor& xv, const Tensor& wv, const Tensor& bv) {
      Tensor rm = nn::zeros({2}, f64), rv = nn::ones({2}, f64);
      Tensor loss = nn::sum(nn::mul(nn::batch_norm2d(xv, wv, bv, rm, rv, true, 0.1, 1e-5, reducer),
                                    coeff));
      Tensor total = loss.detach().clone();
      ctx.communicator().all_reduce(total, ReduceOp::kSum);
      return std::make_pair(loss, total.item());
    };
    Tensor xg = x.clone(), wg = w.clone(), bg = b.clone();
    xg.set_requires_grad(true);
    wg.set_requires_grad(true);
    bg.set_requires_grad(true);
    total_loss(xg, wg, bg).first.backward();
    Tensor dw = wg.grad().clone(), db = bg.grad().clone();
    ctx.communicator().all_reduce(dw, ReduceOp::kSum);
    ctx.communicator().all_reduce(db, ReduceOp::kSum);
    const double h = 1e-6;
    double worst = 0;
    auto compare = [&](double numeric, double analytic) {
      worst = std::max(worst, std::fabs(numeric - analytic) / std::max(1.0, std::fabs(analytic)));
    };
    // Every rank's x elements, rank by rank: all ranks evaluate every perturbation.
    for (int owner = 0; owner < ctx.world_size(); ++owner) {
      const int64_t count = owner == 0 ? 16 : 8;
      for (int64_t i = 0; i < count; ++i) {
        double f[2];
        for (int side = 0; side < 2; ++side) {
          Tensor xp = x.clone();
          if (owner == ctx.rank()) {
            std::vector<double> v = xp.to_vector<double>();
            v[i] += side == 0 ? h : -h;
            xp = nn::from_vector(v, xp.shape(), f64);
          }
          f[side] = total_loss(xp, w, b).second;
        }
        if (owner == ctx.rank()) compare((f[0] - f[1]) / (2 * h), xg.grad().to_vector<double>()[i]);
      }
    }
    for (int which = 0; which < 2; ++which) {
      for (int64_t c = 0; c < 2; ++c) {
        double f[2];
        for (int side = 0; side < 2; ++side) {
          std::vector<double> v = (which == 0 ? w : b).to_vector<double>();
          v[c] += side == 0 ? h : -h;
          const Tensor p = nn::from_vector(v, {2}, f64);
          f[side] = which == 0 ? total_loss(x, p, b).second : total_loss(x, w, p).second;
        }
        compare((f[0] - f[1]) / (2 * h), (which == 0 ? dw : db).to_vector<double>()[c]);
      }
    }
    return worst;
  }, 2, "cpu", options_);
  ASSERT_TRUE(check.ok()) << check.status();
  for (double worst : *check) {
    std::printf("SyncBatchNorm float64 gradient check, 2 ranks: max relative difference %.3g\n", worst);
    EXPECT_LE(worst, 1e-6);
  }
}

TEST_F(SyncBatchNormTest, ConvertKeepsNamesParametersBuffersAndTypedMembers) {
  BnNet net;
  {
    nn::NoGradGuard no_grad;
    net.bn1->running_mean.fill_(0.25);
  }
  const nn::StateDict before = net.state_dict();
  EXPECT_EQ(ConvertSyncBatchNorm(net), 2);
  EXPECT_NE(net.bn1->reducer, nullptr);  // the typed members themselves
  EXPECT_NE(net.bn2->reducer, nullptr);
  const nn::StateDict after = net.state_dict();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].first, before[i].first);
    EXPECT_TRUE(after[i].second.storage() == before[i].second.storage()) << before[i].first;
  }
  EXPECT_EQ(net.bn1->running_mean.to_vector<float>()[0], 0.25f);
  // SyncBatchNorm2d has BatchNorm2d's names.
  SyncBatchNorm2d sync(3);
  nn::BatchNorm2d plain(3);
  std::vector<std::string> a, b;
  for (const auto& [name, t] : sync->named_parameters()) a.push_back(name);
  for (const auto& [name, t] : sync->named_buffers()) a.push_back(name);
  for (const auto& [name, t] : plain->named_parameters()) b.push_back(name);
  for (const auto& [name, t] : plain->named_buffers()) b.push_back(name);
  EXPECT_EQ(a, b);
}

// Eval mode normalises with the running statistics alone: ranks with different
// inputs get BatchNorm's output (a synchronised one would mix the ranks).
TEST_F(SyncBatchNormTest, EvalModeIsBatchNormsAndOutsideSpawnTrainingIsAnError) {
  auto out = spawn([](Context& ctx) {
    nn::manual_seed(20 + ctx.rank());
    const Tensor x = nn::randn({2, 3, 2, 2});
    SyncBatchNorm2d sync(3);
    nn::BatchNorm2d plain(3);
    sync->eval();
    plain->eval();
    return ScaledError(sync(x), plain(x));
  }, 2, "cpu", options_);
  ASSERT_TRUE(out.ok()) << out.status();
  for (double e : *out) EXPECT_EQ(e, 0);
  SyncBatchNorm2d outside(3);
  EXPECT_NE(::tandem::testing::ErrorOf([&] { outside(nn::randn({2, 3, 2, 2})); })
                .find("SyncBatchNorm2d: no communicator"),
            std::string::npos);
}

TEST_F(SyncBatchNormTest, ChannelCountsThatDifferAreOneErrorNotAHang) {
  auto result = spawn([](Context& ctx) {
    const int64_t channels = ctx.rank() == 0 ? 3 : 4;
    SyncBatchNorm2d bn(channels);
    bn(nn::randn({2, channels, 2, 2}));
  }, 2, "cpu", options_);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(std::string(result.message()).find("channel counts differ across ranks: 3, 4"),
            std::string::npos)
      << result;
}

}  // namespace
}  // namespace tandem::dist
