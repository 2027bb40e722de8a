// Grouped and depthwise conv2d (Conv2dParams::groups) against a reference built
// from ordinary convolutions, one per group; float64 gradient checks; float32 on
// every CPU path; shape errors; the Conv2d module's grouped weight.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/layers.h"
#include "nn/ops/conv.h"
#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

// Channels [begin, end) of t (N, C, ...) as a new float64 tensor (N, end - begin, ...).
Tensor Channels(const Tensor& t, int64_t begin, int64_t end) {
  const auto v = t.to_vector<double>();
  const int64_t n = t.size(0), c = t.size(1), inner = t.numel() / std::max<int64_t>(n * c, 1);
  std::vector<double> out;
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t ci = begin; ci < end; ++ci) {
      const auto first = v.begin() + (s * c + ci) * inner;
      out.insert(out.end(), first, first + inner);
    }
  }
  Shape shape = t.shape();
  shape[1] = end - begin;
  return from_vector(out, shape, {.dtype = kFloat64});
}

// Rows [begin, end) of dim 0.
Tensor Rows(const Tensor& t, int64_t begin, int64_t end) {
  return t.detach().to(kFloat64).slice(begin, end).clone();
}

// The parts (N, C_k, ...) side by side along dim 1, as one (N, sum C_k, ...) vector.
std::vector<double> ConcatChannels(const std::vector<Tensor>& parts) {
  const int64_t n = parts[0].size(0);
  std::vector<std::vector<double>> values;
  for (const Tensor& p : parts) values.push_back(p.to_vector<double>());
  std::vector<double> out;
  for (int64_t s = 0; s < n; ++s) {
    for (size_t k = 0; k < parts.size(); ++k) {
      const int64_t per = parts[k].numel() / n;
      out.insert(out.end(), values[k].begin() + s * per, values[k].begin() + (s + 1) * per);
    }
  }
  return out;
}

// The parts (R_k, ...) one after the other along dim 0.
std::vector<double> ConcatRows(const std::vector<Tensor>& parts) {
  std::vector<double> out;
  for (const Tensor& p : parts) {
    const auto v = p.to_vector<double>();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Output and the gradients of x, weight and bias of one conv2d under the output
// gradient dy, as float64 vectors.
struct Result {
  std::vector<double> y, dx, dw, db;
};

Result RunGrouped(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
                  const Conv2dParams& p, DType dtype) {
  Tensor xi = x.detach().to(dtype).set_requires_grad(true);
  Tensor wi = w.detach().to(dtype).set_requires_grad(true);
  Tensor bi = b.defined() ? b.detach().to(dtype).set_requires_grad(true) : Tensor();
  Tensor y = conv2d(xi, wi, bi, p);
  y.backward(dy.to(dtype));
  return {y.to_vector<double>(), xi.grad().to_vector<double>(), wi.grad().to_vector<double>(),
          bi.defined() ? bi.grad().to_vector<double>() : std::vector<double>()};
}

// The reference: groups ordinary (groups 1) float64 convolutions, group k on
// x's channels [k C/G, (k+1) C/G) with weight and bias rows [k O/G, (k+1) O/G),
// outputs and gradients put back together.
Result RunPerGroup(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
                   const Conv2dParams& p) {
  const int64_t groups = p.groups, cg = x.size(1) / groups, og = w.size(0) / groups;
  Conv2dParams one = p;
  one.groups = 1;
  std::vector<Tensor> ys, dxs, dws, dbs;
  for (int64_t k = 0; k < groups; ++k) {
    Tensor xk = Channels(x, k * cg, (k + 1) * cg).set_requires_grad(true);
    Tensor wk = Rows(w, k * og, (k + 1) * og).set_requires_grad(true);
    Tensor bk = b.defined() ? Rows(b, k * og, (k + 1) * og).set_requires_grad(true) : Tensor();
    Tensor yk = conv2d(xk, wk, bk, one);
    yk.backward(Channels(dy, k * og, (k + 1) * og));
    ys.push_back(yk);
    dxs.push_back(xk.grad());
    dws.push_back(wk.grad());
    if (bk.defined()) dbs.push_back(bk.grad());
  }
  return {ConcatChannels(ys), ConcatChannels(dxs), ConcatRows(dws),
          dbs.empty() ? std::vector<double>() : ConcatRows(dbs)};
}

struct Case {
  Shape x, w;
  Conv2dParams p;
  std::string name;
};

// Grouped, depthwise (groups == C, with channel multiplier 1 and 2) and the
// depthwise shapes of MobileNetV2 (3x3, stride 1 and 2, padding 1).
std::vector<Case> Cases() {
  return {
      {{2, 4, 7, 6}, {6, 2, 3, 3}, {.groups = 2}, "groups 2"},
      {{3, 6, 8, 7}, {9, 2, 3, 2}, {.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}, .groups = 3},
       "groups 3, stride/padding/dilation"},
      {{2, 4, 6, 6}, {4, 1, 3, 3}, {.padding = {1, 1}, .groups = 4}, "depthwise"},
      {{1, 3, 7, 5}, {6, 1, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .groups = 3},
       "depthwise, multiplier 2, stride 2, batch 1"},
      {{2, 5, 6, 5}, {5, 1, 1, 1}, {.groups = 5}, "depthwise 1x1"},
      {{4, 32, 16, 16}, {32, 1, 3, 3}, {.padding = {1, 1}, .groups = 32},
       "MobileNetV2 depthwise, stride 1"},
      {{4, 96, 16, 16}, {96, 1, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .groups = 96},
       "MobileNetV2 depthwise, stride 2"},
  };
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
  }
}

TEST(ConvGroupsTest, Float64MatchesPerGroupConvolutions) {
  manual_seed(41);
  for (const Case& c : Cases()) {
    for (bool with_bias : {true, false}) {
      Tensor x = randn(c.x, {.dtype = kFloat64});
      Tensor w = randn(c.w, {.dtype = kFloat64});
      Tensor b = with_bias ? randn({c.w[0]}, {.dtype = kFloat64}) : Tensor();
      const Tensor y_probe = conv2d(x, w, b, c.p);
      ASSERT_EQ(y_probe.size(1), c.w[0]) << c.name;
      Tensor dy = randn(y_probe.shape(), {.dtype = kFloat64});
      const Result got = RunGrouped(x, w, b, dy, c.p, kFloat64);
      const Result want = RunPerGroup(x, w, b, dy, c.p);
      const std::string where = absl::StrCat(c.name, with_bias ? ", bias" : ", no bias");
      ExpectNear(got.y, want.y, 1e-12, where + ": output");
      ExpectNear(got.dx, want.dx, 1e-12, where + ": dx");
      ExpectNear(got.dw, want.dw, 1e-12, where + ": dweight");
      ExpectNear(got.db, want.db, 1e-12, where + ": dbias");
    }
  }
}

// A batch of 41 images spans several of the im2col kernels' chunks of images
// (5 images of 100 KiB float64 columns per group at one OpenBLAS thread), the
// last one a single image: grouped, it still matches the per-group reference.
TEST(ConvGroupsTest, BatchAcrossChunksMatchesPerGroupConvolutions) {
  const int threads = cpu_blas_threads();
  set_cpu_blas_threads(1);
  struct Restore {
    int threads;
    ~Restore() { set_cpu_blas_threads(threads); }
  } restore{threads};
  manual_seed(46);
  for (const Conv2dParams& p : {Conv2dParams{.groups = 2}, Conv2dParams{.padding = {1, 1}, .groups = 2}}) {
    Tensor x = randn({41, 4, 28, 30}, {.dtype = kFloat64});
    Tensor w = randn({6, 2, 3, 3}, {.dtype = kFloat64});
    Tensor b = randn({6}, {.dtype = kFloat64});
    Tensor dy = randn(conv2d(x, w, b, p).shape(), {.dtype = kFloat64});
    const Result got = RunGrouped(x, w, b, dy, p, kFloat64);
    const Result want = RunPerGroup(x, w, b, dy, p);
    const std::string where = absl::StrCat("padding ", p.padding[0]);
    ExpectNear(got.y, want.y, 1e-12, where + ": output");
    ExpectNear(got.dx, want.dx, 1e-12, where + ": dx");
    ExpectNear(got.dw, want.dw, 1e-11, where + ": dweight");
    ExpectNear(got.db, want.db, 1e-11, where + ": dbias");
  }
}

// float32 on each CPU path (the default, with its direct depthwise kernels;
// oneDNN blocked and plain where built; im2col + OpenBLAS) against the float64
// per-group reference; each path repeats its own bits at 1 and 2 threads.
TEST(ConvGroupsTest, EachFloat32CpuPathMatchesReferenceAndRepeats) {
  using ops::internal::CpuConvPath;
  const testing::RestoreCpuConv restore;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare(/*with_auto=*/true);
  manual_seed(42);
  for (const Case& c : Cases()) {
    Tensor x = randn(c.x, {.dtype = kFloat64});
    Tensor w = randn(c.w, {.dtype = kFloat64});
    Tensor b = randn({c.w[0]}, {.dtype = kFloat64});
    Tensor dy = randn(conv2d(x, w, b, c.p).shape(), {.dtype = kFloat64});
    const Result want = RunPerGroup(x, w, b, dy, c.p);
    for (CpuConvPath path : paths) {
      ops::internal::SetCpuConvPath(path);
      for (int t : {1, 2}) {
        set_cpu_blas_threads(t);
        const std::string where =
            absl::StrCat(c.name, ", path ", static_cast<int>(path),
                         " (0 default, 1 im2col, 2 oneDNN, 3 oneDNN blocked, 4 oneDNN nhwc, "
                         "5 Winograd), ",
                         t, " thread(s)");
        const Result got = RunGrouped(x, w, b, dy, c.p, kFloat32);
        ExpectNear(got.y, want.y, 2e-4, where + ": output");
        ExpectNear(got.dx, want.dx, 2e-4, where + ": dx");
        ExpectNear(got.dw, want.dw, 2e-4, where + ": dweight");
        ExpectNear(got.db, want.db, 2e-4, where + ": dbias");
        const Result again = RunGrouped(x, w, b, dy, c.p, kFloat32);
        EXPECT_EQ(again.y, got.y) << where;
        EXPECT_EQ(again.dx, got.dx) << where;
        EXPECT_EQ(again.dw, got.dw) << where;
        EXPECT_EQ(again.db, got.db) << where;
      }
    }
  }
}

// bfloat16 takes the float32 kernels on widened copies: grouped too.
TEST(ConvGroupsTest, BFloat16FollowsFloat32) {
  manual_seed(43);
  const Case c = Cases()[2];  // depthwise
  Tensor x = randn(c.x).to(kBFloat16), w = randn(c.w).to(kBFloat16), b = randn({c.w[0]}).to(kBFloat16);
  const auto got = conv2d(x, w, b, c.p).to_vector<double>();
  const auto want = conv2d(x.to(kFloat32), w.to(kFloat32), b.to(kFloat32), c.p)
                        .to(kBFloat16)
                        .to_vector<double>();
  EXPECT_EQ(got, want);
}

TEST(ConvGroupsGradTest, GroupedAndDepthwise) {
  manual_seed(44);
  const std::vector<Case> cases = {
      {{2, 4, 5, 5}, {6, 2, 3, 3}, {.padding = {1, 1}, .groups = 2}, "groups 2"},
      {{2, 6, 6, 5}, {3, 2, 3, 2}, {.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}, .groups = 3},
       "groups 3, one output channel each"},
      {{2, 3, 5, 6}, {3, 1, 3, 3}, {.padding = {1, 1}, .groups = 3}, "depthwise"},
      {{1, 2, 6, 6}, {4, 1, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .groups = 2},
       "depthwise, multiplier 2, stride 2"},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(GradCheck([&](const auto& in) { return conv2d(in[0], in[1], in[2], c.p); },
                          {RandomInput(c.x), RandomInput(c.w), RandomInput({c.w[0]})}))
        << c.name;
    EXPECT_TRUE(GradCheck([&](const auto& in) { return conv2d(in[0], in[1], Tensor(), c.p); },
                          {RandomInput(c.x), RandomInput(c.w)}))
        << c.name << ", no bias";
  }
}

// Runs f and returns its error message ("" when it did not throw).
template <typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ConvGroupsTest, ShapeErrorsNameTheValues) {
  std::string m = ErrorOf([] { conv2d(zeros({1, 6, 5, 5}), zeros({4, 1, 3, 3}), Tensor(), {.groups = 4}); });
  EXPECT_NE(m.find("in_channels 6"), std::string::npos) << m;
  EXPECT_NE(m.find("groups 4"), std::string::npos) << m;
  m = ErrorOf([] { conv2d(zeros({1, 4, 5, 5}), zeros({6, 1, 3, 3}), Tensor(), {.groups = 4}); });
  EXPECT_NE(m.find("out_channels 6"), std::string::npos) << m;
  EXPECT_NE(m.find("groups 4"), std::string::npos) << m;
  // Weight (O, C, ...) where (O, C / groups, ...) is expected.
  m = ErrorOf([] { conv2d(zeros({1, 4, 5, 5}), zeros({4, 4, 3, 3}), Tensor(), {.groups = 4}); });
  EXPECT_NE(m.find("(4, 4, 3, 3)"), std::string::npos) << m;
  EXPECT_NE(m.find("groups 4"), std::string::npos) << m;
  m = ErrorOf([] { conv2d(zeros({1, 4, 5, 5}), zeros({4, 4, 3, 3}), Tensor(), {.groups = 0}); });
  EXPECT_NE(m.find("groups must be >= 1, got 0"), std::string::npos) << m;
  m = ErrorOf([] { Conv2d(6, 8, 3, {.groups = 4}); });
  EXPECT_NE(m.find("in_channels 6"), std::string::npos) << m;
  m = ErrorOf([] { Conv2d(8, 6, 3, {.groups = 4}); });
  EXPECT_NE(m.find("out_channels 6"), std::string::npos) << m;
}

TEST(ConvGroupsTest, ModuleHasGroupedWeight) {
  manual_seed(45);
  Conv2d depthwise(32, 32, 3, {.padding = {1, 1}, .groups = 32}, /*bias=*/false);
  EXPECT_EQ(depthwise->weight.shape(), (Shape{32, 1, 3, 3}));
  EXPECT_FALSE(depthwise->bias.defined());
  // Init bound 1 / sqrt(in / groups * KH * KW) = 1 / 3.
  for (double v : depthwise->weight.to_vector<double>()) EXPECT_LE(std::abs(v), 1.0 / 3.0);
  EXPECT_EQ(depthwise(zeros({2, 32, 8, 8})).shape(), (Shape{2, 32, 8, 8}));
  Conv2d grouped(4, 6, 3, {.groups = 2});
  EXPECT_EQ(grouped->weight.shape(), (Shape{6, 2, 3, 3}));
  EXPECT_EQ(grouped->bias.shape(), (Shape{6}));
  EXPECT_EQ(grouped(zeros({1, 4, 5, 5})).shape(), (Shape{1, 6, 3, 3}));
}

}  // namespace
}  // namespace tandem::nn
