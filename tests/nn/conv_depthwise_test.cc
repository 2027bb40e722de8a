// The direct depthwise conv2d kernels (nn/ops/conv_depthwise_cpu.cc, the default
// float32 path for groups == channels; stride 1 on zero-padded planes, other
// strides row by row): float64 parity with the im2col reference, adjoint
// (gradient) identities, relu fused, and the same bits at 1 and 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/ops/conv.h"
#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/conv_depthwise_kernels.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"

namespace tandem::nn {
namespace {

using ops::internal::Conv2dGeometry;

struct Case {
  Shape x;  // (N, C, H, W); weight (C, 1, KH, KW)
  int64_t kh, kw;
  Conv2dParams p;
  std::string name;
};

std::vector<Case> Cases() {
  return {
      {{2, 4, 6, 6}, 3, 3, {.padding = {1, 1}}, "3x3 stride 1 pad 1"},
      {{2, 5, 9, 7}, 3, 3, {.stride = {2, 2}, .padding = {1, 1}}, "3x3 stride 2, odd sizes"},
      {{3, 3, 8, 11}, 5, 3, {.stride = {1, 2}, .padding = {2, 0}, .dilation = {1, 2}},
       "5x3, stride (1, 2), dilation (1, 2)"},
      {{2, 6, 2, 2}, 3, 3, {.padding = {1, 1}}, "2x2 input, pad 1 (MobileNetV2's last stages)"},
      {{2, 6, 2, 2}, 3, 3, {.stride = {2, 2}, .padding = {1, 1}}, "2x2 input, stride 2"},
      {{4, 3, 1, 1}, 3, 3, {.padding = {1, 1}}, "1x1 input, pad 1"},
      {{2, 3, 5, 4}, 1, 1, {}, "1x1 kernel"},
      {{2, 3, 7, 6}, 3, 3, {.padding = {0, 2}, .dilation = {2, 1}},
       "stride 1, dilation (2, 1), padding (0, 2)"},
      {{1, 2, 19, 21}, 3, 3, {.stride = {3, 3}, .padding = {2, 2}}, "stride 3, pad 2"},
      {{4, 32, 16, 16}, 3, 3, {.padding = {1, 1}}, "MobileNetV2 16x16, 32 channels"},
  };
}

Conv2dGeometry GeometryOf(const Case& c) {
  Conv2dGeometry g;
  g.n = c.x[0], g.c = c.x[1], g.h = c.x[2], g.w = c.x[3];
  g.o = g.c, g.kh = c.kh, g.kw = c.kw;
  g.params = c.p;
  g.params.groups = g.c;
  g.oh = (g.h + 2 * c.p.padding[0] - c.p.dilation[0] * (c.kh - 1) - 1) / c.p.stride[0] + 1;
  g.ow = (g.w + 2 * c.p.padding[1] - c.p.dilation[1] * (c.kw - 1) - 1) / c.p.stride[1] + 1;
  return g;
}

double Dot(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double s = 0;
  for (size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
  return s;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
  }
}

// float64 conv2d takes im2col (the reference path, gradient-checked in
// conv_groups_test); the direct kernels called on the same float64 tensors agree.
TEST(ConvDepthwiseTest, Float64DirectKernelsMatchIm2col) {
  manual_seed(71);
  for (const Case& c : Cases()) {
    const Conv2dGeometry g = GeometryOf(c);
    Tensor x = randn(c.x, {.dtype = kFloat64}).set_requires_grad(true);
    Tensor w = randn({g.c, 1, c.kh, c.kw}, {.dtype = kFloat64}).set_requires_grad(true);
    Tensor b = randn({g.c}, {.dtype = kFloat64}).set_requires_grad(true);
    Conv2dParams p = c.p;
    p.groups = g.c;
    Tensor y_ref = conv2d(x, w, b, p);
    ASSERT_EQ(y_ref.shape(), Shape({g.n, g.c, g.oh, g.ow})) << c.name;
    Tensor dy = randn(y_ref.shape(), {.dtype = kFloat64});
    y_ref.backward(dy);
    Tensor y = empty(y_ref.shape(), {.dtype = kFloat64});
    Tensor dx = empty(c.x, {.dtype = kFloat64}), dw = empty(w.shape(), {.dtype = kFloat64});
    ops::internal::DepthwiseConv2dForwardCpu(x.detach(), w.detach(), b.detach(), g, y, false);
    ops::internal::DepthwiseConv2dBackwardDataCpu(dy, w.detach(), g, dx);
    ops::internal::DepthwiseConv2dBackwardFilterCpu(dy, x.detach(), g, dw);
    ExpectNear(y.to_vector<double>(), y_ref.to_vector<double>(), 1e-12, c.name + ": y");
    ExpectNear(dx.to_vector<double>(), x.grad().to_vector<double>(), 1e-12, c.name + ": dx");
    ExpectNear(dw.to_vector<double>(), w.grad().to_vector<double>(), 1e-12, c.name + ": dw");
  }
}

// The convolution is linear in x and in w, so backward data and backward
// weights are right exactly when they are its adjoints:
// <dy, conv(x, w)> = <dx(dy, w), x> = <dw(dy, x), w>.
TEST(ConvDepthwiseGradTest, BackwardKernelsAreTheForwardsAdjoints) {
  manual_seed(72);
  for (const Case& c : Cases()) {
    const Conv2dGeometry g = GeometryOf(c);
    Tensor x = randn(c.x, {.dtype = kFloat64});
    Tensor w = randn({g.c, 1, c.kh, c.kw}, {.dtype = kFloat64});
    Tensor y = empty({g.n, g.c, g.oh, g.ow}, {.dtype = kFloat64});
    Tensor dy = randn(y.shape(), {.dtype = kFloat64});
    Tensor dx = empty(c.x, {.dtype = kFloat64}), dw = empty(w.shape(), {.dtype = kFloat64});
    ops::internal::DepthwiseConv2dForwardCpu(x, w, Tensor(), g, y, false);
    ops::internal::DepthwiseConv2dBackwardDataCpu(dy, w, g, dx);
    ops::internal::DepthwiseConv2dBackwardFilterCpu(dy, x, g, dw);
    const double forward = Dot(dy, y);
    EXPECT_NEAR(Dot(dx, x), forward, 1e-12 * (1 + std::abs(forward))) << c.name;
    EXPECT_NEAR(Dot(dw, w), forward, 1e-12 * (1 + std::abs(forward))) << c.name;
  }
}

// conv2d_relu on the direct kernel: relu()'s bits on conv2d's result, and the
// backward masks with y > 0 as relu does.
TEST(ConvDepthwiseTest, FusedReluHasReluBits) {
  const testing::RestoreCpuConv restore;
  manual_seed(73);
  const Case c = Cases()[1];
  Conv2dParams p = c.p;
  p.groups = c.x[1];
  Tensor x = randn(c.x), w = randn({c.x[1], 1, c.kh, c.kw}), b = randn({c.x[1]});
  EXPECT_EQ(conv2d_relu(x, w, b, p).to_vector<float>(), relu(conv2d(x, w, b, p)).to_vector<float>());
}

// The default float32 path (the direct kernels) gives the same bits at 1 and 2
// threads, forward and both gradients.
TEST(ConvDepthwiseTest, Float32BitsDoNotDependOnThreads) {
  const testing::RestoreCpuConv restore;
  manual_seed(74);
  for (const Case& c : Cases()) {
    Conv2dParams p = c.p;
    p.groups = c.x[1];
    const Tensor x0 = randn(c.x), w0 = randn({c.x[1], 1, c.kh, c.kw}), b0 = randn({c.x[1]});
    std::vector<std::vector<float>> runs[2];
    for (int t : {1, 2}) {
      set_cpu_blas_threads(t);
      Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
      Tensor y = conv2d(x, w, b0, p);
      y.backward(ones(y.shape()));
      runs[t - 1] = {y.to_vector<float>(), x.grad().to_vector<float>(), w.grad().to_vector<float>()};
    }
    EXPECT_EQ(runs[0], runs[1]) << c.name;
  }
}

}  // namespace
}  // namespace tandem::nn
