// CUDA bfloat16 conv2d (cuDNN, float32 compute), max_pool2d and avg_pool2d
// (tandem's kernels) against the CPU bfloat16 ops, forward and backward, and
// conv2d under nn::AutocastGuard on CUDA. Label gpu; skipped with a reason when
// no GPU is visible.
//
// Tolerance: both sides round a float32 result to bfloat16, so they may differ
// by two bfloat16 ulps (2^-7 relative) plus what float32 accumulation in a
// different order (and, on CUDA, the bias added after the convolution's own
// rounding) moves: at most half an ulp of the magnitude sum, 2^-8 abs_ref,
// where abs_ref is the float64 op on |x|, |w|, |b|, |dy|. Pools follow the CPU
// kernels step by step and must match exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/ops/conv.h"
#include "nn/ops/pool.h"
#include "nn/random.h"

namespace tandem::nn {
namespace {

class Bf16ConvPoolGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) {
      GTEST_SKIP() << "no CUDA device visible (built with CUDA: " << cuda_built() << ")";
    }
  }
};

const Device kGpu = Device::CUDA(0);

Tensor AbsFloat64Leaf(const Tensor& t) {
  if (!t.defined()) return t;
  std::vector<double> v = t.to_vector<double>();
  for (double& e : v) e = std::abs(e);
  return from_vector(v, t.shape(), {.dtype = kFloat64}).set_requires_grad(true);
}

// Leaf copies of `t` on `device` that require grad (undefined stays undefined).
Tensor LeafOn(const Tensor& t, Device device) {
  if (!t.defined()) return t;
  return t.detach().to(device).set_requires_grad(true);
}

void ExpectClose(const Tensor& gpu, const Tensor& cpu, const Tensor& abs_ref,
                 const std::string& what) {
  ASSERT_TRUE(gpu.defined()) << what;
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  ASSERT_EQ(gpu.shape(), cpu.shape()) << what;
  const auto g = gpu.to_vector<double>(), c = cpu.to_vector<double>(),
             a = abs_ref.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    const double tol = std::abs(c[i]) / 128 + a[i] / 256;
    ASSERT_NEAR(g[i], c[i], tol) << what << " element " << i;
  }
}

void ExpectEqualValues(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  ASSERT_TRUE(gpu.is_cuda()) << what;
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  ASSERT_EQ(gpu.shape(), cpu.shape()) << what;
  const auto g = gpu.to_vector<double>(), c = cpu.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], c[i]) << what << " element " << i;
}

void CheckConv(const Shape& x_shape, const Shape& w_shape, bool with_bias,
               const Conv2dParams& p, const std::string& what) {
  Tensor x = randn(x_shape).to(kBFloat16), w = randn(w_shape).to(kBFloat16);
  Tensor b = with_bias ? randn({w_shape[0]}).to(kBFloat16) : Tensor();
  Tensor xc = LeafOn(x, Device::CPU()), wc = LeafOn(w, Device::CPU()), bc = LeafOn(b, Device::CPU());
  Tensor xg = LeafOn(x, kGpu), wg = LeafOn(w, kGpu), bg = LeafOn(b, kGpu);
  Tensor yc = conv2d(xc, wc, bc, p), yg = conv2d(xg, wg, bg, p);
  Tensor dy = randn(yc.shape()).to(kBFloat16);
  yc.backward(dy);
  yg.backward(dy.to(kGpu));
  Tensor xa = AbsFloat64Leaf(x), wa = AbsFloat64Leaf(w), ba = AbsFloat64Leaf(b);
  Tensor ya = conv2d(xa, wa, ba, p);
  ya.backward(AbsFloat64Leaf(dy).detach());
  ExpectClose(yg, yc, ya, what + ": output");
  ExpectClose(xg.grad(), xc.grad(), xa.grad(), what + ": dx");
  ExpectClose(wg.grad(), wc.grad(), wa.grad(), what + ": dweight");
  if (with_bias) ExpectClose(bg.grad(), bc.grad(), ba.grad(), what + ": dbias");
}

TEST_F(Bf16ConvPoolGpuTest, Conv2dMatchesCpuAcrossVariants) {
  manual_seed(301);
  const std::vector<Conv2dParams> variants = {
      {},
      {.stride = {2, 2}},
      {.padding = {1, 2}},
      {.dilation = {2, 1}},
      {.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}},
  };
  for (size_t v = 0; v < variants.size(); ++v) {
    for (bool bias : {false, true}) {
      CheckConv({2, 3, 9, 8}, {4, 3, 3, 2}, bias, variants[v],
                "variant " + std::to_string(v) + (bias ? " with bias" : " without bias"));
    }
  }
  // A longer reduction and channel counts tensor cores like.
  CheckConv({4, 64, 16, 16}, {32, 64, 3, 3}, true, {.padding = {1, 1}}, "64 -> 32 channels 3x3");
  // Grouped and depthwise (cuDNN's group count).
  CheckConv({2, 6, 9, 8}, {4, 3, 3, 3}, true, {.padding = {1, 1}, .groups = 2}, "groups 2");
  CheckConv({4, 32, 16, 16}, {32, 1, 3, 3}, false, {.stride = {2, 2}, .padding = {1, 1}, .groups = 32},
            "depthwise 32 channels 3x3 stride 2");
}

TEST_F(Bf16ConvPoolGpuTest, Conv2dWithPaddingOnlyWindows) {
  // H = 0 with padding: every window is padding, y is the bias (cuDNN is not called).
  Tensor x = empty({2, 3, 0, 4}, {.dtype = kBFloat16});
  Tensor w = randn({2, 3, 1, 1}).to(kBFloat16), b = randn({2}).to(kBFloat16);
  const Conv2dParams p{.padding = {1, 0}};
  ExpectEqualValues(conv2d(x.to(kGpu), w.to(kGpu), b.to(kGpu), p), conv2d(x, w, b, p),
                    "padding-only conv2d");
}

TEST_F(Bf16ConvPoolGpuTest, Conv2dUnderAutocastMatchesCpu) {
  manual_seed(302);
  Tensor x = randn({2, 3, 10, 10}), w = randn({8, 3, 3, 3}), b = randn({8});
  const Conv2dParams p{.stride = {2, 2}, .padding = {1, 1}};
  Tensor xc = LeafOn(x, Device::CPU()), wc = LeafOn(w, Device::CPU()), bc = LeafOn(b, Device::CPU());
  Tensor xg = LeafOn(x, kGpu), wg = LeafOn(w, kGpu), bg = LeafOn(b, kGpu);
  Tensor yc, yg;
  {
    AutocastGuard autocast(kBFloat16);
    yc = conv2d(xc, wc, bc, p);
    yg = conv2d(xg, wg, bg, p);
  }
  ASSERT_EQ(yg.dtype(), kBFloat16);
  Tensor dy = randn(yc.shape()).to(kBFloat16);
  yc.backward(dy);
  yg.backward(dy.to(kGpu));
  ASSERT_EQ(wg.grad().dtype(), kFloat32);
  Tensor xa = AbsFloat64Leaf(x.to(kBFloat16)), wa = AbsFloat64Leaf(w.to(kBFloat16)),
         ba = AbsFloat64Leaf(b.to(kBFloat16));
  Tensor ya = conv2d(xa, wa, ba, p);
  ya.backward(AbsFloat64Leaf(dy).detach());
  ExpectClose(yg, yc, ya, "autocast output");
  ExpectClose(xg.grad(), xc.grad(), xa.grad(), "autocast dx");
  ExpectClose(wg.grad(), wc.grad(), wa.grad(), "autocast dweight");
  ExpectClose(bg.grad(), bc.grad(), ba.grad(), "autocast dbias");
}

TEST_F(Bf16ConvPoolGpuTest, PoolsMatchCpuExactly) {
  manual_seed(303);
  const std::vector<Pool2dParams> variants = {
      {},
      {.kernel = {3, 3}, .stride = {1, 1}},
      {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}},
  };
  // Random values and values with many ties (first maximum in window order).
  std::vector<double> tied(2 * 3 * 9 * 8);
  for (size_t i = 0; i < tied.size(); ++i) tied[i] = static_cast<double>((i * 7 + i / 5) % 3);
  const std::vector<Tensor> inputs = {randn({2, 3, 9, 8}),
                                      from_vector(tied, {2, 3, 9, 8}, {.dtype = kFloat32})};
  for (size_t v = 0; v < variants.size(); ++v) {
    for (size_t k = 0; k < inputs.size(); ++k) {
      for (bool max : {true, false}) {
        const std::string what = std::string(max ? "max" : "avg") + "_pool2d variant " +
                                 std::to_string(v) + (k ? " tied" : " random");
        auto pool = max ? &max_pool2d : &avg_pool2d;
        Tensor x = inputs[k].to(kBFloat16);
        Tensor xc = LeafOn(x, Device::CPU()), xg = LeafOn(x, kGpu);
        Tensor yc = pool(xc, variants[v]), yg = pool(xg, variants[v]);
        Tensor dy = randn(yc.shape()).to(kBFloat16);
        yc.backward(dy);
        yg.backward(dy.to(kGpu));
        ExpectEqualValues(yg, yc, what + ": output");
        ExpectEqualValues(xg.grad(), xc.grad(), what + ": dx");
      }
    }
  }
}

}  // namespace
}  // namespace tandem::nn
