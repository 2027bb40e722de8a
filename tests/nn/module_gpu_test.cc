// Module::to(cuda) moves parameters, buffers and gradients in place, and the
// LinearNet trains the same on a GPU as on the CPU. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "nn/nn.h"
#include "tests/gpu_test_util.h"

namespace tandem::nn {
namespace {

struct LinearNet : Module {
  LinearNet() : l1(register_module("l1", Linear(10, 10))),
                l2(register_module("l2", Linear(10, 1))) {}
  Tensor forward(const Tensor& x) override { return l2(l1(x)); }
  Linear l1, l2;
};

class ModuleGpuTest : public tandem::testing::GpuTest {};

TEST_F(ModuleGpuTest, ToCudaMovesInPlaceAndBack) {
  manual_seed(1);
  Sequential net({Linear(4, 3), BatchNorm2d(2)});
  const std::vector<Tensor> params = net->parameters();
  const std::vector<Tensor> buffers = net->buffers();
  std::vector<std::vector<float>> values;
  for (const Tensor& p : params) values.push_back(p.to_vector<float>());
  params[0].set_grad(ones(params[0].shape()));

  net->to(Device::CUDA(0));
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(net->parameters()[i].is_same(params[i]));  // same handles
    EXPECT_EQ(params[i].device(), Device::CUDA(0));
    EXPECT_EQ(params[i].to_vector<float>(), values[i]);
    EXPECT_TRUE(params[i].requires_grad());
  }
  for (const Tensor& b : buffers) EXPECT_EQ(b.device(), Device::CUDA(0));
  EXPECT_EQ(params[0].grad().device(), Device::CUDA(0));

  net->to(Device::CPU());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].device(), Device::CPU());
    EXPECT_EQ(params[i].to_vector<float>(), values[i]);
  }
}

// The same seed builds the same model on either device (Philox draws do not
// depend on the device), so SGD on one fixed batch tracks the CPU run closely.
std::vector<double> Train(Device device) {
  DeviceGuard guard(device);
  manual_seed(2024);
  LinearNet net;
  const Tensor x = randn({10, 10});
  const Tensor y = randn({10, 1});
  MSELoss loss_fn;
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    Tensor loss = loss_fn(net(x), y);
    losses.push_back(loss.item());
    loss.backward();
    {
      NoGradGuard no_grad;
      for (Tensor& p : net.parameters()) p.add_(p.grad(), -0.1);
    }
    net.zero_grad();
  }
  return losses;
}

TEST_F(ModuleGpuTest, LinearNetMatchesCpu) {
  const std::vector<double> cpu = Train(Device::CPU());
  const std::vector<double> gpu = Train(Device::CUDA(0));
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-4 * (1 + cpu[i])) << i;
}

}  // namespace
}  // namespace tandem::nn
