// CPU vs CUDA parity of the ops MobileNetV2 adds (issue 14): grouped and
// depthwise conv2d, relu6, adaptive average pooling; forward and backward.
// Label gpu; skipped with a reason when no GPU is visible.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "nn/ops/conv.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/matmul.h"  // set_allow_tf32
#include "nn/ops/pool.h"
#include "nn/random.h"

namespace tandem::nn {
namespace {

class MobileNetOpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << cuda_built() << ")";
    }
    set_allow_tf32(false);
  }
};

// Standard normal values in `dtype` (randn has no bfloat16: rounded from float32).
Tensor RandnOf(const Shape& shape, DType dtype) {
  if (dtype != kBFloat16) return randn(shape, {.dtype = dtype});
  return randn(shape).to(kBFloat16);
}

// Runs f on CPU copies and on CUDA copies of `inputs` (all requiring grad), with
// the same output gradient, and compares outputs and every input's gradient.
void ExpectParity(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                  const std::vector<Tensor>& inputs, double tol, const std::string& what) {
  const Device gpu = Device::CUDA(0);
  std::vector<Tensor> cpu_in, gpu_in;
  for (const Tensor& t : inputs) {
    cpu_in.push_back(t.detach().clone().set_requires_grad(true));
    gpu_in.push_back(t.detach().to(gpu).set_requires_grad(true));
  }
  Tensor cpu_out = f(cpu_in);
  Tensor gpu_out = f(gpu_in);
  ASSERT_TRUE(gpu_out.is_cuda()) << what;
  ASSERT_EQ(cpu_out.shape(), gpu_out.shape()) << what;
  Tensor grad = RandnOf(cpu_out.shape(), cpu_out.dtype());
  cpu_out.backward(grad);
  gpu_out.backward(grad.to(gpu));
  auto expect_near = [&](const Tensor& want, const Tensor& got, const std::string& which) {
    const auto w = want.to_vector<double>(), g = got.to_vector<double>();
    ASSERT_EQ(w.size(), g.size()) << what << ": " << which;
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(g[i], w[i], tol * (1.0 + std::abs(w[i]))) << what << ": " << which << " element " << i;
    }
  };
  expect_near(cpu_out, gpu_out, "output");
  for (size_t k = 0; k < inputs.size(); ++k) {
    ASSERT_TRUE(gpu_in[k].grad().defined()) << what << ": input " << k;
    expect_near(cpu_in[k].grad(), gpu_in[k].grad(), "grad of input " + std::to_string(k));
  }
}

TEST_F(MobileNetOpsGpuTest, GroupedAndDepthwiseConv2d) {
  manual_seed(51);
  struct Case {
    Shape x, w;
    Conv2dParams p;
    std::string name;
  };
  const std::vector<Case> cases = {
      {{4, 6, 12, 11}, {9, 2, 3, 3}, {.padding = {1, 1}, .groups = 3}, "groups 3"},
      {{3, 4, 9, 10}, {8, 2, 3, 2}, {.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}, .groups = 2},
       "groups 2, stride/padding/dilation"},
      {{4, 32, 16, 16}, {32, 1, 3, 3}, {.padding = {1, 1}, .groups = 32}, "depthwise, stride 1"},
      {{4, 96, 16, 16}, {96, 1, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .groups = 96},
       "depthwise, stride 2"},
      {{2, 3, 8, 8}, {6, 1, 3, 3}, {.padding = {1, 1}, .groups = 3}, "depthwise, multiplier 2"},
  };
  for (DType dtype : {kFloat32, kFloat64}) {
    const double tol = dtype == kFloat32 ? 1e-4 : 1e-10;
    for (const Case& c : cases) {
      ExpectParity([&](const auto& in) { return conv2d(in[0], in[1], in[2], c.p); },
                   {RandnOf(c.x, dtype), RandnOf(c.w, dtype), RandnOf({c.w[0]}, dtype)}, tol,
                   c.name);
      ExpectParity([&](const auto& in) { return conv2d(in[0], in[1], Tensor(), c.p); },
                   {RandnOf(c.x, dtype), RandnOf(c.w, dtype)}, tol, c.name + ", no bias");
    }
  }
}

TEST_F(MobileNetOpsGpuTest, Relu6) {
  manual_seed(52);
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    // One operation per element, the same on both devices: equal bits. randn * 4:
    // values on both sides of 0 and of 6, none exactly at a kink.
    ExpectParity([](const auto& in) { return relu6(in[0] * 4.0); }, {RandnOf({7, 300}, dtype)}, 0.0,
                 std::string("relu6 ") + DTypeName(dtype));
  }
}

TEST_F(MobileNetOpsGpuTest, AdaptiveAvgPool2d) {
  manual_seed(53);
  struct Case {
    Shape x;
    std::array<int64_t, 2> out;
  };
  const std::vector<Case> cases = {{{4, 1280, 1, 1}, {1, 1}},  // MobileNetV2 at 32x32
                                   {{3, 7, 6, 5}, {1, 1}},
                                   {{2, 3, 7, 5}, {3, 2}},
                                   {{2, 3, 6, 6}, {4, 4}},
                                   {{1, 2, 3, 4}, {5, 6}}};
  for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
    // The kernels sum in the CPU's order; bfloat16 rounds each result once.
    const double tol = dtype == kFloat64 ? 1e-13 : dtype == kFloat32 ? 1e-6 : 1e-2;
    for (const Case& c : cases) {
      ExpectParity([&](const auto& in) { return adaptive_avg_pool2d(in[0], c.out); },
                   {RandnOf(c.x, dtype)}, tol,
                   "adaptive_avg_pool2d " + ShapeToString(c.x) + " " + DTypeName(dtype));
    }
  }
}

}  // namespace
}  // namespace tandem::nn
