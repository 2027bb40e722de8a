// Kernel interface of the elementwise family, shared by the CPU and CUDA files.
#ifndef TANDEM_NN_OPS_INTERNAL_ELEMENTWISE_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_ELEMENTWISE_KERNELS_H_

#include <cmath>
#include <type_traits>
#include <vector>

#include "nn/random.h"  // TANDEM_HOST_DEVICE
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// out = f(a, b). The *Backward ops take (a = grad of output, b = saved output).
enum class BinaryOp {
  kAdd, kSub, kMul, kDiv, kReluBackward, kRelu6Backward, kSigmoidBackward, kTanhBackward
};
// out = f(x; s).
enum class UnaryOp { kAffine, kRDiv, kPow, kExp, kLog, kRelu, kRelu6, kSigmoid, kTanh };

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

template <typename T>
TANDEM_HOST_DEVICE T ApplyBinary(BinaryOp op, T a, T b) {
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
  }
  return T(0);
}

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

// kAffine: s0 * x + s1; kRDiv: s0 / x; kPow: x^s0.
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

void BinaryCpu(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
               const BroadcastPlan& plan);
void UnaryCpu(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1);
// out (shape broadcastable to x) = x summed over the broadcast dims.
void SumToCpu(const Tensor& x, const Tensor& out);
#if TANDEM_WITH_CUDA
void BinaryCuda(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
                const BroadcastPlan& plan);
void UnaryCuda(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1);
void SumToCuda(const Tensor& x, const Tensor& out);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_ELEMENTWISE_KERNELS_H_
