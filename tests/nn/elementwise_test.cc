#include "nn/ops/elementwise.h"

#include <gtest/gtest.h>

#include "nn/layers.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

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

}  // namespace
}  // namespace tandem::nn
