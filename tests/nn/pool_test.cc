#include "nn/ops/pool.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

// Direct loops, the definition of both poolings (max: -inf padding; avg: zero
// padding counted in the divisor).
std::vector<double> NaivePool(const Tensor& x, const Pool2dParams& p, bool max) {
  const auto xv = x.to_vector<double>();
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t kh = p.kernel[0], kw = p.kernel[1];
  const int64_t sh = p.stride[0] ? p.stride[0] : kh, sw = p.stride[1] ? p.stride[1] : kw;
  const int64_t oh = (h + 2 * p.padding[0] - kh) / sh + 1;
  const int64_t ow = (w + 2 * p.padding[1] - kw) / sw + 1;
  std::vector<double> y;
  for (int64_t pl = 0; pl < planes; ++pl) {
    for (int64_t oy = 0; oy < oh; ++oy) {
      for (int64_t ox = 0; ox < ow; ++ox) {
        double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
        for (int64_t i = 0; i < kh; ++i) {
          for (int64_t j = 0; j < kw; ++j) {
            const int64_t iy = oy * sh - p.padding[0] + i, ix = ox * sw - p.padding[1] + j;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            const double v = xv[(pl * h + iy) * w + ix];
            acc = max ? std::max(acc, v) : acc + v;
          }
        }
        y.push_back(max ? acc : acc / static_cast<double>(kh * kw));
      }
    }
  }
  return y;
}

std::vector<Pool2dParams> Variants() {
  return {
      {},                                                  // 2x2, stride = kernel
      {.kernel = {3, 3}, .stride = {1, 1}},                // overlapping windows
      {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}},
      {.kernel = {2, 3}, .stride = {1, 2}, .padding = {1, 0}},
  };
}

// Distinct values (a shuffled ramp with gaps of 0.05): no ties, so the max-pool
// gradient check never straddles a switch of the argmax.
Tensor DistinctInput(const Shape& shape, uint64_t seed) {
  const int64_t n = NumElements(shape);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = 0.05 * static_cast<double>((i * 7 + seed) % n) - 1.0;
  return from_vector(v, shape, {.requires_grad = true});
}

TEST(PoolTest, MatchesNaiveLoops) {
  manual_seed(21);
  for (const Pool2dParams& p : Variants()) {
    Tensor x = randn({2, 3, 7, 6}, {.dtype = kFloat64});
    const auto mx = max_pool2d(x, p).to_vector<double>();
    const auto av = avg_pool2d(x, p).to_vector<double>();
    const auto want_mx = NaivePool(x, p, true), want_av = NaivePool(x, p, false);
    ASSERT_EQ(mx.size(), want_mx.size());
    ASSERT_EQ(av.size(), want_av.size());
    for (size_t i = 0; i < mx.size(); ++i) ASSERT_EQ(mx[i], want_mx[i]) << i;
    for (size_t i = 0; i < av.size(); ++i) ASSERT_NEAR(av[i], want_av[i], 1e-12) << i;
  }
}

TEST(PoolTest, MaxPoolPaddingIsMinusInfinity) {
  // All-negative input: a zero padding would win; -inf padding never does.
  Tensor x = full({1, 1, 2, 2}, -3.0);
  Tensor y = max_pool2d(x, {.kernel = {2, 2}, .stride = {1, 1}, .padding = {1, 1}});
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(9, -3.0f));
  // Avg counts padding in the divisor: the corner window holds one real element.
  Tensor a = avg_pool2d(full({1, 1, 2, 2}, 4.0), {.kernel = {2, 2}, .stride = {1, 1}, .padding = {1, 1}});
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2, 1, 2, 4, 2, 1, 2, 1}));
}

TEST(PoolTest, TieSendsGradientToTheFirstMaximum) {
  Tensor x = from_vector(std::vector<double>{5, 5, 1, 5}, {1, 1, 2, 2}, {.requires_grad = true});
  max_pool2d(x).backward(ones({1, 1, 1, 1}, {.dtype = kFloat64}));
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{1, 0, 0, 0}));
  Tensor z = from_vector(std::vector<double>{0, 2, 3, 3}, {1, 1, 2, 2}, {.requires_grad = true});
  max_pool2d(z).backward(ones({1, 1, 1, 1}, {.dtype = kFloat64}));
  EXPECT_EQ(z.grad().to_vector<double>(), (std::vector<double>{0, 0, 1, 0}));
}

TEST(PoolTest, OverlappingWindowsAccumulateGradient) {
  // One dominant element inside every 2x2 window of a 3x3 input (stride 1).
  Tensor x = from_vector(std::vector<double>{0, 0, 0, 0, 9, 0, 0, 0, 0}, {1, 1, 3, 3},
                         {.requires_grad = true});
  max_pool2d(x, {.kernel = {2, 2}, .stride = {1, 1}}).backward(ones({1, 1, 2, 2}, {.dtype = kFloat64}));
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0, 0, 0, 4, 0, 0, 0, 0}));
}

TEST(PoolTest, ShapeErrorsNameOpAndShapes) {
  try {
    max_pool2d(zeros({2, 3, 8}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("max_pool2d"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3, 8)"), std::string::npos) << m;
  }
  try {
    avg_pool2d(zeros({1, 1, 2, 2}), {.kernel = {3, 3}});
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("avg_pool2d"), std::string::npos) << m;
    EXPECT_NE(m.find("(1, 1, 2, 2)"), std::string::npos) << m;
  }
  EXPECT_THROW(max_pool2d(zeros({1, 1, 4, 4}), {.kernel = {2, 2}, .padding = {2, 0}}), Error);
  EXPECT_THROW(max_pool2d(zeros({1, 1, 4, 4}), {.kernel = {0, 2}}), Error);
  EXPECT_THROW(max_pool2d(zeros({1, 1, 4, 4}, {.dtype = kInt64})), Error);
}

TEST(PoolGradTest, MaxPoolAcrossVariants) {
  uint64_t seed = 1;
  for (const Pool2dParams& p : Variants()) {
    EXPECT_TRUE(GradCheck([&](const auto& in) { return max_pool2d(in[0], p); },
                          {DistinctInput({2, 2, 6, 5}, seed++)}))
        << "kernel " << p.kernel[0] << "," << p.kernel[1];
  }
}

TEST(PoolGradTest, AvgPoolAcrossVariants) {
  manual_seed(22);
  for (const Pool2dParams& p : Variants()) {
    EXPECT_TRUE(GradCheck([&](const auto& in) { return avg_pool2d(in[0], p); },
                          {RandomInput({2, 2, 6, 5})}))
        << "kernel " << p.kernel[0] << "," << p.kernel[1];
  }
}

}  // namespace
}  // namespace tandem::nn
