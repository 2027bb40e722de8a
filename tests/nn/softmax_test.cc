#include "nn/ops/softmax.h"

#include <gtest/gtest.h>

#include <cmath>

#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

TEST(SoftmaxTest, ClosedFormValues) {
  Tensor x = from_vector(std::vector<double>{0, std::log(2.0), std::log(5.0), 1, 1, 1}, {2, 3});
  const std::vector<double> y = softmax(x, 1).to_vector<double>();
  const std::vector<double> expected = {1.0 / 8, 2.0 / 8, 5.0 / 8, 1.0 / 3, 1.0 / 3, 1.0 / 3};
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], expected[i], 1e-12) << i;
  const std::vector<double> ly = log_softmax(x, -1).to_vector<double>();
  for (size_t i = 0; i < ly.size(); ++i) EXPECT_NEAR(ly[i], std::log(expected[i]), 1e-12) << i;
}

TEST(SoftmaxTest, StableForLargeLogitsAndAlongDim0) {
  Tensor x = from_vector(std::vector<float>{1000, 1000, -1000, 1000}, {2, 2});
  const std::vector<float> y = softmax(x, 0).to_vector<float>();
  EXPECT_FLOAT_EQ(y[0], 1.0f);
  EXPECT_FLOAT_EQ(y[2], 0.0f);
  EXPECT_FLOAT_EQ(y[1], 0.5f);
  EXPECT_FLOAT_EQ(y[3], 0.5f);
  const std::vector<float> ly = log_softmax(x, 0).to_vector<float>();
  EXPECT_FLOAT_EQ(ly[2], -2000.0f);
  EXPECT_FLOAT_EQ(ly[1], -std::log(2.0f));
}

TEST(SoftmaxTest, ErrorsNameOpAndShape) {
  try {
    log_softmax(zeros({2, 3}), 3);
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("log_softmax"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
  }
  EXPECT_THROW(softmax(zeros({2}, {.dtype = kInt64}), 0), Error);
}

TEST(SoftmaxGradTest, EveryDim) {
  manual_seed(21);
  for (int64_t dim : {0, 1, 2}) {
    EXPECT_TRUE(GradCheck([&](const auto& in) { return softmax(in[0], dim); },
                          {RandomInput({2, 3, 4}, 2.0)}));
    EXPECT_TRUE(GradCheck([&](const auto& in) { return log_softmax(in[0], dim); },
                          {RandomInput({2, 3, 4}, 2.0)}));
  }
}

}  // namespace
}  // namespace tandem::nn
