// The convolutions of cuDNN's graph API (nn/ops/conv_cudnn_graph.cc, the
// default) against the legacy cuDNN path of the same build (set_cudnn_graph(false)):
// forward, backward data and backward filter over plain, strided, padded,
// dilated, grouped, depthwise and 1x1 shapes in float32, float64 and bfloat16.
// Each call must find a plan (CudnnGraphConv returns true), and its result must
// match the legacy one within the dtype's rounding over the sum's terms.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/device.h"
#include "nn/ops/conv.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/random.h"
#include "nn/tensor.h"
#include "tests/gpu_test_util.h"

namespace tandem::nn::ops::internal {
namespace {

struct Case {
  const char* name;
  Shape x, w;
  Conv2dParams params;
};

const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      {"plain 3x3", {2, 3, 8, 8}, {4, 3, 3, 3}, {}},
      {"padded strided", {2, 4, 9, 7}, {6, 4, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}}},
      {"dilated", {1, 2, 10, 10}, {3, 2, 3, 3}, {.padding = {2, 2}, .dilation = {2, 2}}},
      {"grouped", {2, 8, 6, 6}, {4, 4, 3, 3}, {.padding = {1, 1}, .groups = 2}},
      {"depthwise", {4, 32, 16, 16}, {32, 1, 3, 3}, {.padding = {1, 1}, .groups = 32}},
      {"1x1", {8, 32, 16, 16}, {64, 32, 1, 1}, {}},
      {"7x7 stride 2", {2, 3, 32, 32}, {16, 3, 7, 7}, {.stride = {2, 2}, .padding = {3, 3}}},
  };
  return cases;
}

// max |a - b| / max(max |a|, 1e-30): the legacy and graph paths may use
// different engines, so the bound is the dtype's rounding times the terms.
double RelDiff(const Tensor& a, const Tensor& b) {
  const Tensor ca = a.to(Device::CPU()).to(kFloat64), cb = b.to(Device::CPU()).to(kFloat64);
  const double* pa = ca.host_data<double>();
  const double* pb = cb.host_data<double>();
  double diff = 0, mag = 1e-30;
  for (int64_t i = 0; i < ca.numel(); ++i) {
    diff = std::max(diff, std::abs(pa[i] - pb[i]));
    mag = std::max(mag, std::abs(pa[i]));
  }
  return diff / mag;
}

double Bound(DType dtype, int64_t terms) {
  const double eps = dtype == kFloat64 ? 1e-15 : dtype == kFloat32 ? 1e-6 : 8e-3;
  return eps * std::sqrt(static_cast<double>(terms)) * 4;
}

class CudnnGraphGpuTest : public ::testing::TestWithParam<DType> {
 protected:
  void TearDown() override { set_cudnn_graph(true); }
};

TEST_P(CudnnGraphGpuTest, EveryDirectionMatchesTheLegacyPath) {
  TANDEM_REQUIRE_GPUS(1);
  const DType dtype = GetParam();
  const Device gpu = Device::CUDA(0);
  manual_seed(3);
  for (const Case& c : Cases()) {
    SCOPED_TRACE(absl::StrCat(c.name, ", ", DTypeName(dtype)));
    const Conv2dGeometry g = Conv2dGeometryOf(c.x, c.w, c.params);
    const Tensor x = randn(c.x).to(dtype).to(gpu);
    const Tensor w = randn(c.w).to(dtype).to(gpu);
    const Tensor dy = randn({g.n, g.o, g.oh, g.ow}).to(dtype).to(gpu);
    const TensorOptions options{.dtype = dtype, .device = gpu};

    set_cudnn_graph(false);  // the Conv2d*Cuda calls below: the legacy API
    Tensor y_legacy = empty({g.n, g.o, g.oh, g.ow}, options);
    Conv2dForwardCuda(x, w, Tensor(), g, y_legacy, /*relu=*/false);
    Tensor y_graph = empty({g.n, g.o, g.oh, g.ow}, options);
    ASSERT_TRUE(CudnnGraphConv(ConvDirection::kForward, g, dtype, gpu, x.data_ptr(), w.data_ptr(),
                               y_graph.data_ptr()));
    EXPECT_LE(RelDiff(y_legacy, y_graph), Bound(dtype, g.c / c.params.groups * g.kh * g.kw));

    Tensor dx_legacy = empty(c.x, options);
    Conv2dBackwardDataCuda(dy, w, g, dx_legacy);
    Tensor dx_graph = empty(c.x, options);
    ASSERT_TRUE(CudnnGraphConv(ConvDirection::kBackwardData, g, dtype, gpu, dx_graph.data_ptr(),
                               w.data_ptr(), dy.data_ptr()));
    EXPECT_LE(RelDiff(dx_legacy, dx_graph), Bound(dtype, g.o / c.params.groups * g.kh * g.kw));

    Tensor dw_legacy = empty(c.w, options);
    Conv2dBackwardFilterCuda(dy, x, g, dw_legacy);
    Tensor dw_graph = empty(c.w, options);
    ASSERT_TRUE(CudnnGraphConv(ConvDirection::kBackwardFilter, g, dtype, gpu, x.data_ptr(),
                               dw_graph.data_ptr(), dy.data_ptr()));
    EXPECT_LE(RelDiff(dw_legacy, dw_graph), Bound(dtype, g.n * g.oh * g.ow));
  }
  set_cudnn_graph(true);
}

// The switch routes the public op: with it off the legacy API runs, and both
// give the same numbers within rounding (a shape the graph API plans).
TEST(CudnnGraphSwitchGpuTest, Conv2dGivesTheSameWithTheSwitchOnAndOff) {
  TANDEM_REQUIRE_GPUS(1);
  EXPECT_TRUE(cudnn_graph());  // the default (TANDEM_CUDNN_GRAPH unset)
  manual_seed(4);
  const Tensor x = randn({2, 3, 8, 8}).to(Device::CUDA(0));
  const Tensor w = randn({4, 3, 3, 3}).to(Device::CUDA(0));
  const Tensor graph = conv2d(x, w, Tensor(), {.padding = {1, 1}});
  set_cudnn_graph(false);
  const Tensor legacy = conv2d(x, w, Tensor(), {.padding = {1, 1}});
  set_cudnn_graph(true);
  EXPECT_LE(RelDiff(legacy, graph), Bound(kFloat32, 27));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudnnGraphGpuTest,
                         ::testing::Values(kFloat32, kFloat64, kBFloat16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace tandem::nn::ops::internal
