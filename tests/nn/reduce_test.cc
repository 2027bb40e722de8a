#include "nn/ops/reduce.h"

#include <gtest/gtest.h>

#include "nn/ops/elementwise.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

TEST(ReduceTest, Values) {
  Tensor a = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(sum(a).item(), 21.0);
  EXPECT_EQ(sum(a).dim(), 0);
  EXPECT_EQ(mean(a).item(), 3.5);
  EXPECT_EQ(sum(a, 0).to_vector<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(sum(a, 1).to_vector<float>(), (std::vector<float>{6, 15}));
  EXPECT_EQ(sum(a, -1, /*keepdim=*/true).shape(), (Shape{2, 1}));
  EXPECT_EQ(mean(a, 0).to_vector<float>(), (std::vector<float>{2.5, 3.5, 4.5}));
  EXPECT_EQ(mean(a, 1, true).shape(), (Shape{2, 1}));
  // A middle dim: (2, 2, 2) summed over dim 1.
  Tensor b = arange(0.0, 8.0, 1.0).reshape({2, 2, 2});
  EXPECT_EQ(sum(b, 1).to_vector<float>(), (std::vector<float>{2, 4, 10, 12}));
}

TEST(ReduceTest, ArgmaxTakesTheFirstMaximum) {
  Tensor a = from_vector(std::vector<double>{1, 7, 7, 0, -1, -1, -3, -1}, {2, 4});
  EXPECT_EQ(argmax(a, 1).to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(argmax(a, 1).dtype(), kInt64);
  EXPECT_EQ(argmax(a, 0).to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 0, 0}));
  Tensor b = from_vector(std::vector<float>{0, 5, 3, 9, 2, 1}, {1, 2, 3});
  EXPECT_EQ(argmax(b, 1).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(argmax(b, 1).shape(), (Shape{1, 3}));
}

TEST(ReduceTest, ErrorsNameOpAndShape) {
  try {
    sum(zeros({2, 3}), 2);
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("sum"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
  }
  EXPECT_THROW(mean(zeros({2}, {.dtype = kInt64})), Error);
  EXPECT_THROW(argmax(zeros({2, 0}), 1), Error);
}

TEST(ReduceGradTest, AllAndOneDim) {
  manual_seed(11);
  EXPECT_TRUE(GradCheck([](const auto& in) { return sum(in[0]); }, {RandomInput({3, 4})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return mean(in[0]); }, {RandomInput({3, 4})}));
  for (int64_t dim : {0, 1, 2, -1}) {
    for (bool keepdim : {false, true}) {
      EXPECT_TRUE(GradCheck([&](const auto& in) { return sum(in[0], dim, keepdim); },
                            {RandomInput({2, 3, 4})}));
      EXPECT_TRUE(GradCheck([&](const auto& in) { return mean(in[0], dim, keepdim); },
                            {RandomInput({2, 3, 4})}));
    }
  }
}

TEST(ReduceGradTest, ComposesWithElementwise) {
  manual_seed(12);
  // mean over rows of x^2 then a sum: exercises gradients flowing through both.
  EXPECT_TRUE(GradCheck([](const auto& in) { return sum(mean(in[0] * in[0], 0)); },
                        {RandomInput({4, 5})}));
}

}  // namespace
}  // namespace tandem::nn
