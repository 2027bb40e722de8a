// CUDA bfloat16 matmul / linear / linear_relu (cuBLASLt, bf16 data, float32
// compute; fused bias / bias+ReLU epilogues and their unfused fallback) against
// the CPU bfloat16 result, forward and backward, and one autocast MLP step on
// CUDA against the same step on the CPU. Label gpu; skipped with a reason when no
// GPU is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

class AutocastGpuTest : public ::tandem::testing::GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    set_allow_tf32(false);  // for the float32 parts; bfloat16 GEMMs ignore it
  }
};

// One bfloat16 ulp at |v| (8 significant bits): 2^(e-8) for |v| in [2^(e-1), 2^e).
double BfUlp(double v) {
  if (v == 0) return 0;
  int e = 0;
  std::frexp(v, &e);
  return std::ldexp(1.0, e - 8);
}

// CUDA bf16 against CPU bf16: within 2 bf16 ulps of the CPU value (both round a
// float32 sum once; different summation orders can put them on either side of a
// rounding boundary), plus 2^-12 of the tensor's largest magnitude for elements
// that cancel to near zero, where the float32 sums' own differences exceed an ulp.
void ExpectBf16Close(const Tensor& cpu, const Tensor& gpu, const std::string& what) {
  ASSERT_EQ(cpu.dtype(), kBFloat16) << what;
  ASSERT_EQ(gpu.dtype(), kBFloat16) << what;
  ASSERT_TRUE(gpu.is_cuda()) << what;
  const auto c = cpu.detach().to(kFloat64).to_vector<double>();
  const auto g = gpu.detach().to(Device::CPU()).to(kFloat64).to_vector<double>();
  ASSERT_EQ(c.size(), g.size()) << what;
  double scale = 0;
  for (double v : c) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < c.size(); ++i) {
    ASSERT_NEAR(g[i], c[i], 2 * BfUlp(c[i]) + 0x1p-12 * scale) << what << " element " << i;
  }
}

// Runs f on CPU and CUDA copies of the bf16 `inputs` (all requiring grad), with
// the same bf16 output gradient, and compares the output and every input's gradient.
void ExpectBf16Parity(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                      const std::vector<Tensor>& inputs, const std::string& what) {
  const Device gpu = Device::CUDA(0);
  std::vector<Tensor> cpu_in, gpu_in;
  for (const Tensor& t : inputs) {
    ASSERT_EQ(t.dtype(), kBFloat16) << what;
    cpu_in.push_back(t.detach().clone().set_requires_grad(true));
    gpu_in.push_back(t.detach().to(gpu).set_requires_grad(true));
  }
  Tensor cpu_out = f(cpu_in);
  Tensor gpu_out = f(gpu_in);
  ASSERT_EQ(cpu_out.shape(), gpu_out.shape()) << what;
  ExpectBf16Close(cpu_out, gpu_out, what + ": output");
  Tensor grad = randn(cpu_out.shape()).to(kBFloat16);
  cpu_out.backward(grad);
  gpu_out.backward(grad.to(gpu));
  for (size_t k = 0; k < inputs.size(); ++k) {
    ASSERT_TRUE(cpu_in[k].grad().defined()) << what << ": input " << k;
    ASSERT_TRUE(gpu_in[k].grad().defined()) << what << ": input " << k;
    ExpectBf16Close(cpu_in[k].grad(), gpu_in[k].grad(),
                    what + ": grad of input " + std::to_string(k));
  }
}

Tensor Bf16(const Shape& shape) { return randn(shape).to(kBFloat16); }

TEST_F(AutocastGpuTest, Bf16MatmulAndLinear) {
  manual_seed(41);
  ExpectBf16Parity([](const auto& in) { return matmul(in[0], in[1]); },
                   {Bf16({33, 17}), Bf16({17, 45})}, "matmul");
  ExpectBf16Parity([](const auto& in) { return matmul(in[0], in[1]); },
                   {Bf16({64, 128}), Bf16({128, 96})}, "matmul (larger)");
  ExpectBf16Parity([](const auto& in) { return linear(in[0], in[1], in[2]); },
                   {Bf16({32, 64}), Bf16({16, 64}), Bf16({16})}, "linear with bias");
  ExpectBf16Parity([](const auto& in) { return linear(in[0], in[1]); },
                   {Bf16({32, 64}), Bf16({16, 64})}, "linear without bias");
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                   {Bf16({32, 64}), Bf16({48, 64}), Bf16({48})}, "linear_relu with bias");
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1]); },
                   {Bf16({32, 64}), Bf16({48, 64})}, "linear_relu without bias");
  // A tall batch: the bias gradient sums 1024 rows (float32 accumulation).
  ExpectBf16Parity([](const auto& in) { return linear(in[0], in[1], in[2]); },
                   {Bf16({1024, 16}), Bf16({8, 16}), Bf16({8})}, "linear, 1024 rows");
}

// Shapes and operands for which the fused epilogue is not used: the float32-
// accumulator fallback (GEMM to float32, rank-1 bias GEMM, ReLU, one rounding).
TEST_F(AutocastGpuTest, Bf16LinearEpilogueFallbacks) {
  manual_seed(42);
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                   {Bf16({1, 16}), Bf16({8, 16}), Bf16({8})}, "batch 1, linear_relu");
  ExpectBf16Parity([](const auto& in) { return linear(in[0], in[1], in[2]); },
                   {Bf16({1, 16}), Bf16({8, 16}), Bf16({8})}, "batch 1, linear");
  ExpectBf16Parity([](const auto& in) { return linear(in[0], in[1], in[2]); },
                   {Bf16({9, 16}), Bf16({1, 16}), Bf16({1})}, "one output, linear");
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                   {Bf16({9, 16}), Bf16({1, 16}), Bf16({1})}, "one output, linear_relu");
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1]); },
                   {Bf16({1, 16}), Bf16({8, 16})}, "batch 1, linear_relu without bias");
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                   {Bf16({9, 1}), Bf16({8, 1}), Bf16({8})}, "one input, linear_relu");
  // Bias starting one element (2 bytes) into its buffer: not 16-byte aligned.
  ExpectBf16Parity([](const auto& in) { return linear_relu(in[0], in[1], in[2].slice(1, 9)); },
                   {Bf16({12, 16}), Bf16({8, 16}), Bf16({9})}, "misaligned bias");
}

// Largest |a - b| over the largest |b|.
using ::tandem::testing::ScaledError;

TEST_F(AutocastGpuTest, MlpStepUnderAutocastMatchesCpu) {
  manual_seed(43);
  // float32 parameters and input holding bf16-exact values (see autocast_test.cc).
  const std::vector<Tensor> host = {
      randn({16, 32}).to(kBFloat16).to(kFloat32),  // x
      (0.2 * randn({64, 32})).to(kBFloat16).to(kFloat32),
      (0.1 * randn({64})).to(kBFloat16).to(kFloat32),
      (0.2 * randn({10, 64})).to(kBFloat16).to(kFloat32),
      (0.1 * randn({10})).to(kBFloat16).to(kFloat32)};
  std::vector<int64_t> label_values(16);
  for (int i = 0; i < 16; ++i) label_values[static_cast<size_t>(i)] = (i * 3) % 10;
  const Tensor labels = from_vector(label_values, {16});

  struct Step {
    Tensor logits, loss;
    std::vector<Tensor> params;
  };
  auto run = [&](Device device) {
    Step s;
    for (size_t i = 1; i < host.size(); ++i) {
      // detach(): the CPU run's to() returns host[i] itself; without it the CPU
      // run would mark host[i] as requiring grad, and the GPU run's copy of it
      // would be an op's output, not a leaf.
      s.params.push_back(host[i].detach().to(device).set_requires_grad(true));
    }
    {
      AutocastGuard autocast(kBFloat16);
      Tensor h = relu(linear(host[0].to(device), s.params[0], s.params[1]));
      s.logits = linear(h, s.params[2], s.params[3]);
      s.loss = cross_entropy(s.logits, labels.to(device));
    }
    s.loss.backward();
    return s;
  };
  const Step cpu = run(Device::CPU());
  const Step gpu = run(Device::CUDA(0));
  ASSERT_EQ(gpu.logits.dtype(), kBFloat16);
  ASSERT_TRUE(gpu.logits.is_cuda());
  ASSERT_EQ(gpu.loss.dtype(), kFloat32);
  ExpectBf16Close(cpu.logits, gpu.logits, "logits");
  EXPECT_NEAR(gpu.loss.item(), cpu.loss.item(), 1e-2 * std::fabs(cpu.loss.item()));
  for (size_t i = 0; i < cpu.params.size(); ++i) {
    ASSERT_TRUE(gpu.params[i].grad().defined()) << "parameter " << i;
    EXPECT_EQ(gpu.params[i].grad().dtype(), kFloat32) << "parameter " << i;
    EXPECT_LT(ScaledError(gpu.params[i].grad(), cpu.params[i].grad()), 1e-2) << "parameter " << i;
  }
}

}  // namespace
}  // namespace tandem::nn
