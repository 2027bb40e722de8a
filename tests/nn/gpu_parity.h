// CPU vs CUDA parity checks shared by the gpu-labelled op tests: a fixture that
// skips with a reason when no GPU is visible (and keeps TF32 off), and
// ExpectParity, which runs an op on CPU and CUDA copies of its inputs and compares
// the output and every input's gradient.
#ifndef TANDEM_TESTS_NN_GPU_PARITY_H_
#define TANDEM_TESTS_NN_GPU_PARITY_H_

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "nn/device.h"
#include "nn/ops/matmul.h"  // set_allow_tf32
#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::nn::testing {

class GpuParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << cuda_built() << ")";
    }
    set_allow_tf32(false);
  }
};

// Standard normal values in `dtype` (randn has no bfloat16: rounded from float32).
inline Tensor RandnOf(const Shape& shape, DType dtype) {
  if (dtype != kBFloat16) return randn(shape, {.dtype = dtype});
  return randn(shape).to(kBFloat16);
}

// Runs f on CPU copies and on CUDA copies of `inputs` (all requiring grad), with
// the same output gradient, and compares outputs and every input's gradient
// within tol * (1 + |cpu value|). `what` prefixes the failure messages.
inline void ExpectParity(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                         const std::vector<Tensor>& inputs, double tol,
                         const std::string& what = "") {
  const std::string prefix = what.empty() ? "" : what + ": ";
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
    ASSERT_EQ(w.size(), g.size()) << prefix << which;
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(g[i], w[i], tol * (1.0 + std::abs(w[i]))) << prefix << which << " element " << i;
    }
  };
  expect_near(cpu_out, gpu_out, "output");
  for (size_t k = 0; k < inputs.size(); ++k) {
    ASSERT_TRUE(gpu_in[k].grad().defined()) << prefix << "input " << k;
    expect_near(cpu_in[k].grad(), gpu_in[k].grad(), "grad of input " + std::to_string(k));
  }
}

}  // namespace tandem::nn::testing

#endif  // TANDEM_TESTS_NN_GPU_PARITY_H_
