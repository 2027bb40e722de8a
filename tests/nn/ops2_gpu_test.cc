// CPU/CUDA parity for reduce, softmax, dropout, batch_norm2d and the losses: the
// same body runs on both devices and the results are compared. Skips (with the
// reason) where no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "nn/device.h"
#include "nn/ops/batch_norm.h"
#include "nn/ops/dropout.h"
#include "nn/ops/loss.h"
#include "nn/ops/reduce.h"
#include "nn/ops/softmax.h"
#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::nn {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: CPU/CUDA parity not run"

const Device kGpu = Device::CUDA(0);

void ExpectNear(const Tensor& cpu, const Tensor& gpu, double tol, const std::string& what) {
  ASSERT_EQ(cpu.shape(), gpu.shape()) << what;
  const std::vector<double> a = cpu.to_vector<double>(), b = gpu.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_NEAR(a[i], b[i], tol * (1.0 + std::abs(a[i]))) << what << " element " << i;
  }
}

// Runs f on CPU copies and on GPU copies of `inputs` (leaves requiring grad),
// backpropagates the same upstream gradient, and compares outputs and gradients.
void CheckParity(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                 const std::vector<Tensor>& inputs, double tol, const std::string& what) {
  std::vector<Tensor> cpu, gpu;
  for (const Tensor& x : inputs) {
    cpu.push_back(x.clone().detach().set_requires_grad(true));
    gpu.push_back(x.to(kGpu).detach().set_requires_grad(true));
  }
  Tensor yc = f(cpu), yg = f(gpu);
  ExpectNear(yc, yg, tol, what + " forward");
  Tensor upstream = randn(yc.shape());
  yc.backward(upstream);
  yg.backward(upstream.to(kGpu));
  for (size_t k = 0; k < inputs.size(); ++k) {
    ExpectNear(cpu[k].grad(), gpu[k].grad(), tol, what + " grad " + std::to_string(k));
  }
}

TEST(Ops2GpuTest, ReduceParityAndDeterminism) {
  SKIP_WITHOUT_GPU();
  manual_seed(1);
  Tensor x = randn({37, 300, 5});
  CheckParity([](const auto& in) { return sum(in[0]).reshape({1}); }, {x}, 1e-4, "sum");
  CheckParity([](const auto& in) { return mean(in[0]).reshape({1}); }, {x}, 1e-4, "mean");
  for (int64_t dim : {0, 1, 2}) {
    CheckParity([dim](const auto& in) { return sum(in[0], dim); }, {x}, 1e-4, "sum dim");
    CheckParity([dim](const auto& in) { return mean(in[0], dim, true); }, {x}, 1e-4, "mean dim");
    EXPECT_EQ(argmax(x, dim).to_vector<int64_t>(), argmax(x.to(kGpu), dim).to_vector<int64_t>());
  }
  Tensor big = randn({3'000'001}, {.device = kGpu});
  EXPECT_EQ(sum(big).item<float>(), sum(big).item<float>());  // same input, same bits
  EXPECT_EQ(sum(big, 0).item<float>(), sum(big, 0).item<float>());
}

TEST(Ops2GpuTest, SoftmaxParity) {
  SKIP_WITHOUT_GPU();
  manual_seed(2);
  Tensor x = randn({6, 1000});
  x.mul_(5.0);
  CheckParity([](const auto& in) { return softmax(in[0], 1); }, {x}, 1e-5, "softmax rows");
  CheckParity([](const auto& in) { return log_softmax(in[0], -1); }, {x}, 1e-5, "log_softmax rows");
  Tensor y = randn({4, 7, 3});
  CheckParity([](const auto& in) { return softmax(in[0], 1); }, {y}, 1e-5, "softmax columns");
  CheckParity([](const auto& in) { return log_softmax(in[0], 0); }, {y}, 1e-5, "log_softmax columns");
}

TEST(Ops2GpuTest, DropoutMasksAreIdentical) {
  SKIP_WITHOUT_GPU();
  Tensor x = randn({1000, 33});
  manual_seed(3);
  Tensor yc = dropout(x, 0.35, true);
  manual_seed(3);
  Tensor yg = dropout(x.to(kGpu), 0.35, true);
  const std::vector<float> a = yc.to_vector<float>(), b = yg.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i] == 0.0f, b[i] == 0.0f) << "mask differs at " << i;
    ASSERT_NEAR(a[i], b[i], 1e-6 * (1 + std::abs(a[i]))) << i;
  }
  CheckParity([](const auto& in) {
    manual_seed(4);
    return dropout(in[0], 0.5, true);
  }, {x}, 1e-6, "dropout");
}

TEST(Ops2GpuTest, BatchNormParity) {
  SKIP_WITHOUT_GPU();
  manual_seed(5);
  Tensor x = randn({8, 3, 5, 7});
  Tensor w = randn({3}), b = randn({3});
  for (bool training : {true, false}) {
    Tensor rmc = zeros({3}), rvc = ones({3});
    Tensor rmg = rmc.to(kGpu), rvg = rvc.to(kGpu);
    auto f = [&](const std::vector<Tensor>& in) {
      const bool on_gpu = in[0].is_cuda();
      return batch_norm2d(in[0], in[1], in[2], on_gpu ? rmg : rmc, on_gpu ? rvg : rvc, training);
    };
    CheckParity(f, {x, w, b}, 1e-4, training ? "batch_norm train" : "batch_norm eval");
    ExpectNear(rmc, rmg, 1e-5, "running_mean");
    ExpectNear(rvc, rvg, 1e-5, "running_var");
  }
}

TEST(Ops2GpuTest, LossParity) {
  SKIP_WITHOUT_GPU();
  manual_seed(6);
  Tensor logits = randn({64, 10});
  logits.mul_(3.0);
  std::vector<int64_t> lv(64);
  for (int64_t i = 0; i < 64; ++i) lv[i] = (i * 7) % 10;
  Tensor labels_cpu = from_vector(lv, {64}), labels_gpu = labels_cpu.to(kGpu);
  CheckParity([&](const auto& in) {
    return cross_entropy(in[0], in[0].is_cuda() ? labels_gpu : labels_cpu).reshape({1});
  }, {logits}, 1e-5, "cross_entropy");
  Tensor wide = randn({5, 3000});
  std::vector<int64_t> wl = {0, 2999, 17, 1500, 3};
  CheckParity([&](const auto& in) {
    Tensor l = from_vector(wl, {5}, {.device = in[0].device()});
    return cross_entropy(in[0], l).reshape({1});
  }, {wide}, 1e-5, "cross_entropy wide");
  CheckParity([](const auto& in) { return mse_loss(in[0], in[1]).reshape({1}); },
              {randn({9, 4}), randn({9, 4})}, 1e-5, "mse_loss");
  for (Reduction r : {Reduction::kNone, Reduction::kSum}) {
    const std::string name(ReductionName(r));
    CheckParity([&](const auto& in) {
      Tensor l = cross_entropy(in[0], in[0].is_cuda() ? labels_gpu : labels_cpu, r);
      return l.reshape({l.numel()});
    }, {logits}, 1e-5, "cross_entropy " + name);
    CheckParity([&](const auto& in) {
      Tensor l = cross_entropy(in[0], from_vector(wl, {5}, {.device = in[0].device()}), r);
      return l.reshape({l.numel()});
    }, {wide}, 1e-5, "cross_entropy wide " + name);
    CheckParity([r](const auto& in) {
      Tensor l = mse_loss(in[0], in[1], r);
      return l.reshape({l.numel()});
    }, {randn({9, 4}), randn({9, 4})}, 1e-5, "mse_loss " + name);
  }
  EXPECT_FLOAT_EQ(accuracy(logits, labels_cpu).item<float>(),
                  accuracy(logits.to(kGpu), labels_gpu).item<float>());
  EXPECT_EQ(accuracy(logits.to(kGpu), labels_gpu).device(), kGpu);
}

}  // namespace
}  // namespace tandem::nn
