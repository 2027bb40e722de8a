// bfloat16 CPU convolutions and GEMMs (matmul, linear) on oneDNN's bfloat16
// primitives (nn::cpu_bf16_native()) against the emulated path (the float32
// kernels on widened copies, each result rounded once): forward, backward data,
// backward weights and bias; and which of the two runs, against the CPU's flags.
//
// Tolerance: each path's result is its float32 sum rounded once to bfloat16, so
// each is within half a bfloat16 ulp of its float32 sum, and the two float32 sums
// (different summation orders) differ by a small multiple of 2^-24 times the sum
// of the terms' magnitudes (`abs_ref`, the float64 op on |x|, |w|, |b|, |dy|): the
// two results are at most one bfloat16 ulp apart (<= 2^-7 relative) plus that.
// We allow 2^-7 |emulated| + 2^-17 abs_ref.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/ops/conv.h"
#include "nn/ops/matmul.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"

namespace tandem::nn {
namespace {

constexpr double kRoundingTol = 1.0 / 128;  // one bfloat16 ulp
constexpr double kAccumulationTol = 1.0 / 131072;

// Puts the bfloat16 switch back on when a test ends.
struct RestoreBf16Native {
  ~RestoreBf16Native() { set_cpu_bf16_native(true); }
};

// The flags of the first processor in /proc/cpuinfo ("" where there is none).
std::string CpuFlags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) return " " + line.substr(line.find(':') + 1) + " ";
  }
  return "";
}

bool HasFlag(const std::string& flags, const std::string& flag) {
  return flags.find(" " + flag + " ") != std::string::npos;
}

TEST(Bf16ConvDnnlTest, PathFollowsTheCpuFlags) {
  RestoreBf16Native restore;
  const std::string flags = CpuFlags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags";
  if (std::getenv("ONEDNN_MAX_CPU_ISA") != nullptr) {
    GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA caps oneDNN's instruction set";
  }
  const bool has_bf16 = HasFlag(flags, "avx512_bf16") || HasFlag(flags, "amx_bf16");
  // Builds without oneDNN emulate everywhere.
  const bool with_dnnl = cpu_conv_backend().rfind("oneDNN", 0) == 0;
  const bool want = with_dnnl && has_bf16;
  EXPECT_EQ(cpu_bf16_supported(), want) << "cpu flags:" << flags;
  EXPECT_EQ(cpu_bf16_native(), want);
  EXPECT_EQ(cpu_bf16_backend().find("oneDNN bfloat16") == 0, want) << cpu_bf16_backend();
  // The switch forces the emulation, and says so.
  set_cpu_bf16_native(false);
  EXPECT_FALSE(cpu_bf16_native());
  EXPECT_EQ(cpu_bf16_backend().find("emulated"), 0u) << cpu_bf16_backend();
  set_cpu_bf16_native(true);
  EXPECT_EQ(cpu_bf16_native(), want);
}

Tensor RandomBf16(const Shape& shape) {
  return randn(shape).to(kBFloat16).detach().set_requires_grad(true);
}

Tensor Leaf(const Tensor& t) {
  return t.defined() ? t.detach().set_requires_grad(true) : t;
}

Tensor AbsFloat64Leaf(const Tensor& t) {
  if (!t.defined()) return t;
  std::vector<double> v = t.to_vector<double>();
  for (double& e : v) e = std::abs(e);
  return from_vector(v, t.shape(), {.dtype = kFloat64}).set_requires_grad(true);
}

void ExpectClose(const Tensor& got, const Tensor& want, const Tensor& abs_ref,
                 const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.dtype(), kBFloat16) << what;
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto g = got.to_vector<double>(), w = want.to_vector<double>(),
             a = abs_ref.to_vector<double>();
  int64_t differ = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double tol = kRoundingTol * std::abs(w[i]) + kAccumulationTol * a[i];
    ASSERT_NEAR(g[i], w[i], tol) << what << " element " << i;
    differ += g[i] != w[i];
  }
  // Most results are the same bits (the float32 sums round alike).
  EXPECT_LE(differ, static_cast<int64_t>(g.size() / 4) + 1) << what;
}

struct Grads {
  Tensor y, dx, dw, db;
};

// conv2d (relu: conv2d_relu) on bf16 leaves x, w, b with upstream gradient dy.
Grads Run(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
          const Conv2dParams& p, bool relu) {
  Tensor xl = Leaf(x), wl = Leaf(w), bl = Leaf(b);
  Tensor y = relu ? conv2d_relu(xl, wl, bl, p) : conv2d(xl, wl, bl, p);
  y.backward(dy);
  return {y.detach(), xl.grad(), wl.grad(), b.defined() ? bl.grad() : Tensor()};
}

void CheckParity(const Shape& x_shape, const Shape& w_shape, bool bias, const Conv2dParams& p,
                 bool relu, const std::string& what) {
  Tensor x = RandomBf16(x_shape), w = RandomBf16(w_shape);
  Tensor b = bias ? RandomBf16({w_shape[0]}) : Tensor();
  Tensor y_shape_probe = conv2d(x.detach(), w.detach(), b.defined() ? b.detach() : b, p);
  Tensor dy = randn(y_shape_probe.shape()).to(kBFloat16);

  ASSERT_TRUE(cpu_bf16_native());
  const Grads native = Run(x, w, b, dy, p, relu);
  set_cpu_bf16_native(false);
  const Grads emulated = Run(x, w, b, dy, p, relu);
  set_cpu_bf16_native(true);

  Tensor xa = AbsFloat64Leaf(x), wa = AbsFloat64Leaf(w), ba = AbsFloat64Leaf(b);
  Tensor ya = conv2d(xa, wa, ba, p);
  ya.backward(AbsFloat64Leaf(dy).detach());
  ExpectClose(native.y, emulated.y, ya, what + ": output");
  // relu: the masks agree where the outputs' signs do; compare the gradients
  // where the two outputs are the same (all but a few elements near 0).
  ExpectClose(native.dx, emulated.dx, xa.grad(), what + ": dx");
  ExpectClose(native.dw, emulated.dw, wa.grad(), what + ": dweight");
  if (bias) ExpectClose(native.db, emulated.db, ba.grad(), what + ": dbias");
}

class Bf16ConvDnnlParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cpu_bf16_supported()) GTEST_SKIP() << "no oneDNN bfloat16 on this CPU: " << cpu_bf16_backend();
  }
  RestoreBf16Native restore_;
  testing::RestoreCpuConv restore_conv_;
};

TEST_F(Bf16ConvDnnlParityTest, LeNetShapes) {
  manual_seed(201);
  // train_mnist's two convolutions (batch 8 instead of 64).
  CheckParity({8, 1, 28, 28}, {20, 1, 5, 5}, true, {}, false, "1 -> 20 5x5 on 28x28");
  CheckParity({8, 20, 12, 12}, {50, 20, 5, 5}, true, {}, false, "20 -> 50 5x5 on 12x12");
}

TEST_F(Bf16ConvDnnlParityTest, Variants) {
  manual_seed(202);
  const std::vector<Conv2dParams> variants = {
      {},
      {.stride = {2, 2}},
      {.padding = {1, 2}},
      {.dilation = {2, 1}},
      {.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}},
  };
  for (size_t i = 0; i < variants.size(); ++i) {
    for (bool bias : {false, true}) {
      CheckParity({2, 16, 9, 8}, {32, 16, 3, 2}, bias, variants[i], false,
                  "variant " + std::to_string(i) + (bias ? " with bias" : ""));
    }
  }
  CheckParity({2, 8, 7, 7}, {12, 4, 3, 3}, true, {.padding = {1, 1}, .groups = 2}, false,
              "2 groups");
  CheckParity({2, 64, 12, 12}, {8, 64, 5, 5}, true, {.padding = {2, 2}}, false,
              "64 channels 5x5 (1600 products per output)");
}

TEST_F(Bf16ConvDnnlParityTest, EveryLayoutPath) {
  manual_seed(203);
  using ops::internal::CpuConvPath;
  for (CpuConvPath path : {CpuConvPath::kDnnl, CpuConvPath::kDnnlBlocked, CpuConvPath::kDnnlNhwc}) {
    ops::internal::SetCpuConvPath(path);
    CheckParity({4, 20, 10, 10}, {50, 20, 3, 3}, true, {.padding = {1, 1}}, false,
                "layout path " + std::to_string(static_cast<int>(path)));
    // One input channel: on the blocked and plain layouts oneDNN 2.6 offers only its
    // gemm kernel for the bfloat16 weight gradient, which runs on widened copies.
    CheckParity({4, 1, 12, 12}, {8, 1, 5, 5}, true, {}, false,
                "one channel, layout path " + std::to_string(static_cast<int>(path)));
  }
}

TEST_F(Bf16ConvDnnlParityTest, ForwardIsOneRoundingOfAFloat32Sum) {
  // The native output against the float32 convolution rounded once: within one
  // bfloat16 ulp (a different float32 summation order can round the other way).
  manual_seed(204);
  Tensor x = RandomBf16({2, 5, 7, 7}), w = RandomBf16({6, 5, 3, 3}), b = RandomBf16({6});
  const Conv2dParams p{.padding = {1, 1}};
  Tensor y = conv2d(x, w, b, p);
  Tensor y32 = conv2d(x.detach().to(kFloat32), w.detach().to(kFloat32), b.detach().to(kFloat32), p);
  const auto got = y.to_vector<double>(), want = y32.to(kBFloat16).to_vector<double>();
  int64_t same = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], std::abs(want[i]) / 128 + 1e-30) << "element " << i;
    same += got[i] == want[i];
  }
  EXPECT_GE(same, static_cast<int64_t>(got.size()) * 9 / 10);
}

TEST_F(Bf16ConvDnnlParityTest, AutocastGivesFloat32ParameterGradientsOnBothPaths) {
  manual_seed(205);
  Tensor x = randn({4, 3, 10, 10});
  Tensor w = randn({16, 3, 3, 3}).set_requires_grad(true);
  Tensor b = randn({16}).set_requires_grad(true);
  std::vector<std::vector<double>> grads;
  for (bool native : {true, false}) {
    set_cpu_bf16_native(native);
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    Tensor loss;
    {
      AutocastGuard autocast(kBFloat16);
      loss = sum(conv2d_relu(x, w, b, {.padding = {1, 1}}).to(kFloat32));
    }
    loss.backward();
    ASSERT_EQ(w.grad().dtype(), kFloat32);
    ASSERT_EQ(b.grad().dtype(), kFloat32);
    grads.push_back(w.grad().to_vector<double>());
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_NEAR(grads[0][i], grads[1][i], 0.02 * (std::abs(grads[1][i]) + 1.0)) << i;
  }
}

// linear and matmul: oneDNN's bfloat16 matmul primitive (bfloat16 operands,
// float32 result rounded once after bias and relu) against sgemm on widened
// copies; forward and the three gradients (dy W and dy^T x are the transposed
// GEMMs). Same tolerance as the convolutions', abs_ref from the float64 op on
// the magnitudes.
struct LinearGrads {
  Tensor y, dx, dw, db;
};

LinearGrads RunLinear(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
                      bool relu) {
  Tensor xl = Leaf(x), wl = Leaf(w), bl = Leaf(b);
  Tensor y = relu ? linear_relu(xl, wl, bl) : linear(xl, wl, bl);
  y.backward(dy);
  return {y.detach(), xl.grad(), wl.grad(), bl.grad()};
}

TEST_F(Bf16ConvDnnlParityTest, LinearForwardAndGradients) {
  manual_seed(206);
  struct Shape3 {
    int64_t rows, in, out;
  };
  // train_mnist's fc (batch 64, 980 -> 10), a square one, odd sizes.
  for (const Shape3 s : {Shape3{64, 980, 10}, Shape3{32, 64, 64}, Shape3{7, 33, 5}}) {
    for (bool relu : {false, true}) {
      const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.in) + " -> " +
                               std::to_string(s.out) + (relu ? " relu" : "");
      Tensor x = RandomBf16({s.rows, s.in}), w = RandomBf16({s.out, s.in}),
             b = RandomBf16({s.out});
      Tensor dy = randn({s.rows, s.out}).to(kBFloat16);
      const LinearGrads native = RunLinear(x, w, b, dy, relu);
      set_cpu_bf16_native(false);
      const LinearGrads emulated = RunLinear(x, w, b, dy, relu);
      set_cpu_bf16_native(true);
      Tensor xa = AbsFloat64Leaf(x), wa = AbsFloat64Leaf(w), ba = AbsFloat64Leaf(b);
      Tensor ya = linear(xa, wa, ba);
      ya.backward(AbsFloat64Leaf(dy).detach());
      ExpectClose(native.y, emulated.y, ya, what + ": output");
      if (relu) {
        // The masks agree where both outputs are the same: compare the gradients
        // only when they are (a sum rounding across 0 would move one element).
        if (native.y.to_vector<double>() != emulated.y.to_vector<double>()) continue;
      }
      ExpectClose(native.dx, emulated.dx, xa.grad(), what + ": dx");
      ExpectClose(native.dw, emulated.dw, wa.grad(), what + ": dweight");
      ExpectClose(native.db, emulated.db, ba.grad(), what + ": dbias");
    }
  }
}

TEST_F(Bf16ConvDnnlParityTest, MatmulAndAutocastLinear) {
  manual_seed(207);
  Tensor a = RandomBf16({9, 40}), b = RandomBf16({40, 11});
  Tensor dc = randn({9, 11}).to(kBFloat16);
  std::vector<std::vector<Tensor>> runs;
  for (bool native : {true, false}) {
    set_cpu_bf16_native(native);
    Tensor al = Leaf(a), bl = Leaf(b);
    Tensor c = matmul(al, bl);
    c.backward(dc);
    runs.push_back({c.detach(), al.grad(), bl.grad()});
  }
  set_cpu_bf16_native(true);
  Tensor aa = AbsFloat64Leaf(a), ba = AbsFloat64Leaf(b);
  Tensor ca = matmul(aa, ba);
  ca.backward(AbsFloat64Leaf(dc).detach());
  ExpectClose(runs[0][0], runs[1][0], ca, "matmul output");
  ExpectClose(runs[0][1], runs[1][1], aa.grad(), "matmul da");
  ExpectClose(runs[0][2], runs[1][2], ba.grad(), "matmul db");

  // Under autocast: float32 weights (the master copy) get float32 gradients on
  // both paths, within bfloat16 rounding of each other.
  Tensor x = randn({16, 50});
  Tensor w = randn({8, 50}).set_requires_grad(true);
  Tensor bias = randn({8}).set_requires_grad(true);
  std::vector<std::vector<double>> grads;
  for (bool native : {true, false}) {
    set_cpu_bf16_native(native);
    w.set_grad(Tensor());
    bias.set_grad(Tensor());
    Tensor loss;
    {
      AutocastGuard autocast(kBFloat16);
      Tensor y = linear(x, w, bias);
      ASSERT_EQ(y.dtype(), kBFloat16);
      loss = sum(y.to(kFloat32));
    }
    loss.backward();
    ASSERT_EQ(w.grad().dtype(), kFloat32);
    ASSERT_EQ(bias.grad().dtype(), kFloat32);
    grads.push_back(w.grad().to_vector<double>());
  }
  for (size_t i = 0; i < grads[0].size(); ++i) {
    ASSERT_NEAR(grads[0][i], grads[1][i], 0.02 * (std::abs(grads[1][i]) + 1.0)) << i;
  }
}

}  // namespace
}  // namespace tandem::nn
