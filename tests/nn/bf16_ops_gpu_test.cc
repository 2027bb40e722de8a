// CUDA bfloat16 kernels of the elementwise family and dropout against the CPU
// bfloat16 kernels (tests/nn/bf16_ops_test.cc checks those against float64):
// outputs and gradients within 2 bf16 ulps, dropout masks equal. Label gpu;
// skipped with a reason when no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/random.h"

namespace tandem::nn {
namespace {

class Bf16OpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << cuda_built() << ")";
    }
  }
};

// The spacing of bfloat16 values at |v|.
double Bf16Ulp(double v) {
  v = std::fabs(v);
  if (v < std::ldexp(1.0, -126)) return std::ldexp(1.0, -133);
  int e;
  std::frexp(v, &e);
  return std::ldexp(1.0, e - 8);
}

// Uniform values in [lo, hi) as a bf16 CPU tensor.
Tensor Bf16Uniform(const Shape& shape, double lo, double hi) {
  Tensor u = rand(shape, {.dtype = kFloat64});
  return add_scalar(mul_scalar(u, hi - lo), lo).to(kBFloat16).detach();
}

// got (CUDA) within `ulps` bf16 ulps of want (CPU), plus `slack` absolute.
void ExpectWithinUlps(const Tensor& want, const Tensor& got, double ulps, const std::string& what,
                      double slack = 0) {
  ASSERT_EQ(want.dtype(), kBFloat16) << what;
  ASSERT_EQ(got.dtype(), kBFloat16) << what;
  ASSERT_EQ(want.shape(), got.shape()) << what;
  const std::vector<double> w = want.to_vector<double>(), g = got.to_vector<double>();
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_LE(std::fabs(g[i] - w[i]), ulps * Bf16Ulp(w[i]) + slack)
        << what << " element " << i << ": cpu " << w[i] << ", cuda " << g[i];
  }
}

// f on CPU bf16 copies and on CUDA bf16 copies of `inputs` (all requiring
// grad), the same output gradient; outputs within 2 ulps. Gradients within 3:
// a gradient formula chains up to three bf16 ops, and CUDA's expf/powf/tanhf
// may round an intermediate to the neighbouring bf16 value, which the next
// product carries (up to 2 ulps) before its own rounding.
void ExpectParity(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                  const std::vector<Tensor>& inputs, const std::string& what) {
  const Device gpu = Device::CUDA(0);
  std::vector<Tensor> cpu_in, gpu_in;
  for (const Tensor& t : inputs) {
    cpu_in.push_back(t.detach().clone().set_requires_grad(true));
    gpu_in.push_back(t.detach().to(gpu).set_requires_grad(true));
  }
  Tensor cpu_out = f(cpu_in);
  Tensor gpu_out = f(gpu_in);
  ASSERT_TRUE(gpu_out.is_cuda()) << what;
  Tensor grad = Bf16Uniform(cpu_out.shape(), -2, 2);
  cpu_out.backward(grad);
  gpu_out.backward(grad.to(gpu));
  ExpectWithinUlps(cpu_out, gpu_out, 2, what + " output");
  for (size_t k = 0; k < inputs.size(); ++k) {
    ASSERT_TRUE(gpu_in[k].grad().defined()) << what << " input " << k;
    ExpectWithinUlps(cpu_in[k].grad(), gpu_in[k].grad(), 3,
                     what + " grad of input " + std::to_string(k));
  }
}

TEST_F(Bf16OpsGpuTest, UnaryOps) {
  manual_seed(201);
  struct Case {
    std::string name;
    std::function<Tensor(const Tensor&)> f;
    double lo, hi;
  };
  const std::vector<Case> cases = {
      {"neg", [](const Tensor& x) { return neg(x); }, -3, 3},
      {"add_scalar", [](const Tensor& x) { return add_scalar(x, 0.75); }, -3, 3},
      {"mul_scalar", [](const Tensor& x) { return mul_scalar(x, 0.3); }, -3, 3},
      {"rsub_scalar", [](const Tensor& x) { return rsub_scalar(x, 1.5); }, -3, 3},
      {"rdiv_scalar", [](const Tensor& x) { return rdiv_scalar(x, 2.5); }, 0.2, 4},
      {"pow_scalar 2", [](const Tensor& x) { return pow_scalar(x, 2.0); }, -3, 3},
      {"pow_scalar 0.5", [](const Tensor& x) { return pow_scalar(x, 0.5); }, 0.1, 9},
      {"exp", [](const Tensor& x) { return exp(x); }, -5, 5},
      {"log", [](const Tensor& x) { return log(x); }, 0.05, 20},
      {"relu", [](const Tensor& x) { return relu(x); }, -2, 2},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, -8, 8},
      {"tanh", [](const Tensor& x) { return tanh(x); }, -3, 3},
  };
  for (const Case& c : cases) {
    ExpectParity([&](const auto& in) { return c.f(in[0]); }, {Bf16Uniform({33, 65}, c.lo, c.hi)},
                 c.name);
  }
}

TEST_F(Bf16OpsGpuTest, BinaryOpsWithBroadcasting) {
  manual_seed(202);
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{40, 50}, {40, 50}}, {{40, 50}, {1}}, {{40, 50}, {50}},
      {{40, 1}, {1, 50}},   {{50}, {3, 40, 50}}, {{3, 40, 50}, {40, 1}}};
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&, const Tensor&)>>>
      ops = {{"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
             {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
             {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
             {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }}};
  for (const auto& [name, f] : ops) {
    for (const auto& [sa, sb] : shapes) {
      ExpectParity([&](const auto& in) { return f(in[0], in[1]); },
                   {Bf16Uniform(sa, -3, 3), Bf16Uniform(sb, 0.5, 3)},
                   name + " " + ShapeToString(sa) + " " + ShapeToString(sb));
    }
  }
}

// Few reduced elements (one thread per output) and many (one block per output):
// both accumulate in float, so 1000 ones sum to exactly 1000 on the GPU too.
TEST_F(Bf16OpsGpuTest, SumToBothKernels) {
  manual_seed(203);
  const Device gpu = Device::CUDA(0);
  Tensor x = Bf16Uniform({300, 8, 5}, -2, 2);
  for (const Shape& shape : std::vector<Shape>{{8, 5}, {8, 1}, {300, 1, 1}, {5}, {1}}) {
    // The two sum in different orders (float): 1e-3 absolute covers a sum near 0.
    ExpectWithinUlps(sum_to(x, shape), sum_to(x.to(gpu), shape), 2,
                     "sum_to " + ShapeToString(shape), 1e-3);
  }
  Tensor ones_gpu = ones({4, 1000}, {.dtype = kBFloat16, .device = gpu});
  EXPECT_EQ(sum_to(ones_gpu, {4, 1}).to_vector<double>(), std::vector<double>(4, 1000.0));
  EXPECT_EQ(sum_to(ones({40}, {.dtype = kBFloat16, .device = gpu}), {1}).item(), 40.0);
}

TEST_F(Bf16OpsGpuTest, DropoutMaskMatchesCpuAndFloat32) {
  manual_seed(204);
  const Device gpu = Device::CUDA(0);
  const double p = 0.3;
  Tensor x = Bf16Uniform({61, 47}, 0.5, 2);  // no zeros: a zero output means dropped
  Tensor x32_gpu = x.to(kFloat32).detach().to(gpu);
  manual_seed(9);
  Tensor y_cpu = dropout(x, p, true);
  manual_seed(9);
  Tensor y_gpu = dropout(x.to(gpu).detach().set_requires_grad(true), p, true);
  manual_seed(9);
  Tensor y32_gpu = dropout(x32_gpu, p, true);
  ExpectWithinUlps(y_cpu, y_gpu, 2, "dropout");
  const std::vector<float> a = y_cpu.to_vector<float>(), b = y_gpu.to_vector<float>(),
                           c = y32_gpu.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i] != 0.0f, b[i] != 0.0f) << "cpu vs cuda mask, element " << i;
    ASSERT_EQ(c[i] != 0.0f, b[i] != 0.0f) << "float32 vs bf16 mask, element " << i;
  }
  ExpectParity(
      [&](const auto& in) {
        manual_seed(10);
        return dropout(in[0], p, true);
      },
      {x}, "dropout forward and backward");
}

TEST_F(Bf16OpsGpuTest, InPlaceAddScaleAndGradientAccumulation) {
  manual_seed(205);
  const Device gpu = Device::CUDA(0);
  Tensor y = Bf16Uniform({1000}, -3, 3), x = Bf16Uniform({1000}, -3, 3);
  Tensor yg = y.to(gpu).detach();
  y.add_(x, 0.375);
  yg.add_(x.to(gpu), 0.375);
  ExpectWithinUlps(y, yg, 2, "add_");
  y.mul_(1.7);
  yg.mul_(1.7);
  ExpectWithinUlps(y, yg, 2, "mul_");
  // A tensor used twice: its two bf16 gradients summed in bf16 on the device.
  Tensor c1 = Bf16Uniform({1000}, -2, 2), c2 = Bf16Uniform({1000}, -2, 2);
  ExpectParity([&](const auto& in) { return add(mul(in[0], in[1]), mul(in[0], in[2])); },
               {x, c1, c2}, "x used twice");
}

}  // namespace
}  // namespace tandem::nn
