// The Winograd F(4x4, 3x3) convolutions (nn/ops/conv_winograd_cpu.cc): output and
// gradients against float64, which shapes take them, and their repeatability.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/autograd.h"
#include "nn/ops/conv.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/matmul.h"  // set_cpu_blas_threads
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using ops::internal::Conv2dGeometry;
using ops::internal::CpuConvPath;
using ops::internal::UseWinograd;
using ::tandem::testing::ScaledError;

Conv2dGeometry GeometryOf(const Shape& x, const Shape& w, const Conv2dParams& p) {
  Conv2dGeometry g{.n = x[0], .c = x[1], .h = x[2], .w = x[3], .o = w[0], .kh = w[2], .kw = w[3]};
  g.params = p;
  g.oh = (g.h + 2 * p.padding[0] - p.dilation[0] * (g.kh - 1) - 1) / p.stride[0] + 1;
  g.ow = (g.w + 2 * p.padding[1] - p.dilation[1] * (g.kw - 1) - 1) / p.stride[1] + 1;
  return g;
}

// y, dx, dweight, dbias of conv2d on copies of x, w, b in `dtype`, with dy.
std::vector<Tensor> RunConv(const Tensor& x0, const Tensor& w0, const Tensor& b0,
                            const Tensor& dy0, const Conv2dParams& p, DType dtype) {
  Tensor x = x0.detach().to(dtype).set_requires_grad(true);
  Tensor w = w0.detach().to(dtype).set_requires_grad(true);
  Tensor b = b0.detach().to(dtype).set_requires_grad(true);
  Tensor y = conv2d(x, w, b, p);
  y.backward(dy0.to(dtype));
  return {y, x.grad(), w.grad(), b.grad()};
}

// Every padding up to 2 on sizes that are not multiples of the 4x4 output
// tiles, 1x1 and 2x2 outputs, channel counts around the weight transforms'
// blocks of 64 filters, and a batch that spans several chunks of images: the
// float32 result and all three gradients within 2e-5 of the float64 one,
// relative to the largest magnitude (a direct float32 convolution is within
// about 2e-6; F(4x4, 3x3)'s transforms add up to ten times that).
TEST(ConvWinogradTest, MatchesFloat64AcrossPaddingsAndSizes) {
  const testing::RestoreCpuConv restore;
  struct Case {
    Shape x, w;
    Conv2dParams p;
  };
  std::vector<Case> cases;
  for (const auto& [ph, pw] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 0}, {1, 1}, {2, 2}, {0, 2}, {2, 1}}) {
    cases.push_back({{2, 5, 9, 7}, {6, 5, 3, 3}, {.padding = {ph, pw}}});
  }
  cases.push_back({{3, 4, 1, 1}, {2, 4, 3, 3}, {.padding = {1, 1}}});   // 1x1 output
  cases.push_back({{3, 4, 1, 2}, {2, 4, 3, 3}, {.padding = {2, 2}}});   // 3x4 output
  cases.push_back({{1, 3, 4, 4}, {5, 3, 3, 3}, {}});                    // 2x2 output
  cases.push_back({{2, 70, 6, 6}, {66, 70, 3, 3}, {.padding = {1, 1}}});  // 64 + tail filters
  cases.push_back({{9, 64, 32, 32}, {64, 64, 3, 3}, {.padding = {1, 1}}});  // 2 chunks
  manual_seed(41);
  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  for (const Case& c : cases) {
    const std::string where = absl::StrCat("x ", ShapeToString(c.x), ", weight ",
                                           ShapeToString(c.w), ", padding ", c.p.padding[0], ",",
                                           c.p.padding[1]);
    ASSERT_TRUE(UseWinograd(kFloat32, GeometryOf(c.x, c.w, c.p))) << where;
    const Tensor x = randn(c.x, {.dtype = kFloat64});
    const Tensor w = randn(c.w, {.dtype = kFloat64});
    const Tensor b = randn({c.w[0]}, {.dtype = kFloat64});
    const Tensor dy = randn(conv2d(x, w, b, c.p).shape(), {.dtype = kFloat64});
    const std::vector<Tensor> want = RunConv(x, w, b, dy, c.p, kFloat64);
    const std::vector<Tensor> got = RunConv(x, w, b, dy, c.p, kFloat32);
    for (size_t k = 0; k < got.size(); ++k) {
      ASSERT_EQ(got[k].shape(), want[k].shape()) << where;
      EXPECT_LT(ScaledError(got[k], want[k]), 2e-5) << "output/gradient " << k << ", " << where;
    }
  }
}

// Same inputs, same thread count: the same bits (the chunking and the GEMMs'
// split depend on the shapes and the thread count only).
TEST(ConvWinogradTest, RepeatsBitForBitAtEachThreadCount) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  manual_seed(42);
  const Tensor x = randn({4, 64, 12, 10}), w = randn({72, 64, 3, 3}), b = randn({72});
  const Conv2dParams p{.padding = {1, 1}};
  const Tensor dy = randn({4, 72, 12, 10});
  for (int threads : {1, 2}) {
    set_cpu_blas_threads(threads);
    const std::vector<Tensor> first = RunConv(x, w, b, dy, p, kFloat32);
    const std::vector<Tensor> again = RunConv(x, w, b, dy, p, kFloat32);
    for (size_t k = 0; k < first.size(); ++k) {
      EXPECT_EQ(first[k].to_vector<float>(), again[k].to_vector<float>())
          << "output/gradient " << k << ", " << threads << " thread(s)";
    }
  }
}

// kAuto takes Winograd for ResNet-18's 3x3 layers and not where it does not pay
// or does not apply; kWinograd for every shape it applies to; the other paths never.
TEST(ConvWinogradTest, AutoTakesWinogradWhereItPays) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  const Conv2dParams same{.padding = {1, 1}};
  for (const auto& [c, hw] : std::vector<std::pair<int64_t, int64_t>>{
           {64, 32}, {128, 16}, {256, 8}, {512, 4}}) {
    EXPECT_TRUE(UseWinograd(kFloat32, GeometryOf({32, c, hw, hw}, {c, c, 3, 3}, same)))
        << c << " channels, " << hw << "x" << hw;
    EXPECT_FALSE(UseWinograd(kFloat64, GeometryOf({32, c, hw, hw}, {c, c, 3, 3}, same)));
    EXPECT_FALSE(UseWinograd(kBFloat16, GeometryOf({32, c, hw, hw}, {c, c, 3, 3}, same)));
  }
  // Too small to pay: the ConvNet's layers, few channels, a 6x6 input.
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf({32, 32, 15, 15}, {64, 32, 3, 3}, {})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf({32, 64, 6, 6}, {64, 64, 3, 3}, {})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf({32, 16, 32, 32}, {16, 16, 3, 3}, same)));
  // Not a stride-1, undilated, ungrouped 3x3 convolution with padding <= 2.
  const Shape x{8, 64, 32, 32};
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 64, 5, 5}, {.padding = {2, 2}})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 64, 3, 3}, {.stride = {2, 2}})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 64, 3, 3}, {.dilation = {2, 2}})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 32, 3, 3}, {.groups = 2})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 64, 3, 3}, {.padding = {3, 3}})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf({8, 64, 0, 4}, {64, 64, 3, 3}, same)));

  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  EXPECT_TRUE(UseWinograd(kFloat32, GeometryOf({1, 1, 3, 3}, {1, 1, 3, 3}, {})));
  EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 64, 3, 3}, {.stride = {2, 2}})));
  for (CpuConvPath path : {CpuConvPath::kIm2col, CpuConvPath::kDnnl, CpuConvPath::kDnnlBlocked,
                           CpuConvPath::kDnnlNhwc}) {
    ops::internal::SetCpuConvPath(path);
    EXPECT_FALSE(UseWinograd(kFloat32, GeometryOf(x, {64, 64, 3, 3}, same)))
        << "path " << static_cast<int>(path);
  }
}

// An infinite input makes the whole 4x4 output tile that reads it non-finite
// (the transforms mix the 6x6 patch), where a direct convolution spoils only the
// 3x3 window around it; every other output is finite and as without it.
TEST(ConvWinogradTest, NonFiniteInputSpoilsOnlyItsOutputTile) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  manual_seed(43);
  const Tensor x = randn({1, 2, 12, 12}), w = randn({3, 2, 3, 3});
  const Conv2dParams p{.padding = {1, 1}};
  std::vector<float> xv = x.to_vector<float>();
  xv[5 * 12 + 5] = std::numeric_limits<float>::infinity();  // channel 0, (5, 5)
  const std::vector<float> y = conv2d(from_vector<float>(xv, {1, 2, 12, 12}), w, Tensor(), p)
                                   .to_vector<float>();
  const std::vector<float> clean = conv2d(x, w, Tensor(), p).to_vector<float>();
  // Input row 5 is read by the tile of output rows 4..7 only (it reads rows 3..8).
  for (int64_t o = 0; o < 3; ++o) {
    for (int64_t oy = 0; oy < 12; ++oy) {
      for (int64_t ox = 0; ox < 12; ++ox) {
        const size_t i = (o * 12 + oy) * 12 + ox;
        const bool in_tile = oy >= 4 && oy < 8 && ox >= 4 && ox < 8;
        if (in_tile) {
          EXPECT_FALSE(std::isfinite(y[i])) << "output " << o << " (" << oy << ", " << ox << ")";
        } else {
          EXPECT_EQ(y[i], clean[i]) << "output " << o << " (" << oy << ", " << ox << ")";
        }
      }
    }
  }
}

}  // namespace
}  // namespace tandem::nn
