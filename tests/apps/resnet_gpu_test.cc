// ResNet blocks on CUDA against the CPU: the same weights and input give the
// same outputs, input gradients, parameter gradients and running statistics
// (BasicBlock through ResNet-18's CIFAR stem and layers, Bottleneck through
// ResNet-50's). Skips without a GPU.
//
// float32 is compared in eval mode (running statistics) and, in training mode,
// on the forward output. A whole ResNet's float32 gradients in training mode are
// not a parity check: BatchNorm over a handful of values per channel (8 in
// ResNet-50's last stage here) and ReLUs whose inputs sit within rounding of zero
// turn last-bit differences into percent-level ones (the CPU against itself on an
// input changed by one part in 10^7: up to 20% of a gradient's largest element in
// ResNet-50, 3% in ResNet-18). Training-mode gradients are therefore compared in
// float64 (Module::to(kFloat64)), where no such flip happens.
//
// The CPU side runs its direct convolutions (nn::set_cpu_winograd(false)): the
// Winograd kernels' rounding, up to 2e-5 of a layer's largest output (their own
// test checks them against float64), is enough to flip such ReLUs in eval mode
// too. Measured on the CPU against float64, eval mode: direct convolutions 3e-6
// (ResNet-18) and 1.3e-6 (ResNet-50) at worst, the Winograd kernels 2.2e-2 and
// 3.1e-2, and float64 itself on an input moved by 1e-5 relative 1.9e-2 and
// 3.1e-2 (by 1e-6: 9e-7), so those percents are flipped ReLUs, not a wrong kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "apps/models.h"
#include "nn/device.h"
#include "nn/ops/conv.h"  // set_cpu_winograd
#include "nn/ops/matmul.h"  // set_allow_tf32
#include "nn/random.h"
#include "tests/test_util.h"

namespace tandem::apps {
namespace {

class ResNetGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    winograd_ = nn::cpu_winograd();
    if (nn::cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << nn::cuda_built() << ")";
    }
    nn::set_allow_tf32(false);
    nn::set_cpu_winograd(false);
  }
  void TearDown() override { nn::set_cpu_winograd(winograd_); }

 private:
  bool winograd_ = true;
};

struct Pass {
  nn::Tensor output;
  std::vector<std::pair<std::string, nn::Tensor>> tensors;  // input gradient, gradients, buffers
};

// One forward and backward of `model` on `x` with upstream gradient `grad`.
Pass Run(nn::Module& model, const nn::Tensor& x, const nn::Tensor& grad, nn::Device device) {
  nn::Tensor input = x.to(device).detach().set_requires_grad(true);
  Pass pass;
  pass.output = model.forward(input);
  pass.output.backward(grad.to(device));
  pass.tensors.emplace_back("input gradient", input.grad());
  for (const auto& [name, p] : model.named_parameters()) pass.tensors.emplace_back(name, p.grad());
  for (const auto& [name, b] : model.named_buffers()) pass.tensors.emplace_back(name, b);
  return pass;
}

struct Check {
  nn::DType dtype;
  bool training;
  bool gradients;  // compare the input gradient, gradients and buffers (else the output only)
  double tol;      // on ScaledError
};

// Builds the model from one seed, copies its weights to a CUDA copy, converts
// both to check.dtype, runs forward and backward on both, compares.
void ExpectParity(const std::function<std::shared_ptr<nn::Module>()>& make, const nn::Shape& input,
                  const Check& check, const std::string& what) {
  nn::manual_seed(11);
  std::shared_ptr<nn::Module> cpu = make(), gpu = make();
  ASSERT_TRUE(gpu->load_state_dict(cpu->state_dict()).ok());
  for (nn::Module* m : {cpu.get(), gpu.get()}) {
    m->to(check.dtype);
    m->train(check.training);
  }
  gpu->to(nn::Device::CUDA(0));
  const nn::TensorOptions host{.dtype = check.dtype, .device = nn::Device::CPU()};
  const nn::Tensor x = nn::randn(input, host);
  nn::Shape output_shape;
  {
    nn::NoGradGuard no_grad;
    std::shared_ptr<nn::Module> probe = make();  // for the shape; leaves cpu's statistics alone
    probe->eval();
    output_shape = probe->forward(nn::randn(input)).shape();
  }
  const nn::Tensor grad = nn::randn(output_shape, host);
  const Pass want = Run(*cpu, x, grad, nn::Device::CPU());
  const Pass got = Run(*gpu, x, grad, nn::Device::CUDA(0));

  double worst = testing::ScaledError(got.output, want.output);
  EXPECT_LE(worst, check.tol) << what << ": output";
  if (check.gradients) {
    for (size_t i = 0; i < want.tensors.size(); ++i) {
      const double error = testing::ScaledError(got.tensors[i].second, want.tensors[i].second);
      worst = std::max(worst, error);
      EXPECT_LE(error, check.tol) << what << ": " << want.tensors[i].first;
    }
  }
  std::printf("%s: max scaled difference GPU vs CPU %.3g (tolerance %.3g)\n", what.c_str(), worst,
              check.tol);
}

void ExpectModelParity(const std::function<std::shared_ptr<nn::Module>()>& make,
                       const nn::Shape& input, const std::string& name) {
  ExpectParity(make, input, {nn::kFloat32, false, true, 1e-3}, name + ", float32, eval");
  ExpectParity(make, input, {nn::kFloat32, true, false, 1e-3},
               name + ", float32, training, output");
  ExpectParity(make, input, {nn::kFloat64, true, true, 1e-10}, name + ", float64, training");
}

TEST_F(ResNetGpuTest, BasicBlocksMatchTheCpu) {
  ExpectModelParity([] { return MakeResNet18({.num_classes = 10, .cifar_stem = true}); },
                    {4, 3, 32, 32}, "ResNet-18 (CIFAR stem)");
}

TEST_F(ResNetGpuTest, BottlenecksMatchTheCpu) {
  ExpectModelParity([] { return MakeResNet50({.num_classes = 10}); }, {2, 3, 64, 64}, "ResNet-50");
}

}  // namespace
}  // namespace tandem::apps
