// CPU vs CUDA parity of matmul / linear / linear_relu, conv2d, conv2d_relu and pooling,
// forward and backward. Label gpu; skipped with a reason when no GPU is visible.
#include <gtest/gtest.h>

#include <vector>

#include "nn/ops/conv.h"
#include "nn/ops/matmul.h"
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "tests/nn/gpu_parity.h"

namespace tandem::nn {
namespace {

class OpsGpuTest : public testing::GpuParityTest {};
using testing::ExpectParity;

TEST_F(OpsGpuTest, MatmulAndLinear) {
  manual_seed(31);
  for (DType dtype : {kFloat32, kFloat64}) {
    const double tol = dtype == kFloat32 ? 1e-4 : 1e-10;
    const TensorOptions o{.dtype = dtype};
    ExpectParity([](const auto& in) { return matmul(in[0], in[1]); },
                 {randn({33, 17}, o), randn({17, 45}, o)}, tol);
    ExpectParity([](const auto& in) { return linear(in[0], in[1], in[2]); },
                 {randn({32, 64}, o), randn({10, 64}, o), randn({10}, o)}, tol);
    ExpectParity([](const auto& in) { return linear(in[0], in[1]); },
                 {randn({7, 5}, o), randn({3, 5}, o)}, tol);
    ExpectParity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                 {randn({32, 64}, o), randn({48, 64}, o), randn({48}, o)}, tol);
  }
}

// Shapes and operands for which the fused cuBLASLt epilogue is not used (a size-1
// dimension, a bias view that is not 16-byte aligned): the unfused fallback
// (GEMM, rank-1 bias GEMM, ReLU) must give the same results.
TEST_F(OpsGpuTest, LinearEpilogueFallbacks) {
  manual_seed(35);
  for (DType dtype : {kFloat32, kFloat64}) {
    const double tol = dtype == kFloat32 ? 1e-4 : 1e-10;
    const TensorOptions o{.dtype = dtype};
    ExpectParity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                 {randn({1, 16}, o), randn({8, 16}, o), randn({8}, o)}, tol);  // batch 1
    ExpectParity([](const auto& in) { return linear(in[0], in[1], in[2]); },
                 {randn({9, 16}, o), randn({1, 16}, o), randn({1}, o)}, tol);  // one output
    ExpectParity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                 {randn({9, 1}, o), randn({8, 1}, o), randn({8}, o)}, tol);  // one input
    // Bias starting one element into its buffer: 4 or 8 bytes off alignment.
    ExpectParity([](const auto& in) { return linear_relu(in[0], in[1], in[2].slice(1, 9)); },
                 {randn({12, 16}, o), randn({8, 16}, o), randn({9}, o)}, tol);
  }
}

TEST_F(OpsGpuTest, Conv2dVariants) {
  manual_seed(32);
  const std::vector<Conv2dParams> variants = {
      {}, {.padding = {2, 2}}, {.stride = {2, 1}, .padding = {1, 0}}, {.dilation = {2, 2}}};
  for (DType dtype : {kFloat32, kFloat64}) {
    const double tol = dtype == kFloat32 ? 1e-4 : 1e-10;
    const TensorOptions o{.dtype = dtype};
    for (const Conv2dParams& p : variants) {
      ExpectParity([&](const auto& in) { return conv2d(in[0], in[1], in[2], p); },
                   {randn({4, 3, 12, 11}, o), randn({5, 3, 3, 3}, o), randn({5}, o)}, tol);
    }
    // LeNet's first layer.
    ExpectParity([](const auto& in) { return conv2d(in[0], in[1], in[2], {.padding = {2, 2}}); },
                 {randn({8, 1, 28, 28}, o), randn({20, 1, 5, 5}, o), randn({20}, o)}, tol);
    // conv2d_relu: the fused op (relu's kernel in place on the GPU, a oneDNN post-op on the CPU).
    for (const Conv2dParams& p : variants) {
      ExpectParity([&](const auto& in) { return conv2d_relu(in[0], in[1], in[2], p); },
                   {randn({4, 3, 12, 11}, o), randn({5, 3, 3, 3}, o), randn({5}, o)}, tol);
    }
  }
}

TEST_F(OpsGpuTest, Pooling) {
  manual_seed(33);
  const std::vector<Pool2dParams> variants = {
      {}, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}, {.kernel = {2, 3}, .stride = {1, 2}}};
  for (DType dtype : {kFloat32, kFloat64}) {
    const double tol = dtype == kFloat32 ? 1e-5 : 1e-12;
    const TensorOptions o{.dtype = dtype};
    for (const Pool2dParams& p : variants) {
      // randn values: ties have probability ~0, so both sides pick one maximum.
      ExpectParity([&](const auto& in) { return max_pool2d(in[0], p); }, {randn({3, 4, 9, 10}, o)}, tol);
      ExpectParity([&](const auto& in) { return avg_pool2d(in[0], p); }, {randn({3, 4, 9, 10}, o)}, tol);
    }
  }
}

TEST_F(OpsGpuTest, Tf32IsOptIn) {
  EXPECT_FALSE(allow_tf32());
  set_allow_tf32(true);
  EXPECT_TRUE(allow_tf32());
  manual_seed(34);
  // Looser tolerance with TF32 (10-bit mantissa products).
  ExpectParity([](const auto& in) { return linear(in[0], in[1], in[2]); },
               {randn({64, 128}), randn({32, 128}), randn({32})}, 5e-2);
  set_allow_tf32(false);
}

}  // namespace
}  // namespace tandem::nn
