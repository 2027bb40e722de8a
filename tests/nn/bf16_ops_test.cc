// bfloat16 kernels of the elementwise family and dropout on the CPU: every op
// in bf16 against the float64 op on the same bf16-rounded inputs, forward and
// backward; sum_to accumulating in float; dropout's bf16 mask equal to the
// float32 one; gradient accumulation of a bf16 tensor staying bf16; dtype errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/random.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using testing::ErrorOf;

// v rounded to bfloat16 (through float, as the kernels store).
double RoundBf16(double v) { return static_cast<float>(BFloat16(static_cast<float>(v))); }

// The spacing of bfloat16 values at |v| (8 significant bits); subnormal spacing
// below the smallest normal.
double Bf16Ulp(double v) {
  v = std::fabs(v);
  if (v < std::ldexp(1.0, -126)) return std::ldexp(1.0, -133);
  int e;
  std::frexp(v, &e);  // v = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0, e - 8);
}

// Uniform values in [lo, hi), rounded to bfloat16.
Tensor Bf16Uniform(const Shape& shape, double lo, double hi) {
  Tensor u = rand(shape, {.dtype = kFloat64});
  return add_scalar(mul_scalar(u, hi - lo), lo).to(kBFloat16).detach();
}

// Values with |v| in [lo, hi) and a random sign, rounded to bfloat16 (no zeros).
Tensor Bf16AwayFromZero(const Shape& shape, double lo, double hi) {
  std::vector<double> mag = rand(shape, {.dtype = kFloat64}).to_vector<double>();
  std::vector<double> sign = rand(shape, {.dtype = kFloat64}).to_vector<double>();
  for (size_t i = 0; i < mag.size(); ++i) {
    mag[i] = (lo + (hi - lo) * mag[i]) * (sign[i] < 0.5 ? -1.0 : 1.0);
  }
  return from_vector(mag, shape, {.dtype = kBFloat16});
}

Tensor ToF64(const Tensor& t) { return t.detach().to(kFloat64).detach(); }

// got (bf16) within `ulps` bf16 ulps of `want` (float64 values); `round_want`
// compares against want rounded to bf16 (one rounding), else against the
// exact value (a chain of several bf16 roundings).
void ExpectBf16Near(const Tensor& got, const Tensor& want, double ulps, bool round_want,
                    const std::string& what, const std::vector<double>& slack = {}) {
  ASSERT_EQ(got.dtype(), kBFloat16) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<double> g = got.to_vector<double>();
  const std::vector<double> w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    const double ref = round_want ? RoundBf16(w[i]) : w[i];
    const double tol = ulps * Bf16Ulp(ref) + (slack.empty() ? 0.0 : slack[i]);
    ASSERT_LE(std::fabs(g[i] - ref), tol)
        << what << " element " << i << ": got " << g[i] << ", float64 reference " << w[i];
  }
}

struct UnaryCase {
  std::string name;
  std::function<Tensor(const Tensor&)> f;
  double lo, hi;   // input range
  double bw_ulps;  // backward: bf16 roundings in the gradient formula
};

std::vector<UnaryCase> UnaryCases() {
  return {
      {"neg", [](const Tensor& x) { return neg(x); }, -3, 3, 0},
      {"add_scalar", [](const Tensor& x) { return add_scalar(x, 0.75); }, -3, 3, 0},
      {"mul_scalar", [](const Tensor& x) { return mul_scalar(x, 0.3); }, -3, 3, 1},
      {"rsub_scalar", [](const Tensor& x) { return rsub_scalar(x, 1.5); }, -3, 3, 0},
      {"div by scalar", [](const Tensor& x) { return x / 3.0; }, -3, 3, 1},
      {"rdiv_scalar", [](const Tensor& x) { return rdiv_scalar(x, 2.5); }, 0.2, 4, 3},
      {"pow_scalar 2", [](const Tensor& x) { return pow_scalar(x, 2.0); }, -3, 3, 3},
      {"pow_scalar 0.5", [](const Tensor& x) { return pow_scalar(x, 0.5); }, 0.1, 9, 3},
      {"pow_scalar -1.5", [](const Tensor& x) { return pow_scalar(x, -1.5); }, 0.2, 5, 3},
      {"exp", [](const Tensor& x) { return exp(x); }, -5, 5, 2},
      {"log", [](const Tensor& x) { return log(x); }, 0.05, 20, 1},
      {"relu", [](const Tensor& x) { return relu(x); }, -2, 2, 0},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, -8, 8, -1},
      {"tanh", [](const Tensor& x) { return tanh(x); }, -3, 3, -1},
      {"abs", [](const Tensor& x) { return abs(x); }, -3, 3, 0},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, 0.1, 9, 2},
      {"clamp", [](const Tensor& x) { return clamp(x, -1.0, 1.5); }, -3, 3, 0},
      {"leaky_relu", [](const Tensor& x) { return leaky_relu(x, 0.2); }, -3, 3, 1},
      // gelu from -3: below, 1 + erf (1 + tanh) cancels in float (see gpu_parity_cases.cc).
      {"gelu", [](const Tensor& x) { return gelu(x); }, -3, 3, 1},
      {"gelu tanh", [](const Tensor& x) { return gelu(x, GeluApproximate::kTanh); }, -3, 3, 1},
      {"silu", [](const Tensor& x) { return silu(x); }, -8, 8, 1},
      {"softplus", [](const Tensor& x) { return softplus(x); }, -8, 8, 2},
  };
}

TEST(Bf16OpsTest, UnaryForwardWithinOneUlpOfFloat64) {
  manual_seed(101);
  for (const UnaryCase& c : UnaryCases()) {
    Tensor x = Bf16Uniform({7, 33}, c.lo, c.hi);
    Tensor y = c.f(x);
    ASSERT_EQ(y.dtype(), kBFloat16) << c.name;
    ExpectBf16Near(y, c.f(ToF64(x)), 1, true, c.name);
  }
}

// The gradient of each unary op in bf16 against the float64 op's gradient on
// the same rounded input and output gradient. A formula of k bf16 roundings
// (rounded saved output, rounded intermediate products) is allowed k + 0.5 ulps
// of the exact value; k = 0 must be exact.
TEST(Bf16OpsTest, UnaryBackwardMatchesFloat64Gradients) {
  manual_seed(102);
  for (const UnaryCase& c : UnaryCases()) {
    if (c.bw_ulps < 0) continue;  // checked against their saved output below
    Tensor x = Bf16Uniform({5, 21}, c.lo, c.hi).set_requires_grad(true);
    Tensor g = Bf16Uniform({5, 21}, -2, 2);
    c.f(x).backward(g);
    Tensor x64 = ToF64(x).set_requires_grad(true);
    c.f(x64).backward(ToF64(g));
    ASSERT_TRUE(x.grad().defined()) << c.name;
    const double ulps = c.bw_ulps == 0 ? 0 : c.bw_ulps + 0.5;
    ExpectBf16Near(x.grad(), x64.grad(), ulps, /*round_want=*/false, c.name + " backward");
  }
}

// relu / sigmoid / tanh backward take the saved bf16 output: checked against
// the float64 formula on that output (one rounding).
TEST(Bf16OpsTest, ActivationBackwardFromSavedOutputWithinOneUlp) {
  manual_seed(103);
  struct Case {
    std::string name;
    std::function<Tensor(const Tensor&)> f;
    std::function<double(double g, double y)> grad;
  };
  const std::vector<Case> cases = {
      {"relu", [](const Tensor& x) { return relu(x); },
       [](double g, double y) { return y > 0 ? g : 0.0; }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); },
       [](double g, double y) { return g * y * (1 - y); }},
      {"tanh", [](const Tensor& x) { return tanh(x); },
       [](double g, double y) { return g * (1 - y * y); }},
  };
  for (const Case& c : cases) {
    Tensor x = Bf16Uniform({9, 17}, -4, 4).set_requires_grad(true);
    Tensor g = Bf16Uniform({9, 17}, -2, 2);
    Tensor y = c.f(x);
    y.backward(g);
    const std::vector<double> yv = y.to_vector<double>(), gv = g.to_vector<double>();
    std::vector<double> want(yv.size());
    for (size_t i = 0; i < yv.size(); ++i) want[i] = c.grad(gv[i], yv[i]);
    ExpectBf16Near(x.grad(), from_vector(want, x.shape(), {.dtype = kFloat64}), 1, true,
                   c.name + " backward");
  }
}

// relu's backward on the bits of special values: dy where the saved output is
// > 0 (+inf and the smallest subnormal included), +0 elsewhere (-0, NaN); a NaN
// dy stays NaN, a -0 dy stays -0.
TEST(Bf16OpsTest, ReluBackwardSpecialValues) {
  const float inf = INFINITY, nan = NAN, tiny = 9.2e-41f;  // a bfloat16 subnormal
  const std::vector<float> xs = {-1.0f, -0.0f, 0.0f, tiny, 2.0f, inf, -inf, nan};
  const std::vector<float> dys = {3.0f, -0.0f, nan, -inf};
  std::vector<double> xv, dyv;
  for (float x : xs) {
    for (float dy : dys) xv.push_back(x), dyv.push_back(dy);
  }
  const Shape shape{static_cast<int64_t>(xv.size())};
  Tensor x = from_vector(xv, shape, {.dtype = kFloat32}).to(kBFloat16).set_requires_grad(true);
  relu(x).backward(from_vector(dyv, shape, {.dtype = kFloat32}).to(kBFloat16));
  const std::vector<double> got = x.grad().to_vector<double>();
  for (size_t i = 0; i < got.size(); ++i) {
    const float xb = static_cast<float>(BFloat16(static_cast<float>(xv[i])));
    const double want = xb > 0.0f ? dyv[i] : 0.0;
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], want) << i;
      EXPECT_EQ(std::signbit(got[i]), std::signbit(want)) << i;
    }
  }
}

struct BinaryCase {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> f;
};

std::vector<BinaryCase> BinaryCases() {
  return {{"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
          {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
          {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
          {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }}};
}

// Same shape, b a single element, and broadcasting both ways.
const std::vector<std::pair<Shape, Shape>>& BinaryShapes() {
  static const std::vector<std::pair<Shape, Shape>> shapes = {
      {{4, 5}, {4, 5}}, {{4, 5}, {1}},    {{4, 5}, {5}},
      {{4, 1}, {1, 5}}, {{5}, {3, 4, 5}}, {{3, 4, 5}, {4, 1}}};
  return shapes;
}

TEST(Bf16OpsTest, BinaryForwardWithinOneUlpOfFloat64) {
  manual_seed(104);
  for (const BinaryCase& c : BinaryCases()) {
    for (const auto& [sa, sb] : BinaryShapes()) {
      Tensor a = Bf16Uniform(sa, -3, 3);
      Tensor b = Bf16AwayFromZero(sb, 0.25, 3);
      Tensor y = c.f(a, b);
      const std::string what = c.name + " " + ShapeToString(sa) + " " + ShapeToString(sb);
      ExpectBf16Near(y, c.f(ToF64(a), ToF64(b)), 1, true, what);
    }
  }
}

// Same shapes: each gradient is a chain of bf16 ops (mul: 1 rounding; div's
// gradient of b: mul, mul, div = 3). add/sub pass the gradient through exactly.
TEST(Bf16OpsTest, BinaryBackwardMatchesFloat64Gradients) {
  manual_seed(105);
  const double ulps_a[] = {0, 0, 1.5, 1.5};
  const double ulps_b[] = {0, 0, 1.5, 3.5};
  const std::vector<BinaryCase> cases = BinaryCases();
  for (size_t k = 0; k < cases.size(); ++k) {
    Tensor a = Bf16Uniform({6, 7}, -3, 3).set_requires_grad(true);
    Tensor b = Bf16AwayFromZero({6, 7}, 0.25, 3).set_requires_grad(true);
    Tensor g = Bf16Uniform({6, 7}, -2, 2);
    cases[k].f(a, b).backward(g);
    Tensor a64 = ToF64(a).set_requires_grad(true), b64 = ToF64(b).set_requires_grad(true);
    cases[k].f(a64, b64).backward(ToF64(g));
    ExpectBf16Near(a.grad(), a64.grad(), ulps_a[k], false, cases[k].name + " grad a");
    ExpectBf16Near(b.grad(), b64.grad(), ulps_b[k], false, cases[k].name + " grad b");
  }
}

// Broadcast backward: sum_to of the (rounded) gradient terms, accumulated in
// float and rounded once. add: the terms are exact; mul: each term g*a is
// rounded to bf16 first, so the bound is one ulp plus 2^-8 of the sum of |terms|.
TEST(Bf16OpsTest, BroadcastBackwardSumsInFloat) {
  manual_seed(106);
  Tensor a = Bf16Uniform({40, 6}, -3, 3).set_requires_grad(true);
  Tensor b = Bf16Uniform({6}, -3, 3).set_requires_grad(true);
  Tensor g = Bf16Uniform({40, 6}, -2, 2);
  add(a, b).backward(g);
  Tensor want_b = sum_to(ToF64(g), {6});
  ExpectBf16Near(b.grad(), want_b, 1, true, "add grad b",
                 std::vector<double>(6, 40.0 * 40.0 * 2.0 * std::ldexp(1.0, -24)));
  ExpectBf16Near(a.grad(), ToF64(g), 0, false, "add grad a");

  Tensor c = Bf16Uniform({6}, -3, 3).set_requires_grad(true);
  mul(a.detach(), c).backward(g);
  const std::vector<double> av = a.to_vector<double>(), gv = g.to_vector<double>();
  std::vector<double> want(6, 0.0), abs_sum(6, 0.0);
  for (size_t i = 0; i < av.size(); ++i) {
    want[i % 6] += gv[i] * av[i];
    abs_sum[i % 6] += std::fabs(gv[i] * av[i]);
  }
  for (double& s : abs_sum) s *= std::ldexp(1.0, -8);
  ExpectBf16Near(c.grad(), from_vector(want, {6}, {.dtype = kFloat64}), 1, true, "mul grad b",
                 abs_sum);
}

TEST(Bf16OpsTest, SumToWithinOneUlpPlusFloatAccumulation) {
  manual_seed(107);
  Tensor x = Bf16Uniform({6, 4, 5}, -2, 2);
  const std::vector<double> xv = x.to_vector<double>();
  double max_abs = 0;
  for (double v : xv) max_abs = std::max(max_abs, std::fabs(v));
  for (const Shape& shape : std::vector<Shape>{{4, 5}, {4, 1}, {1, 5}, {5}, {6, 1, 1}, {1}}) {
    Tensor y = sum_to(x, shape);
    ASSERT_EQ(y.shape(), shape);
    const double count = static_cast<double>(x.numel() / y.numel());
    const double slack = count * count * max_abs * std::ldexp(1.0, -24);
    ExpectBf16Near(y, sum_to(ToF64(x), shape), 1, true, "sum_to " + ShapeToString(shape),
                   std::vector<double>(static_cast<size_t>(y.numel()), slack));
  }
}

// 1000 ones: a bf16 running sum would stop at 256 (256 + 1 rounds back to 256);
// a float one gives 1000, which bf16 holds exactly.
TEST(Bf16OpsTest, SumToAccumulatesInFloatNotBf16) {
  Tensor x = ones({1000}, {.dtype = kBFloat16});
  EXPECT_EQ(sum_to(x, {1}).item(), 1000.0);
  Tensor big = ones({4, 1000}, {.dtype = kBFloat16});
  EXPECT_EQ(sum_to(big, {4, 1}).to_vector<double>(), std::vector<double>(4, 1000.0));
  Tensor b = zeros({1}, {.dtype = kBFloat16}).set_requires_grad(true);
  add(x, b).backward(ones({1000}, {.dtype = kBFloat16}));
  EXPECT_EQ(b.grad().item(), 1000.0);
}

// Bits of a bf16 tensor's elements.
std::vector<uint16_t> Bits(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  const Tensor c = t.detach().clone();
  std::memcpy(out.data(), c.data_ptr(), out.size() * 2);
  return out;
}

double FromBits(uint16_t bits) {
  BFloat16 b;
  b.bits = bits;
  return static_cast<float>(b);
}

TEST(Bf16OpsTest, GradientOfATensorUsedTwiceAccumulatesInBf16) {
  manual_seed(108);
  Tensor x = Bf16Uniform({3, 11}, -3, 3).set_requires_grad(true);
  Tensor c1 = Bf16Uniform({3, 11}, -2, 2), c2 = Bf16Uniform({3, 11}, -2, 2);
  Tensor g = Bf16Uniform({3, 11}, -2, 2);
  add(mul(x, c1), mul(x, c2)).backward(g);
  ASSERT_EQ(x.grad().dtype(), kBFloat16);
  // Each term rounded to bf16 (mul's backward), their sum in float rounded once.
  const std::vector<double> gv = g.to_vector<double>(), v1 = c1.to_vector<double>(),
                            v2 = c2.to_vector<double>();
  std::vector<uint16_t> want(gv.size());
  for (size_t i = 0; i < gv.size(); ++i) {
    const float t1 = static_cast<float>(BFloat16(static_cast<float>(gv[i] * v1[i])));
    const float t2 = static_cast<float>(BFloat16(static_cast<float>(gv[i] * v2[i])));
    want[i] = BFloat16(t1 + t2).bits;
  }
  EXPECT_EQ(Bits(x.grad()), want);
  // A second backward adds into the leaf's bf16 gradient (doubling is exact).
  add(mul(x, c1), mul(x, c2)).backward(g);
  const std::vector<double> twice = x.grad().to_vector<double>();
  for (size_t i = 0; i < gv.size(); ++i) ASSERT_EQ(twice[i], 2.0 * FromBits(want[i])) << i;
  // x * x: one op using x twice; 2 * x * g within 1.5 ulps (two roundings).
  Tensor z = Bf16Uniform({3, 11}, -3, 3).set_requires_grad(true);
  mul(z, z).backward(g);
  Tensor want64 = mul_scalar(mul(ToF64(z), ToF64(g)), 2.0);
  ExpectBf16Near(z.grad(), want64, 2.5, false, "x*x grad");
}

TEST(Bf16OpsTest, InPlaceAddAndScaleRoundOnce) {
  manual_seed(109);
  Tensor y = Bf16Uniform({50}, -3, 3), x = Bf16Uniform({50}, -3, 3);
  Tensor want = add(ToF64(y), mul_scalar(ToF64(x), 0.375));
  y.add_(x, 0.375);
  ExpectBf16Near(y, want, 1, true, "add_");
  Tensor want2 = mul_scalar(ToF64(y), 1.7);
  y.mul_(1.7);
  ExpectBf16Near(y, want2, 1, true, "mul_");
}

TEST(Bf16OpsTest, DropoutMaskEqualsFloat32Mask) {
  manual_seed(110);
  const double p = 0.35;
  Tensor x32 = randn({37, 29});
  Tensor xb = x32.to(kBFloat16).detach().set_requires_grad(true);
  manual_seed(5);
  Tensor y32 = dropout(x32, p, true);
  manual_seed(5);
  Tensor yb = dropout(xb, p, true);
  ASSERT_EQ(yb.dtype(), kBFloat16);
  const std::vector<float> v32 = y32.to_vector<float>(), vb = yb.to_vector<float>();
  const std::vector<double> xv = xb.to_vector<double>();
  std::vector<double> want(vb.size());
  int64_t kept = 0;
  for (size_t i = 0; i < vb.size(); ++i) {
    ASSERT_NE(xv[i], 0.0);
    ASSERT_EQ(v32[i] != 0.0f, vb[i] != 0.0f) << "element " << i;
    want[i] = v32[i] != 0.0f ? xv[i] / (1.0 - p) : 0.0;
    kept += v32[i] != 0.0f;
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, yb.numel());
  ExpectBf16Near(yb, from_vector(want, yb.shape(), {.dtype = kFloat64}), 1, true, "dropout");
  Tensor g = Bf16Uniform({37, 29}, -2, 2);
  yb.backward(g);
  const std::vector<double> gv = g.to_vector<double>();
  for (size_t i = 0; i < vb.size(); ++i) want[i] = v32[i] != 0.0f ? gv[i] / (1.0 - p) : 0.0;
  ExpectBf16Near(xb.grad(), from_vector(want, yb.shape(), {.dtype = kFloat64}), 1, true,
                 "dropout backward");
}

TEST(Bf16OpsTest, MixedDTypesAreErrors) {
  Tensor b = ones({2, 3}, {.dtype = kBFloat16});
  Tensor f = ones({2, 3});
  Tensor d = ones({3}, {.dtype = kFloat64});
  EXPECT_NE(ErrorOf([&] { add(b, f); }).find("add: dtypes differ"), std::string::npos)
      << ErrorOf([&] { add(b, f); });
  EXPECT_NE(ErrorOf([&] { sub(f, b); }).find("sub: dtypes differ"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { mul(b, d); }).find("mul: dtypes differ"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { div(d, b); }).find("div: dtypes differ"), std::string::npos);
  const std::string err = ErrorOf([&] { add(b, f); });
  EXPECT_NE(err.find("bfloat16"), std::string::npos) << err;
  EXPECT_NE(err.find("float32"), std::string::npos) << err;
  // Non-floating dtypes name the op and the accepted dtypes.
  Tensor i = ones({3}, {.dtype = kInt64});
  const std::string relu_err = ErrorOf([&] { relu(i); });
  EXPECT_NE(relu_err.find("relu: expected a float32, float64 or bfloat16 tensor"),
            std::string::npos)
      << relu_err;
  const std::string drop_err = ErrorOf([&] { dropout(i, 0.5, true); });
  EXPECT_NE(drop_err.find("dropout: expected a float32, float64 or bfloat16 tensor"),
            std::string::npos)
      << drop_err;
  const std::string sum_err = ErrorOf([&] { sum_to(ones({2, 3}, {.dtype = kInt64}), {3}); });
  EXPECT_NE(sum_err.find("sum_to: unsupported dtype int64"), std::string::npos) << sum_err;
}

// These ops add no autocast behaviour: under a guard they run in the dtype given.
TEST(Bf16OpsTest, AutocastLeavesElementwiseDTypesAlone) {
  AutocastGuard guard(kBFloat16);
  Tensor f = ones({2, 3});
  Tensor b = ones({2, 3}, {.dtype = kBFloat16});
  EXPECT_EQ(add(f, f).dtype(), kFloat32);
  EXPECT_EQ(relu(f).dtype(), kFloat32);
  EXPECT_EQ(mul(b, b).dtype(), kBFloat16);
  EXPECT_EQ(dropout(b, 0.5, true).dtype(), kBFloat16);
  EXPECT_NE(ErrorOf([&] { add(b, f); }).find("add: dtypes differ"), std::string::npos);
}

}  // namespace
}  // namespace tandem::nn
