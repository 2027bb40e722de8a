// CPU vs CUDA parity of the ops MobileNetV2 adds: grouped and
// depthwise conv2d, relu6, adaptive average pooling; forward and backward.
// Label gpu; skipped with a reason when no GPU is visible.
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

#include "nn/ops/conv.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "tests/nn/gpu_parity.h"

namespace tandem::nn {
namespace {

class MobileNetOpsGpuTest : public testing::GpuParityTest {};
using testing::ExpectParity;
using testing::RandnOf;

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
