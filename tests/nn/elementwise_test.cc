#include "nn/ops/elementwise.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "nn/layers.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using tandem::testing::ErrorOf;
using testing::GradCheck;
using testing::RandomInput;

TEST(ElementwiseTest, BroadcastingValues) {
  Tensor a = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor row = from_vector(std::vector<float>{10, 20, 30}, {3});
  Tensor col = from_vector(std::vector<float>{100, 200}, {2, 1});
  EXPECT_EQ((a + row).to_vector<float>(), (std::vector<float>{11, 22, 33, 14, 25, 36}));
  EXPECT_EQ((a * col).to_vector<float>(), (std::vector<float>{100, 200, 300, 800, 1000, 1200}));
  EXPECT_EQ((row + col).shape(), (Shape{2, 3}));
  EXPECT_EQ((a - 1.0).to_vector<float>(), (std::vector<float>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ((12.0 / a).to_vector<float>()[2], 4.0f);
  EXPECT_EQ(sum_to(a, {3}).to_vector<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(sum_to(a, {2, 1}).to_vector<float>(), (std::vector<float>{6, 15}));
}

TEST(ElementwiseTest, MismatchesNameOpAndShapes) {
  try {
    add(zeros({2, 3}), zeros({4}));
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("add"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4)"), std::string::npos) << m;
  }
  EXPECT_THROW(add(zeros({2}), zeros({2}, {.dtype = kFloat64})), Error);
  EXPECT_THROW(relu(zeros({2}, {.dtype = kInt64})), Error);
}

TEST(ElementwiseGradTest, BinaryWithBroadcasting) {
  manual_seed(1);
  for (auto op : {add, sub, mul}) {
    EXPECT_TRUE(GradCheck([&](const auto& in) { return op(in[0], in[1]); },
                          {RandomInput({2, 3, 4}), RandomInput({3, 1})}));
    EXPECT_TRUE(GradCheck([&](const auto& in) { return op(in[0], in[1]); },
                          {RandomInput({4}), RandomInput({2, 1, 4})}));
  }
  // Keep the divisor away from 0.
  Tensor b = RandomInput({3, 1}, 0.1, false);
  b.add_(ones({3, 1}, {.dtype = kFloat64}), 2.0);
  b.set_requires_grad(true);
  EXPECT_TRUE(GradCheck([](const auto& in) { return div(in[0], in[1]); }, {RandomInput({2, 3, 4}), b}));
}

TEST(ElementwiseGradTest, ScalarAndUnary) {
  manual_seed(2);
  auto positive = [] {
    Tensor t = rand({3, 4}, {.dtype = kFloat64});
    t.add_(ones({3, 4}, {.dtype = kFloat64}), 0.5);
    return t.set_requires_grad(true);
  };
  EXPECT_TRUE(GradCheck([](const auto& in) { return neg(in[0]) * 3.0 + 2.0; }, {RandomInput({3, 4})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return 1.5 - in[0]; }, {RandomInput({3, 4})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return 2.0 / in[0]; }, {positive()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return pow_scalar(in[0], 2.5); }, {positive()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return log(in[0]); }, {positive()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return exp(in[0]); }, {RandomInput({3, 4})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return sigmoid(in[0]); }, {RandomInput({3, 4}, 2.0)}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return tanh(in[0]); }, {RandomInput({3, 4}, 2.0)}));
}

TEST(ElementwiseGradTest, ReluAwayFromTheKink) {
  // Values at least 0.1 from 0, so +-eps never crosses the kink.
  std::vector<double> v = {-1.0, -0.5, -0.1, 0.1, 0.7, 2.0};
  Tensor x = from_vector(v, {2, 3}, {.requires_grad = true});
  EXPECT_TRUE(GradCheck([](const auto& in) { return relu(in[0]); }, {x}));
  // At exactly 0 the subgradient 0 is used.
  Tensor z = zeros({1}, {.dtype = kFloat64, .requires_grad = true});
  relu(z).backward();
  EXPECT_EQ(z.grad().item(), 0.0);
}

TEST(ElementwiseTest, Relu6ClampsToZeroSix) {
  const std::vector<double> v = {-3.0, -0.0, 0.25, 5.5, 6.0, 7.5};
  const std::vector<double> want = {0.0, 0.0, 0.25, 5.5, 6.0, 6.0};
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    Tensor x = from_vector(v, {2, 3}).to(dtype);
    Tensor y = relu6(x);
    EXPECT_EQ(y.dtype(), dtype);
    EXPECT_EQ(y.to_vector<double>(), want) << DTypeName(dtype);
    EXPECT_EQ(ReLU6()(x).to_vector<double>(), want) << DTypeName(dtype);
  }
  EXPECT_THROW(relu6(zeros({2}, {.dtype = kInt64})), Error);
}

TEST(ElementwiseGradTest, Relu6AwayFromTheKinks) {
  // Values at least 0.1 from 0 and from 6, on both sides of each kink.
  std::vector<double> v = {-1.0, -0.1, 0.1, 0.7, 3.0, 5.9, 6.1, 8.0};
  Tensor x = from_vector(v, {2, 4}, {.requires_grad = true});
  EXPECT_TRUE(GradCheck([](const auto& in) { return relu6(in[0]); }, {x}));
  manual_seed(4);
  EXPECT_TRUE(GradCheck([](const auto& in) { return relu6(in[0] * 4.0) * 2.0; },
                        {RandomInput({3, 5}, 2.0)}));
  // At exactly 0 and 6 the subgradient 0 is used (PyTorch's hardtanh backward).
  Tensor k = from_vector(std::vector<double>{0.0, 6.0}, {2}, {.requires_grad = true});
  relu6(k).backward(ones({2}, {.dtype = kFloat64}));
  EXPECT_EQ(k.grad().to_vector<double>(), (std::vector<double>{0.0, 0.0}));
}

TEST(ElementwiseGradTest, SharedInputGetsBothContributions) {
  manual_seed(3);
  EXPECT_TRUE(GradCheck([](const auto& in) { return in[0] * in[0] + tanh(in[0]); }, {RandomInput({5})}));
}

TEST(ElementwiseTest, NewUnaryValuesInEveryDType) {
  // Values exact in bfloat16, with closed forms.
  const std::vector<double> v = {-4.0, -1.5, -0.25, 0.0, 0.5, 2.0};
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    Tensor x = from_vector(v, {2, 3}).to(dtype);
    EXPECT_EQ(abs(x).to_vector<double>(), (std::vector<double>{4, 1.5, 0.25, 0, 0.5, 2}));
    EXPECT_EQ(clamp(x, -1.0, 1.0).to_vector<double>(),
              (std::vector<double>{-1, -1, -0.25, 0, 0.5, 1}));
    EXPECT_EQ(clamp(x, std::nullopt, 0.0).to_vector<double>(),
              (std::vector<double>{-4, -1.5, -0.25, 0, 0, 0}));
    EXPECT_EQ(clamp(x, 0.0, std::nullopt).to_vector<double>(),
              (std::vector<double>{0, 0, 0, 0, 0.5, 2}));
    EXPECT_EQ(clamp(x, 1.0, -1.0).to_vector<double>(), std::vector<double>(6, -1.0));
    EXPECT_EQ(leaky_relu(x, 0.5).to_vector<double>(),
              (std::vector<double>{-2, -0.75, -0.125, 0, 0.5, 2}));
    EXPECT_EQ(LeakyReLU(0.5)(x).to_vector<double>(), leaky_relu(x, 0.5).to_vector<double>());
    Tensor sq = sqrt(from_vector(std::vector<double>{0, 0.25, 4, 16}, {4}).to(dtype));
    EXPECT_EQ(sq.dtype(), dtype);
    EXPECT_EQ(sq.to_vector<double>(), (std::vector<double>{0, 0.5, 2, 4}));
    const double tol = dtype == kBFloat16 ? 1e-2 : dtype == kFloat32 ? 1e-6 : 1e-15;
    const std::vector<double> g = gelu(x).to_vector<double>();
    const std::vector<double> gt = GELU(GeluApproximate::kTanh)(x).to_vector<double>();
    const std::vector<double> s = SiLU()(x).to_vector<double>();
    for (size_t i = 0; i < v.size(); ++i) {
      const double t = v[i];
      EXPECT_NEAR(g[i], 0.5 * t * (1 + std::erf(t / std::sqrt(2.0))), tol * (1 + std::abs(t)));
      const double inner = std::sqrt(2 / M_PI) * (t + 0.044715 * t * t * t);
      EXPECT_NEAR(gt[i], 0.5 * t * (1 + std::tanh(inner)), tol * (1 + std::abs(t)));
      EXPECT_NEAR(s[i], t / (1 + std::exp(-t)), tol * (1 + std::abs(t)));
    }
    EXPECT_EQ(GELU()(x).to_vector<double>(), g);
  }
  // softplus does not overflow where exp(x) would.
  Tensor big = from_vector(std::vector<float>{-200.0f, 0.0f, 200.0f}, {3});
  const std::vector<float> sp = softplus(big).to_vector<float>();
  EXPECT_NEAR(sp[0], 0.0f, 1e-30f);
  EXPECT_FLOAT_EQ(sp[1], std::log(2.0f));
  EXPECT_FLOAT_EQ(sp[2], 200.0f);
  // A NaN input stays NaN through clamp.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(clamp(from_vector(std::vector<float>{nan}, {1}), 0.0, 1.0).item()));
}

TEST(ElementwiseTest, MaximumMinimumBroadcastAndPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    Tensor a = from_vector(std::vector<double>{1, 5, -2, 3, 0, 7}, {2, 3}).to(dtype);
    Tensor b = from_vector(std::vector<double>{2, 4, -2}, {3}).to(dtype);
    EXPECT_EQ(maximum(a, b).to_vector<double>(), (std::vector<double>{2, 5, -2, 3, 4, 7}));
    EXPECT_EQ(minimum(a, b).to_vector<double>(), (std::vector<double>{1, 4, -2, 2, 0, -2}));
    EXPECT_EQ(maximum(b, a).shape(), (Shape{2, 3}));
  }
  Tensor n = from_vector(std::vector<float>{nan, 1.0f}, {2});
  Tensor m = from_vector(std::vector<float>{0.0f, nan}, {2});
  for (float r : maximum(n, m).to_vector<float>()) EXPECT_TRUE(std::isnan(r));
  for (float r : minimum(n, m).to_vector<float>()) EXPECT_TRUE(std::isnan(r));
}

TEST(ElementwiseTest, NewOpsNameBadInputs) {
  const std::string shapes = ErrorOf([] { maximum(zeros({2, 3}), zeros({4})); });
  EXPECT_NE(shapes.find("maximum"), std::string::npos) << shapes;
  EXPECT_NE(shapes.find("(2, 3)"), std::string::npos) << shapes;
  const std::string dtypes = ErrorOf([] { minimum(zeros({2}), zeros({2}, {.dtype = kFloat64})); });
  EXPECT_NE(dtypes.find("minimum"), std::string::npos) << dtypes;
  const std::string ints = ErrorOf([] { gelu(zeros({2}, {.dtype = kInt64})); });
  EXPECT_NE(ints.find("gelu"), std::string::npos) << ints;
  EXPECT_NE(ints.find("int64"), std::string::npos) << ints;
  for (auto f : {abs, sqrt, silu, softplus}) {
    EXPECT_THROW(f(zeros({2}, {.dtype = kInt64})), Error);
  }
  EXPECT_NE(ErrorOf([] { clamp(zeros({2}), std::nullopt, std::nullopt); }).find("at least one"),
            std::string::npos);
  const std::string nan_bound = ErrorOf([] { clamp(zeros({2}), std::nan(""), 1.0); });
  EXPECT_NE(nan_bound.find("NaN"), std::string::npos) << nan_bound;
  const std::string slope = ErrorOf([] { leaky_relu(zeros({2}), HUGE_VAL); });
  EXPECT_NE(slope.find("negative_slope inf"), std::string::npos) << slope;
  EXPECT_NE(ErrorOf([] { LeakyReLU(std::nan("")); }).find("LeakyReLU(nan)"), std::string::npos);
  const std::string approx = ErrorOf([] { gelu(zeros({2}), static_cast<GeluApproximate>(7)); });
  EXPECT_NE(approx.find("approximate 7"), std::string::npos) << approx;
}

TEST(ElementwiseGradTest, NewUnaryOps) {
  manual_seed(5);
  // Away from the kinks at 0 (abs, leaky_relu) and at the clamp bounds.
  const std::vector<double> v = {-2.0, -0.9, -0.3, 0.2, 0.6, 1.4, 2.5, -1.1};
  auto kinked = [&] { return from_vector(v, {2, 4}, {.requires_grad = true}); };
  EXPECT_TRUE(GradCheck([](const auto& in) { return abs(in[0]); }, {kinked()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return leaky_relu(in[0], 0.2); }, {kinked()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return leaky_relu(in[0], -1.5); }, {kinked()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return clamp(in[0], -1.0, 1.0); }, {kinked()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return clamp(in[0], 0.5, std::nullopt); }, {kinked()}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return clamp(in[0], std::nullopt, 0.0); }, {kinked()}));
  Tensor positive = rand({3, 4}, {.dtype = kFloat64});
  positive.add_(ones({3, 4}, {.dtype = kFloat64}), 0.2);
  EXPECT_TRUE(GradCheck([](const auto& in) { return sqrt(in[0]); },
                        {positive.set_requires_grad(true)}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return gelu(in[0]); }, {RandomInput({3, 5}, 2.0)}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return gelu(in[0], GeluApproximate::kTanh); },
                        {RandomInput({3, 5}, 2.0)}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return silu(in[0]); }, {RandomInput({3, 5}, 3.0)}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return softplus(in[0]); }, {RandomInput({3, 5}, 4.0)}));
  // Subgradients at the kinks, as PyTorch: abs 0, leaky_relu the slope, clamp 1 at a bound.
  Tensor z = from_vector(std::vector<double>{0.0, -1.0, 1.0}, {3}, {.requires_grad = true});
  abs(z).backward(ones({3}, {.dtype = kFloat64}));
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{0, -1, 1}));
  z.set_grad(Tensor());
  leaky_relu(z, 0.2).backward(ones({3}, {.dtype = kFloat64}));
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{0.2, 0.2, 1}));
  z.set_grad(Tensor());
  clamp(z, -1.0, 0.5).backward(ones({3}, {.dtype = kFloat64}));
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{1, 1, 0}));
}

TEST(ElementwiseGradTest, MaximumMinimumSplitTies) {
  manual_seed(6);
  for (auto op : {maximum, minimum}) {
    // Random values: no ties, so the finite difference is smooth.
    EXPECT_TRUE(GradCheck([&](const auto& in) { return op(in[0], in[1]); },
                          {RandomInput({2, 3, 4}), RandomInput({3, 1})}));
    EXPECT_TRUE(GradCheck([&](const auto& in) { return op(in[0], in[1]); },
                          {RandomInput({4}), RandomInput({2, 1, 4})}));
  }
  // Ties split the gradient in half (PyTorch 1.13: a [0, .5, 1], b [1, .5, 0] for maximum).
  Tensor a = from_vector(std::vector<double>{1, 2, 3}, {3}, {.requires_grad = true});
  Tensor b = from_vector(std::vector<double>{2, 2, 1}, {3}, {.requires_grad = true});
  maximum(a, b).backward(ones({3}, {.dtype = kFloat64}));
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0, 0.5, 1}));
  EXPECT_EQ(b.grad().to_vector<double>(), (std::vector<double>{1, 0.5, 0}));
  a.set_grad(Tensor());
  b.set_grad(Tensor());
  minimum(a, b).backward(ones({3}, {.dtype = kFloat64}));
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{1, 0.5, 0}));
  EXPECT_EQ(b.grad().to_vector<double>(), (std::vector<double>{0, 0.5, 1}));
  // A broadcast b collects its shares: b (1) against a (3) with one tie.
  Tensor c = from_vector(std::vector<double>{2}, {1}, {.requires_grad = true});
  maximum(from_vector(std::vector<double>{1, 2, 3}, {3}), c).backward(ones({3}, {.dtype = kFloat64}));
  EXPECT_EQ(c.grad().to_vector<double>(), (std::vector<double>{1.5}));
}

}  // namespace
}  // namespace tandem::nn
