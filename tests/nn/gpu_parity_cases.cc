// The rows of the CPU/CUDA parity table (gpu_parity.h says what a row holds,
// gpu_parity_test.cc runs them). Adding an op, a shape or a dtype is one
// `rows.push_back({...})` here: `.f` takes the inputs (CPU leaves on one side, CUDA
// copies on the other) and returns the op's output; tensors it makes itself (labels,
// running statistics) go on in[0].device().
//
// Tolerances, by family:
//  - float32 / float64 GEMM and convolution: Rel(1e-4) / Rel(1e-10), TF32 off (a
//    TF32 row: Rel(5e-2), about 10 mantissa bits per product); float32 also
//    1e-5 of the element's magnitude sum a: a filter gradient summing hundreds of
//    products of order one to a small value is rounded in the order of its terms
//    (seen on an H100: cuDNN 1.2e-4 off float64 at -0.0716 with a = 105, where
//    Rel(1e-4) alone allows 1.07e-4), while a term lost or doubled moves it by
//    about a / (number of terms), far above 1e-5 a;
//  - pools: Rel(1e-5) / Rel(1e-12); adaptive average pooling sums in the CPU's
//    order: Rel(1e-6) / Rel(1e-13), bfloat16 Rel(1e-2) (one rounding);
//  - bfloat16 elementwise: outputs within 2 ulps, gradients within 3 (a gradient
//    formula chains up to three bfloat16 ops, and CUDA's expf/powf/tanhf may round
//    an intermediate to the neighbouring bfloat16 value, which the next product
//    carries before its own rounding);
//  - bfloat16 convolution: Bf16Magnitude() (gpu_parity.h); bfloat16 pools follow
//    the CPU kernels step by step: Exact();
//  - one operation per element, the same on both devices (relu6): Exact();
//  - the activations and losses of AddActivationRows / AddNewLossRows /
//    AddClassLossOptionRows: see there.
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nn/ops/batch_norm.h"
#include "nn/ops/conv.h"
#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/join.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/ops/pool.h"
#include "nn/ops/reduce.h"
#include "nn/ops/softmax.h"
#include "tests/nn/gpu_parity.h"

namespace tandem::nn::testing {
namespace {

using Rows = std::vector<ParityCase>;
using Ins = const std::vector<Tensor>&;

const DType kFloats[] = {kFloat32, kFloat64};
// GEMMs and convolutions in float32 / float64 without TF32.
Tolerance GemmTol(DType dtype) { return dtype == kFloat32 ? Rel(1e-4, 1e-5) : Rel(1e-10); }

std::string ConvAttrs(const Conv2dParams& p) {
  auto pair = [](const std::array<int64_t, 2>& v) {
    return std::to_string(v[0]) + "x" + std::to_string(v[1]);
  };
  return "stride " + pair(p.stride) + " padding " + pair(p.padding) + " dilation " +
         pair(p.dilation) + " groups " + std::to_string(p.groups);
}

std::string PoolAttrs(const Pool2dParams& p) {
  auto pair = [](const std::array<int64_t, 2>& v) {
    return std::to_string(v[0]) + "x" + std::to_string(v[1]);
  };
  return "kernel " + pair(p.kernel) + " stride " + pair(p.stride) + " padding " + pair(p.padding);
}

void AddMatmulRows(Rows& rows) {
  for (DType dt : kFloats) {
    const Tolerance tol = GemmTol(dt);
    rows.push_back({.op = "matmul", .dtype = dt, .inputs = {Randn({33, 17}), Randn({17, 45})},
                    .f = [](Ins in) { return matmul(in[0], in[1]); }, .tol = tol});
    rows.push_back({.op = "linear", .dtype = dt,
                    .inputs = {Randn({32, 64}), Randn({10, 64}), Randn({10})},
                    .f = [](Ins in) { return linear(in[0], in[1], in[2]); }, .tol = tol});
    rows.push_back({.op = "linear", .attrs = "no bias", .dtype = dt,
                    .inputs = {Randn({7, 5}), Randn({3, 5})},
                    .f = [](Ins in) { return linear(in[0], in[1]); }, .tol = tol});
    rows.push_back({.op = "linear_relu", .dtype = dt,
                    .inputs = {Randn({32, 64}), Randn({48, 64}), Randn({48})},
                    .f = [](Ins in) { return linear_relu(in[0], in[1], in[2]); }, .tol = tol});
    // Where the fused cuBLASLt epilogue is not used (a size-1 dimension, a bias view
    // that is not 16-byte aligned) the unfused fallback must give the same results.
    rows.push_back({.op = "linear_relu", .attrs = "batch 1 (unfused)", .dtype = dt,
                    .inputs = {Randn({1, 16}), Randn({8, 16}), Randn({8})},
                    .f = [](Ins in) { return linear_relu(in[0], in[1], in[2]); }, .tol = tol});
    rows.push_back({.op = "linear", .attrs = "one output (unfused)", .dtype = dt,
                    .inputs = {Randn({9, 16}), Randn({1, 16}), Randn({1})},
                    .f = [](Ins in) { return linear(in[0], in[1], in[2]); }, .tol = tol});
    rows.push_back({.op = "linear_relu", .attrs = "one input (unfused)", .dtype = dt,
                    .inputs = {Randn({9, 1}), Randn({8, 1}), Randn({8})},
                    .f = [](Ins in) { return linear_relu(in[0], in[1], in[2]); }, .tol = tol});
    rows.push_back({.op = "linear_relu", .attrs = "bias one element into its buffer (unfused)",
                    .dtype = dt, .inputs = {Randn({12, 16}), Randn({8, 16}), Randn({9})},
                    .f = [](Ins in) { return linear_relu(in[0], in[1], in[2].slice(1, 9)); },
                    .tol = tol});
  }
  rows.push_back({.op = "linear", .attrs = "TF32", .dtype = kFloat32,
                  .inputs = {Randn({64, 128}), Randn({32, 128}), Randn({32})},
                  .f = [](Ins in) { return linear(in[0], in[1], in[2]); }, .tol = Rel(5e-2),
                  .tf32 = true});
}

void AddConvRows(Rows& rows) {
  const std::vector<Conv2dParams> variants = {
      {}, {.padding = {2, 2}}, {.stride = {2, 1}, .padding = {1, 0}}, {.dilation = {2, 2}}};
  // Grouped and depthwise (MobileNetV2's): {x shape, weight shape, params}.
  struct Grouped {
    Shape x, w;
    Conv2dParams p;
  };
  const std::vector<Grouped> grouped = {
      {{4, 6, 12, 11}, {9, 2, 3, 3}, {.padding = {1, 1}, .groups = 3}},
      {{3, 4, 9, 10}, {8, 2, 3, 2}, {.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}, .groups = 2}},
      {{4, 32, 16, 16}, {32, 1, 3, 3}, {.padding = {1, 1}, .groups = 32}},               // depthwise
      {{4, 96, 16, 16}, {96, 1, 3, 3}, {.stride = {2, 2}, .padding = {1, 1}, .groups = 96}},
      {{2, 3, 8, 8}, {6, 1, 3, 3}, {.padding = {1, 1}, .groups = 3}},  // depthwise, multiplier 2
  };
  for (DType dt : kFloats) {
    const Tolerance tol = GemmTol(dt);
    for (const Conv2dParams& p : variants) {
      rows.push_back({.op = "conv2d", .attrs = ConvAttrs(p), .dtype = dt,
                      .inputs = {Randn({4, 3, 12, 11}), Randn({5, 3, 3, 3}), Randn({5})},
                      .f = [p](Ins in) { return conv2d(in[0], in[1], in[2], p); }, .tol = tol});
    }
    rows.push_back({.op = "conv2d", .attrs = "LeNet's first layer", .dtype = dt,
                    .inputs = {Randn({8, 1, 28, 28}), Randn({20, 1, 5, 5}), Randn({20})},
                    .f = [](Ins in) { return conv2d(in[0], in[1], in[2], {.padding = {2, 2}}); },
                    .tol = tol});
    // The fused op: relu's kernel in place on the GPU, a oneDNN post-op on the CPU.
    for (const Conv2dParams& p : variants) {
      rows.push_back({.op = "conv2d_relu", .attrs = ConvAttrs(p), .dtype = dt,
                      .inputs = {Randn({4, 3, 12, 11}), Randn({5, 3, 3, 3}), Randn({5})},
                      .f = [p](Ins in) { return conv2d_relu(in[0], in[1], in[2], p); }, .tol = tol});
    }
    // Conv + ReLU + max pool as one op: on the CPU (float32) the fused
    // channels-last and blocked paths, on the GPU the ops one by one.
    rows.push_back({.op = "conv2d_relu_max_pool2d", .attrs = "LeNet's second block", .dtype = dt,
                    .inputs = {Randn({4, 20, 14, 14}), Randn({20, 20, 5, 5}), Randn({20})},
                    .f = [](Ins in) {
                      return conv2d_relu_max_pool2d(in[0], in[1], in[2], {.padding = {2, 2}}, {});
                    },
                    .tol = tol});
    rows.push_back({.op = "conv2d_relu_max_pool2d", .attrs = "ConvNet's second block", .dtype = dt,
                    .inputs = {Randn({4, 32, 15, 15}), Randn({64, 32, 3, 3}), Randn({64})},
                    .f = [](Ins in) { return conv2d_relu_max_pool2d(in[0], in[1], in[2], {}, {}); },
                    .tol = tol});
    for (const Grouped& g : grouped) {
      rows.push_back({.op = "conv2d", .attrs = ConvAttrs(g.p), .dtype = dt,
                      .inputs = {Randn(g.x), Randn(g.w), Randn({g.w[0]})},
                      .f = [p = g.p](Ins in) { return conv2d(in[0], in[1], in[2], p); }, .tol = tol});
      rows.push_back({.op = "conv2d", .attrs = ConvAttrs(g.p) + ", no bias", .dtype = dt,
                      .inputs = {Randn(g.x), Randn(g.w)},
                      .f = [p = g.p](Ins in) { return conv2d(in[0], in[1], Tensor(), p); },
                      .tol = tol});
    }
  }
}

// bfloat16 conv2d (cuDNN, float32 compute) and under autocast.
void AddBf16ConvRows(Rows& rows) {
  const std::vector<Conv2dParams> variants = {
      {},
      {.stride = {2, 2}},
      {.padding = {1, 2}},
      {.dilation = {2, 1}},
      {.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}},
  };
  for (const Conv2dParams& p : variants) {
    rows.push_back({.op = "conv2d", .attrs = ConvAttrs(p) + ", no bias", .dtype = kBFloat16,
                    .inputs = {Randn({2, 3, 9, 8}), Randn({4, 3, 3, 2})},
                    .f = [p](Ins in) { return conv2d(in[0], in[1], Tensor(), p); },
                    .tol = Bf16Magnitude()});
    rows.push_back({.op = "conv2d", .attrs = ConvAttrs(p), .dtype = kBFloat16,
                    .inputs = {Randn({2, 3, 9, 8}), Randn({4, 3, 3, 2}), Randn({4})},
                    .f = [p](Ins in) { return conv2d(in[0], in[1], in[2], p); },
                    .tol = Bf16Magnitude()});
  }
  rows.push_back({.op = "conv2d", .attrs = "64 -> 32 channels 3x3 (a longer reduction)",
                  .dtype = kBFloat16,
                  .inputs = {Randn({4, 64, 16, 16}), Randn({32, 64, 3, 3}), Randn({32})},
                  .f = [](Ins in) { return conv2d(in[0], in[1], in[2], {.padding = {1, 1}}); },
                  .tol = Bf16Magnitude()});
  rows.push_back({.op = "conv2d", .attrs = "groups 2", .dtype = kBFloat16,
                  .inputs = {Randn({2, 6, 9, 8}), Randn({4, 3, 3, 3}), Randn({4})},
                  .f = [](Ins in) {
                    return conv2d(in[0], in[1], in[2], {.padding = {1, 1}, .groups = 2});
                  },
                  .tol = Bf16Magnitude()});
  rows.push_back({.op = "conv2d", .attrs = "depthwise 32 channels 3x3 stride 2, no bias",
                  .dtype = kBFloat16, .inputs = {Randn({4, 32, 16, 16}), Randn({32, 1, 3, 3})},
                  .f = [](Ins in) {
                    return conv2d(in[0], in[1], Tensor(),
                                  {.stride = {2, 2}, .padding = {1, 1}, .groups = 32});
                  },
                  .tol = Bf16Magnitude()});
  // H = 0 with padding: every window is padding, y is the bias (cuDNN is not called).
  rows.push_back({.op = "conv2d", .attrs = "padding-only windows (H = 0)", .dtype = kBFloat16,
                  .inputs = {Randn({2, 3, 0, 4}), Randn({2, 3, 1, 1}), Randn({2})},
                  .f = [](Ins in) { return conv2d(in[0], in[1], in[2], {.padding = {1, 0}}); },
                  .tol = Exact(), .mode = Mode::kForward});
  // float32 leaves, bfloat16 output; the gradients come back in float32.
  rows.push_back({.op = "conv2d", .attrs = "stride 2 padding 1", .dtype = kFloat32,
                  .inputs = {Randn({2, 3, 10, 10}), Randn({8, 3, 3, 3}), Randn({8})},
                  .f = [](Ins in) {
                    return conv2d(in[0], in[1], in[2], {.stride = {2, 2}, .padding = {1, 1}});
                  },
                  .tol = Bf16Magnitude(), .autocast = kBFloat16});
}

void AddPoolRows(Rows& rows) {
  const std::vector<Pool2dParams> variants = {
      {}, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}, {.kernel = {2, 3}, .stride = {1, 2}}};
  for (DType dt : kFloats) {
    const Tolerance tol = Rel(dt == kFloat32 ? 1e-5 : 1e-12);
    // randn values: ties have probability ~0, so both sides pick one maximum.
    for (const Pool2dParams& p : variants) {
      rows.push_back({.op = "max_pool2d", .attrs = PoolAttrs(p), .dtype = dt,
                      .inputs = {Randn({3, 4, 9, 10})},
                      .f = [p](Ins in) { return max_pool2d(in[0], p); }, .tol = tol});
      rows.push_back({.op = "avg_pool2d", .attrs = PoolAttrs(p), .dtype = dt,
                      .inputs = {Randn({3, 4, 9, 10})},
                      .f = [p](Ins in) { return avg_pool2d(in[0], p); }, .tol = tol});
    }
  }
  // H = 0 with padding: every window is padding, y is 0 (cuDNN is not called).
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    const Pool2dParams p{.kernel = {2, 2}, .padding = {1, 0}};
    rows.push_back({.op = "max_pool2d", .attrs = "padding-only windows (H = 0)", .dtype = dt,
                    .inputs = {Randn({2, 3, 0, 4})},
                    .f = [p](Ins in) { return max_pool2d(in[0], p); }, .tol = Exact()});
    rows.push_back({.op = "avg_pool2d", .attrs = "padding-only windows (H = 0)", .dtype = dt,
                    .inputs = {Randn({2, 3, 0, 4})},
                    .f = [p](Ins in) { return avg_pool2d(in[0], p); }, .tol = Exact()});
  }
  const std::vector<Pool2dParams> bf16_variants = {
      {},
      {.kernel = {3, 3}, .stride = {1, 1}},
      {.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}},
  };
  // bfloat16: random values and values with many ties (first maximum in window order).
  for (const Pool2dParams& p : bf16_variants) {
    for (const Input& x : {Randn({2, 3, 9, 8}), Tied({2, 3, 9, 8})}) {
      const std::string values = x.fill.kind == Fill::Kind::kTied ? ", tied values" : "";
      rows.push_back({.op = "max_pool2d", .attrs = PoolAttrs(p) + values, .dtype = kBFloat16,
                      .inputs = {x}, .f = [p](Ins in) { return max_pool2d(in[0], p); },
                      .tol = Exact()});
      rows.push_back({.op = "avg_pool2d", .attrs = PoolAttrs(p) + values, .dtype = kBFloat16,
                      .inputs = {x}, .f = [p](Ins in) { return avg_pool2d(in[0], p); },
                      .tol = Exact()});
    }
  }
  const std::vector<std::pair<Shape, std::array<int64_t, 2>>> adaptive = {
      {{4, 1280, 1, 1}, {1, 1}},  // MobileNetV2 at 32x32
      {{3, 7, 6, 5}, {1, 1}},
      {{2, 3, 7, 5}, {3, 2}},
      {{2, 3, 6, 6}, {4, 4}},
      {{1, 2, 3, 4}, {5, 6}}};
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    const Tolerance tol = Rel(dt == kFloat64 ? 1e-13 : dt == kFloat32 ? 1e-6 : 1e-2);
    for (const auto& [x, out] : adaptive) {
      rows.push_back({.op = "adaptive_avg_pool2d",
                      .attrs = "output " + std::to_string(out[0]) + "x" + std::to_string(out[1]),
                      .dtype = dt, .inputs = {Randn(x)},
                      .f = [out](Ins in) { return adaptive_avg_pool2d(in[0], out); }, .tol = tol});
    }
  }
}

// A unary op's rows: its name and attrs, the op, and its input's range.
struct UnaryCase {
  std::string op, attrs;
  std::function<Tensor(const Tensor&)> f;
  double lo, hi;
};

// One row per case in `dtype`: a (33, 65) input uniform in [lo, hi), the output's
// gradient uniform in [-2, 2).
void AddUnaryRows(Rows& rows, DType dtype, Tolerance tol, const std::vector<UnaryCase>& cases) {
  const Fill grad_fill{.kind = Fill::Kind::kUniform, .lo = -2, .hi = 2};
  for (const UnaryCase& u : cases) {
    rows.push_back({.op = u.op, .attrs = u.attrs, .dtype = dtype,
                    .inputs = {Uniform({33, 65}, u.lo, u.hi)},
                    .f = [f = u.f](Ins in) { return f(in[0]); }, .tol = tol,
                    .out_grad = grad_fill});
  }
}

// relu6 and the bfloat16 elementwise family.
void AddElementwiseRows(Rows& rows) {
  // randn * 4: values on both sides of 0 and of 6, none exactly at a kink.
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    rows.push_back({.op = "relu6", .attrs = "of x * 4", .dtype = dt, .inputs = {Randn({7, 300})},
                    .f = [](Ins in) { return relu6(in[0] * 4.0); }, .tol = Exact()});
  }
  const Fill grad_fill{.kind = Fill::Kind::kUniform, .lo = -2, .hi = 2};
  AddUnaryRows(rows, kBFloat16, Ulps(2, 3), {
      {"neg", "", [](const Tensor& x) { return neg(x); }, -3, 3},
      {"add_scalar", "0.75", [](const Tensor& x) { return add_scalar(x, 0.75); }, -3, 3},
      {"mul_scalar", "0.3", [](const Tensor& x) { return mul_scalar(x, 0.3); }, -3, 3},
      {"rsub_scalar", "1.5", [](const Tensor& x) { return rsub_scalar(x, 1.5); }, -3, 3},
      {"rdiv_scalar", "2.5", [](const Tensor& x) { return rdiv_scalar(x, 2.5); }, 0.2, 4},
      {"pow_scalar", "2", [](const Tensor& x) { return pow_scalar(x, 2.0); }, -3, 3},
      {"pow_scalar", "0.5", [](const Tensor& x) { return pow_scalar(x, 0.5); }, 0.1, 9},
      {"exp", "", [](const Tensor& x) { return exp(x); }, -5, 5},
      {"log", "", [](const Tensor& x) { return log(x); }, 0.05, 20},
      {"relu", "", [](const Tensor& x) { return relu(x); }, -2, 2},
      {"sigmoid", "", [](const Tensor& x) { return sigmoid(x); }, -8, 8},
      {"tanh", "", [](const Tensor& x) { return tanh(x); }, -3, 3},
  });
  // Broadcasting pairs; the divisor stays in [0.5, 3).
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{40, 50}, {40, 50}}, {{40, 50}, {1}}, {{40, 50}, {50}},
      {{40, 1}, {1, 50}},   {{50}, {3, 40, 50}}, {{3, 40, 50}, {40, 1}}};
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&, const Tensor&)>>>
      binary = {{"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }},
                {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }},
                {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }},
                {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }}};
  for (const auto& [op, f] : binary) {
    for (const auto& [sa, sb] : shapes) {
      rows.push_back({.op = op, .attrs = ShapeToString(sa) + " with " + ShapeToString(sb),
                      .dtype = kBFloat16, .inputs = {Uniform(sa, -3, 3), Uniform(sb, 0.5, 3)},
                      .f = [f = f](Ins in) { return f(in[0], in[1]); }, .tol = Ulps(2, 3),
                      .out_grad = grad_fill});
    }
  }
}

// bfloat16: a tensor used twice, the in-place ops, sum_to.
void AddBf16AccumulationRows(Rows& rows) {
  const Fill grad_fill{.kind = Fill::Kind::kUniform, .lo = -2, .hi = 2};
  // A tensor used twice: its two bfloat16 gradients summed in bfloat16 on the device.
  rows.push_back({.op = "add", .attrs = "x * c1 + x * c2 (x used twice)", .dtype = kBFloat16,
                  .inputs = {Uniform({1000}, -3, 3), Uniform({1000}, -2, 2), Uniform({1000}, -2, 2)},
                  .f = [](Ins in) { return add(mul(in[0], in[1]), mul(in[0], in[2])); },
                  .tol = Ulps(2, 3), .out_grad = grad_fill});
  // In place, on a copy of the first input: y += 0.375 x, then y *= 1.7.
  rows.push_back({.op = "add_", .attrs = "alpha 0.375", .dtype = kBFloat16,
                  .inputs = {Uniform({1000}, -3, 3), Uniform({1000}, -3, 3)},
                  .f = [](Ins in) {
                    Tensor y = in[0].clone();
                    y.add_(in[1], 0.375);
                    return y;
                  },
                  .tol = Ulps(2, 3), .mode = Mode::kForward});
  rows.push_back({.op = "mul_", .attrs = "1.7, after add_ alpha 0.375", .dtype = kBFloat16,
                  .inputs = {Uniform({1000}, -3, 3), Uniform({1000}, -3, 3)},
                  .f = [](Ins in) {
                    Tensor y = in[0].clone();
                    y.add_(in[1], 0.375);
                    y.mul_(1.7);
                    return y;
                  },
                  .tol = Ulps(2, 3), .mode = Mode::kForward});
  // Few reduced elements (one thread per output) and many (one block per output); the
  // two sum in different orders in float32: 1e-3 absolute covers a sum near 0.
  for (const Shape& to : std::vector<Shape>{{8, 5}, {8, 1}, {300, 1, 1}, {5}, {1}}) {
    rows.push_back({.op = "sum_to", .attrs = ShapeToString(to), .dtype = kBFloat16,
                    .inputs = {Uniform({300, 8, 5}, -2, 2)},
                    .f = [to](Ins in) { return sum_to(in[0], to); }, .tol = Ulps(2, 3, 1e-3),
                    .mode = Mode::kForward});
  }
}

void AddReduceSoftmaxRows(Rows& rows) {
  const Input x = Randn({37, 300, 5});
  rows.push_back({.op = "sum", .attrs = "all", .inputs = {x},
                  .f = [](Ins in) { return sum(in[0]).reshape({1}); }, .tol = Rel(1e-4)});
  rows.push_back({.op = "mean", .attrs = "all", .inputs = {x},
                  .f = [](Ins in) { return mean(in[0]).reshape({1}); }, .tol = Rel(1e-4)});
  for (int64_t dim : {0, 1, 2}) {
    const std::string attrs = "dim " + std::to_string(dim);
    rows.push_back({.op = "sum", .attrs = attrs, .inputs = {x},
                    .f = [dim](Ins in) { return sum(in[0], dim); }, .tol = Rel(1e-4)});
    rows.push_back({.op = "mean", .attrs = attrs + " keepdim", .inputs = {x},
                    .f = [dim](Ins in) { return mean(in[0], dim, true); }, .tol = Rel(1e-4)});
    rows.push_back({.op = "argmax", .attrs = attrs, .inputs = {x},
                    .f = [dim](Ins in) { return argmax(in[0], dim); }, .tol = Exact(),
                    .mode = Mode::kForward});
  }
  // Rows of 1000 (randn * 5: large logits) and a softmax over a middle or first dim.
  rows.push_back({.op = "softmax", .attrs = "rows of 1000", .inputs = {Randn({6, 1000}, 5)},
                  .f = [](Ins in) { return softmax(in[0], 1); }, .tol = Rel(1e-5)});
  rows.push_back({.op = "log_softmax", .attrs = "rows of 1000", .inputs = {Randn({6, 1000}, 5)},
                  .f = [](Ins in) { return log_softmax(in[0], -1); }, .tol = Rel(1e-5)});
  rows.push_back({.op = "softmax", .attrs = "dim 1 of 3", .inputs = {Randn({4, 7, 3})},
                  .f = [](Ins in) { return softmax(in[0], 1); }, .tol = Rel(1e-5)});
  rows.push_back({.op = "log_softmax", .attrs = "dim 0 of 3", .inputs = {Randn({4, 7, 3})},
                  .f = [](Ins in) { return log_softmax(in[0], 0); }, .tol = Rel(1e-5)});
}

// Labels 0..9 for 64 rows (narrow) and labels at both ends of 3000 classes (wide).
Tensor NarrowLabels(Device device) {
  std::vector<int64_t> labels(64);
  for (int64_t i = 0; i < 64; ++i) labels[i] = (i * 7) % 10;
  return from_vector(labels, {64}, {.device = device});
}
Tensor WideLabels(Device device) {
  return from_vector(std::vector<int64_t>{0, 2999, 17, 1500, 3}, {5}, {.device = device});
}

void AddDropoutNormLossRows(Rows& rows) {
  // The same seed draws the same mask on both devices.
  rows.push_back({.op = "dropout", .attrs = "p 0.5", .inputs = {Randn({1000, 33})},
                  .f = [](Ins in) {
                    manual_seed(4);
                    return dropout(in[0], 0.5, true);
                  },
                  .tol = Rel(1e-6)});
  rows.push_back({.op = "dropout", .attrs = "p 0.3 (no zero inputs)", .dtype = kBFloat16,
                  .inputs = {Uniform({61, 47}, 0.5, 2)},
                  .f = [](Ins in) {
                    manual_seed(10);
                    return dropout(in[0], 0.3, true);
                  },
                  .tol = Ulps(2, 3), .out_grad = {.kind = Fill::Kind::kUniform, .lo = -2, .hi = 2}});
  // Running statistics start at 0 / 1 on each side (ops_gpu_test.cc compares their updates).
  for (DType dt : kFloats) {
    for (bool training : {true, false}) {
      rows.push_back({.op = "batch_norm2d", .attrs = training ? "training" : "eval",
                      .dtype = dt,
                      .inputs = {Randn({8, 3, 5, 7}), Randn({3}), Randn({3})},
                      .f = [training](Ins in) {
                        const TensorOptions options{.dtype = in[0].dtype(),
                                                    .device = in[0].device()};
                        Tensor mean = zeros({3}, options);
                        Tensor var = ones({3}, options);
                        return batch_norm2d(in[0], in[1], in[2], mean, var, training);
                      },
                      .tol = Rel(dt == kFloat64 ? 1e-12 : 1e-4)});
    }
  }
  for (Reduction r : {Reduction::kMean, Reduction::kNone, Reduction::kSum}) {
    const std::string name(ReductionName(r));
    auto flat = [](const Tensor& t) { return t.reshape({t.numel()}); };
    rows.push_back({.op = "cross_entropy", .attrs = name + ", 10 classes",
                    .inputs = {Randn({64, 10}, 3)},
                    .f = [r, flat](Ins in) {
                      return flat(cross_entropy(in[0], NarrowLabels(in[0].device()), r));
                    },
                    .tol = Rel(1e-5)});
    rows.push_back({.op = "cross_entropy", .attrs = name + ", 3000 classes",
                    .inputs = {Randn({5, 3000})},
                    .f = [r, flat](Ins in) {
                      return flat(cross_entropy(in[0], WideLabels(in[0].device()), r));
                    },
                    .tol = Rel(1e-5)});
    rows.push_back({.op = "mse_loss", .attrs = name, .inputs = {Randn({9, 4}), Randn({9, 4})},
                    .f = [r, flat](Ins in) { return flat(mse_loss(in[0], in[1], r)); },
                    .tol = Rel(1e-5)});
  }
  rows.push_back({.op = "accuracy", .attrs = "10 classes", .inputs = {Randn({64, 10}, 3)},
                  .f = [](Ins in) { return accuracy(in[0], NarrowLabels(in[0].device())); },
                  .tol = Exact(), .mode = Mode::kForward});
}

// The activations, clamp, abs, sqrt, maximum / minimum and the losses built on them.
// float32 / float64: the libm and CUDA erf / exp / tanh differ by ulps: Rel(1e-5) /
// Rel(1e-12); bfloat16 as the elementwise family: Ulps(2, 3).
Tolerance ActivationTol(DType dt) {
  return dt == kBFloat16 ? Ulps(2, 3) : Rel(dt == kFloat64 ? 1e-12 : 1e-5);
}

void AddActivationRows(Rows& rows) {
  const Fill grad_fill{.kind = Fill::Kind::kUniform, .lo = -2, .hi = 2};
  const std::vector<UnaryCase> unary = {
      {"abs", "", [](const Tensor& x) { return abs(x); }, -3, 3},
      {"sqrt", "", [](const Tensor& x) { return sqrt(x); }, 0.1, 9},
      {"clamp", "-1, 1", [](const Tensor& x) { return clamp(x, -1.0, 1.0); }, -3, 3},
      {"clamp", "min 0.5", [](const Tensor& x) { return clamp(x, 0.5, std::nullopt); }, -3, 3},
      {"clamp", "max -0.5", [](const Tensor& x) { return clamp(x, std::nullopt, -0.5); }, -3, 3},
      {"leaky_relu", "0.2", [](const Tensor& x) { return leaky_relu(x, 0.2); }, -3, 3},
      // Not below -3: 1 + erf (1 + tanh) cancels there, and one float ulp of erff
      // (tanhf) near -1 is many bfloat16 ulps of the small result.
      {"gelu", "", [](const Tensor& x) { return gelu(x); }, -3, 3},
      {"gelu", "tanh", [](const Tensor& x) { return gelu(x, GeluApproximate::kTanh); }, -3, 3},
      {"silu", "", [](const Tensor& x) { return silu(x); }, -8, 8},
      {"softplus", "", [](const Tensor& x) { return softplus(x); }, -20, 20},
  };
  for (DType dt : {kFloat32, kFloat64, kBFloat16}) {
    AddUnaryRows(rows, dt, ActivationTol(dt), unary);
    // Each CUDA path: same shape, b of one element, and the general broadcast (b, a or
    // both expanded; odd sizes).
    const std::vector<std::pair<Shape, Shape>> shapes = {
        {{40, 50}, {40, 50}}, {{33, 65}, {1}}, {{40, 50}, {50}}, {{40, 1}, {1, 50}},
        {{65}, {3, 33, 65}}};
    for (const auto& [sa, sb] : shapes) {
      const std::string attrs = ShapeToString(sa) + " with " + ShapeToString(sb);
      rows.push_back({.op = "maximum", .attrs = attrs, .dtype = dt,
                      .inputs = {Uniform(sa, -3, 3), Uniform(sb, -3, 3)},
                      .f = [](Ins in) { return maximum(in[0], in[1]); }, .tol = ActivationTol(dt),
                      .out_grad = grad_fill});
      rows.push_back({.op = "minimum", .attrs = attrs, .dtype = dt,
                      .inputs = {Uniform(sa, -3, 3), Uniform(sb, -3, 3)},
                      .f = [](Ins in) { return minimum(in[0], in[1]); }, .tol = ActivationTol(dt),
                      .out_grad = grad_fill});
    }
  }
}

void AddNewLossRows(Rows& rows) {
  auto flat = [](const Tensor& t) { return t.reshape({t.numel()}); };
  for (Reduction r : {Reduction::kMean, Reduction::kNone, Reduction::kSum}) {
    const std::string name(ReductionName(r));
    rows.push_back({.op = "l1_loss", .attrs = name, .inputs = {Randn({9, 4}), Randn({9, 4})},
                    .f = [r, flat](Ins in) { return flat(l1_loss(in[0], in[1], r)); },
                    .tol = Rel(1e-5)});
    rows.push_back({.op = "smooth_l1_loss", .attrs = name + ", beta 0.5",
                    .inputs = {Randn({9, 4}), Randn({9, 4})},
                    .f = [r, flat](Ins in) { return flat(smooth_l1_loss(in[0], in[1], r, 0.5)); },
                    .tol = Rel(1e-5)});
    rows.push_back({.op = "binary_cross_entropy_with_logits", .attrs = name + ", pos_weight",
                    .inputs = {Randn({9, 4}, 3), Uniform({9, 4}, 0, 1), Uniform({4}, 0.5, 3)},
                    .f = [r, flat](Ins in) {
                      return flat(binary_cross_entropy_with_logits(in[0], in[1], in[2], r));
                    },
                    .tol = Rel(1e-5)});
    rows.push_back({.op = "nll_loss", .attrs = name + ", 10 classes",
                    .inputs = {Randn({64, 10}, 3)},
                    .f = [r, flat](Ins in) {
                      return flat(nll_loss(log_softmax(in[0], 1), NarrowLabels(in[0].device()), r));
                    },
                    .tol = Rel(1e-5)});
  }
}

// cross_entropy and nll_loss with their options (CrossEntropyOptions): class weight,
// ignore_index (every fifth label -100, or class 3), label smoothing, all three;
// narrow rows (a warp per row) and 3000 classes (a block per row, smoothing's third
// pass); 2500 and 70000 rows (float32). The weight and labels are made on the row's
// device (a weight takes no gradient). Rel(1e-5) / Rel(1e-12): the same sums in
// another order.
void AddClassLossOptionRows(Rows& rows) {
  auto flat = [](const Tensor& t) { return t.reshape({t.numel()}); };
  // Every fifth label `ignored`, the others spread over the classes.
  auto labels = [](Device device, int64_t rows_n, int64_t classes, int64_t ignored) {
    std::vector<int64_t> y(static_cast<size_t>(rows_n));
    for (int64_t i = 0; i < rows_n; ++i) y[i] = i % 5 == 1 ? ignored : (i * 7919) % classes;
    return from_vector(y, {rows_n}, {.device = device});
  };
  auto weight = [](const Tensor& like, int64_t classes) {
    std::vector<double> w(static_cast<size_t>(classes));
    for (int64_t c = 0; c < classes; ++c) w[c] = 0.25 + 0.5 * static_cast<double>(c % 7);
    return from_vector(w, {classes}, {.device = like.device()}).to(like.dtype());
  };
  struct Variant {
    std::string name;
    bool weighted;
    int64_t ignore_index;
    double smoothing;
  };
  const std::vector<Variant> variants = {{"weight", true, -100, 0.0},
                                         {"ignore_index -100", false, -100, 0.0},
                                         {"label_smoothing 0.2", false, -100, 0.2},
                                         {"weight, ignore_index 3, label_smoothing 0.1", true, 3,
                                          0.1}};
  for (DType dt : kFloats) {
    const Tolerance tol = Rel(dt == kFloat64 ? 1e-12 : 1e-5);
    for (Reduction r : {Reduction::kMean, Reduction::kNone, Reduction::kSum}) {
      const std::string red(ReductionName(r));
      for (const Variant& v : variants) {
        for (int64_t classes : {int64_t{10}, int64_t{3000}}) {
          const int64_t n = classes == 10 ? 64 : 7;
          rows.push_back({.op = "cross_entropy",
                          .attrs = red + ", " + v.name + ", " + std::to_string(classes) +
                                   " classes",
                          .dtype = dt, .inputs = {Randn({n, classes}, 3)},
                          .f = [=](Ins in) {
                            CrossEntropyOptions options{.reduction = r,
                                                        .ignore_index = v.ignore_index,
                                                        .label_smoothing = v.smoothing};
                            if (v.weighted) options.weight = weight(in[0], classes);
                            const Tensor y = labels(in[0].device(), n, classes, v.ignore_index);
                            return flat(cross_entropy(in[0], y, options));
                          },
                          .tol = tol});
        }
      }
      rows.push_back({.op = "nll_loss", .attrs = red + ", weight, ignore_index -100",
                      .dtype = dt, .inputs = {Randn({64, 10}, 3)},
                      .f = [=](Ins in) {
                        const Tensor y = labels(in[0].device(), 64, 10, -100);
                        return flat(nll_loss(log_softmax(in[0], 1), y,
                                             {.reduction = r, .weight = weight(in[0], 10)}));
                      },
                      .tol = tol});
    }
  }
  // Batches past the mean kernel's one block (1024 threads: its strided loop) and
  // past the forward kernel's grid (65535 blocks: its grid-stride loop): the default
  // path (labels all in range) and a weight with every fifth label -100.
  for (int64_t n : {int64_t{2500}, int64_t{70000}}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum}) {
      const std::string attrs = std::string(ReductionName(r)) + ", " + std::to_string(n) + " rows";
      rows.push_back({.op = "cross_entropy", .attrs = attrs, .inputs = {Randn({n, 3}, 3)},
                      .f = [=](Ins in) {
                        return flat(cross_entropy(in[0], labels(in[0].device(), n, 3, 1), r));
                      },
                      .tol = Rel(1e-5)});
      rows.push_back({.op = "cross_entropy", .attrs = attrs + ", weight, ignore_index -100",
                      .inputs = {Randn({n, 3}, 3)},
                      .f = [=](Ins in) {
                        const Tensor y = labels(in[0].device(), n, 3, -100);
                        return flat(cross_entropy(in[0], y,
                                                  {.reduction = r, .weight = weight(in[0], 3)}));
                      },
                      .tol = Rel(1e-5)});
    }
  }
  rows.push_back({.op = "nll_loss", .attrs = "mean, weight, ignore_index -100, 2500 rows",
                  .inputs = {Randn({2500, 3}, 3)},
                  .f = [=](Ins in) {
                    const Tensor y = labels(in[0].device(), 2500, 3, -100);
                    return flat(nll_loss(log_softmax(in[0], 1), y, {.weight = weight(in[0], 3)}));
                  },
                  .tol = Rel(1e-5)});
  // What the rows above leave out: rows of 100 classes (128 threads a row) with
  // weight and smoothing (block 0's sum of the class weights at that width);
  // 8193 rows, one past the one-block mean (33 first-pass blocks, the last with
  // one row), and 70000 rows (past the forward grid: block 0 sums the class
  // weights, then strides over its rows), both with every option.
  for (Reduction r : {Reduction::kMean, Reduction::kNone}) {
    rows.push_back({.op = "cross_entropy",
                    .attrs = std::string(ReductionName(r)) +
                             ", weight, ignore_index -100, label_smoothing 0.2, 100 classes",
                    .inputs = {Randn({20, 100}, 3)},
                    .f = [=](Ins in) {
                      const Tensor y = labels(in[0].device(), 20, 100, -100);
                      return flat(cross_entropy(in[0], y,
                                                {.reduction = r, .weight = weight(in[0], 100),
                                                 .label_smoothing = 0.2}));
                    },
                    .tol = Rel(1e-5)});
  }
  for (int64_t n : {int64_t{8193}, int64_t{70000}}) {
    rows.push_back({.op = "cross_entropy",
                    .attrs = "mean, " + std::to_string(n) +
                             " rows, weight, ignore_index -100, label_smoothing 0.1",
                    .inputs = {Randn({n, 3}, 3)},
                    .f = [=](Ins in) {
                      const Tensor y = labels(in[0].device(), n, 3, -100);
                      return flat(cross_entropy(in[0], y,
                                                {.weight = weight(in[0], 3),
                                                 .label_smoothing = 0.1}));
                    },
                    .tol = Rel(1e-5)});
  }
}

// cat / stack: copies and an index_select gather (the backward an index_add
// without repeated indices): exact on both devices.
void AddJoinRows(Rows& rows) {
  for (DType dt : kFloats) {
    rows.push_back({.op = "cat", .attrs = "dim 0", .dtype = dt,
                    .inputs = {Randn({3, 5}), Randn({1, 5}), Randn({4, 5})},
                    .f = [](Ins in) { return cat(in, 0); }, .tol = Exact()});
    rows.push_back({.op = "cat", .attrs = "middle dim", .dtype = dt,
                    .inputs = {Randn({4, 3, 7}), Randn({4, 1, 7}), Randn({4, 2, 7})},
                    .f = [](Ins in) { return cat(in, 1); }, .tol = Exact()});
    rows.push_back({.op = "stack", .attrs = "last dim", .dtype = dt,
                    .inputs = {Randn({6, 5}), Randn({6, 5})},
                    .f = [](Ins in) { return stack(in, -1); }, .tol = Exact()});
  }
}

}  // namespace

std::vector<ParityCase> ParityCases() {
  Rows rows;
  AddMatmulRows(rows);
  AddConvRows(rows);
  AddBf16ConvRows(rows);
  AddPoolRows(rows);
  AddElementwiseRows(rows);
  AddBf16AccumulationRows(rows);
  AddReduceSoftmaxRows(rows);
  AddDropoutNormLossRows(rows);
  AddActivationRows(rows);
  AddNewLossRows(rows);
  AddClassLossOptionRows(rows);
  AddJoinRows(rows);
  // A seed from what the row is (FNV-1a of its name), not its position: adding a row
  // leaves the other rows' inputs as they were.
  for (ParityCase& row : rows) {
    const std::string name = row.op + "|" + row.attrs + "|" + DTypeName(row.dtype) +
                             (row.mode == Mode::kForward ? "|forward" : "|gradients");
    uint64_t h = 14695981039346656037ull;
    for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
    row.seed = h;
  }
  return rows;
}

}  // namespace tandem::nn::testing
