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
#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using ops::internal::Conv2dGeometryOf;
using ops::internal::CpuConvPath;
using ops::internal::UseWinograd;
using ::tandem::testing::ScaledError;
using testing::TakesWinograd;

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
  cases.push_back({{2, 6, 5, 33}, {4, 6, 3, 3}, {.padding = {1, 1}}});  // 9 tiles per row
  cases.push_back({{9, 64, 32, 32}, {64, 64, 3, 3}, {.padding = {1, 1}}});  // 2 chunks
  manual_seed(41);
  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  for (const Case& c : cases) {
    const std::string where = absl::StrCat("x ", ShapeToString(c.x), ", weight ",
                                           ShapeToString(c.w), ", padding ", c.p.padding[0], ",",
                                           c.p.padding[1]);
    ASSERT_TRUE(TakesWinograd(c.x, c.w, c.p)) << where;
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
// or does not apply; kWinograd for every shape it applies to; the other paths
// never. (bfloat16 convolutions run the float32 kernels on widened copies and
// so take the float32 choice: UseWinograd is asked with kFloat32 then.)
TEST(ConvWinogradTest, AutoTakesWinogradWhereItPays) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  const Conv2dParams same{.padding = {1, 1}};
  for (const auto& [c, hw] : std::vector<std::pair<int64_t, int64_t>>{
           {64, 32}, {128, 16}, {256, 8}, {512, 4}}) {
    EXPECT_TRUE(UseWinograd(kFloat32, Conv2dGeometryOf({32, c, hw, hw}, {c, c, 3, 3}, same)))
        << c << " channels, " << hw << "x" << hw;
    EXPECT_FALSE(UseWinograd(kFloat64, Conv2dGeometryOf({32, c, hw, hw}, {c, c, 3, 3}, same)));
  }
  // Too small to pay: the ConvNet's layers, few channels, a 6x6 input.
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf({32, 32, 15, 15}, {64, 32, 3, 3}, {})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf({32, 64, 6, 6}, {64, 64, 3, 3}, {})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf({32, 16, 32, 32}, {16, 16, 3, 3}, same)));
  // Not a stride-1, undilated, ungrouped 3x3 convolution with padding <= 2.
  const Shape x{8, 64, 32, 32};
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 64, 5, 5}, {.padding = {2, 2}})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 64, 3, 3}, {.stride = {2, 2}})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 64, 3, 3}, {.dilation = {2, 2}})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 32, 3, 3}, {.groups = 2})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 64, 3, 3}, {.padding = {3, 3}})));
  // An empty plane (padding 2: conv2d takes it, its output all padding).
  EXPECT_FALSE(
      UseWinograd(kFloat32, Conv2dGeometryOf({8, 64, 0, 4}, {64, 64, 3, 3}, {.padding = {2, 2}})));

  // nn::set_cpu_winograd(false) turns kAuto's choice off (and the backend's report).
  const Shape resnet_x{32, 64, 32, 32}, resnet_w{64, 64, 3, 3};
  EXPECT_TRUE(cpu_winograd());
  EXPECT_NE(cpu_conv_backend().find("Winograd"), std::string::npos) << cpu_conv_backend();
  set_cpu_winograd(false);
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(resnet_x, resnet_w, same)));
  EXPECT_EQ(cpu_conv_backend().find("Winograd"), std::string::npos) << cpu_conv_backend();

  // kWinograd: wherever it applies (the switch does not bind it).
  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  EXPECT_TRUE(UseWinograd(kFloat32, Conv2dGeometryOf(resnet_x, resnet_w, same)));
  set_cpu_winograd(true);
  EXPECT_TRUE(UseWinograd(kFloat32, Conv2dGeometryOf({1, 2, 3, 3}, {1, 2, 3, 3}, {})));
  // One channel in and out is depthwise: the direct depthwise kernels take it.
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf({1, 1, 3, 3}, {1, 1, 3, 3}, {})));
  EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 64, 3, 3}, {.stride = {2, 2}})));
  for (CpuConvPath path : {CpuConvPath::kIm2col, CpuConvPath::kDnnl, CpuConvPath::kDnnlBlocked,
                           CpuConvPath::kDnnlNhwc}) {
    ops::internal::SetCpuConvPath(path);
    EXPECT_FALSE(UseWinograd(kFloat32, Conv2dGeometryOf(x, {64, 64, 3, 3}, same)))
        << "path " << static_cast<int>(path);
  }
}

// An infinite input spoils at most the 4x4 blocks of outputs of the tiles whose
// 6x6 patches hold it (the transforms mix a patch; a direct convolution spoils
// only the 3x3 window around it) and at least that window; every other output
// keeps its bits. Inside a patch, (5, 5) spoils its whole block; on a patch's
// edge, (4, 4) is read by four tiles.
TEST(ConvWinogradTest, NonFiniteInputSpoilsOnlyTheTilesThatReadIt) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kWinograd);
  manual_seed(43);
  const Tensor x = randn({1, 2, 12, 12}), w = randn({3, 2, 3, 3});
  const Conv2dParams p{.padding = {1, 1}};
  const std::vector<float> clean = conv2d(x, w, Tensor(), p).to_vector<float>();
  struct Case {
    int64_t iy, ix;    // the infinite input (channel 0)
    int64_t lo, hi;    // the rows and columns [lo, hi) of the tiles that read it
    bool whole_block;  // every output there non-finite
  };
  // Tile ty reads input rows 4 ty - 1 .. 4 ty + 4.
  for (const Case& c : {Case{5, 5, 4, 8, true}, Case{4, 4, 0, 8, false}}) {
    std::vector<float> xv = x.to_vector<float>();
    xv[c.iy * 12 + c.ix] = std::numeric_limits<float>::infinity();
    const std::vector<float> y =
        conv2d(from_vector<float>(xv, {1, 2, 12, 12}), w, Tensor(), p).to_vector<float>();
    for (int64_t o = 0; o < 3; ++o) {
      for (int64_t oy = 0; oy < 12; ++oy) {
        for (int64_t ox = 0; ox < 12; ++ox) {
          const size_t i = (o * 12 + oy) * 12 + ox;
          const std::string at = absl::StrCat("inf at (", c.iy, ", ", c.ix, "), output ", o,
                                              " (", oy, ", ", ox, ")");
          const bool window = std::abs(oy - c.iy) <= 1 && std::abs(ox - c.ix) <= 1;
          const bool tiles = oy >= c.lo && oy < c.hi && ox >= c.lo && ox < c.hi;
          if (window || (tiles && c.whole_block)) {
            EXPECT_FALSE(std::isfinite(y[i])) << at;
          } else if (!tiles) {
            EXPECT_EQ(y[i], clean[i]) << at;
          }
        }
      }
    }
  }
}

// conv2d_relu on the Winograd kernels is relu(conv2d) bit for bit, forward and
// backward; kAuto runs a ResNet-sized layer's forward and both gradients on them
// (the same bits as kWinograd, other bits than oneDNN's or im2col's).
TEST(ConvWinogradTest, FusedReluAndTheAutoPathRunTheSameKernels) {
  const testing::RestoreCpuConv restore;
  manual_seed(44);
  const Shape xs{2, 64, 16, 16}, ws{64, 64, 3, 3};
  const Conv2dParams p{.padding = {1, 1}};
  const Tensor x0 = randn(xs), w0 = randn(ws), b0 = randn({64}), dy = randn({2, 64, 16, 16});
  auto run = [&](CpuConvPath path, bool fused) {
    ops::internal::SetCpuConvPath(path);
    Tensor x = x0.detach().set_requires_grad(true);
    Tensor w = w0.detach().set_requires_grad(true);
    Tensor b = b0.detach().set_requires_grad(true);
    Tensor y = fused ? conv2d_relu(x, w, b, p) : relu(conv2d(x, w, b, p));
    y.backward(dy);
    std::vector<std::vector<float>> out;
    for (const Tensor& t : {y, x.grad(), w.grad(), b.grad()}) out.push_back(t.to_vector<float>());
    return out;
  };
  const auto winograd = run(CpuConvPath::kWinograd, false);
  EXPECT_EQ(run(CpuConvPath::kWinograd, true), winograd);
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  ASSERT_TRUE(TakesWinograd(xs, ws, p));
  EXPECT_EQ(run(CpuConvPath::kAuto, true), winograd);
  const auto other = run(CpuConvPath::kIm2col, false);
  for (size_t k = 0; k < 3; ++k) {  // y, dx, dweight (dbias is a plain sum of dy)
    EXPECT_NE(other[k], winograd[k]) << "output/gradient " << k;
  }
}

}  // namespace
}  // namespace tandem::nn
