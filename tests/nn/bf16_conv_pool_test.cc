// bfloat16 conv2d, max_pool2d and avg_pool2d on the CPU, forward and backward,
// against the float64 ops run on the same (bfloat16-exact) values; conv2d
// under nn::AutocastGuard.
//
// Tolerance (bf16_design.md): a bfloat16 result is the float32 result rounded
// once, so it is within half a bfloat16 ulp (<= 2^-8 relative) of it, and the
// float32 result is within the accumulation error of the exact sum, bounded by
// a small multiple of 2^-24 times the sum of the terms' magnitudes (`abs_ref`,
// the float64 op run on |x|, |w|, |b|, |dy|). We allow 2^-8 |want| + 2^-17 abs_ref.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "nn/autocast.h"
#include "nn/ops/conv.h"
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using testing::ErrorOf;

constexpr double kRoundingTol = 1.0 / 256;        // 2^-8: one bfloat16 rounding
constexpr double kAccumulationTol = 1.0 / 131072;  // 2^-17 of the magnitude sum

// A random bfloat16 tensor (values drawn in float32, rounded) that requires grad.
Tensor RandomBf16(const Shape& shape) {
  return randn(shape).to(kBFloat16).detach().set_requires_grad(true);
}

// The same values in float64 (exact), as a fresh leaf that requires grad.
Tensor AsFloat64Leaf(const Tensor& t) {
  if (!t.defined()) return t;
  return t.detach().to(kFloat64).set_requires_grad(true);
}

// |t| in float64, a leaf that requires grad (for the magnitude references).
Tensor AbsFloat64Leaf(const Tensor& t) {
  if (!t.defined()) return t;
  std::vector<double> v = t.to_vector<double>();
  for (double& e : v) e = std::abs(e);
  return from_vector(v, t.shape(), {.dtype = kFloat64}).set_requires_grad(true);
}

// Every element of `got` within kRoundingTol |want| + kAccumulationTol abs_ref.
void ExpectClose(const Tensor& got, const Tensor& want, const Tensor& abs_ref,
                 const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto g = got.to_vector<double>(), w = want.to_vector<double>(),
             a = abs_ref.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    const double tol = kRoundingTol * std::abs(w[i]) + kAccumulationTol * a[i];
    ASSERT_NEAR(g[i], w[i], tol) << what << " element " << i;
  }
}

// Exact equality of the values of two tensors (any dtypes).
void ExpectEqualValues(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], w[i]) << what << " element " << i;
}

std::vector<Conv2dParams> ConvVariants() {
  return {
      {},                                                         // plain
      {.stride = {2, 2}},                                         // stride
      {.padding = {1, 2}},                                        // asymmetric padding
      {.dilation = {2, 1}},                                       // dilation
      {.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}},  // all at once
  };
}

std::string Describe(const Conv2dParams& p, bool bias) {
  return "stride (" + std::to_string(p.stride[0]) + ", " + std::to_string(p.stride[1]) +
         ") padding (" + std::to_string(p.padding[0]) + ", " + std::to_string(p.padding[1]) +
         ") dilation (" + std::to_string(p.dilation[0]) + ", " + std::to_string(p.dilation[1]) +
         (bias ? ") with bias" : ") without bias");
}

// conv2d on bfloat16 x, w (and b): output and the three gradients against the
// float64 op on the same values, with the magnitude reference of each.
void CheckConvAgainstFloat64(const Shape& x_shape, const Shape& w_shape, bool with_bias,
                             const Conv2dParams& params, const std::string& what) {
  Tensor x = RandomBf16(x_shape), w = RandomBf16(w_shape);
  Tensor b = with_bias ? RandomBf16({w_shape[0]}) : Tensor();
  Tensor y = conv2d(x, w, b, params);
  ASSERT_EQ(y.dtype(), kBFloat16) << what;
  Tensor dy = randn(y.shape()).to(kBFloat16);
  y.backward(dy);

  Tensor x64 = AsFloat64Leaf(x), w64 = AsFloat64Leaf(w), b64 = AsFloat64Leaf(b);
  Tensor y64 = conv2d(x64, w64, b64, params);
  y64.backward(dy.to(kFloat64));
  Tensor xa = AbsFloat64Leaf(x), wa = AbsFloat64Leaf(w), ba = AbsFloat64Leaf(b);
  Tensor ya = conv2d(xa, wa, ba, params);
  ya.backward(AbsFloat64Leaf(dy).detach());

  ExpectClose(y, y64, ya, what + ": output");
  ASSERT_EQ(x.grad().dtype(), kBFloat16) << what;
  ASSERT_EQ(w.grad().dtype(), kBFloat16) << what;
  ExpectClose(x.grad(), x64.grad(), xa.grad(), what + ": dx");
  ExpectClose(w.grad(), w64.grad(), wa.grad(), what + ": dweight");
  if (with_bias) {
    ASSERT_EQ(b.grad().dtype(), kBFloat16) << what;
    ExpectClose(b.grad(), b64.grad(), ba.grad(), what + ": dbias");
  }
}

TEST(Bf16ConvTest, ForwardAndBackwardMatchFloat64AcrossVariants) {
  manual_seed(101);
  for (const Conv2dParams& p : ConvVariants()) {
    for (bool bias : {false, true}) {
      CheckConvAgainstFloat64({2, 3, 9, 8}, {4, 3, 3, 2}, bias, p, Describe(p, bias));
    }
  }
}

TEST(Bf16ConvTest, LongerReductionsStayWithinTolerance) {
  // 64 channels x 5x5 taps: 1600 products per output, where float32 accumulation
  // and the single rounding both matter.
  manual_seed(102);
  CheckConvAgainstFloat64({2, 64, 12, 12}, {8, 64, 5, 5}, true, {.padding = {2, 2}},
                          "64 channels 5x5");
}

TEST(Bf16ConvTest, OutputIsTheFloat32ResultRoundedOnce) {
  // Two roundings (e.g. of the products or of conv before the bias) would show.
  // On the emulated path, which runs the float32 kernels (oneDNN's bfloat16
  // primitives sum in their own order: bf16_conv_dnnl_test.cc checks them).
  set_cpu_bf16_native(false);
  struct Restore {
    ~Restore() { set_cpu_bf16_native(true); }
  } restore;
  manual_seed(103);
  Tensor x = RandomBf16({2, 5, 7, 7}), w = RandomBf16({6, 5, 3, 3}), b = RandomBf16({6});
  const Conv2dParams p{.padding = {1, 1}};
  Tensor y = conv2d(x, w, b, p);
  Tensor y32 = conv2d(x.detach().to(kFloat32), w.detach().to(kFloat32), b.detach().to(kFloat32), p);
  ExpectEqualValues(y, y32.to(kBFloat16), "bfloat16 conv2d vs float32 conv2d rounded");
}

TEST(Bf16ConvTest, EmptyBatchGivesZeroFilterAndBiasGradients) {
  Tensor x = RandomBf16({0, 3, 5, 5}), w = RandomBf16({2, 3, 3, 3}), b = RandomBf16({2});
  Tensor y = conv2d(x, w, b);
  ASSERT_EQ(y.shape(), (Shape{0, 2, 3, 3}));
  ASSERT_EQ(y.dtype(), kBFloat16);
  y.backward(empty(y.shape(), {.dtype = kBFloat16}));
  ExpectEqualValues(w.grad(), zeros({2, 3, 3, 3}), "dweight");
  ExpectEqualValues(b.grad(), zeros({2}), "dbias");
}

TEST(Bf16ConvTest, MixedDTypesFailOutsideAutocast) {
  Tensor x = randn({1, 2, 4, 4}).to(kBFloat16), w = randn({3, 2, 3, 3});
  const std::string error = ErrorOf([&] { conv2d(x, w); });
  EXPECT_NE(error.find("dtypes differ"), std::string::npos) << error;
  const std::string bias_error =
      ErrorOf([&] { conv2d(x, w.to(kBFloat16), randn({3})); });
  EXPECT_NE(bias_error.find("dtypes differ"), std::string::npos) << bias_error;
  const std::string int_error = ErrorOf([&] {
    conv2d(zeros({1, 2, 4, 4}, {.dtype = kInt64}), zeros({3, 2, 3, 3}, {.dtype = kInt64}));
  });
  EXPECT_NE(int_error.find("int64"), std::string::npos) << int_error;
}

TEST(Bf16ConvTest, AutocastRunsBfloat16AndGivesFloat32ParameterGradients) {
  manual_seed(104);
  const Conv2dParams p{.stride = {2, 1}, .padding = {1, 1}};
  // float32 parameters and input, as a model has them.
  Tensor x = randn({2, 3, 8, 8}).set_requires_grad(true);
  Tensor w = randn({4, 3, 3, 3}).set_requires_grad(true);
  Tensor b = randn({4}).set_requires_grad(true);
  Tensor y;
  {
    AutocastGuard autocast(kBFloat16);
    y = conv2d(x, w, b, p);
  }
  ASSERT_EQ(y.dtype(), kBFloat16);
  Tensor dy = randn(y.shape()).to(kBFloat16);
  y.backward(dy);
  ASSERT_EQ(x.grad().dtype(), kFloat32);
  ASSERT_EQ(w.grad().dtype(), kFloat32);
  ASSERT_EQ(b.grad().dtype(), kFloat32);

  // Reference: the float64 op on the bfloat16-rounded operands.
  auto rounded = [](const Tensor& t) {
    return t.detach().to(kBFloat16).to(kFloat64).set_requires_grad(true);
  };
  Tensor x64 = rounded(x), w64 = rounded(w), b64 = rounded(b);
  Tensor y64 = conv2d(x64, w64, b64, p);
  y64.backward(dy.to(kFloat64));
  Tensor xa = AbsFloat64Leaf(x64), wa = AbsFloat64Leaf(w64), ba = AbsFloat64Leaf(b64);
  Tensor ya = conv2d(xa, wa, ba, p);
  ya.backward(AbsFloat64Leaf(dy).detach());
  ExpectClose(y, y64, ya, "autocast output");
  ExpectClose(x.grad(), x64.grad(), xa.grad(), "autocast dx");
  ExpectClose(w.grad(), w64.grad(), wa.grad(), "autocast dweight");
  ExpectClose(b.grad(), b64.grad(), ba.grad(), "autocast dbias");
}

TEST(Bf16ConvTest, AutocastLowersFloat32OperandsMixedWithBfloat16) {
  manual_seed(105);
  Tensor x = randn({1, 2, 5, 5}).to(kBFloat16);  // e.g. the output of a bf16 layer
  Tensor w = randn({3, 2, 3, 3});
  AutocastGuard autocast(kBFloat16);
  Tensor y = conv2d(x, w);
  EXPECT_EQ(y.dtype(), kBFloat16);
  {
    AutocastGuard off(kFloat32);
    const std::string error = ErrorOf([&] { conv2d(x, w); });
    EXPECT_NE(error.find("dtypes differ"), std::string::npos) << error;
    EXPECT_EQ(conv2d(randn({1, 2, 5, 5}), w).dtype(), kFloat32);
  }
  // float64 is not lowered: autocast only casts float32.
  EXPECT_EQ(conv2d(randn({1, 2, 5, 5}, {.dtype = kFloat64}),
                   randn({3, 2, 3, 3}, {.dtype = kFloat64}))
                .dtype(),
            kFloat64);
}

TEST(Bf16ConvTest, AutocastIsPerThread) {
  AutocastGuard autocast(kBFloat16);
  DType seen = kBFloat16;
  std::thread other([&] { seen = conv2d(randn({1, 1, 3, 3}), randn({1, 1, 2, 2})).dtype(); });
  other.join();
  EXPECT_EQ(seen, kFloat32);
}

// ---- pooling ----

std::vector<Pool2dParams> PoolVariants() {
  return {
      {},                                                       // 2x2, stride = kernel
      {.kernel = {3, 3}, .stride = {1, 1}},                     // overlapping windows
      {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}},  // padding, uneven
  };
}

using PoolFn = Tensor (*)(const Tensor&, const Pool2dParams&);

// pool on bfloat16 x against the float64 op on the same values.
void CheckPoolAgainstFloat64(PoolFn pool, const Tensor& values, const Pool2dParams& p,
                             bool exact, const std::string& what) {
  Tensor x = values.detach().to(kBFloat16).set_requires_grad(true);
  Tensor y = pool(x, p);
  ASSERT_EQ(y.dtype(), kBFloat16) << what;
  Tensor dy = randn(y.shape()).to(kBFloat16);
  y.backward(dy);
  ASSERT_EQ(x.grad().dtype(), kBFloat16) << what;
  Tensor x64 = AsFloat64Leaf(x);
  Tensor y64 = pool(x64, p);
  y64.backward(dy.to(kFloat64));
  if (exact) {
    ExpectEqualValues(y, y64, what + ": output");
    ExpectEqualValues(x.grad(), x64.grad(), what + ": dx");
    return;
  }
  Tensor xa = AbsFloat64Leaf(x);
  Tensor ya = pool(xa, p);
  ya.backward(AbsFloat64Leaf(dy).detach());
  ExpectClose(y, y64, ya, what + ": output");
  ExpectClose(x.grad(), x64.grad(), xa.grad(), what + ": dx");
}

TEST(Bf16PoolTest, MaxPoolSelectsExactlyAsFloat64) {
  manual_seed(201);
  const std::vector<Pool2dParams> variants = PoolVariants();
  for (size_t v = 0; v < variants.size(); ++v) {
    const Pool2dParams& p = variants[v];
    // Outputs only select, so they are exact; gradients are exact where windows
    // do not overlap (each input receives at most one dy) and within one
    // rounding of a float32 sum where they do.
    const bool overlapping = v != 0;
    Tensor values = randn({2, 3, 7, 8});
    CheckPoolAgainstFloat64(&max_pool2d, values, p, /*exact=*/!overlapping,
                            "max_pool2d variant " + std::to_string(v));
    if (overlapping) {
      // The forward is exact regardless.
      Tensor x = values.to(kBFloat16);
      ExpectEqualValues(max_pool2d(x, p), max_pool2d(x.to(kFloat64), p),
                        "max_pool2d forward variant " + std::to_string(v));
    }
  }
}

TEST(Bf16PoolTest, MaxPool2x2RowsMatchFloat32) {
  // 2x2 stride 2 on rows of 13 outputs (groups of 4 and a remainder, LeNet's
  // 24 -> 12 plane included): bfloat16 runs float32's row kernel on widened rows.
  manual_seed(205);
  for (const Shape& shape : {Shape{2, 3, 24, 26}, Shape{1, 2, 24, 24}, Shape{1, 1, 5, 3}}) {
    Tensor values = randn(shape).to(kBFloat16).to(kFloat32);
    Tensor xb = values.to(kBFloat16).set_requires_grad(true);
    Tensor xf = values.clone().set_requires_grad(true);
    const Pool2dParams p{.kernel = {2, 2}, .stride = {2, 2}};
    Tensor yb = max_pool2d(xb, p), yf = max_pool2d(xf, p);
    Tensor dy = randn(yb.shape()).to(kBFloat16);
    yb.backward(dy);
    yf.backward(dy.to(kFloat32));
    ExpectEqualValues(yb, yf, "2x2 max_pool2d output");
    ExpectEqualValues(xb.grad(), xf.grad(), "2x2 max_pool2d gradient");
  }
}

TEST(Bf16PoolTest, MaxPoolTiesRouteToTheSameArgmaxAsFloat32) {
  // Values from {0, 1, 2}: most windows hold ties. bfloat16 must send each dy to
  // the element the float32 op picks (the first maximum in row-major order).
  manual_seed(202);
  std::vector<double> v(2 * 2 * 8 * 8);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((i * 7 + i / 5) % 3);
  Tensor values = from_vector(v, {2, 2, 8, 8}, {.dtype = kFloat32});
  for (const Pool2dParams& p : PoolVariants()) {
    Tensor xb = values.to(kBFloat16).set_requires_grad(true);
    Tensor xf = values.clone().set_requires_grad(true);
    Tensor yb = max_pool2d(xb, p), yf = max_pool2d(xf, p);
    // Small integers as dy: sums of up to 9 of them stay below 256, exact in
    // bfloat16 and float32, so a different routing changes some gradient.
    std::vector<double> g(yb.numel());
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<double>(1 + (i * 5) % 16);
    yb.backward(from_vector(g, yb.shape(), {.dtype = kFloat32}).to(kBFloat16));
    yf.backward(from_vector(g, yf.shape(), {.dtype = kFloat32}));
    ExpectEqualValues(yb, yf, "tied max_pool2d output");
    ExpectEqualValues(xb.grad(), xf.grad(), "tied max_pool2d gradient routing");
  }
}

TEST(Bf16PoolTest, AvgPoolMatchesFloat64) {
  manual_seed(203);
  const std::vector<Pool2dParams> variants = PoolVariants();
  for (size_t v = 0; v < variants.size(); ++v) {
    CheckPoolAgainstFloat64(&avg_pool2d, randn({2, 3, 7, 8}), variants[v], /*exact=*/false,
                            "avg_pool2d variant " + std::to_string(v));
  }
}

TEST(Bf16PoolTest, AvgPoolRoundsOnce) {
  // The float32 op on the same values, rounded once, is what bfloat16 returns.
  manual_seed(204);
  const Pool2dParams p{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  Tensor x = randn({2, 2, 9, 9}).to(kBFloat16);
  ExpectEqualValues(avg_pool2d(x, p), avg_pool2d(x.to(kFloat32), p).to(kBFloat16),
                    "avg_pool2d bfloat16 vs float32 rounded");
}

TEST(Bf16PoolTest, PoolsKeepTheirDTypeUnderAutocast) {
  AutocastGuard autocast(kBFloat16);
  Tensor xb = randn({1, 1, 4, 4}).to(kBFloat16), xf = randn({1, 1, 4, 4});
  EXPECT_EQ(max_pool2d(xb).dtype(), kBFloat16);
  EXPECT_EQ(avg_pool2d(xb).dtype(), kBFloat16);
  EXPECT_EQ(max_pool2d(xf).dtype(), kFloat32);
  EXPECT_EQ(avg_pool2d(xf).dtype(), kFloat32);
}

TEST(Bf16PoolTest, NonFloatingInputIsRejectedByName) {
  const std::string error = ErrorOf([] { max_pool2d(zeros({1, 1, 4, 4}, {.dtype = kInt64})); });
  EXPECT_NE(error.find("int64"), std::string::npos) << error;
  EXPECT_NE(error.find("max_pool2d"), std::string::npos) << error;
}

}  // namespace
}  // namespace tandem::nn
