// Kernel interface of the elementwise family, shared by the CPU and CUDA files.
#ifndef TANDEM_NN_OPS_INTERNAL_ELEMENTWISE_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_ELEMENTWISE_KERNELS_H_

#include <cmath>
#include <type_traits>
#include <vector>

#include "nn/random.h"  // TANDEM_HOST_DEVICE
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// out = f(a, b; s0, s1). The *Backward ops take a = grad of output and b = the saved
// output (relu, relu6, sigmoid, tanh, sqrt) or the saved input (the others).
// kMaximumShare / kMinimumShare: the share of the output's gradient that goes to a
// (1 where a wins, 0.5 at a tie, 0 where b wins; a NaN operand keeps 1, as PyTorch).
enum class BinaryOp {
  kAdd, kSub, kMul, kDiv, kReluBackward, kRelu6Backward, kSigmoidBackward, kTanhBackward,
  kMaximum, kMinimum, kMaximumShare, kMinimumShare, kAbsBackward, kSqrtBackward,
  kClampBackward, kLeakyReluBackward, kGeluBackward, kGeluTanhBackward, kSiluBackward,
  kSmoothL1Backward
};
// out = f(x; s0, s1).
enum class UnaryOp {
  kAffine, kRDiv, kPow, kExp, kLog, kRelu, kRelu6, kSigmoid, kTanh,
  kAbs, kSqrt, kClamp, kLeakyRelu, kGelu, kGeluTanh, kSilu, kSoftplus, kSmoothL1
};

// How a and b index into the output: strides in elements per output dim, 0 where
// that operand is broadcast. Up to kMaxDims dims.
inline constexpr int kMaxDims = 8;
struct BroadcastPlan {
  Shape out_shape;
  int ndim = 0;
  int64_t out_sizes[kMaxDims] = {};
  int64_t a_strides[kMaxDims] = {};
  int64_t b_strides[kMaxDims] = {};
  bool same_shape = false;  // a, b and out all have one shape: no index arithmetic
};
// Throws an error naming `op` and both shapes when they do not broadcast.
BroadcastPlan PlanBroadcast(const Shape& a, const Shape& b, const char* op);

// Math functions that name the C function for each type, so they compile on
// host and device alike (and never find tandem::nn's tensor ops of the same name).
template <typename T> TANDEM_HOST_DEVICE T MathExp(T x) {
  if constexpr (sizeof(T) == 4) { return ::expf(x); } else { return ::exp(x); }
}
template <typename T> TANDEM_HOST_DEVICE T MathLog(T x) {
  if constexpr (sizeof(T) == 4) { return ::logf(x); } else { return ::log(x); }
}
template <typename T> TANDEM_HOST_DEVICE T MathPow(T x, T p) {
  if constexpr (sizeof(T) == 4) { return ::powf(x, p); } else { return ::pow(x, p); }
}
template <typename T> TANDEM_HOST_DEVICE T MathTanh(T x) {
  if constexpr (sizeof(T) == 4) { return ::tanhf(x); } else { return ::tanh(x); }
}
template <typename T> TANDEM_HOST_DEVICE T MathSqrt(T x) {
  if constexpr (sizeof(T) == 4) { return ::sqrtf(x); } else { return ::sqrt(x); }
}
template <typename T> TANDEM_HOST_DEVICE T MathAbs(T x) {
  if constexpr (sizeof(T) == 4) { return ::fabsf(x); } else { return ::fabs(x); }
}
template <typename T> TANDEM_HOST_DEVICE T MathErf(T x) {
  if constexpr (sizeof(T) == 4) { return ::erff(x); } else { return ::erf(x); }
}
template <typename T> TANDEM_HOST_DEVICE T MathLog1p(T x) {
  if constexpr (sizeof(T) == 4) { return ::log1pf(x); } else { return ::log1p(x); }
}

// PyTorch's gelu constants: 1/sqrt(2), 1/sqrt(2 pi), sqrt(2/pi) and the tanh form's cubic term.
inline constexpr double kGeluSqrtHalf = 0.70710678118654752440;
inline constexpr double kGeluInvSqrt2Pi = 0.39894228040143267794;
inline constexpr double kGeluSqrt2OverPi = 0.79788456080286535588;
inline constexpr double kGeluKappa = 0.044715;

// gelu, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) and its derivative,
// written as PyTorch's GeluBackward (tanh) writes it.
template <typename T>
TANDEM_HOST_DEVICE T GeluTanhGrad(T x) {
  const T inner = T(kGeluSqrt2OverPi) * (x + T(kGeluKappa) * x * x * x);
  const T t = MathTanh(inner);
  const T left_derivative = T(0.5) * (T(1) + t);
  const T right_derivative = T(0.5) * x * (T(1) - t * t) * T(kGeluSqrt2OverPi) *
                             (T(1) + T(3) * T(kGeluKappa) * x * x);
  return left_derivative + right_derivative;
}

template <typename T>
TANDEM_HOST_DEVICE T ApplyBinary(BinaryOp op, T a, T b, T s0 = T(0), T s1 = T(0)) {
  switch (op) {
    case BinaryOp::kAdd: return a + b;
    case BinaryOp::kSub: return a - b;
    case BinaryOp::kMul: return a * b;
    case BinaryOp::kDiv: return a / b;
    case BinaryOp::kReluBackward: return b > T(0) ? a : T(0);
    case BinaryOp::kSigmoidBackward: return a * b * (T(1) - b);
    case BinaryOp::kTanhBackward: return a * (T(1) - b * b);
    // Saved output strictly inside (0, 6) <=> input inside (0, 6).
    case BinaryOp::kRelu6Backward: return b > T(0) && b < T(6) ? a : T(0);
    // The larger (smaller) value; a NaN in either operand gives NaN.
    case BinaryOp::kMaximum: return (a > b || a != a) ? a : b;
    case BinaryOp::kMinimum: return (a < b || a != a) ? a : b;
    case BinaryOp::kMaximumShare: return a < b ? T(0) : (a == b ? T(0.5) : T(1));
    case BinaryOp::kMinimumShare: return a > b ? T(0) : (a == b ? T(0.5) : T(1));
    // sign(x) * g, 0 at x == 0 (PyTorch's sgn).
    case BinaryOp::kAbsBackward: return b > T(0) ? a : (b < T(0) ? -a : T(0));
    case BinaryOp::kSqrtBackward: return a / (T(2) * b);
    // g where s0 <= x <= s1 (bounds included, as PyTorch's clamp_backward).
    case BinaryOp::kClampBackward: return b >= s0 && b <= s1 ? a : T(0);
    case BinaryOp::kLeakyReluBackward: return b > T(0) ? a : a * s0;
    case BinaryOp::kGeluBackward: {
      const T cdf = T(0.5) * (T(1) + MathErf(b * T(kGeluSqrtHalf)));
      const T pdf = T(kGeluInvSqrt2Pi) * MathExp(T(-0.5) * b * b);
      return a * (cdf + b * pdf);
    }
    case BinaryOp::kGeluTanhBackward: return a * GeluTanhGrad(b);
    case BinaryOp::kSiluBackward: {
      const T sig = T(1) / (T(1) + MathExp(-b));
      return a * sig * (T(1) + b * (T(1) - sig));
    }
    // b = pred - target; s0 = beta: g * d / beta inside |d| < beta, g * sign(d) outside.
    case BinaryOp::kSmoothL1Backward:
      return MathAbs(b) < s0 ? a * b / s0 : (b > T(0) ? a : (b < T(0) ? -a : T(0)));
  }
  return T(0);
}


// kAffine: s0 * x + s1; kRDiv: s0 / x; kPow: x^s0; kClamp: x bounded to [s0, s1]
// (a NaN x stays NaN; s0 > s1 gives s1 everywhere, as PyTorch); kLeakyRelu: slope s0;
// kSoftplus: log(1 + exp(x)) without overflow; kSmoothL1: beta s0 (> 0).
// ApplyBinary / ApplyUnary run on the compute type (float or double); a bfloat16
// kernel loads its operands as float and stores the float result rounded once.
template <typename T>
TANDEM_HOST_DEVICE T ApplyUnary(UnaryOp op, T x, T s0, T s1) {
  switch (op) {
    case UnaryOp::kAffine: return s0 * x + s1;
    case UnaryOp::kRDiv: return s0 / x;
    case UnaryOp::kPow: return MathPow(x, s0);
    case UnaryOp::kExp: return MathExp(x);
    case UnaryOp::kLog: return MathLog(x);
    case UnaryOp::kRelu: return x > T(0) ? x : T(0);
    case UnaryOp::kRelu6: return x > T(0) ? (x < T(6) ? x : T(6)) : T(0);
    case UnaryOp::kSigmoid: return T(1) / (T(1) + MathExp(-x));
    case UnaryOp::kTanh: return MathTanh(x);
    case UnaryOp::kAbs: return MathAbs(x);
    case UnaryOp::kSqrt: return MathSqrt(x);
    case UnaryOp::kClamp: {
      const T lo = x < s0 ? s0 : x;
      return lo > s1 ? s1 : lo;
    }
    case UnaryOp::kLeakyRelu: return x > T(0) ? x : x * s0;
    case UnaryOp::kGelu: return T(0.5) * x * (T(1) + MathErf(x * T(kGeluSqrtHalf)));
    case UnaryOp::kGeluTanh:
      return T(0.5) * x *
             (T(1) + MathTanh(T(kGeluSqrt2OverPi) * (x + T(kGeluKappa) * x * x * x)));
    case UnaryOp::kSilu: return x / (T(1) + MathExp(-x));
    case UnaryOp::kSoftplus: return (x > T(0) ? x : T(0)) + MathLog1p(MathExp(-MathAbs(x)));
    case UnaryOp::kSmoothL1: {
      const T d = MathAbs(x);
      return d < s0 ? T(0.5) * x * x / s0 : d - T(0.5) * s0;
    }
  }
  return T(0);
}

// Host side of bfloat16 storage with float arithmetic: Compute<T> is the type
// the math runs in (float for BFloat16, T itself otherwise); Load widens an element,
// Store<T> narrows a result (round to nearest even for BFloat16). For float and
// double both are the identity, so those loops compile as before.
template <typename T>
using Compute = std::conditional_t<std::is_same_v<T, BFloat16>, float, T>;
template <typename T>
inline Compute<T> Load(T v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return static_cast<float>(v);
  } else {
    return v;
  }
}
template <typename T>
inline T Store(Compute<T> v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16(v);
  } else {
    return v;
  }
}

// s0, s1: the op's scalars (clamp's bounds, leaky_relu's slope, smooth_l1's beta).
void BinaryCpu(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
               const BroadcastPlan& plan, double s0 = 0, double s1 = 0);
void UnaryCpu(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1);
// out (shape broadcastable to x) = x summed over the broadcast dims.
void SumToCpu(const Tensor& x, const Tensor& out);
#if TANDEM_WITH_CUDA
void BinaryCuda(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
                const BroadcastPlan& plan, double s0 = 0, double s1 = 0);
void UnaryCuda(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1);
void SumToCuda(const Tensor& x, const Tensor& out);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_ELEMENTWISE_KERNELS_H_
