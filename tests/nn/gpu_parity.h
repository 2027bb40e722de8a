// The CPU/CUDA parity table of the ops (the style of ggml's test-backend-ops): one
// ParityCase per row (op, input shapes and fills, dtype, tolerance, forward only or
// with gradients, the op's attributes bound in `f`), gpu_parity_cases.cc lists the
// rows, gpu_parity_test.cc runs every row on every visible CUDA device against
// the CPU. Adding an op to the suite is one row in gpu_parity_cases.cc.
//
// The comparison helpers here are shared with ops_gpu_test.cc (the CUDA op
// checks that are not a row: masks, running statistics, determinism).
#ifndef TANDEM_TESTS_NN_GPU_PARITY_H_
#define TANDEM_TESTS_NN_GPU_PARITY_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "nn/ops/elementwise.h"
#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::nn::testing {

// How a row fills an input or its output gradient, on the CPU, from the row's seed.
struct Fill {
  enum class Kind {
    kRandn,    // standard normal times `scale` (bfloat16: drawn in float32, rounded)
    kUniform,  // uniform in [lo, hi) (drawn in float64, rounded to the dtype)
    kTied,     // the values 0, 1, 2 in a fixed pattern: max-pool windows with ties
  };
  Kind kind = Kind::kRandn;
  double scale = 1;
  double lo = 0, hi = 0;
};

struct Input {
  Shape shape;
  Fill fill;
};

inline Input Randn(Shape shape, double scale = 1) {
  return {std::move(shape), {.kind = Fill::Kind::kRandn, .scale = scale}};
}
inline Input Uniform(Shape shape, double lo, double hi) {
  return {std::move(shape), {.kind = Fill::Kind::kUniform, .lo = lo, .hi = hi}};
}
inline Input Tied(Shape shape) { return {std::move(shape), {.kind = Fill::Kind::kTied}}; }

// How far the CUDA value g may be from the CPU value c.
struct Tolerance {
  enum class Kind {
    kRelative,       // |g - c| <= rel * (1 + |c|) + magnitude * a; rel 0: equal values
    kBf16Ulps,       // |g - c| <= ulps * (bfloat16 spacing at c) + slack
    kBf16Magnitude,  // |g - c| <= |c| / 128 + a / 256 (see Bf16Magnitude)
  };
  Kind kind = Kind::kRelative;
  double rel = 0;
  // kRelative: a multiple of a, the element's magnitude sum (the op computed in
  // float64 on |inputs| and |output gradient|, see Bf16Magnitude). A sum of many
  // terms that cancel to a small value carries rounding of the order of its terms,
  // not of its result; 0: no such term.
  double magnitude = 0;
  double output_ulps = 0, grad_ulps = 0, slack = 0;

  bool needs_magnitude() const { return kind == Kind::kBf16Magnitude || magnitude > 0; }
};

inline Tolerance Rel(double rel, double magnitude = 0) {
  return {.kind = Tolerance::Kind::kRelative, .rel = rel, .magnitude = magnitude};
}
inline Tolerance Exact() { return Rel(0); }
// Outputs within `output_ulps` bfloat16 ulps, gradients within `grad_ulps`.
inline Tolerance Ulps(double output_ulps, double grad_ulps, double slack = 0) {
  return {.kind = Tolerance::Kind::kBf16Ulps, .output_ulps = output_ulps, .grad_ulps = grad_ulps,
          .slack = slack};
}
// Both devices round a float32 result to bfloat16, so they may differ by two
// bfloat16 ulps (2^-7 relative) plus what float32 accumulation in another order
// moves: at most half an ulp of the magnitude sum, 2^-8 a, where a is the same
// value computed in float64 on |inputs| and |output gradient|.
inline Tolerance Bf16Magnitude() { return {.kind = Tolerance::Kind::kBf16Magnitude}; }

enum class Mode { kForward, kGradients };

struct ParityCase {
  std::string op;     // the op's name, the first part of the test's name
  std::string attrs;  // the op's attributes and what the row is about, for messages
  DType dtype = kFloat32;      // of every input
  std::vector<Input> inputs;   // CPU leaves; a CUDA copy of each for the other side
  std::function<Tensor(const std::vector<Tensor>&)> f;  // the op, attributes bound
  Tolerance tol;
  // kGradients: every input requires grad; one output gradient (out_grad, in the
  // output's dtype) is backpropagated on both devices and every input's gradient
  // compared too.
  Mode mode = Mode::kGradients;
  Fill out_grad;
  std::optional<DType> autocast;  // f runs under AutocastGuard(*autocast) on both devices
  bool tf32 = false;              // TF32 allowed in CUDA GEMMs while f runs on the GPU
  uint64_t seed = 0;              // set by ParityCases() from the row's name
};

// Every row (gpu_parity_cases.cc).
std::vector<ParityCase> ParityCases();

// A CPU tensor of `shape` in `dtype` filled as `fill` says, from the calling
// thread's generator.
inline Tensor Filled(const Shape& shape, const Fill& fill, DType dtype) {
  const TensorOptions cpu64{.dtype = kFloat64, .device = Device::CPU()};
  switch (fill.kind) {
    case Fill::Kind::kRandn: {
      const DType drawn = dtype == kBFloat16 ? kFloat32 : dtype;  // randn has no bfloat16
      Tensor t = randn(shape, {.dtype = drawn, .device = Device::CPU()});
      if (fill.scale != 1) t.mul_(fill.scale);
      return t.to(dtype);
    }
    case Fill::Kind::kUniform: {
      Tensor u = rand(shape, cpu64);
      return add_scalar(mul_scalar(u, fill.hi - fill.lo), fill.lo).to(dtype).detach();
    }
    case Fill::Kind::kTied: {
      int64_t numel = 1;
      for (int64_t d : shape) numel *= d;
      std::vector<double> v(static_cast<size_t>(numel));
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((i * 7 + i / 5) % 3);
      return from_vector(v, shape, cpu64).to(dtype);
    }
  }
  return Tensor();
}

// The spacing of bfloat16 values at |v|.
inline double Bf16Ulp(double v) {
  v = std::fabs(v);
  if (v < std::ldexp(1.0, -126)) return std::ldexp(1.0, -133);
  int e;
  std::frexp(v, &e);
  return std::ldexp(1.0, e - 8);
}

// The CUDA tensor `gpu` against the CPU tensor `cpu` under `tol` (`grad`: a
// gradient, for the ulp budgets; `abs_ref`: the float64 magnitude reference, for
// tolerances with one, Tolerance::needs_magnitude). Stops at the first element out of bounds.
inline void ExpectClose(const Tensor& cpu, const Tensor& gpu, const Tolerance& tol, bool grad,
                        const Tensor& abs_ref, const std::string& what) {
  ASSERT_TRUE(cpu.defined()) << what << ": undefined on the CPU";
  ASSERT_TRUE(gpu.defined()) << what << ": undefined on CUDA";
  ASSERT_TRUE(gpu.is_cuda()) << what << ": on " << gpu.device().ToString();
  ASSERT_EQ(cpu.dtype(), gpu.dtype()) << what;
  ASSERT_EQ(cpu.shape(), gpu.shape()) << what;
  const std::vector<double> c = cpu.to_vector<double>(), g = gpu.to_vector<double>();
  std::vector<double> a;
  if (tol.needs_magnitude()) {
    ASSERT_TRUE(abs_ref.defined()) << what << ": no magnitude reference";
    ASSERT_EQ(abs_ref.shape(), cpu.shape()) << what;
    a = abs_ref.to_vector<double>();
  }
  for (size_t i = 0; i < c.size(); ++i) {
    double bound = 0;
    switch (tol.kind) {
      case Tolerance::Kind::kRelative:
        bound = tol.rel * (1.0 + std::fabs(c[i])) + (a.empty() ? 0.0 : tol.magnitude * a[i]);
        break;
      case Tolerance::Kind::kBf16Ulps:
        bound = (grad ? tol.grad_ulps : tol.output_ulps) * Bf16Ulp(c[i]) + tol.slack;
        break;
      case Tolerance::Kind::kBf16Magnitude: bound = std::fabs(c[i]) / 128 + a[i] / 256; break;
    }
    ASSERT_LE(std::fabs(g[i] - c[i]), bound)
        << what << " element " << i << ": cpu " << c[i] << ", cuda " << g[i]
        << (a.empty() ? "" : ", magnitude sum " + std::to_string(a[i]));
  }
}

}  // namespace tandem::nn::testing

#endif  // TANDEM_TESTS_NN_GPU_PARITY_H_
