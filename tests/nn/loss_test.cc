#include "nn/ops/loss.h"

#include <gtest/gtest.h>

#include <cmath>

#include "nn/ops/elementwise.h"
#include "nn/ops/softmax.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

TEST(LossTest, MseValue) {
  Tensor p = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor t = from_vector(std::vector<float>{0, 2, 5, 4}, {2, 2});
  EXPECT_FLOAT_EQ(mse_loss(p, t).item<float>(), 5.0f / 4.0f);
  EXPECT_EQ(mse_loss(p, t).dim(), 0);
}

TEST(LossTest, MseRefusesDifferentShapes) {
  try {
    mse_loss(zeros({4, 1}), zeros({4}));
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("mse_loss"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 1)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4)"), std::string::npos) << m;
  }
}

TEST(LossTest, CrossEntropyOfUniformLogitsIsLogC) {
  for (int64_t c : {2, 10, 1000}) {
    Tensor logits = full({3, c}, 0.7);
    Tensor labels = from_vector(std::vector<int64_t>{0, c - 1, c / 2}, {3});
    EXPECT_NEAR(cross_entropy(logits, labels).item(), std::log(static_cast<double>(c)), 1e-5) << c;
  }
}

TEST(LossTest, CrossEntropyMatchesLogSoftmaxAndIsStable) {
  manual_seed(41);
  Tensor logits = randn({5, 7}, {.dtype = kFloat64});
  logits.mul_(100.0);  // large logits: the fused kernel subtracts the max
  Tensor labels = from_vector(std::vector<int64_t>{0, 6, 3, 3, 1}, {5});
  const std::vector<double> ls = log_softmax(logits, 1).to_vector<double>();
  const std::vector<int64_t> lv = labels.to_vector<int64_t>();
  double expected = 0;
  for (int64_t i = 0; i < 5; ++i) expected -= ls[i * 7 + lv[i]];
  const double loss = cross_entropy(logits, labels).item();
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, expected / 5, 1e-9);
}

TEST(LossTest, CrossEntropyLabelOutOfRangeNamesItAndC) {
  Tensor logits = zeros({2, 4});
  for (int64_t bad : {4, -1}) {
    try {
      cross_entropy(logits, from_vector(std::vector<int64_t>{0, bad}, {2}));
      FAIL() << bad;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("cross_entropy"), std::string::npos) << m;
      EXPECT_NE(m.find("label " + std::to_string(bad)), std::string::npos) << m;
      EXPECT_NE(m.find("4 classes"), std::string::npos) << m;
    }
  }
  EXPECT_THROW(cross_entropy(logits, zeros({2})), Error);                       // not int64
  EXPECT_THROW(cross_entropy(logits, zeros({3}, {.dtype = kInt64})), Error);    // wrong N
}

TEST(LossTest, AccuracyCountsFirstArgmax) {
  Tensor logits = from_vector(std::vector<float>{0.1f, 0.9f, 0.0f,   // argmax 1
                                                 2.0f, 2.0f, 1.0f,   // tie: first max, 0
                                                 0.0f, 0.0f, 3.0f,   // argmax 2
                                                 5.0f, 1.0f, 1.0f},  // argmax 0
                              {4, 3});
  Tensor labels = from_vector(std::vector<int64_t>{1, 1, 2, 2}, {4});
  Tensor acc = accuracy(logits, labels);
  EXPECT_EQ(acc.dtype(), kFloat32);
  EXPECT_EQ(acc.dim(), 0);
  EXPECT_FLOAT_EQ(acc.item<float>(), 0.5f);
}

TEST(LossGradTest, Mse) {
  manual_seed(42);
  EXPECT_TRUE(GradCheck([](const auto& in) { return mse_loss(in[0], in[1]); },
                        {RandomInput({3, 4}), RandomInput({3, 4})}));
}

TEST(LossGradTest, CrossEntropy) {
  manual_seed(43);
  Tensor labels = from_vector(std::vector<int64_t>{2, 0, 4, 4, 1, 3}, {6});
  EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], labels); },
                        {RandomInput({6, 5}, 2.0)}));
  // Upstream gradient other than 1: the loss scaled inside the graph.
  EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], labels) * 3.0; },
                        {RandomInput({6, 5})}));
}

}  // namespace
}  // namespace tandem::nn
