// cat and stack on the CPU: values along every dim, float64 gradient checks,
// inputs without a gradient, and errors that name the bad input; randint's range
// and reproducibility.
#include "nn/ops/join.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "nn/ops/elementwise.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using ::tandem::testing::ErrorOf;
using testing::GradCheck;
using testing::RandomInput;

Tensor Range(const Shape& shape, double start) {
  return add_scalar(arange(NumElements(shape), {.dtype = kFloat64}).reshape(shape), start);
}

TEST(CatTest, JoinsAlongEveryDim) {
  const Tensor a = Range({2, 3}, 0);    // 0..5
  const Tensor b = Range({2, 3}, 100);  // 100..105
  EXPECT_EQ(cat({a, b}, 0).shape(), (Shape{4, 3}));
  EXPECT_EQ(cat({a, b}, 0).to_vector<double>(),
            (std::vector<double>{0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104, 105}));
  EXPECT_EQ(cat({a, b}, 1).shape(), (Shape{2, 6}));
  EXPECT_EQ(cat({a, b}, -1).to_vector<double>(),
            (std::vector<double>{0, 1, 2, 100, 101, 102, 3, 4, 5, 103, 104, 105}));
  // Different sizes along the joined dim, an empty part, a middle dim.
  const Tensor c = Range({2, 1, 2}, 0), d = Range({2, 2, 2}, 10), e = Range({2, 0, 2}, 0);
  const Tensor j = cat({c, e, d}, 1);
  EXPECT_EQ(j.shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(j.to_vector<double>(),
            (std::vector<double>{0, 1, 10, 11, 12, 13, 2, 3, 14, 15, 16, 17}));
  EXPECT_EQ(cat({a}, 1).to_vector<double>(), a.to_vector<double>());
}

TEST(CatTest, Int64WithoutGradient) {
  const Tensor a = arange(4).reshape({2, 2});
  EXPECT_EQ(cat({a, a}, 1).to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 0, 1, 2, 3, 2, 3}));
}

TEST(StackTest, NewDimAnywhere) {
  const Tensor a = Range({2, 3}, 0), b = Range({2, 3}, 100);
  EXPECT_EQ(stack({a, b}).shape(), (Shape{2, 2, 3}));
  EXPECT_EQ(stack({a, b}, 1).shape(), (Shape{2, 2, 3}));
  EXPECT_EQ(stack({a, b}, -1).shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(stack({a, b}, 2).to_vector<double>(),
            (std::vector<double>{0, 100, 1, 101, 2, 102, 3, 103, 4, 104, 5, 105}));
  // Scalars stack into a vector.
  EXPECT_EQ(stack({scalar_tensor(1, {.dtype = kFloat64}), scalar_tensor(2, {.dtype = kFloat64})})
                .to_vector<double>(),
            (std::vector<double>{1, 2}));
}

TEST(CatTest, GradientsFloat64) {
  for (int64_t dim : {0, 1, 2, -1}) {
    SCOPED_TRACE(dim);
    Shape sa = {2, 3, 2}, sb = {2, 3, 2};
    sb[dim < 0 ? 2 : dim] = 1;
    EXPECT_TRUE(GradCheck([dim](const std::vector<Tensor>& in) { return cat(in, dim); },
                          {RandomInput(sa), RandomInput(sb), RandomInput(sa)}));
  }
  // One input without a gradient: the others still get theirs.
  const Tensor fixed = RandomInput({2, 2}, 1.0, /*requires_grad=*/false);
  EXPECT_TRUE(GradCheck(
      [&](const std::vector<Tensor>& in) {
        const Tensor j = cat({in[0], fixed}, 1);
        return mul(j, j);
      },
      {RandomInput({2, 3})}));
}

TEST(StackTest, GradientsFloat64) {
  for (int64_t dim : {0, 1, 2}) {
    SCOPED_TRACE(dim);
    EXPECT_TRUE(GradCheck([dim](const std::vector<Tensor>& in) { return stack(in, dim); },
                          {RandomInput({3, 2}), RandomInput({3, 2})}));
  }
}

TEST(JoinTest, ErrorsNameTheInput) {
  const Tensor a = zeros({2, 3});
  EXPECT_NE(ErrorOf([] { cat({}); }).find("cat: expected at least one tensor"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { cat({a, zeros({2, 4})}, 0); })
                .find("cat: tensors[1] is float32(2, 4) on cpu, tensors[0] float32(2, 3) on cpu: "
                      "sizes must match except in dim 0"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { cat({a, zeros({2, 3}, {.dtype = kFloat64})}); }).find("tensors[1]"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { cat({a, zeros({6})}); }).find("has 1 dims, tensors[0] 2"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { cat({a}, 2); }).find("cat: dim 2 is out of range"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { stack({a, zeros({3, 2})}); }).find("stack needs one shape"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { stack({a}, 3); }).find("stack: dim 3 is out of range"),
            std::string::npos);
}

TEST(RandintTest, InRangeReproducibleAndCoveringIt) {
  manual_seed(5);
  const std::vector<int64_t> first = randint(-3, 4, {2000}).to_vector<int64_t>();
  manual_seed(5);
  EXPECT_EQ(randint(-3, 4, {2000}).to_vector<int64_t>(), first);
  std::vector<int> counts(7, 0);
  for (int64_t v : first) {
    ASSERT_GE(v, -3);
    ASSERT_LT(v, 4);
    ++counts[static_cast<size_t>(v + 3)];
  }
  for (int c : counts) EXPECT_GT(c, 200);  // 2000 / 7 = 286 expected each
  EXPECT_EQ(randint(0, 10, {2, 3}).dtype(), kInt64);
  EXPECT_EQ(randint(0, 10, {2, 3}, {.dtype = kFloat32}).dtype(), kFloat32);
  EXPECT_NE(randint(0, 10, {20}).to_vector<int64_t>(), randint(0, 10, {20}).to_vector<int64_t>());
  EXPECT_NE(ErrorOf([] { randint(2, 2, {1}); }).find("randint: empty range [2, 2)"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem::nn
