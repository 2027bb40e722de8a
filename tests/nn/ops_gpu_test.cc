// CUDA op checks that are not a row of the parity table (gpu_parity_cases.cc):
// dropout masks drawn alike on both devices and in both dtypes, batch norm's
// running statistics, the determinism of a large sum, bfloat16 sums accumulated in
// float32, an allocation the device cannot hold. Label gpu; skipped with the
// reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/device.h"
#include "nn/ops/batch_norm.h"
#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "nn/tensor.h"
#include "tests/gpu_test_util.h"
#include "tests/nn/gpu_parity.h"

namespace tandem::nn {
namespace {

class OpsGpuTest : public tandem::testing::GpuTest {};
using testing::ExpectClose;
using testing::Filled;
using testing::Fill;
using testing::Rel;
using testing::Ulps;

const Device kGpu = Device::CUDA(0);

// An allocation the device cannot hold throws naming its size, and the
// thread goes on: the next kernel's launch check does not report the
// out-of-memory again (before, CheckCuda left it in the thread's last error,
// and the next launch check blamed FillKernel for it).
TEST_F(OpsGpuTest, FailedAllocationNamesItsSizeAndLeavesTheThreadUsable) {
  const Device gpu = Device::CUDA(0);
  const int64_t bytes = int64_t{1} << 50;  // 1 PiB
  std::string error;
  try {
    (void)empty({bytes}, {.dtype = kUInt8, .device = gpu});
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("cudaMallocAsync of 1125899906842624 bytes failed on cuda:0"),
            std::string::npos)
      << error;
  EXPECT_EQ(full({4}, 3.0, {.device = gpu}).to_vector<float>(), std::vector<float>(4, 3.0f));
}

TEST_F(OpsGpuTest, LargeSumIsDeterministic) {
  manual_seed(1);
  Tensor big = randn({3'000'001}, {.device = kGpu});
  EXPECT_EQ(sum(big).item<float>(), sum(big).item<float>());  // same input, same bits
  EXPECT_EQ(sum(big, 0).item<float>(), sum(big, 0).item<float>());
}

TEST_F(OpsGpuTest, DropoutMasksAreIdentical) {
  Tensor x = randn({1000, 33}, {.device = Device::CPU()});
  manual_seed(3);
  Tensor yc = dropout(x, 0.35, true);
  manual_seed(3);
  Tensor yg = dropout(x.to(kGpu), 0.35, true);
  const std::vector<float> a = yc.to_vector<float>(), b = yg.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i] == 0.0f, b[i] == 0.0f) << "mask differs at " << i;
    ASSERT_NEAR(a[i], b[i], 1e-6 * (1 + std::abs(a[i]))) << i;
  }
}

// The outputs and gradients are table rows; here the running statistics each side updates.
TEST_F(OpsGpuTest, BatchNormRunningStatisticsMatchTheCpu) {
  manual_seed(5);
  const TensorOptions cpu{.device = Device::CPU()};
  Tensor x = randn({8, 3, 5, 7}, cpu), w = randn({3}, cpu), b = randn({3}, cpu);
  for (bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "eval");
    Tensor rmc = zeros({3}, cpu), rvc = ones({3}, cpu);
    Tensor rmg = rmc.to(kGpu), rvg = rvc.to(kGpu);
    Tensor yc = batch_norm2d(x, w, b, rmc, rvc, training);
    Tensor yg = batch_norm2d(x.to(kGpu), w.to(kGpu), b.to(kGpu), rmg, rvg, training);
    ExpectClose(yc, yg, Rel(1e-4), false, Tensor(), "output");
    ExpectClose(rmc, rmg, Rel(1e-5), false, Tensor(), "running_mean");
    ExpectClose(rvc, rvg, Rel(1e-5), false, Tensor(), "running_var");
  }
}

// sum_to of bfloat16 accumulates in float32 in both CUDA kernels (one thread per
// output, one block per output): 1000 ones sum to exactly 1000.
TEST_F(OpsGpuTest, Bf16SumToAccumulatesInFloat32) {
  Tensor ones_gpu = ones({4, 1000}, {.dtype = kBFloat16, .device = kGpu});
  EXPECT_EQ(sum_to(ones_gpu, {4, 1}).to_vector<double>(), std::vector<double>(4, 1000.0));
  EXPECT_EQ(sum_to(ones({40}, {.dtype = kBFloat16, .device = kGpu}), {1}).item(), 40.0);
}

TEST_F(OpsGpuTest, Bf16DropoutMaskMatchesCpuAndFloat32) {
  manual_seed(204);
  const double p = 0.3;
  // No zeros: a zero output means dropped.
  Tensor x = Filled({61, 47}, {.kind = Fill::Kind::kUniform, .lo = 0.5, .hi = 2}, kBFloat16);
  Tensor x32_gpu = x.to(kFloat32).detach().to(kGpu);
  manual_seed(9);
  Tensor y_cpu = dropout(x, p, true);
  manual_seed(9);
  Tensor y_gpu = dropout(x.to(kGpu).detach().set_requires_grad(true), p, true);
  manual_seed(9);
  Tensor y32_gpu = dropout(x32_gpu, p, true);
  ExpectClose(y_cpu, y_gpu, Ulps(2, 3), false, Tensor(), "dropout");
  const std::vector<float> a = y_cpu.to_vector<float>(), b = y_gpu.to_vector<float>(),
                           c = y32_gpu.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i] != 0.0f, b[i] != 0.0f) << "cpu vs cuda mask, element " << i;
    ASSERT_EQ(c[i] != 0.0f, b[i] != 0.0f) << "float32 vs bf16 mask, element " << i;
  }
}

}  // namespace
}  // namespace tandem::nn
