// conv2d_relu_max_pool2d: the same bits as conv2d_relu then max_pool2d, values
// and gradients, on every CPU convolution path, where the fused path runs
// (channels-last and blocked layouts) and where the ops run one by one; and
// nn::Sequential's use of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/autograd.h"
#include "nn/layers.h"
#include "nn/ops/conv.h"
#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/conv_kernels.h"  // CpuConvPath
#include "nn/ops/pool.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"
#include "tests/nn/gradcheck.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using ops::internal::CpuConvPath;

using ::tandem::testing::CountOps;
using ::tandem::testing::RunWholeAndOneByOne;

struct Case {
  std::string name;
  Shape x, w;
  Conv2dParams conv;
  Pool2dParams pool;
  bool bias = true;
  // Which inputs require grad: x, weight, bias.
  bool gx = true, gw = true, gb = true;
  // Whether the fused path can take it (windows that tile, no padding).
  bool tiles = true;
};

std::vector<Case> Cases() {
  const Conv2dParams pad2{.padding = {2, 2}}, pad1{.padding = {1, 1}};
  return {
      {"lenet conv1", {5, 1, 28, 28}, {20, 1, 5, 5}, pad2, {}},
      {"lenet conv2", {3, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}},
      // The ConvNet's: 3 -> 32 channels (channels-last or blocked), 32 -> 64 (blocked).
      {"convnet conv1", {2, 3, 32, 32}, {32, 3, 3, 3}, {}, {}},
      {"convnet conv2", {2, 32, 15, 15}, {64, 32, 3, 3}, {}, {}},
      // Odd sizes: the last row and column of y belong to no window.
      {"odd sizes", {2, 12, 13, 11}, {20, 12, 3, 3}, pad1, {}},
      // Channel counts off the 4-lane vectors, and exactly one 8-channel block.
      {"13 channels", {2, 5, 9, 9}, {13, 5, 3, 3}, pad1, {}},
      {"one block", {2, 8, 10, 10}, {8, 8, 3, 3}, pad1, {}},
      {"3x3 windows", {2, 3, 9, 9}, {12, 3, 3, 3}, pad1, {.kernel = {3, 3}}},
      {"2x3 windows", {2, 20, 8, 9}, {20, 20, 3, 3}, pad1, {.kernel = {2, 3}}},
      {"no bias", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, /*bias=*/false},
      {"x as data", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, true, /*gx=*/false},
      {"frozen weight", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, true, true, /*gw=*/false},
      {"only the bias", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, true, false, false, true},
      // Overlapping and padded windows: the ops one by one.
      {"overlapping windows",
       {2, 20, 14, 14},
       {20, 20, 5, 5},
       pad2,
       {.kernel = {3, 3}, .stride = {2, 2}},
       true,
       true,
       true,
       true,
       /*tiles=*/false},
      {"padded windows",
       {2, 20, 14, 14},
       {20, 20, 5, 5},
       pad2,
       {.kernel = {2, 2}, .padding = {1, 1}},
       true,
       true,
       true,
       true,
       /*tiles=*/false},
  };
}

// Inputs with ties: x and weight on a coarse grid, so equal maxima in a window
// are common, and a bias below zero in some channels, so whole windows are 0
// after the ReLU.
Tensor Coarse(const Shape& shape, float scale) {
  std::vector<float> v = randn(shape).to_vector<float>();
  for (float& e : v) e = std::round(2.0f * e) * scale;
  return from_vector<float>(v, shape);
}

std::vector<Tensor> RunCase(const Case& c, const Tensor& x0, const Tensor& w0, const Tensor& b0,
                            const Tensor& dy, bool fused, Tensor* out = nullptr) {
  Tensor x = x0.detach().set_requires_grad(c.gx);
  Tensor w = w0.detach().set_requires_grad(c.gw);
  Tensor b = c.bias ? b0.detach().set_requires_grad(c.gb) : Tensor();
  Tensor y = fused ? conv2d_relu_max_pool2d(x, w, b, c.conv, c.pool)
                   : max_pool2d(conv2d_relu(x, w, b, c.conv), c.pool);
  if (out != nullptr) *out = y;
  y.backward(dy);
  return {y, c.gx ? x.grad() : Tensor(), c.gw ? w.grad() : Tensor(),
          c.bias && c.gb ? b.grad() : Tensor()};
}

void ExpectSameBits(const std::vector<Tensor>& a, const std::vector<Tensor>& b,
                    const std::string& what) {
  const char* names[] = {"output", "dx", "dweight", "dbias"};
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].defined(), b[k].defined()) << names[k] << ", " << what;
    if (!a[k].defined()) continue;
    ASSERT_EQ(a[k].shape(), b[k].shape()) << names[k] << ", " << what;
    ASSERT_EQ(a[k].dtype(), b[k].dtype()) << names[k] << ", " << what;
    EXPECT_EQ(std::memcmp(a[k].data_ptr(), b[k].data_ptr(),
                          static_cast<size_t>(a[k].numel() * ElementSize(a[k].dtype()))),
              0)
        << names[k] << " differs: " << what;
  }
}

// Each case twice: on a coarse grid (exact sums: ties in the windows and whole
// windows zeroed by the ReLU) and from randn (sums that depend on the order the
// convolution adds in, so a different primitive in forward would show).
TEST(ConvReluPoolTest, FusedEqualsTheOpsOneByOneBitForBit) {
  const testing::RestoreCpuConv restore;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare(/*with_auto=*/true);
  manual_seed(31);
  for (const Case& c : Cases()) {
    for (bool coarse : {true, false}) {
      const Tensor x0 = coarse ? Coarse(c.x, 0.5) : randn(c.x);
      const Tensor w0 = coarse ? Coarse(c.w, 0.125) : mul_scalar(randn(c.w), 0.3);
      const Tensor b0 = coarse ? Coarse({c.w[0]}, 0.5) : randn({c.w[0]});
      Shape y_shape = max_pool2d(conv2d_relu(x0, w0, b0, c.conv), c.pool).shape();
      const Tensor dy = randn(y_shape);
      for (CpuConvPath path : paths) {
        ops::internal::SetCpuConvPath(path);
        const std::string what = c.name + (coarse ? ", coarse" : ", randn") + ", path " +
                                 std::to_string(static_cast<int>(path));
        Tensor y;
        const std::vector<Tensor> fused = RunCase(c, x0, w0, b0, dy, true, &y);
        const std::vector<Tensor> plain = RunCase(c, x0, w0, b0, dy, false);
        ExpectSameBits(fused, plain, what);
        // Channels-last oneDNN takes every tiling case, blocked oneDNN those whose
        // output channels fill its 8- or 16-channel blocks; kAuto chooses between
        // them by shape. The fused node is what tells the fused kernels ran.
        const int fused_ops = CountOps(y, "conv2d_relu_max_pool2d");
        if (path == CpuConvPath::kDnnlNhwc) EXPECT_EQ(fused_ops, c.tiles ? 1 : 0) << what;
        if (path == CpuConvPath::kDnnlBlocked && c.w[0] % 16 == 0) {
          EXPECT_EQ(fused_ops, c.tiles ? 1 : 0) << what;
        }
        if (path == CpuConvPath::kIm2col || path == CpuConvPath::kDnnl) EXPECT_EQ(fused_ops, 0);
        // The ReLU zeroed whole windows and ties happened: both rules were tested.
        const std::vector<float> v = fused[0].to_vector<float>();
        EXPECT_GT(std::count(v.begin(), v.end(), 0.0f), 0) << what;
        EXPECT_GT(std::count_if(v.begin(), v.end(), [](float e) { return e > 0; }), 0) << what;
      }
    }
  }
}

// NaN, infinities and -0 in x and NaN and -0 in the output gradient: the rules
// of the ops one by one (a NaN stays only as a window's first element, -0 and +0
// tie, routed gradients are 0 + dy).
TEST(ConvReluPoolTest, SpecialValuesGiveTheSameBits) {
  const testing::RestoreCpuConv restore;
  manual_seed(35);
  const Case c = {"special", {2, 8, 12, 12}, {20, 8, 1, 1}, {}, {}};
  std::vector<float> x = randn(c.x).to_vector<float>();
  const float kNan = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < x.size(); i += 37) x[i] = kNan;
  for (size_t i = 5; i < x.size(); i += 41) x[i] = kInf;
  for (size_t i = 9; i < x.size(); i += 43) x[i] = -kInf;
  for (size_t i = 13; i < x.size(); i += 29) x[i] = -0.0f;
  const Tensor x0 = from_vector<float>(x, c.x), w0 = randn(c.w), b0 = randn({20});
  std::vector<float> d = randn({2, 20, 6, 6}).to_vector<float>();
  for (size_t i = 0; i < d.size(); i += 17) d[i] = -0.0f;
  for (size_t i = 3; i < d.size(); i += 31) d[i] = kNan;
  const Tensor dy = from_vector<float>(d, {2, 20, 6, 6});
  for (CpuConvPath path : testing::CpuConvPathsToCompare(/*with_auto=*/true)) {
    ops::internal::SetCpuConvPath(path);
    ExpectSameBits(RunCase(c, x0, w0, b0, dy, true), RunCase(c, x0, w0, b0, dy, false),
                   "path " + std::to_string(static_cast<int>(path)));
  }
}

// The CPU path changed between forward and backward (a test or benchmark
// switching kernels mid-step): the fused op's backward takes the new path's
// kernels as conv2d_relu's backward does, with the same bits.
TEST(ConvReluPoolTest, PathChangedBeforeBackwardGivesTheSameBits) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "built without oneDNN: no fused path";
  struct Switch {
    CpuConvPath forward, backward;
    Case c;
  };
  const Case lenet2 = Cases()[1];
  const Case depthwise = {
      "depthwise", {2, 16, 10, 10}, {16, 1, 3, 3}, {.padding = {1, 1}, .groups = 16}, {}};
  const std::vector<Switch> switches = {
      {CpuConvPath::kDnnlNhwc, CpuConvPath::kIm2col, lenet2},
      {CpuConvPath::kAuto, CpuConvPath::kIm2col, lenet2},
      {CpuConvPath::kDnnlNhwc, CpuConvPath::kDnnlBlocked, lenet2},
      {CpuConvPath::kDnnlBlocked, CpuConvPath::kDnnl, Cases()[3]},
      {CpuConvPath::kDnnlNhwc, CpuConvPath::kAuto, depthwise},  // direct depthwise kernels
  };
  manual_seed(36);
  for (const Switch& s : switches) {
    const Tensor x0 = randn(s.c.x), w0 = randn(s.c.w), b0 = randn({s.c.w[0]});
    const Tensor dy = randn(max_pool2d(conv2d_relu(x0, w0, b0, s.c.conv), s.c.pool).shape());
    std::vector<std::vector<Tensor>> runs;
    for (bool fused : {true, false}) {
      Tensor x = x0.detach().set_requires_grad(true), w = w0.detach().set_requires_grad(true);
      Tensor b = b0.detach().set_requires_grad(true);
      ops::internal::SetCpuConvPath(s.forward);
      Tensor y = fused ? conv2d_relu_max_pool2d(x, w, b, s.c.conv, s.c.pool)
                       : max_pool2d(conv2d_relu(x, w, b, s.c.conv), s.c.pool);
      if (fused) EXPECT_EQ(CountOps(y, "conv2d_relu_max_pool2d"), 1) << s.c.name;
      ops::internal::SetCpuConvPath(s.backward);
      y.backward(dy);
      runs.push_back({y, x.grad(), w.grad(), b.grad()});
    }
    ExpectSameBits(runs[0], runs[1],
                   s.c.name + ", path " + std::to_string(static_cast<int>(s.forward)) + " then " +
                       std::to_string(static_cast<int>(s.backward)));
  }
}

// The fused kernels split rows over the rank's threads (oneDNN's own results
// depend on the thread count, so each count is compared with the ops one by one
// at that count); without grad mode (evaluation) the same output.
TEST(ConvReluPoolTest, SameBitsAtOneAndTwoThreadsAndInEvaluation) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  manual_seed(32);
  // LeNet's second convolution (channels-last on kAuto) and the ConvNet's
  // second (blocked), with enough rows to split.
  for (Case c : {Cases()[1], Cases()[3]}) {
    c.x[0] = 16;
    const Tensor x0 = randn(c.x), w0 = randn(c.w), b0 = randn({c.w[0]});
    const Tensor dy = randn(max_pool2d(conv2d_relu(x0, w0, b0, c.conv), c.pool).shape());
    for (int threads : {1, 2}) {
      set_cpu_blas_threads(threads);
      Tensor y;
      const std::vector<Tensor> fused = RunCase(c, x0, w0, b0, dy, true, &y);
      if (ops::internal::CpuConvUsesDnnl()) EXPECT_EQ(CountOps(y, "conv2d_relu_max_pool2d"), 1);
      const std::string what = c.name + ", " + std::to_string(threads) + " thread(s)";
      ExpectSameBits(fused, RunCase(c, x0, w0, b0, dy, false), what);
      NoGradGuard no_grad;
      ExpectSameBits({conv2d_relu_max_pool2d(x0, w0, b0, c.conv, c.pool)}, {fused[0]},
                     "evaluation, " + what);
    }
  }
}

// Other dtypes run the ops one by one: float64 gradients against finite
// differences, as every op's.
TEST(ConvReluPoolTest, GradCheckFloat64) {
  manual_seed(33);
  using testing::RandomInput;
  EXPECT_TRUE(testing::GradCheck(
      [](const auto& in) {
        return conv2d_relu_max_pool2d(in[0], in[1], in[2], {.padding = {1, 1}}, {});
      },
      {RandomInput({2, 3, 6, 7}), RandomInput({4, 3, 3, 3}), RandomInput({4})}));
}

// Sequential runs Conv2d, ReLU, MaxPool2d as conv2d_relu_max_pool2d (or, where
// the fused path does not apply, conv2d_relu and max_pool2d): LeNet's modules
// give the same bits as run one by one, forward and backward.
TEST(ConvReluPoolTest, SequentialFusesConvReluPoolWithTheSameBits) {
  manual_seed(34);
  Sequential net({Conv2d(1, 20, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2),
                  Conv2d(20, 20, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2), Flatten(),
                  Linear(20 * 7 * 7, 10)});
  const ::tandem::testing::WholeAndOneByOne r = RunWholeAndOneByOne(net, randn({6, 1, 28, 28}));
  const int triples = CountOps(r.whole, "conv2d_relu_max_pool2d");
  EXPECT_EQ(triples + CountOps(r.whole, "conv2d_relu"), 2);
  EXPECT_EQ(triples + CountOps(r.whole, "max_pool2d"), 2);
  EXPECT_EQ(CountOps(r.whole, "relu"), 0);
  // LeNet's second convolution (20 channels) is channels-last on oneDNN.
  if (ops::internal::CpuConvUsesDnnl()) EXPECT_GE(triples, 1);
  EXPECT_EQ(CountOps(r.one_by_one, "conv2d_relu_max_pool2d"), 0);
  EXPECT_EQ(CountOps(r.one_by_one, "relu"), 2);
  EXPECT_EQ(r.whole.to_vector<float>(), r.one_by_one.to_vector<float>());
  EXPECT_EQ(r.whole_grads, r.one_by_one_grads);
}

// bfloat16 (autocast's dtype on the CPU): where the CPU has bfloat16 instructions
// (cpu_bf16_native()) the fused path runs on oneDNN's bfloat16 convolution with
// relu as its post-op, y and dy bfloat16 in the primitive's layout, and its
// values and gradients are the bits of the bfloat16 ops one by one (which run
// the same primitives); emulated (set_cpu_bf16_native(false), or no avx512_bf16 /
// amx_bf16) the ops run one by one. How close bfloat16 is to float32 is
// bf16_conv_dnnl_test's and bf16_conv_pool_test's (one bfloat16 rounding plus
// float32 accumulation error).
struct RestoreBf16Native {
  ~RestoreBf16Native() { set_cpu_bf16_native(true); }
};

TEST(ConvReluPoolTest, Bfloat16FusedEqualsTheOpsOneByOneBitForBit) {
  const testing::RestoreCpuConv restore;
  const RestoreBf16Native restore_bf16;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare(/*with_auto=*/true);
  manual_seed(37);
  for (const Case& c : Cases()) {
    for (bool native : {true, false}) {
      set_cpu_bf16_native(native);
      const Tensor x0 = randn(c.x).to(kBFloat16);
      const Tensor w0 = mul_scalar(randn(c.w), 0.3).to(kBFloat16);
      const Tensor b0 = randn({c.w[0]}).to(kBFloat16);
      const Shape y_shape = max_pool2d(conv2d_relu(x0, w0, b0, c.conv), c.pool).shape();
      const Tensor dy = randn(y_shape).to(kBFloat16);
      for (CpuConvPath path : paths) {
        ops::internal::SetCpuConvPath(path);
        const std::string what = c.name + (native ? ", native" : ", emulated") + ", path " +
                                 std::to_string(static_cast<int>(path));
        Tensor y;
        const std::vector<Tensor> fused = RunCase(c, x0, w0, b0, dy, true, &y);
        ASSERT_EQ(y.dtype(), kBFloat16) << what;
        ExpectSameBits(fused, RunCase(c, x0, w0, b0, dy, false), what);
        const int fused_ops = CountOps(y, "conv2d_relu_max_pool2d");
        if (!cpu_bf16_native() || path == CpuConvPath::kIm2col || path == CpuConvPath::kDnnl) {
          EXPECT_EQ(fused_ops, 0) << what;
        } else if (path == CpuConvPath::kDnnlNhwc) {
          EXPECT_EQ(fused_ops, c.tiles ? 1 : 0) << what;
        }
      }
    }
  }
}

// The path follows the CPU's flags: LeNet under autocast runs both conv + relu
// + pool triples fused on bfloat16 primitives where /proc/cpuinfo lists
// avx512_bf16 or amx_bf16 (and tandem is built with oneDNN), else the float32
// kernels on widened copies, one op at a time; the values agree within
// bfloat16 rounding (the pooled outputs, 2^-6 of the largest: two roundings of
// the products' sums and a different summation order), and each path's
// gradients reach the float32 parameters.
TEST(ConvReluPoolTest, AutocastLeNetPathFollowsTheCpuFlags) {
  const testing::RestoreCpuConv restore;
  const RestoreBf16Native restore_bf16;
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  std::string flags;
  {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (flags.empty() && std::getline(in, line)) {
      if (line.rfind("flags", 0) == 0) flags = " " + line.substr(line.find(':') + 1) + " ";
    }
  }
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags";
  if (std::getenv("ONEDNN_MAX_CPU_ISA") != nullptr) {
    GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA caps oneDNN's instruction set";
  }
  const bool has_bf16 = flags.find(" avx512_bf16 ") != std::string::npos ||
                        flags.find(" amx_bf16 ") != std::string::npos;
  const bool want_fused = has_bf16 && ops::internal::CpuConvUsesDnnl();
  manual_seed(38);
  Sequential net({Conv2d(1, 20, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2),
                  Conv2d(20, 20, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2)});
  const Tensor x = randn({4, 1, 28, 28});
  std::vector<std::vector<float>> outs;
  for (bool native : {true, false}) {
    set_cpu_bf16_native(native);
    Tensor y;
    {
      AutocastGuard autocast(kBFloat16);
      y = net->forward(x);
    }
    ASSERT_EQ(y.dtype(), kBFloat16);
    EXPECT_EQ(CountOps(y, "conv2d_relu_max_pool2d"), native && want_fused ? 2 : 0)
        << "native " << native << ", flags:" << flags;
    EXPECT_EQ(CountOps(y, "conv2d_relu"), native && want_fused ? 0 : 2) << "native " << native;
    net->zero_grad();
    sum(y.to(kFloat32)).backward();
    for (const Tensor& p : net->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().dtype(), kFloat32);
    }
    outs.push_back(y.to_vector<float>());
  }
  float largest = 0;
  for (float v : outs[1]) largest = std::max(largest, std::abs(v));
  ASSERT_GT(largest, 0.0f);
  for (size_t i = 0; i < outs[0].size(); ++i) {
    ASSERT_NEAR(outs[0][i], outs[1][i], largest / 64) << "element " << i;
  }
}

}  // namespace
}  // namespace tandem::nn
