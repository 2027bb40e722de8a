// ResNet blocks on CUDA against the CPU: the same weights and input give the
// same outputs, input gradients and parameter gradients (BasicBlock through
// ResNet-18's CIFAR stem and layers, Bottleneck through ResNet-50's), in
// training mode (batch statistics) and in eval mode. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "apps/models.h"
#include "nn/device.h"
#include "nn/ops/matmul.h"  // set_allow_tf32
#include "nn/random.h"

namespace tandem::apps {
namespace {

class ResNetGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (nn::cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << nn::cuda_built() << ")";
    }
    nn::set_allow_tf32(false);
  }
};

void ExpectNear(const nn::Tensor& want, const nn::Tensor& got, double tol, const std::string& what) {
  const std::vector<double> w = want.to_vector<double>(), g = got.to_vector<double>();
  ASSERT_EQ(w.size(), g.size()) << what;
  double scale = 0;
  for (double v : w) scale = std::max(scale, std::abs(v));
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_NEAR(g[i], w[i], tol * (1 + scale)) << what << " element " << i;
  }
}

// Builds the model twice from one seed (CPU and CUDA copies of the same
// weights), runs forward and backward on both, compares.
void ExpectParity(const std::function<std::shared_ptr<nn::Module>()>& make, const nn::Shape& input,
                  bool training, double tol) {
  nn::manual_seed(11);
  std::shared_ptr<nn::Module> cpu = make();
  std::shared_ptr<nn::Module> gpu = make();
  ASSERT_TRUE(gpu->load_state_dict(cpu->state_dict()).ok());
  gpu->to(nn::Device::CUDA(0));
  cpu->train(training);
  gpu->train(training);
  const nn::Tensor x = nn::randn(input, {.device = nn::Device::CPU()});
  nn::Tensor x_cpu = x.clone().set_requires_grad(true);
  nn::Tensor x_gpu = x.to(nn::Device::CUDA(0)).set_requires_grad(true);
  nn::Tensor y_cpu = cpu->forward(x_cpu), y_gpu = gpu->forward(x_gpu);
  ExpectNear(y_cpu, y_gpu, tol, "output");
  const nn::Tensor grad = nn::randn(y_cpu.shape(), {.device = nn::Device::CPU()});
  y_cpu.backward(grad);
  y_gpu.backward(grad.to(nn::Device::CUDA(0)));
  ExpectNear(x_cpu.grad(), x_gpu.grad(), tol, "input gradient");
  const auto pc = cpu->named_parameters(), pg = gpu->named_parameters();
  for (size_t i = 0; i < pc.size(); ++i) ExpectNear(pc[i].second.grad(), pg[i].second.grad(), tol, pc[i].first);
  const auto bc = cpu->named_buffers(), bg = gpu->named_buffers();
  for (size_t i = 0; i < bc.size(); ++i) ExpectNear(bc[i].second, bg[i].second, tol, bc[i].first);
}

TEST_F(ResNetGpuTest, BasicBlocksMatchTheCpuInTraining) {
  ExpectParity([] { return MakeResNet18({.num_classes = 10, .cifar_stem = true}); }, {4, 3, 32, 32},
               /*training=*/true, 1e-3);
}

TEST_F(ResNetGpuTest, BottlenecksMatchTheCpuInTrainingAndEval) {
  ExpectParity([] { return MakeResNet50({.num_classes = 10}); }, {2, 3, 64, 64}, true, 1e-3);
  ExpectParity([] { return MakeResNet50({.num_classes = 10}); }, {2, 3, 64, 64}, false, 1e-3);
}

}  // namespace
}  // namespace tandem::apps
