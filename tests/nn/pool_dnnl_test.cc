// float32 CPU pooling on each implementation (CpuPoolPath: our loops and, where
// tandem is built with oneDNN, oneDNN on NCHW, NHWC and nChw16c) against our
// loops and float64: max pooling exactly (values and where each gradient goes,
// ties included), average pooling within float32 rounding; each run repeated
// bit for bit at 1 and 2 threads. float64 always runs our loops (pool_test.cc's
// gradchecks).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads
#include "nn/ops/internal/pool_kernels.h"  // CpuPoolPath
#include "nn/ops/pool.h"
#include "nn/random.h"

namespace tandem::nn {
namespace {

using ops::internal::CpuPoolPath;

// Restores the thread count and kAuto when a test ends.
struct Restore {
  int threads = cpu_blas_threads();
  ~Restore() {
    set_cpu_blas_threads(threads);
    ops::internal::SetCpuPoolPath(CpuPoolPath::kAuto);
  }
};

std::vector<CpuPoolPath> DnnlPaths() {
  if (!ops::internal::CpuPoolDnnlBuilt()) return {};
  return {CpuPoolPath::kDnnl, CpuPoolPath::kDnnlNhwc, CpuPoolPath::kDnnlBlocked};
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) std::memcpy(&out[i], &v[i], sizeof(float));
  return out;
}

struct Case {
  Shape x;
  Pool2dParams p;
};

// The models' pools (LeNet: 20 channels, 28 -> 14 and 14 -> 7; ConvNet: 32 x 30
// -> 15, 64 x 13 -> 6, the last row and column unread), then padding, overlap,
// uneven strides and kernels on small inputs, 20 channels (off oneDNN's 16-channel
// block).
std::vector<Case> Cases() {
  return {{{3, 20, 28, 28}, {}},
          {{3, 20, 14, 14}, {}},
          {{2, 32, 30, 30}, {}},
          {{2, 64, 13, 13}, {}},
          {{2, 20, 9, 9}, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}},
          {{2, 20, 7, 6}, {.kernel = {3, 3}, .stride = {1, 1}}},
          {{2, 3, 7, 6}, {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}}},
          {{2, 3, 7, 6}, {.kernel = {2, 3}, .stride = {1, 2}, .padding = {1, 0}}},
          {{1, 5, 5, 8}, {.kernel = {2, 2}, .stride = {2, 2}, .padding = {1, 1}}}};
}

std::string Where(CpuPoolPath path, int threads, const Case& c, bool max) {
  return absl::StrCat(max ? "max" : "avg", " path ", static_cast<int>(path),
                      " (1 own, 2 oneDNN NCHW, 3 blocked, 4 NHWC), ", threads, " thread(s), x ",
                      ShapeToString(c.x), " kernel ", c.p.kernel[0], "x", c.p.kernel[1],
                      " stride ", c.p.stride[0], "x", c.p.stride[1], " padding ", c.p.padding[0],
                      "x", c.p.padding[1]);
}

// y and dx of one float32 pooling of x32 with output gradient dy32.
std::pair<std::vector<float>, std::vector<float>> Pool32(const Tensor& x32, const Tensor& dy32,
                                                         const Pool2dParams& p, bool max) {
  Tensor x = x32.detach().set_requires_grad(true);
  Tensor y = max ? max_pool2d(x, p) : avg_pool2d(x, p);
  y.backward(dy32);
  return {y.to_vector<float>(), x.grad().to_vector<float>()};
}

// Small integers with many ties (max pooling) as x; small integers as dy, so that
// every gradient sum is exact in float32 and comparable bit for bit whatever the
// order of summation.
Tensor SmallIntegers(const Shape& shape, int lo, int hi, std::mt19937& rng, DType dtype) {
  std::uniform_int_distribution<int> pick(lo, hi);
  std::vector<double> v(static_cast<size_t>(NumElements(shape)));
  for (double& e : v) e = pick(rng);
  return from_vector(v, shape, {.dtype = dtype});
}

TEST(PoolDnnlTest, MaxPoolEachPathMatchesOwnBitForBitWithTies) {
  Restore restore;
  std::mt19937 rng(5);
  for (const Case& c : Cases()) {
    for (bool ties : {true, false}) {
      Tensor x = ties ? SmallIntegers(c.x, -2, 2, rng, kFloat32) : randn(c.x);
      ops::internal::SetCpuPoolPath(CpuPoolPath::kOwn);
      Tensor y_shape = max_pool2d(x, c.p);
      Tensor dy = SmallIntegers(y_shape.shape(), 1, 8, rng, kFloat32);
      const auto want = Pool32(x, dy, c.p, true);
      // float64 on our loops: the same maxima.
      const auto want64 = max_pool2d(x.to(kFloat64), c.p).to_vector<double>();
      for (size_t i = 0; i < want64.size(); ++i) ASSERT_EQ(want.first[i], want64[i]);
      for (CpuPoolPath path : DnnlPaths()) {
        ops::internal::SetCpuPoolPath(path);
        for (int t : {1, 2}) {
          set_cpu_blas_threads(t);
          const std::string where = Where(path, t, c, true) + (ties ? " ties" : "");
          for (int run = 0; run < 2; ++run) {
            const auto got = Pool32(x, dy, c.p, true);
            EXPECT_EQ(Bits(got.first), Bits(want.first)) << "y, run " << run << ", " << where;
            EXPECT_EQ(Bits(got.second), Bits(want.second)) << "dx, run " << run << ", " << where;
          }
        }
      }
    }
  }
}

TEST(PoolDnnlTest, AvgPoolEachPathMatchesFloat64AndRepeatsBitForBit) {
  Restore restore;
  manual_seed(9);
  std::vector<CpuPoolPath> paths = {CpuPoolPath::kOwn};
  for (CpuPoolPath path : DnnlPaths()) paths.push_back(path);
  for (const Case& c : Cases()) {
    Tensor x64 = randn(c.x, {.dtype = kFloat64}).set_requires_grad(true);
    Tensor y64 = avg_pool2d(x64, c.p);
    Tensor dy64 = randn(y64.shape(), {.dtype = kFloat64});
    y64.backward(dy64);
    const auto want_y = y64.to_vector<double>(), want_dx = x64.grad().to_vector<double>();
    Tensor x = x64.detach().to(kFloat32), dy = dy64.to(kFloat32);
    for (CpuPoolPath path : paths) {
      ops::internal::SetCpuPoolPath(path);
      for (int t : {1, 2}) {
        set_cpu_blas_threads(t);
        const std::string where = Where(path, t, c, false);
        const auto first = Pool32(x, dy, c.p, false);
        ASSERT_EQ(first.first.size(), want_y.size());
        ASSERT_EQ(first.second.size(), want_dx.size());
        // At most kh * kw (or, for dx, overlapping windows' worth of) float32 roundings.
        for (size_t i = 0; i < want_y.size(); ++i) {
          ASSERT_NEAR(first.first[i], want_y[i], 1e-5 * (1 + std::abs(want_y[i])))
              << i << " " << where;
        }
        for (size_t i = 0; i < want_dx.size(); ++i) {
          ASSERT_NEAR(first.second[i], want_dx[i], 1e-5 * (1 + std::abs(want_dx[i])))
              << i << " " << where;
        }
        const auto again = Pool32(x, dy, c.p, false);
        EXPECT_EQ(Bits(again.first), Bits(first.first)) << "y not repeated, " << where;
        EXPECT_EQ(Bits(again.second), Bits(first.second)) << "dx not repeated, " << where;
      }
    }
  }
}

TEST(PoolDnnlTest, Float64AndAutoStayOnOwnLoopsWhereChosen) {
  Restore restore;
  // An explicit path resolves to that path.
  ops::internal::SetCpuPoolPath(CpuPoolPath::kAuto);
  const ops::internal::Pool2dGeometry g{.n = 2, .c = 20, .h = 28, .w = 28, .kh = 2, .kw = 2,
                                        .sh = 2, .sw = 2, .ph = 0, .pw = 0, .oh = 14, .ow = 14};
  // The measured choice (docs/benchmarks.md): max on our loops, avg on oneDNN NCHW.
  EXPECT_EQ(ops::internal::ResolveCpuPoolPath(g, true), CpuPoolPath::kOwn);
  EXPECT_EQ(ops::internal::ResolveCpuPoolPath(g, false), ops::internal::CpuPoolDnnlBuilt()
                                                             ? CpuPoolPath::kDnnl
                                                             : CpuPoolPath::kOwn);
  for (CpuPoolPath path : DnnlPaths()) {
    ops::internal::SetCpuPoolPath(path);
    EXPECT_EQ(ops::internal::ResolveCpuPoolPath(g, true), path);
    // float64 ignores the switch: the NaN-first semantics of our loops hold.
    const double nan = std::nan("");
    Tensor x = from_vector(std::vector<double>{nan, 1, 2, 3}, {1, 1, 2, 2});
    EXPECT_TRUE(std::isnan(max_pool2d(x).to_vector<double>()[0]));
  }
}


// Where oneDNN differs from our loops (documented in pool_dnnl.cc / pool_kernels.h):
// it ignores NaN, also as a window's first element (ours keeps that one; PyTorch
// propagates any NaN), and a window of only NaN gives -FLT_MAX with the gradient
// on its first element. Signed zeros and ties follow ours.
TEST(PoolDnnlTest, MaxPoolIgnoresNaNOnOneDnnl) {
  Restore restore;
  const float nan = std::nanf("");
  struct Window {
    std::vector<float> x;
    float y;
    int at;
  };
  const Window windows[] = {{{nan, 5, 6, 7}, 7, 3},
                            {{1, nan, 2, nan}, 2, 2},
                            {{nan, nan, nan, nan}, -std::numeric_limits<float>::max(), 0},
                            {{-0.0f, 0.0f, 0.0f, -1}, -0.0f, 0}};
  for (CpuPoolPath path : DnnlPaths()) {
    ops::internal::SetCpuPoolPath(path);
    for (const Window& w : windows) {
      Tensor x = from_vector(w.x, {1, 1, 2, 2}, {.requires_grad = true});
      Tensor y = max_pool2d(x);
      y.backward(ones(y.shape()));
      EXPECT_EQ(Bits(y.to_vector<float>()), Bits({w.y})) << static_cast<int>(path);
      std::vector<float> want_dx(4, 0.0f);
      want_dx[w.at] = 1.0f;
      EXPECT_EQ(x.grad().to_vector<float>(), want_dx) << static_cast<int>(path);
    }
  }
}

}  // namespace
}  // namespace tandem::nn
