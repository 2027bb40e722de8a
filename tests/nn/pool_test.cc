#include "nn/ops/pool.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
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

// H = 0 with padding: every window holds only padding. Both pools give 0 (the
// contract the CUDA side follows: cuDNN is not called there), and x's
// gradient is empty. Every dtype, through the default paths.
TEST(PoolTest, AllPaddingWindowsGiveZeroAndAnEmptyGradient) {
  const Pool2dParams p{.kernel = {2, 2}, .padding = {1, 0}};
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    for (bool max : {true, false}) {
      Tensor x = zeros({2, 3, 0, 4}, {.dtype = dt, .requires_grad = true});
      Tensor y = max ? max_pool2d(x, p) : avg_pool2d(x, p);
      ASSERT_EQ(y.shape(), (Shape{2, 3, 1, 2})) << DTypeName(dt) << (max ? " max" : " avg");
      EXPECT_EQ(y.to_vector<double>(), std::vector<double>(12, 0.0))
          << DTypeName(dt) << (max ? " max" : " avg");
      y.backward(ones(y.shape(), {.dtype = dt}));
      ASSERT_TRUE(x.grad().defined()) << DTypeName(dt);
      EXPECT_EQ(x.grad().shape(), x.shape()) << DTypeName(dt);
    }
  }
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


// --- Max-pool fast path (no padding) against the generic path (padding) -----
// The CPU max-pool has a fast path for float32 / float64 without padding (all
// windows inside; kernel == stride also in backward) and a generic one for the
// rest. A no-padding pool of x equals, in the output block [t, oh + t) x
// [u, ow + u), the padded pool (padding (1, 1)) of x' = x with q = stride - 1
// junk rows on top and r junk columns on the left, t = u = 1: window (oy + 1,
// ox + 1) of x' covers exactly window (oy, ox) of x, in the same row-major order,
// and junk windows get a zero gradient. So the two paths must agree bit for bit:
// values, argmax positions (seen through where backward routes dy) and dx.

// Bits of each element, so NaN == NaN and -0 != +0.
template <typename T>
std::vector<uint64_t> Bits(const std::vector<T>& v) {
  std::vector<uint64_t> out(v.size(), 0);
  for (size_t i = 0; i < v.size(); ++i) std::memcpy(&out[i], &v[i], sizeof(T));
  return out;
}

// Values with many ties: integers in [-2, 2], -0, and (with `nans`) NaN.
template <typename T>
std::vector<T> TiedValues(int64_t n, std::mt19937& rng, bool nans) {
  std::uniform_int_distribution<int> pick(0, nans ? 7 : 6);
  std::vector<T> v(static_cast<size_t>(n));
  for (T& e : v) {
    const int k = pick(rng);
    e = k <= 4 ? T(k - 2) : k == 5 ? T(-0.0) : k == 6 ? T(0.0) : std::numeric_limits<T>::quiet_NaN();
  }
  return v;
}

template <typename T>
void ExpectFastMatchesGeneric(int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                              int64_t sh, int64_t sw, bool nans, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "x (" << n << ", " << c << ", " << h << ", " << w
                                  << ") kernel " << kh << "x" << kw << " stride " << sh << "x"
                                  << sw << (nans ? " with NaN" : "") << " dtype "
                                  << sizeof(T) * 8);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int64_t planes = n * c, q = sh - 1, r = sw - 1, hp = h + q, wp = w + r;
  const std::vector<T> xv = TiedValues<T>(planes * h * w, rng, nans);
  // x' = x below q junk rows and right of r junk columns (junk: tied values too).
  std::vector<T> xpv = TiedValues<T>(planes * hp * wp, rng, nans);
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < h; ++i) {
      for (int64_t j = 0; j < w; ++j) {
        xpv[(p * hp + i + q) * wp + j + r] = xv[(p * h + i) * w + j];
      }
    }
  }
  Tensor x = from_vector(xv, {n, c, h, w}, {.requires_grad = true});
  Tensor xp = from_vector(xpv, {n, c, hp, wp}, {.requires_grad = true});
  const Pool2dParams fast{.kernel = {kh, kw}, .stride = {sh, sw}};
  const Pool2dParams generic{.kernel = {kh, kw}, .stride = {sh, sw}, .padding = {1, 1}};
  Tensor y = max_pool2d(x, fast), yp = max_pool2d(xp, generic);
  const int64_t oh = y.size(2), ow = y.size(3), ohp = yp.size(2), owp = yp.size(3);
  ASSERT_GE(ohp, oh + 1);
  ASSERT_GE(owp, ow + 1);
  // dy: distinct values (so a misrouted gradient shows) and some -0; dy' = dy in
  // the matching block, +0 elsewhere.
  std::vector<T> dyv(static_cast<size_t>(planes * oh * ow));
  for (size_t i = 0; i < dyv.size(); ++i) dyv[i] = i % 5 == 3 ? T(-0.0) : T(1 + i % 1000);
  std::vector<T> dypv(static_cast<size_t>(planes * ohp * owp), T(0));
  const std::vector<T> yv = y.template to_vector<T>(), ypv = yp.template to_vector<T>();
  std::vector<T> y_block;
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        const int64_t at = (p * ohp + i + 1) * owp + j + 1;
        y_block.push_back(ypv[at]);
        dypv[at] = dyv[(p * oh + i) * ow + j];
      }
    }
  }
  ASSERT_EQ(Bits(yv), Bits(y_block));
  y.backward(from_vector(dyv, y.shape()));
  yp.backward(from_vector(dypv, yp.shape()));
  const std::vector<T> dx = x.grad().template to_vector<T>(), dxp = xp.grad().template to_vector<T>();
  std::vector<T> dx_block;
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < h; ++i) {
      for (int64_t j = 0; j < w; ++j) dx_block.push_back(dxp[(p * hp + i + q) * wp + j + r]);
    }
  }
  ASSERT_EQ(Bits(dx), Bits(dx_block));
}

template <typename T>
void FastMatchesGenericAcrossShapes() {
  uint64_t seed = 100;
  // 2x2 stride 2: widths giving 1..9 outputs per row (SIMD groups of 4 / 2 and
  // the outputs after them), odd sizes leaving an unpooled last row / column.
  for (int64_t w : {2, 3, 6, 7, 8, 9, 10, 14, 15, 16, 17, 18, 28, 30}) {
    for (int64_t h : {2, 5, 8}) {
      for (bool nans : {false, true}) {
        ExpectFastMatchesGeneric<T>(2, 3, h, w, 2, 2, 2, 2, nans, seed++);
      }
    }
  }
  // Other kernel == stride shapes (generic fast forward, fast backward).
  ExpectFastMatchesGeneric<T>(2, 2, 9, 10, 3, 3, 3, 3, true, seed++);
  ExpectFastMatchesGeneric<T>(1, 3, 7, 11, 2, 3, 2, 3, true, seed++);
  ExpectFastMatchesGeneric<T>(1, 2, 8, 9, 3, 2, 3, 2, false, seed++);
  // Overlapping / sparse windows: fast forward, generic backward.
  ExpectFastMatchesGeneric<T>(2, 2, 7, 9, 2, 2, 1, 1, true, seed++);
  ExpectFastMatchesGeneric<T>(1, 2, 9, 9, 3, 3, 2, 2, true, seed++);
  ExpectFastMatchesGeneric<T>(1, 2, 9, 11, 2, 2, 3, 3, false, seed++);
  // A ConvNet-sized float32 batch.
  ExpectFastMatchesGeneric<T>(4, 8, 30, 30, 2, 2, 2, 2, false, seed++);
  ExpectFastMatchesGeneric<T>(4, 8, 13, 13, 2, 2, 2, 2, true, seed++);
}

TEST(PoolFastPathTest, Float32MatchesGenericBitForBit) { FastMatchesGenericAcrossShapes<float>(); }
TEST(PoolFastPathTest, Float64MatchesGenericBitForBit) { FastMatchesGenericAcrossShapes<double>(); }

TEST(PoolFastPathTest, TiesNaNAndSignedZeroKeepTheFirstElement) {
  // Windows of 2x2 stride 2 (fast path), one per case, in row-major order:
  //   ties -> the first maximum; NaN first -> NaN; NaN later -> ignored;
  //   -0 then +0 -> -0 (no '>' between them).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> windows[] = {
      {1, 3, 3, 3}, {0, 1, 2, 2}, {nan, 5, 6, 7}, {1, nan, 2, nan}, {-0.0f, 0.0f, 0.0f, -1},
      {-1, -1, -1, -1}, {-2, -1, -1, -1}};
  const float want_y[] = {3, 2, nan, 2, -0.0f, -1, -1};
  const int want_at[] = {1, 2, 0, 2, 0, 0, 1};
  for (size_t k = 0; k < std::size(windows); ++k) {
    SCOPED_TRACE(k);
    // Eight windows in one row so the SIMD path (groups of 4) sees it at every lane.
    for (int lane = 0; lane < 8; ++lane) {
      std::vector<float> xv(2 * 16, 7.0f);  // other windows: all 7
      xv[2 * lane] = windows[k][0], xv[2 * lane + 1] = windows[k][1];
      xv[16 + 2 * lane] = windows[k][2], xv[16 + 2 * lane + 1] = windows[k][3];
      Tensor x = from_vector(xv, {1, 1, 2, 16}, {.requires_grad = true});
      Tensor y = max_pool2d(x);
      const float got = y.to_vector<float>()[lane];
      EXPECT_EQ(Bits(std::vector<float>{got}), Bits(std::vector<float>{want_y[k]})) << lane;
      y.backward(ones(y.shape()));
      const auto g = x.grad().to_vector<float>();
      const int at = want_at[k];
      const int64_t pos = (at / 2) * 16 + 2 * lane + at % 2;
      EXPECT_EQ(g[pos], 1.0f) << lane;
      float window_sum = g[2 * lane] + g[2 * lane + 1] + g[16 + 2 * lane] + g[16 + 2 * lane + 1];
      EXPECT_EQ(window_sum, 1.0f) << lane;
    }
  }
}

}  // namespace
}  // namespace tandem::nn
