// Elementwise ops: shape checks, device dispatch and autograd wiring.
#include "nn/ops/elementwise.h"

#include <cmath>
#include <limits>

#include "nn/autograd.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/elementwise_kernels.h"

namespace tandem::nn {
namespace {

using ops::internal::BinaryOp;
using ops::internal::UnaryOp;

// These ops have bfloat16 kernels (float arithmetic, one rounding per output),
// so they take all three floating dtypes, unlike nn's CheckFloating.
void CheckFloatingOrBFloat16(const Tensor& t, const char* op) {
  TANDEM_CHECK(IsFloating(t.dtype()), op,
               ": expected a float32, float64 or bfloat16 tensor, got ", t.ToString());
}

Tensor Binary(BinaryOp op, const Tensor& a, const Tensor& b, const char* name, double s0 = 0,
              double s1 = 0) {
  CheckDefined(a, name, "a");
  CheckDefined(b, name, "b");
  CheckSameDevice(a, b, name);
  CheckSameDType(a, b, name);
  CheckFloatingOrBFloat16(a, name);
  const auto plan = ops::internal::PlanBroadcast(a.shape(), b.shape(), name);
  Tensor out = empty(plan.out_shape, {.dtype = a.dtype(), .device = a.device()});
  TANDEM_ON_DEVICE(a, ops::internal::Binary, op, a, b, out, plan, s0, s1);
  return out;
}

Tensor Unary(UnaryOp op, const Tensor& x, const char* name, double s0 = 0, double s1 = 0) {
  CheckDefined(x, name, "x");
  CheckFloatingOrBFloat16(x, name);
  Tensor out = empty_like(x);
  TANDEM_ON_DEVICE(x, ops::internal::Unary, op, x, out, s0, s1);
  return out;
}

// maximum / minimum: the output's gradient times the share of each operand, summed
// back to the operand's shape.
Tensor Extremum(BinaryOp op, BinaryOp share, const Tensor& a, const Tensor& b, const char* name) {
  Tensor out = Binary(op, a, b, name);
  const bool ga = a.requires_grad(), gb = b.requires_grad();
  return autograd::Record(name, {a, b}, out,
                          [a = a.detach(), b = b.detach(), ga, gb, share](const Tensor& g) {
    Tensor da, db;
    if (ga) da = sum_to(mul(g, Binary(share, a, b, "extremum_backward")), a.shape());
    if (gb) db = sum_to(mul(g, Binary(share, b, a, "extremum_backward")), b.shape());
    return std::vector<Tensor>{da, db};
  });
}

}  // namespace

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  ops::internal::PlanBroadcast(shape, x.shape(), "sum_to");  // checks compatibility
  Tensor out = empty(shape, {.dtype = x.dtype(), .device = x.device()});
  TANDEM_ON_DEVICE(x, ops::internal::SumTo, x, out);
  TANDEM_CHECK(NumElements(shape) <= x.numel(), "sum_to: ", ShapeToString(shape),
               " is larger than ", ShapeToString(x.shape()));
  const Shape in_shape = x.shape();
  return autograd::Record("sum_to", {x}, out, [in_shape](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kAdd, zeros(in_shape, {.dtype = g.dtype(), .device = g.device()}), g, "sum_to_backward")};
  });
}

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = Binary(BinaryOp::kAdd, a, b, "add");
  return autograd::Record("add", {a, b}, out, [sa = a.shape(), sb = b.shape()](const Tensor& g) {
    return std::vector<Tensor>{sum_to(g, sa), sum_to(g, sb)};
  });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = Binary(BinaryOp::kSub, a, b, "sub");
  return autograd::Record("sub", {a, b}, out, [sa = a.shape(), sb = b.shape()](const Tensor& g) {
    return std::vector<Tensor>{sum_to(g, sa), sum_to(neg(g), sb)};
  });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = Binary(BinaryOp::kMul, a, b, "mul");
  const bool ga = a.requires_grad(), gb = b.requires_grad();
  return autograd::Record("mul", {a, b}, out,
                          [a = a.detach(), b = b.detach(), ga, gb](const Tensor& g) {
    return std::vector<Tensor>{ga ? sum_to(mul(g, b), a.shape()) : Tensor(),
                               gb ? sum_to(mul(g, a), b.shape()) : Tensor()};
  });
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = Binary(BinaryOp::kDiv, a, b, "div");
  const bool ga = a.requires_grad(), gb = b.requires_grad();
  return autograd::Record("div", {a, b}, out,
                          [a = a.detach(), b = b.detach(), ga, gb](const Tensor& g) {
    // d(a/b)/da = 1/b; d(a/b)/db = -a/b^2.
    Tensor ga_t = ga ? sum_to(div(g, b), a.shape()) : Tensor();
    Tensor gb_t = gb ? sum_to(neg(div(mul(g, a), mul(b, b))), b.shape()) : Tensor();
    return std::vector<Tensor>{ga_t, gb_t};
  });
}

Tensor neg(const Tensor& x) { return mul_scalar(x, -1.0); }

Tensor add_scalar(const Tensor& x, double s) {
  Tensor out = Unary(UnaryOp::kAffine, x, "add_scalar", 1.0, s);
  return autograd::Record("add_scalar", {x}, out, [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

Tensor mul_scalar(const Tensor& x, double s) {
  Tensor out = Unary(UnaryOp::kAffine, x, "mul_scalar", s, 0.0);
  return autograd::Record("mul_scalar", {x}, out,
                          [s](const Tensor& g) { return std::vector<Tensor>{mul_scalar(g, s)}; });
}

Tensor rsub_scalar(const Tensor& x, double s) {
  Tensor out = Unary(UnaryOp::kAffine, x, "rsub_scalar", -1.0, s);
  return autograd::Record("rsub_scalar", {x}, out,
                          [](const Tensor& g) { return std::vector<Tensor>{neg(g)}; });
}

Tensor rdiv_scalar(const Tensor& x, double s) {
  Tensor out = Unary(UnaryOp::kRDiv, x, "rdiv_scalar", s);
  return autograd::Record("rdiv_scalar", {x}, out, [x = x.detach(), s](const Tensor& g) {
    // d(s/x)/dx = -s / x^2
    return std::vector<Tensor>{mul(g, rdiv_scalar(mul(x, x), -s))};
  });
}

Tensor pow_scalar(const Tensor& x, double p) {
  Tensor out = Unary(UnaryOp::kPow, x, "pow_scalar", p);
  return autograd::Record("pow_scalar", {x}, out, [x = x.detach(), p](const Tensor& g) {
    return std::vector<Tensor>{mul(g, mul_scalar(pow_scalar(x, p - 1), p))};
  });
}

Tensor exp(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kExp, x, "exp");
  return autograd::Record("exp", {x}, out, [y = out.detach()](const Tensor& g) {
    return std::vector<Tensor>{mul(g, y)};
  });
}

Tensor log(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kLog, x, "log");
  return autograd::Record("log", {x}, out, [x = x.detach()](const Tensor& g) {
    return std::vector<Tensor>{div(g, x)};
  });
}

Tensor relu(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kRelu, x, "relu");
  return autograd::Record("relu", {x}, out, [y = out.detach()](const Tensor& g) {
    // At x == 0 the subgradient 0 is used (as PyTorch does).
    return std::vector<Tensor>{Binary(BinaryOp::kReluBackward, g, y, "relu_backward")};
  });
}

Tensor relu6(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kRelu6, x, "relu6");
  return autograd::Record("relu6", {x}, out, [y = out.detach()](const Tensor& g) {
    // At x == 0 and x == 6 the subgradient 0 is used (as PyTorch's hardtanh).
    return std::vector<Tensor>{Binary(BinaryOp::kRelu6Backward, g, y, "relu6_backward")};
  });
}

Tensor sigmoid(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kSigmoid, x, "sigmoid");
  return autograd::Record("sigmoid", {x}, out, [y = out.detach()](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kSigmoidBackward, g, y, "sigmoid_backward")};
  });
}

Tensor tanh(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kTanh, x, "tanh");
  return autograd::Record("tanh", {x}, out, [y = out.detach()](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kTanhBackward, g, y, "tanh_backward")};
  });
}

Tensor maximum(const Tensor& a, const Tensor& b) {
  return Extremum(BinaryOp::kMaximum, BinaryOp::kMaximumShare, a, b, "maximum");
}

Tensor minimum(const Tensor& a, const Tensor& b) {
  return Extremum(BinaryOp::kMinimum, BinaryOp::kMinimumShare, a, b, "minimum");
}

Tensor abs(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kAbs, x, "abs");
  return autograd::Record("abs", {x}, out, [x = x.detach()](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kAbsBackward, g, x, "abs_backward")};
  });
}

Tensor sqrt(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kSqrt, x, "sqrt");
  return autograd::Record("sqrt", {x}, out, [y = out.detach()](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kSqrtBackward, g, y, "sqrt_backward")};
  });
}

Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max) {
  TANDEM_CHECK(min.has_value() || max.has_value(),
               "clamp: at least one of min and max must be given");
  TANDEM_CHECK(!(min && std::isnan(*min)) && !(max && std::isnan(*max)), "clamp: bounds min ",
               min ? *min : -HUGE_VAL, " and max ", max ? *max : HUGE_VAL, " include NaN");
  const double lo = min.value_or(-std::numeric_limits<double>::infinity());
  const double hi = max.value_or(std::numeric_limits<double>::infinity());
  Tensor out = Unary(UnaryOp::kClamp, x, "clamp", lo, hi);
  return autograd::Record("clamp", {x}, out, [x = x.detach(), lo, hi](const Tensor& g) {
    return std::vector<Tensor>{
        Binary(BinaryOp::kClampBackward, g, x, "clamp_backward", lo, hi)};
  });
}

Tensor leaky_relu(const Tensor& x, double negative_slope) {
  TANDEM_CHECK(std::isfinite(negative_slope), "leaky_relu: negative_slope ", negative_slope,
               " is not finite");
  Tensor out = Unary(UnaryOp::kLeakyRelu, x, "leaky_relu", negative_slope);
  return autograd::Record("leaky_relu", {x}, out,
                          [x = x.detach(), negative_slope](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kLeakyReluBackward, g, x,
                                        "leaky_relu_backward", negative_slope)};
  });
}

Tensor gelu(const Tensor& x, GeluApproximate approximate) {
  TANDEM_CHECK(approximate == GeluApproximate::kNone || approximate == GeluApproximate::kTanh,
               "gelu: unknown approximate ", static_cast<int>(approximate),
               " (expected kNone or kTanh)");
  const bool tanh_form = approximate == GeluApproximate::kTanh;
  Tensor out = Unary(tanh_form ? UnaryOp::kGeluTanh : UnaryOp::kGelu, x, "gelu");
  return autograd::Record("gelu", {x}, out, [x = x.detach(), tanh_form](const Tensor& g) {
    const BinaryOp op = tanh_form ? BinaryOp::kGeluTanhBackward : BinaryOp::kGeluBackward;
    return std::vector<Tensor>{Binary(op, g, x, "gelu_backward")};
  });
}

Tensor silu(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kSilu, x, "silu");
  return autograd::Record("silu", {x}, out, [x = x.detach()](const Tensor& g) {
    return std::vector<Tensor>{Binary(BinaryOp::kSiluBackward, g, x, "silu_backward")};
  });
}

Tensor softplus(const Tensor& x) {
  Tensor out = Unary(UnaryOp::kSoftplus, x, "softplus");
  return autograd::Record("softplus", {x}, out, [x = x.detach()](const Tensor& g) {
    // d/dx log(1 + exp(x)) = sigmoid(x): the saved input through sigmoid's kernel.
    return std::vector<Tensor>{mul(g, sigmoid(x))};
  });
}

}  // namespace tandem::nn
