// Elementwise ops: binary arithmetic with NumPy broadcasting, ops with a scalar,
// and activations. All differentiable; float32, float64 and bfloat16. Operands
// of a binary op must share one dtype (mixed dtypes are an error naming both).
// bfloat16 runs bf16 in, bf16 out: elements are loaded as float, the math is
// float32, each output is rounded to bfloat16 once (sum_to accumulates in float32
// and rounds each sum once); gradients of bfloat16 tensors are bfloat16. These ops
// do nothing special under nn::AutocastGuard: they run in the dtype they are given.
// CPU kernels: elementwise_cpu.cc; CUDA kernels: elementwise_cuda.cu.
#ifndef TANDEM_NN_OPS_ELEMENTWISE_H_
#define TANDEM_NN_OPS_ELEMENTWISE_H_

#include <optional>

#include "nn/tensor.h"

namespace tandem::nn {

// a, b: broadcastable shapes (trailing dims equal or 1). Output: the broadcast shape.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
// The larger / smaller element of a and b (broadcasting as add; a NaN in either gives
// NaN). The gradient goes to the operand that won; at a tie it is split in half
// between a and b, as PyTorch's maximum / minimum.
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);

Tensor neg(const Tensor& x);
Tensor add_scalar(const Tensor& x, double s);  // x + s
Tensor mul_scalar(const Tensor& x, double s);  // x * s
Tensor rsub_scalar(const Tensor& x, double s); // s - x
Tensor rdiv_scalar(const Tensor& x, double s); // s / x
Tensor pow_scalar(const Tensor& x, double p);  // x^p (x > 0 unless p is a whole number)
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor abs(const Tensor& x);   // gradient sign(x): 0 at x == 0
Tensor sqrt(const Tensor& x);  // gradient 1 / (2 sqrt(x)): inf at x == 0
// x bounded to [min, max]; either bound may be absent, not both, and neither NaN.
// min > max gives max everywhere (as PyTorch). Gradient 1 where min <= x <= max.
Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max);

Tensor relu(const Tensor& x);
// min(max(x, 0), 6) (MobileNetV2's activation); gradient 1 strictly inside (0, 6).
Tensor relu6(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor tanh(const Tensor& x);
// x where x > 0, negative_slope * x elsewhere (gradient negative_slope at x == 0).
Tensor leaky_relu(const Tensor& x, double negative_slope = 0.01);
// PyTorch's gelu: kNone is x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2))); kTanh is
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (approximate="tanh").
enum class GeluApproximate { kNone, kTanh };
Tensor gelu(const Tensor& x, GeluApproximate approximate = GeluApproximate::kNone);
Tensor silu(const Tensor& x);  // x * sigmoid(x) (swish)
// log(1 + exp(x)), computed as max(x, 0) + log1p(exp(-|x|)) (no overflow); gradient
// sigmoid(x). PyTorch's softplus (beta 1) returns x itself above its threshold 20
// (gradient 1): there the two differ by less than exp(-20) ~ 2.1e-9.
Tensor softplus(const Tensor& x);

// Sums `x` down to `shape` (the reverse of broadcasting `shape` up to x's shape).
Tensor sum_to(const Tensor& x, const Shape& shape);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator+(const Tensor& x, double s) { return add_scalar(x, s); }
inline Tensor operator+(double s, const Tensor& x) { return add_scalar(x, s); }
inline Tensor operator-(const Tensor& x, double s) { return add_scalar(x, -s); }
inline Tensor operator-(double s, const Tensor& x) { return rsub_scalar(x, s); }
inline Tensor operator*(const Tensor& x, double s) { return mul_scalar(x, s); }
inline Tensor operator*(double s, const Tensor& x) { return mul_scalar(x, s); }
inline Tensor operator/(const Tensor& x, double s) { return mul_scalar(x, 1.0 / s); }
inline Tensor operator/(double s, const Tensor& x) { return rdiv_scalar(x, s); }

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_ELEMENTWISE_H_
