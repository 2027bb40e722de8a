// Matmul family: shape checks, device dispatch and autograd wiring.
#include "nn/ops/matmul.h"

#include <atomic>

#include "nn/autograd.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn {
namespace {

std::atomic<bool> g_allow_tf32{false};

// out = op(a) op(b), no autograd.
Tensor Gemm(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b) {
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  Tensor out = empty({m, n}, {.dtype = a.dtype(), .device = a.device()});
  if (out.numel() == 0) return out;
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  if (k == 0) return out.fill_(0.0);
  TANDEM_ON_DEVICE(a, ops::internal::Gemm, trans_a, trans_b, a, b, out);
  return out;
}

// db = dy summed over rows; for bfloat16 dy the sum accumulates in float32 and
// is rounded to bfloat16 once.
Tensor BiasGrad(const Tensor& dy) {
  Tensor db = empty({dy.size(1)}, {.dtype = dy.dtype(), .device = dy.device()});
  if (db.numel() == 0) return db;
  if (dy.size(0) == 0) return db.fill_(0.0);
  TANDEM_ON_DEVICE(dy, ops::internal::BiasGrad, dy, db);
  return db;
}

// g where y > 0, else 0 (relu's backward through its output).
Tensor ReluBackward(const Tensor& g, const Tensor& y) {
  Tensor out = empty_like(g);
  const auto plan = ops::internal::PlanBroadcast(g.shape(), y.shape(), "linear_relu_backward");
  TANDEM_ON_DEVICE(g, ops::internal::Binary, ops::internal::BinaryOp::kReluBackward, g, y, out,
                   plan);
  return out;
}

// float32, float64 or bfloat16 (bfloat16 products accumulate in float32).
void CheckMatmulDType(const Tensor& t, const char* op) {
  TANDEM_CHECK(IsFloating(t.dtype()), op, ": expected a float32, float64 or bfloat16 tensor, got ",
               t.ToString());
}

void CheckOperands(const Tensor& a, const Tensor& b, const char* op, const char* a_name,
                   const char* b_name) {
  CheckDefined(a, op, a_name);
  CheckDefined(b, op, b_name);
  CheckSameDevice(a, b, op);
  CheckSameDType(a, b, op);
  CheckMatmulDType(a, op);
  CheckDim(a, 2, op, a_name);
  CheckDim(b, 2, op, b_name);
}

void CheckLinear(const Tensor& x, const Tensor& weight, const Tensor& bias, const char* op) {
  CheckOperands(x, weight, op, "x", "weight");
  TANDEM_CHECK(x.size(1) == weight.size(1), op, ": x ", ShapeToString(x.shape()),
               " has ", x.size(1), " features but weight ", ShapeToString(weight.shape()),
               " expects ", weight.size(1));
  if (!bias.defined()) return;
  CheckSameDevice(x, bias, op);
  CheckSameDType(x, bias, op);
  TANDEM_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), op, ": bias must be (",
               weight.size(0), ") for weight ", ShapeToString(weight.shape()), " but is ",
               ShapeToString(bias.shape()));
}

Tensor LinearImpl(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in, bool relu,
                  const char* op) {
  // Under autocast, float32 operands become bfloat16 (differentiable casts).
  const Tensor x = ops::internal::AutocastLower(x_in);
  const Tensor weight = ops::internal::AutocastLower(weight_in);
  const Tensor bias = ops::internal::AutocastLower(bias_in);
  CheckLinear(x, weight, bias, op);
  Tensor out = empty({x.size(0), weight.size(0)}, {.dtype = x.dtype(), .device = x.device()});
  if (out.numel() > 0) {
    if (x.size(1) == 0) {
      // Empty reduction: the product is zero; bias and relu still apply.
      out.fill_(0.0);
      if (bias.defined()) {
        NoGradGuard no_grad;
        out.copy_(Gemm(false, false, ones({x.size(0), 1}, {.dtype = x.dtype(), .device = x.device()}),
                       bias.reshape({1, bias.size(0)})));
      }
      if (relu) out = ReluBackward(out, out);
    } else {
      TANDEM_ON_DEVICE(x, ops::internal::Linear, x, weight, bias, relu, out);
    }
  }
  const bool gx = x.requires_grad(), gw = weight.requires_grad();
  const bool gb = bias.defined() && bias.requires_grad();
  return autograd::Record(
      op, {x, weight, bias}, out,
      [x = x.detach(), w = weight.detach(), y = relu ? out.detach() : Tensor(), gx, gw,
       gb](const Tensor& grad) {
        const Tensor g = y.defined() ? ReluBackward(grad, y) : grad;
        return std::vector<Tensor>{gx ? Gemm(false, false, g, w) : Tensor(),   // dy W
                                   gw ? Gemm(true, false, g, x) : Tensor(),    // dy^T x
                                   gb ? BiasGrad(g) : Tensor()};
      });
}

}  // namespace

namespace ops::internal {
bool AllowTf32() { return g_allow_tf32.load(std::memory_order_relaxed); }
}  // namespace ops::internal

void set_allow_tf32(bool allow) { g_allow_tf32.store(allow, std::memory_order_relaxed); }
bool allow_tf32() { return ops::internal::AllowTf32(); }

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = ops::internal::AutocastLower(a_in);
  const Tensor b = ops::internal::AutocastLower(b_in);
  CheckOperands(a, b, "matmul", "a", "b");
  TANDEM_CHECK(a.size(1) == b.size(0), "matmul: inner sizes differ: a ", ShapeToString(a.shape()),
               " and b ", ShapeToString(b.shape()));
  Tensor out = Gemm(false, false, a, b);
  const bool ga = a.requires_grad(), gb = b.requires_grad();
  return autograd::Record("matmul", {a, b}, out,
                          [a = a.detach(), b = b.detach(), ga, gb](const Tensor& g) {
    return std::vector<Tensor>{ga ? Gemm(false, true, g, b) : Tensor(),   // dC B^T
                               gb ? Gemm(true, false, a, g) : Tensor()};  // A^T dC
  });
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return LinearImpl(x, weight, bias, /*relu=*/false, "linear");
}

Tensor linear_relu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return LinearImpl(x, weight, bias, /*relu=*/true, "linear_relu");
}

}  // namespace tandem::nn
