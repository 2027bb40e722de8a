// CPU/GPU parity of the fused optimizer kernels and of clip_grad_norm_ (label gpu).
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "nn/random.h"
#include "optim/sgd.h"

namespace tandem::optim {
namespace {

// Parameters of several sizes (more than one chunk, a chunk boundary inside a
// tensor, a tiny one) on `device`, with zero gradients; same values everywhere.
std::vector<nn::Tensor> MakeParams(nn::Device device, nn::DType dtype) {
  std::vector<nn::Tensor> params;
  nn::manual_seed(7);
  for (int64_t n : {5000, 3, 4096, 10000}) {
    nn::Tensor p = nn::randn({n}, {.dtype = dtype}).to(device);
    p.set_requires_grad(true);
    p.set_grad(nn::zeros_like(p));
    params.push_back(p);
  }
  return params;
}

// Writes grads of f = sum(0.5 * w^2 + w * sin-like constant) computed on the CPU.
void SetGrads(const std::vector<nn::Tensor>& params) {
  nn::NoGradGuard no_grad;
  for (const nn::Tensor& p : params) {
    std::vector<double> w = p.to_vector<double>();
    for (size_t i = 0; i < w.size(); ++i) w[i] = w[i] + 0.01 * static_cast<double>(i % 7) - 0.03;
    nn::Tensor g = p.grad();
    g.copy_(nn::from_vector(w, p.shape()));
  }
}

using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<nn::Tensor>)>;

void ExpectParity(const Factory& make, nn::DType dtype, double tol) {
  std::vector<nn::Tensor> cpu = MakeParams(nn::Device::CPU(), dtype);
  std::vector<nn::Tensor> gpu = MakeParams(nn::Device::CUDA(0), dtype);
  auto opt_cpu = make(cpu);
  auto opt_gpu = make(gpu);
  for (int step = 0; step < 10; ++step) {
    SetGrads(cpu);
    SetGrads(gpu);
    opt_cpu->step();
    opt_gpu->step();
    opt_gpu->zero_grad();
    opt_cpu->zero_grad();
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const std::vector<double> a = cpu[i].to_vector<double>(), b = gpu[i].to_vector<double>();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], tol) << "tensor " << i << " " << k;
  }
}

class OptimGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (nn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  }
};

TEST_F(OptimGpuTest, FusedUpdatesMatchCpu) {
  for (nn::DType dtype : {nn::kFloat64, nn::kFloat32}) {
    const double tol = dtype == nn::kFloat64 ? 1e-12 : 1e-5;
    ExpectParity([](auto p) { return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true}); }, dtype, tol);
    ExpectParity([](auto p) { return std::make_unique<Adagrad>(p, AdagradOptions{.lr = 0.1, .lr_decay = 0.01}); }, dtype, tol);
    ExpectParity([](auto p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true}); }, dtype, tol);
    ExpectParity([](auto p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01}); }, dtype, tol);
  }
}

TEST_F(OptimGpuTest, ClipGradNormMatchesCpu) {
  std::vector<nn::Tensor> cpu = MakeParams(nn::Device::CPU(), nn::kFloat64);
  std::vector<nn::Tensor> gpu = MakeParams(nn::Device::CUDA(0), nn::kFloat64);
  SetGrads(cpu);
  SetGrads(gpu);
  const nn::Tensor n_cpu = clip_grad_norm_(cpu, 1.0);
  const nn::Tensor n_gpu = clip_grad_norm_(gpu, 1.0);
  EXPECT_TRUE(n_gpu.is_cuda());
  EXPECT_NEAR(n_cpu.item(), n_gpu.item(), 1e-9 * n_cpu.item());
  for (size_t i = 0; i < cpu.size(); ++i) {
    const auto a = cpu[i].grad().to_vector<double>(), b = gpu[i].grad().to_vector<double>();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-12);
  }
}

}  // namespace
}  // namespace tandem::optim
