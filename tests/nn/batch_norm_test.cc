#include "nn/ops/batch_norm.h"

#include <gtest/gtest.h>

#include <cmath>

#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

constexpr int64_t kN = 3, kC = 2, kH = 2, kW = 3;

// Per-channel mean and biased variance of an (N, C, H, W) vector, in double.
void ChannelStats(const std::vector<double>& x, int64_t c, double* mean, double* var) {
  double s = 0, ss = 0;
  const int64_t hw = kH * kW, m = kN * hw;
  for (int64_t n = 0; n < kN; ++n) {
    for (int64_t j = 0; j < hw; ++j) s += x[(n * kC + c) * hw + j];
  }
  *mean = s / m;
  for (int64_t n = 0; n < kN; ++n) {
    for (int64_t j = 0; j < hw; ++j) {
      const double d = x[(n * kC + c) * hw + j] - *mean;
      ss += d * d;
    }
  }
  *var = ss / m;
}

TEST(BatchNormTest, TrainingNormalisesAndUpdatesRunningStats) {
  manual_seed(31);
  Tensor x = randn({kN, kC, kH, kW}, {.dtype = kFloat64});
  x.mul_(3.0);
  x.add_(ones(x.shape(), {.dtype = kFloat64}), 2.0);
  Tensor rm = from_vector(std::vector<double>{0.5, -1.0}, {kC});
  Tensor rv = from_vector(std::vector<double>{2.0, 0.25}, {kC});
  const double eps = 1e-5, momentum = 0.1;
  Tensor y = batch_norm2d(x, Tensor(), Tensor(), rm, rv, /*training=*/true, momentum, eps);
  const std::vector<double> xv = x.to_vector<double>(), yv = y.to_vector<double>();
  const std::vector<double> rmv = rm.to_vector<double>(), rvv = rv.to_vector<double>();
  const double m = kN * kH * kW;
  const double rm0[] = {0.5, -1.0}, rv0[] = {2.0, 0.25};
  for (int64_t c = 0; c < kC; ++c) {
    double x_mean, x_var, y_mean, y_var;
    ChannelStats(xv, c, &x_mean, &x_var);
    ChannelStats(yv, c, &y_mean, &y_var);
    EXPECT_NEAR(y_mean, 0.0, 1e-12) << c;
    EXPECT_NEAR(y_var, x_var / (x_var + eps), 1e-12) << c;
    EXPECT_NEAR(rmv[c], (1 - momentum) * rm0[c] + momentum * x_mean, 1e-12) << c;
    EXPECT_NEAR(rvv[c], (1 - momentum) * rv0[c] + momentum * x_var * m / (m - 1), 1e-12) << c;
  }
}

TEST(BatchNormTest, EvalUsesRunningStatsAndLeavesThem) {
  manual_seed(32);
  Tensor x = randn({kN, kC, kH, kW});
  Tensor w = from_vector(std::vector<float>{2.0f, -0.5f}, {kC});
  Tensor b = from_vector(std::vector<float>{0.25f, 1.0f}, {kC});
  Tensor rm = from_vector(std::vector<float>{0.1f, -0.3f}, {kC});
  Tensor rv = from_vector(std::vector<float>{1.5f, 0.5f}, {kC});
  const double eps = 1e-3;
  const std::vector<float> y = batch_norm2d(x, w, b, rm, rv, /*training=*/false, 0.1, eps)
                                   .to_vector<float>();
  const std::vector<float> xv = x.to_vector<float>();
  const float wv[] = {2.0f, -0.5f}, bv[] = {0.25f, 1.0f}, mv[] = {0.1f, -0.3f}, vv[] = {1.5f, 0.5f};
  for (int64_t i = 0; i < x.numel(); ++i) {
    const int64_t c = (i / (kH * kW)) % kC;
    const double expected = (xv[i] - mv[c]) / std::sqrt(vv[c] + eps) * wv[c] + bv[c];
    EXPECT_NEAR(y[i], expected, 1e-5) << i;
  }
  EXPECT_EQ(rm.to_vector<float>(), (std::vector<float>{0.1f, -0.3f}));
  EXPECT_EQ(rv.to_vector<float>(), (std::vector<float>{1.5f, 0.5f}));
  // Training on the same input gives a different output (batch stats).
  const std::vector<float> yt = batch_norm2d(x, w, b, rm, rv, true, 0.1, eps).to_vector<float>();
  EXPECT_NE(yt, y);
}

TEST(BatchNormTest, ErrorsNameOpAndShapes) {
  try {
    batch_norm2d(zeros({2, 3, 4, 4}), zeros({4}), Tensor(), zeros({3}), ones({3}), true);
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("batch_norm2d"), std::string::npos) << m;
    EXPECT_NE(m.find("weight"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3, 4, 4)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4)"), std::string::npos) << m;
  }
  EXPECT_THROW(batch_norm2d(zeros({2, 3}), Tensor(), Tensor(), zeros({3}), ones({3}), true), Error);
  // Eval needs running stats; training needs more than one value per channel.
  EXPECT_THROW(batch_norm2d(zeros({2, 3, 1, 1}), Tensor(), Tensor(), Tensor(), Tensor(), false),
               Error);
  EXPECT_THROW(batch_norm2d(zeros({1, 3, 1, 1}), Tensor(), Tensor(), Tensor(), Tensor(), true),
               Error);
}

TEST(BatchNormGradTest, Training) {
  manual_seed(33);
  Tensor rm = zeros({kC}, {.dtype = kFloat64}), rv = ones({kC}, {.dtype = kFloat64});
  auto f = [&](const std::vector<Tensor>& in) {
    return batch_norm2d(in[0], in[1], in[2], rm, rv, /*training=*/true, 0.1, 1e-5);
  };
  EXPECT_TRUE(GradCheck(f, {RandomInput({kN, kC, kH, kW}, 2.0), RandomInput({kC}),
                            RandomInput({kC})}));
  // Without running stats and without an affine transform.
  EXPECT_TRUE(GradCheck([](const auto& in) {
    return batch_norm2d(in[0], Tensor(), Tensor(), Tensor(), Tensor(), true);
  }, {RandomInput({kN, kC, kH, kW})}));
}

TEST(BatchNormGradTest, Eval) {
  manual_seed(34);
  Tensor rm = RandomInput({kC}, 1.0, false);
  Tensor rv = rand({kC}, {.dtype = kFloat64});
  rv.add_(ones({kC}, {.dtype = kFloat64}), 0.5);
  auto f = [&](const std::vector<Tensor>& in) {
    return batch_norm2d(in[0], in[1], in[2], rm, rv, /*training=*/false);
  };
  EXPECT_TRUE(GradCheck(f, {RandomInput({kN, kC, kH, kW}), RandomInput({kC}), RandomInput({kC})}));
}

}  // namespace
}  // namespace tandem::nn
