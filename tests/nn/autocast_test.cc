// bfloat16 matmul / linear / linear_relu on the CPU (forward and backward, given
// bf16 operands directly) against float64 references on the bf16-rounded values,
// and nn::AutocastGuard end to end: an MLP step under autocast against the
// float32 step and against PyTorch's CPU autocast (tests/nn/autocast_ref_data.h,
// made by scripts/ref/autocast_ref.py), the float32 entries of the reductions,
// nesting, bad dtypes and the guard's thread-locality.
#include "nn/autocast.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "nn/layers.h"
#include "nn/ops/batch_norm.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/ops/reduce.h"
#include "nn/ops/softmax.h"
#include "nn/random.h"
#include "tests/nn/autocast_ref_data.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using tandem::testing::ErrorOf;

// A row-major float64 matrix.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double at(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
};

Mat MatOf(const Tensor& t) {
  return {t.size(0), t.size(1), t.detach().to(kFloat64).to_vector<double>()};
}

Mat Transpose(const Mat& m) {
  Mat t{m.cols, m.rows, std::vector<double>(m.v.size())};
  for (int64_t r = 0; r < m.rows; ++r) {
    for (int64_t c = 0; c < m.cols; ++c) t.v[static_cast<size_t>(c * m.rows + r)] = m.at(r, c);
  }
  return t;
}

Mat Abs(Mat m) {
  for (double& x : m.v) x = std::fabs(x);
  return m;
}

Mat Product(const Mat& a, const Mat& b) {
  EXPECT_EQ(a.cols, b.rows);
  Mat c{a.rows, b.cols, std::vector<double>(static_cast<size_t>(a.rows * b.cols), 0.0)};
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int64_t j = 0; j < b.cols; ++j) {
      double s = 0;
      for (int64_t p = 0; p < a.cols; ++p) s += a.at(i, p) * b.at(p, j);
      c.v[static_cast<size_t>(i * b.cols + j)] = s;
    }
  }
  return c;
}

// One bfloat16 ulp at |v| (8 significant bits): 2^(e-8) for |v| in [2^(e-1), 2^e).
double BfUlp(double v) {
  if (v == 0) return 0;
  int e = 0;
  std::frexp(v, &e);
  return std::ldexp(1.0, e - 8);
}

// got (bfloat16) within one bf16 ulp of want plus the float32 accumulation error
// of a k-term sum with the given sum of |terms| (k * 2^-24 * sum|terms|, doubled).
void ExpectBf16Near(const Tensor& got, const Mat& want, const Mat& abs_terms, int64_t k,
                    const std::string& what) {
  ASSERT_EQ(got.dtype(), kBFloat16) << what;
  const std::vector<double> g = got.detach().to(kFloat64).to_vector<double>();
  ASSERT_EQ(g.size(), want.v.size()) << what;
  for (size_t i = 0; i < g.size(); ++i) {
    const double tol = BfUlp(want.v[i]) + static_cast<double>(k + 1) * 0x1p-23 * abs_terms.v[i];
    EXPECT_NEAR(g[i], want.v[i], tol) << what << " element " << i;
  }
}

// A bfloat16 leaf (from float32 normals) that requires grad.
Tensor Bf16Leaf(const Shape& shape) {
  return randn(shape).to(kBFloat16).set_requires_grad(true);
}

TEST(Bf16MatmulTest, MatmulForwardAndBackwardMatchFloat64OnRoundedValues) {
  manual_seed(11);
  Tensor a = Bf16Leaf({5, 7}), b = Bf16Leaf({7, 3});
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.dtype(), kBFloat16);
  const Mat ma = MatOf(a), mb = MatOf(b);
  ExpectBf16Near(c, Product(ma, mb), Product(Abs(ma), Abs(mb)), 7, "matmul");

  Tensor g = randn({5, 3}).to(kBFloat16);
  c.backward(g);
  const Mat mg = MatOf(g);
  ASSERT_TRUE(a.grad().defined());
  ASSERT_TRUE(b.grad().defined());
  EXPECT_EQ(a.grad().dtype(), kBFloat16);
  EXPECT_EQ(b.grad().dtype(), kBFloat16);
  ExpectBf16Near(a.grad(), Product(mg, Transpose(mb)), Product(Abs(mg), Transpose(Abs(mb))), 3,
                 "matmul da");
  ExpectBf16Near(b.grad(), Product(Transpose(ma), mg), Product(Transpose(Abs(ma)), Abs(mg)), 5,
                 "matmul db");
}

// linear / linear_relu on bf16 x, W, b: y = x W^T + b [relu]; backward
// dx = g' W, dW = g'^T x, db = column sums of g', g' = g masked by y > 0 for relu.
void CheckLinearBf16(bool relu, bool with_bias) {
  const int64_t n = 6, in = 9, out = 4;
  Tensor x = Bf16Leaf({n, in}), w = Bf16Leaf({out, in});
  Tensor b = with_bias ? Bf16Leaf({out}) : Tensor();
  Tensor y = relu ? linear_relu(x, w, b) : linear(x, w, b);
  const std::string name = std::string(relu ? "linear_relu" : "linear") +
                           (with_bias ? " with bias" : " without bias");
  ASSERT_EQ(y.dtype(), kBFloat16) << name;

  const Mat mx = MatOf(x), mw = MatOf(w);
  Mat want = Product(mx, Transpose(mw));
  Mat bound = Product(Abs(mx), Transpose(Abs(mw)));
  if (with_bias) {
    const std::vector<double> bv = b.detach().to(kFloat64).to_vector<double>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        want.v[static_cast<size_t>(r * out + o)] += bv[static_cast<size_t>(o)];
        bound.v[static_cast<size_t>(r * out + o)] += std::fabs(bv[static_cast<size_t>(o)]);
      }
    }
  }
  if (relu) {
    for (double& v : want.v) v = v > 0 ? v : 0;
  }
  ExpectBf16Near(y, want, bound, in, name);

  Tensor g = randn({n, out}).to(kBFloat16);
  y.backward(g);
  Mat mg = MatOf(g);
  if (relu) {
    const std::vector<double> yv = y.detach().to(kFloat64).to_vector<double>();
    for (size_t i = 0; i < mg.v.size(); ++i) {
      if (!(yv[i] > 0)) mg.v[i] = 0;
    }
  }
  ExpectBf16Near(x.grad(), Product(mg, mw), Product(Abs(mg), Abs(mw)), out, name + " dx");
  ExpectBf16Near(w.grad(), Product(Transpose(mg), mx), Product(Transpose(Abs(mg)), Abs(mx)), n,
                 name + " dW");
  if (with_bias) {
    Mat ones{1, n, std::vector<double>(static_cast<size_t>(n), 1.0)};
    ExpectBf16Near(b.grad(), Product(ones, mg), Product(ones, Abs(mg)), n, name + " db");
  }
}

TEST(Bf16MatmulTest, LinearForwardAndBackwardMatchFloat64OnRoundedValues) {
  manual_seed(12);
  CheckLinearBf16(/*relu=*/false, /*with_bias=*/true);
  CheckLinearBf16(/*relu=*/false, /*with_bias=*/false);
}

TEST(Bf16MatmulTest, LinearReluForwardAndBackwardMatchFloat64OnRoundedValues) {
  manual_seed(13);
  CheckLinearBf16(/*relu=*/true, /*with_bias=*/true);
  CheckLinearBf16(/*relu=*/true, /*with_bias=*/false);
}

TEST(Bf16MatmulTest, ResultIsRoundedOnceFromTheFloatSum) {
  // 1 + 2^-8 + 2^-8 = 1 + 2^-7 is a bf16 value (ulp 2^-7 at 1); rounding after
  // each partial sum (1 + 2^-8 is a tie and goes to the even 1) would give 1.
  Tensor a = from_vector(std::vector<float>{1.0f, 0x1p-8f, 0x1p-8f}, {1, 3}).to(kBFloat16);
  Tensor b = ones({3, 1}).to(kBFloat16);
  EXPECT_EQ(matmul(a, b).to(kFloat32).to_vector<float>(), std::vector<float>{1.0f + 0x1p-7f});
  // The bias joins the float sum too: 1 + 2^-8 (product) + 2^-8 (bias).
  Tensor x = from_vector(std::vector<float>{1.0f, 0x1p-8f}, {1, 2}).to(kBFloat16);
  Tensor w = ones({1, 2}).to(kBFloat16);
  Tensor bias = from_vector(std::vector<float>{0x1p-8f}, {1}).to(kBFloat16);
  EXPECT_EQ(linear(x, w, bias).to(kFloat32).to_vector<float>(),
            std::vector<float>{1.0f + 0x1p-7f});
  EXPECT_EQ(linear_relu(x, w, bias).to(kFloat32).to_vector<float>(),
            std::vector<float>{1.0f + 0x1p-7f});
}

TEST(Bf16MatmulTest, BiasGradientAccumulatesInFloat) {
  // 256 rows of 2^-8 under a leading 1: a bf16 running sum would stall at 1
  // (1 + 2^-8 rounds to 1 with ties to even); in float32 it is exactly 2.
  std::vector<float> g(257, 0x1p-8f);
  g[0] = 1.0f;
  Tensor x = zeros({257, 1}).to(kBFloat16);
  Tensor w = zeros({1, 1}).to(kBFloat16).set_requires_grad(true);
  Tensor b = zeros({1}).to(kBFloat16).set_requires_grad(true);
  linear(x, w, b).backward(from_vector(g, {257, 1}).to(kBFloat16));
  EXPECT_EQ(b.grad().to(kFloat32).to_vector<float>(), std::vector<float>{2.0f});
}

TEST(Bf16MatmulTest, EmptyInnerDimensionGivesBiasInBf16) {
  Tensor bias = from_vector(std::vector<float>{1.5f, -2.0f}, {2}).to(kBFloat16);
  Tensor x = zeros({3, 0}).to(kBFloat16), w = zeros({2, 0}).to(kBFloat16);
  Tensor y = linear(x, w, bias);
  EXPECT_EQ(y.dtype(), kBFloat16);
  EXPECT_EQ(y.to(kFloat32).to_vector<float>(),
            (std::vector<float>{1.5f, -2.0f, 1.5f, -2.0f, 1.5f, -2.0f}));
  EXPECT_EQ(matmul(zeros({2, 0}).to(kBFloat16), zeros({0, 3}).to(kBFloat16))
                .to(kFloat32)
                .to_vector<float>(),
            std::vector<float>(6, 0.0f));
}

TEST(Bf16MatmulTest, MixedAndUnsupportedDtypesAreRejected) {
  Tensor x = ones({2, 3}).to(kBFloat16), w32 = ones({4, 3});
  // Outside autocast nothing is cast: bf16 with float32 is an error.
  EXPECT_NE(ErrorOf([&] { linear(x, w32); }).find("dtypes differ"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { matmul(x, ones({3, 2})); }).find("dtypes differ"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { linear(x, w32.to(kBFloat16), ones({4})); }).find("dtypes differ"),
            std::string::npos);
  Tensor i64 = ones({2, 2}).to(kInt64);
  const std::string err = ErrorOf([&] { matmul(i64, i64); });
  EXPECT_NE(err.find("matmul"), std::string::npos) << err;
  EXPECT_NE(err.find("int64"), std::string::npos) << err;
}

// --- Autocast ---------------------------------------------------------------------

TEST(AutocastTest, GuardRejectsOtherDtypesByName) {
  const std::string err = ErrorOf([] { AutocastGuard g(kInt64); });
  EXPECT_NE(err.find("int64"), std::string::npos) << err;
  EXPECT_NE(ErrorOf([] { AutocastGuard g(kFloat64); }).find("float64"), std::string::npos);
  EXPECT_FALSE(autocast_enabled());
}

TEST(AutocastTest, GemmOpsCastFloat32OperandsToBf16) {
  manual_seed(21);
  Tensor x = randn({3, 4}), w = randn({2, 4}), b = randn({2});
  Tensor y32 = linear(x, w, b);
  EXPECT_EQ(y32.dtype(), kFloat32);
  AutocastGuard autocast(kBFloat16);
  EXPECT_TRUE(autocast_enabled());
  Tensor y = linear(x, w, b);
  EXPECT_EQ(y.dtype(), kBFloat16);
  // Same as linear on the operands rounded to bf16 by hand.
  Tensor by_hand = linear(x.to(kBFloat16), w.to(kBFloat16), b.to(kBFloat16));
  EXPECT_EQ(y.to(kFloat32).to_vector<float>(), by_hand.to(kFloat32).to_vector<float>());
  EXPECT_EQ(linear_relu(x, w, b).dtype(), kBFloat16);
  EXPECT_EQ(matmul(x, randn({4, 5})).dtype(), kBFloat16);
  // A bf16 activation with a float32 weight: the weight is cast too.
  EXPECT_EQ(linear(y, randn({3, 2})).dtype(), kBFloat16);
  // float64 is left alone.
  EXPECT_EQ(matmul(x.to(kFloat64), w.to(kFloat64).reshape({4, 2})).dtype(), kFloat64);
}

TEST(AutocastTest, NestedFloat32GuardTurnsItOff) {
  Tensor x = randn({3, 4}), w = randn({2, 4});
  AutocastGuard on(kBFloat16);
  EXPECT_EQ(linear(x, w).dtype(), kBFloat16);
  {
    AutocastGuard off(kFloat32);
    EXPECT_FALSE(autocast_enabled());
    EXPECT_EQ(linear(x, w).dtype(), kFloat32);
    {
      AutocastGuard on_again(kBFloat16);
      EXPECT_EQ(linear(x, w).dtype(), kBFloat16);
    }
    EXPECT_EQ(matmul(x, w.reshape({4, 2})).dtype(), kFloat32);
  }
  EXPECT_TRUE(autocast_enabled());
  EXPECT_EQ(linear(x, w).dtype(), kBFloat16);
}

TEST(AutocastTest, GuardIsPerThread) {
  Tensor x = randn({3, 4}), w = randn({2, 4});
  AutocastGuard on(kBFloat16);
  bool other_enabled = true;
  DType other_dtype = kBFloat16;
  std::thread t([&] {
    other_enabled = autocast_enabled();
    other_dtype = linear(x, w).dtype();
  });
  t.join();
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(other_dtype, kFloat32);
  EXPECT_TRUE(autocast_enabled());
}

TEST(AutocastTest, PrecisionSensitiveOpsComputeInFloat32) {
  manual_seed(22);
  Tensor h = randn({4, 5}).to(kBFloat16).set_requires_grad(true);
  Tensor labels = from_vector(std::vector<int64_t>{0, 4, 2, 1}, {4});
  // Outside autocast they reject bf16, as before.
  EXPECT_NE(ErrorOf([&] { softmax(h, 1); }).find("bfloat16"), std::string::npos);
  EXPECT_NE(ErrorOf([&] { cross_entropy(h, labels); }).find("bfloat16"), std::string::npos);

  AutocastGuard autocast(kBFloat16);
  const Tensor h32 = h.detach().to(kFloat32);
  auto expect_same = [](const Tensor& got, const Tensor& want, const char* what) {
    ASSERT_EQ(got.dtype(), kFloat32) << what;
    EXPECT_EQ(got.to_vector<float>(), want.to_vector<float>()) << what;
  };
  {
    AutocastGuard off(kFloat32);  // float32 references on the same (bf16-exact) values
    Tensor ce = cross_entropy(h32, labels), sm = softmax(h32, 1), lsm = log_softmax(h32, -1);
    Tensor s = sum(h32), m = mean(h32), s1 = sum(h32, 1), m0 = mean(h32, 0, true);
    Tensor mse = mse_loss(h32, zeros({4, 5}));
    // third: a bf16 target whose difference from h needs more than bf16's 8 bits.
    const Tensor third = full({4, 5}, 1.0 / 3).to(kBFloat16);
    Tensor nll = nll_loss(h32, labels), l1 = l1_loss(h32, third.to(kFloat32));
    Tensor sl1 = smooth_l1_loss(h32, third.to(kFloat32), Reduction::kMean, 0.5);
    Tensor bce = binary_cross_entropy_with_logits(h32, full({4, 5}, 0.25), full({5}, 2.0));
    // The class weight of the loss options (bf16-exact values), with the other options.
    const Tensor class_weight = from_vector(std::vector<float>{0.5f, 2, 1, 3, 0.25f}, {5});
    const CrossEntropyOptions ce_options{.weight = class_weight, .ignore_index = 2,
                                         .label_smoothing = 0.1};
    Tensor ce_weighted = cross_entropy(h32, labels, ce_options);
    Tensor nll_weighted = nll_loss(h32, labels, {.weight = class_weight, .ignore_index = 2});
    AutocastGuard on(kBFloat16);
    expect_same(cross_entropy(h, labels), ce, "cross_entropy");
    expect_same(softmax(h, 1), sm, "softmax");
    expect_same(log_softmax(h, -1), lsm, "log_softmax");
    expect_same(sum(h), s, "sum");
    expect_same(mean(h), m, "mean");
    expect_same(sum(h, 1), s1, "sum(dim)");
    expect_same(mean(h, 0, true), m0, "mean(dim)");
    expect_same(mse_loss(h, zeros({4, 5})), mse, "mse_loss");
    // The losses added with the activations; a bf16 target and pos_weight are cast too.
    const Tensor quarter = full({4, 5}, 0.25).to(kBFloat16);
    expect_same(nll_loss(h, labels), nll, "nll_loss");
    expect_same(l1_loss(h, third), l1, "l1_loss");
    expect_same(smooth_l1_loss(h, third, Reduction::kMean, 0.5), sl1, "smooth_l1_loss");
    expect_same(binary_cross_entropy_with_logits(h, quarter, full({5}, 2.0).to(kBFloat16)), bce,
                "binary_cross_entropy_with_logits");
    // A bf16 class weight is cast as the input is.
    CrossEntropyOptions bf16_options = ce_options;
    bf16_options.weight = class_weight.to(kBFloat16);
    expect_same(cross_entropy(h, labels, bf16_options), ce_weighted, "cross_entropy options");
    expect_same(cross_entropy(h, labels, ce_options), ce_weighted, "cross_entropy f32 weight");
    expect_same(nll_loss(h, labels, {.weight = class_weight.to(kBFloat16), .ignore_index = 2}),
                nll_weighted, "nll_loss options");
    // The activations stay in bfloat16, as in PyTorch 1.13's CPU autocast.
    for (const Tensor& y : {abs(h), sqrt(abs(h)), clamp(h, -1.0, 1.0), leaky_relu(h), gelu(h),
                            silu(h), softplus(h), maximum(h, h), minimum(h, h)}) {
      EXPECT_EQ(y.dtype(), kBFloat16);
    }
    EXPECT_EQ(argmax(h, 1).to_vector<int64_t>(), argmax(h32, 1).to_vector<int64_t>());
    EXPECT_EQ(accuracy(h, labels).item(), accuracy(h32, labels).item());
  }
  // The gradient flows back through the cast as bf16.
  cross_entropy(h, labels).backward();
  ASSERT_TRUE(h.grad().defined());
  EXPECT_EQ(h.grad().dtype(), kBFloat16);

  // batch_norm2d: a bf16 x is normalised in float32 with float32 parameters and
  // running statistics (which it still updates in place).
  Tensor x = randn({2, 3, 2, 2}).to(kBFloat16);
  Tensor weight = ones({3}), bias = zeros({3}), rm = zeros({3}), rv = ones({3});
  Tensor y = batch_norm2d(x, weight, bias, rm, rv, /*training=*/true);
  EXPECT_EQ(y.dtype(), kFloat32);
  Tensor rm_want = zeros({3}), rv_want = ones({3});
  Tensor y_want;
  {
    AutocastGuard off(kFloat32);
    y_want = batch_norm2d(x.to(kFloat32), weight, bias, rm_want, rv_want, true);
  }
  EXPECT_EQ(y.to_vector<float>(), y_want.to_vector<float>());
  EXPECT_EQ(rm.to_vector<float>(), rm_want.to_vector<float>());
  EXPECT_EQ(rv.to_vector<float>(), rv_want.to_vector<float>());
}

// Largest |a - b| over the largest |b|: the error relative to the tensor's scale.
using ::tandem::testing::ScaledError;

struct Mlp : Module {
  Mlp()
      : l1(register_module("l1", Linear(32, 64))), l2(register_module("l2", Linear(64, 10))) {}
  Tensor forward(const Tensor& x) override { return l2(relu(l1(x))); }
  Linear l1, l2;
};

TEST(AutocastTest, MlpStepUnderAutocastMatchesFloat32Step) {
  manual_seed(23);
  Mlp net;
  // Parameters and input hold bf16-exact values, so autocast's casts of them are
  // exact and both runs see the same pre-activations up to summation order: a
  // relu whose input lies within the operands' bf16 rounding of 0 could otherwise
  // switch sides and move one gradient entry by its whole size. What remains is
  // what autocast adds: activations and gradients rounded to bf16 after each product.
  Tensor x = randn({16, 32}).to(kBFloat16).to(kFloat32);
  {
    NoGradGuard no_grad;
    for (Tensor& p : net.parameters()) p.copy_(p.to(kBFloat16));
  }
  std::vector<int64_t> label_values(16);
  for (int i = 0; i < 16; ++i) label_values[static_cast<size_t>(i)] = (i * 7) % 10;
  Tensor labels = from_vector(label_values, {16});

  Tensor loss32 = cross_entropy(net.forward(x), labels);
  loss32.backward();
  std::vector<Tensor> grads32;
  for (const Tensor& p : net.parameters()) grads32.push_back(p.grad().detach().clone());
  net.zero_grad();

  Tensor hidden, logits, loss;
  {
    AutocastGuard autocast(kBFloat16);
    hidden = relu(net.l1(x));
    logits = net.l2(hidden);
    loss = cross_entropy(logits, labels);
  }
  EXPECT_EQ(hidden.dtype(), kBFloat16);
  EXPECT_EQ(logits.dtype(), kBFloat16);
  EXPECT_EQ(loss.dtype(), kFloat32);
  loss.backward();  // outside the guard: backward follows the recorded dtypes
  EXPECT_NEAR(loss.item(), loss32.item(), 1e-2 * std::fabs(loss32.item()));
  const std::vector<Tensor> params = net.parameters();
  ASSERT_EQ(params.size(), grads32.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << "parameter " << i;
    EXPECT_EQ(params[i].dtype(), kFloat32);
    EXPECT_EQ(params[i].grad().dtype(), kFloat32) << "parameter " << i;
    // bf16 operands carry 8 significant bits (2^-8 relative per rounding); over
    // this net's few roundings the gradients stay within 1e-2 of their scale.
    EXPECT_LT(ScaledError(params[i].grad(), grads32[i]), 1e-2) << "parameter " << i;
  }
}

// Against PyTorch 1.13's CPU autocast on the same step (scripts/ref/autocast_ref.py).
// Tolerance 2e-2 of each tensor's largest magnitude: both sides round the same
// operands to bf16 (ties to even), but torch's CPU bf16 linear may round the
// product before adding the bias (tandem rounds once, after the bias), the sums
// run in different orders, and a one-ulp (2^-8 relative) difference in a bf16
// activation or gradient propagates through the later bf16 products; elements
// that cancel to near zero carry the error of the tensor's scale, not their own.
TEST(AutocastTest, MatchesPyTorchCpuAutocast) {
  namespace ref = autocast_ref;
  auto floats = [](const auto& values, const Shape& shape) {
    return from_vector(std::vector<float>(std::begin(values), std::end(values)), shape);
  };
  Tensor x = floats(ref::kX, {4, 6});
  Tensor labels =
      from_vector(std::vector<int64_t>(std::begin(ref::kLabels), std::end(ref::kLabels)), {4});
  Tensor w1 = floats(ref::kW1, {5, 6}).set_requires_grad(true);
  Tensor b1 = floats(ref::kB1, {5}).set_requires_grad(true);
  Tensor w2 = floats(ref::kW2, {3, 5}).set_requires_grad(true);
  Tensor b2 = floats(ref::kB2, {3}).set_requires_grad(true);
  Tensor logits, loss;
  {
    AutocastGuard autocast(kBFloat16);
    logits = linear(relu(linear(x, w1, b1)), w2, b2);
    loss = cross_entropy(logits, labels);
  }
  ASSERT_EQ(logits.dtype(), kBFloat16);
  ASSERT_EQ(loss.dtype(), kFloat32);
  loss.backward();
  EXPECT_LT(ScaledError(logits, floats(ref::kLogits, {4, 3})), 2e-2);
  EXPECT_NEAR(loss.item(), ref::kLoss[0], 2e-2 * std::fabs(ref::kLoss[0]));
  const struct {
    const char* name;
    Tensor param, want;
  } grads[] = {{"W1", w1, floats(ref::kGradW1, {5, 6})},
               {"b1", b1, floats(ref::kGradB1, {5})},
               {"W2", w2, floats(ref::kGradW2, {3, 5})},
               {"b2", b2, floats(ref::kGradB2, {3})}};
  for (const auto& g : grads) {
    ASSERT_TRUE(g.param.grad().defined()) << g.name;
    EXPECT_EQ(g.param.grad().dtype(), kFloat32) << g.name;
    EXPECT_LT(ScaledError(g.param.grad(), g.want), 2e-2) << g.name;
  }
}

}  // namespace
}  // namespace tandem::nn
