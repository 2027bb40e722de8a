// CPU kernels of the elementwise family.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"

#include "nn/ops/internal/cpu_parallel.h"
#include "nn/ops/internal/elementwise_kernels.h"

namespace tandem::nn::ops::internal {

BroadcastPlan PlanBroadcast(const Shape& a, const Shape& b, const char* op) {
  BroadcastPlan plan;
  const int ndim = static_cast<int>(std::max(a.size(), b.size()));
  TANDEM_CHECK(ndim <= kMaxDims, op, ": at most ", kMaxDims, " dims, got ", ShapeToString(a),
               " and ", ShapeToString(b));
  plan.ndim = ndim;
  plan.out_shape.resize(ndim);
  int64_t a_stride = 1, b_stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    const int ia = i - (ndim - static_cast<int>(a.size()));
    const int ib = i - (ndim - static_cast<int>(b.size()));
    const int64_t da = ia >= 0 ? a[ia] : 1;
    const int64_t db = ib >= 0 ? b[ib] : 1;
    TANDEM_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", ShapeToString(a), " and ",
                 ShapeToString(b), " do not broadcast (dim ", i, ": ", da, " vs ", db, ")");
    const int64_t d = da == 1 ? db : da;
    plan.out_shape[i] = d;
    plan.out_sizes[i] = d;
    plan.a_strides[i] = da == 1 ? 0 : a_stride;
    plan.b_strides[i] = db == 1 ? 0 : b_stride;
    a_stride *= da;
    b_stride *= db;
  }
  plan.same_shape = a == b;
  return plan;
}

namespace {
// Elements per thread at the least before a map splits over the kernel threads
// (ParallelFor; a map's bits do not depend on the split): below this the
// OpenMP fork and join costs more than the second core gives.
constexpr int64_t kMinPerThread = int64_t{1} << 15;

// The op a compile-time constant, as UnaryLoop below: no switch per element, so
// the loops vectorise (relu's backward select becomes a mask instead of a
// branch that random data mispredicts). Each element gets the same operations
// as before, so results are unchanged. b_step: 1 for same-shape operands, 0 for
// a one-element b. No __restrict: out may alias an operand (the compiler checks
// for overlap before its vector loop).
template <BinaryOp kOp, typename T>
void BinaryRange(const T* pa, const T* pb, int64_t b_step, T* po, int64_t n) {
  if (b_step == 0) {
    const Compute<T> vb = Load(pb[0]);
    for (int64_t i = 0; i < n; ++i) po[i] = Store<T>(ApplyBinary(kOp, Load(pa[i]), vb));
  } else {
    for (int64_t i = 0; i < n; ++i) po[i] = Store<T>(ApplyBinary(kOp, Load(pa[i]), Load(pb[i])));
  }
}

// relu's backward on bfloat16 (conv2d_relu's mask under autocast), on the bits:
// b > 0 is b in [0x0001, 0x7f80] (positive, nonzero, not NaN; +inf included),
// then a as Store would give it (exact; a NaN quietened) or +0. The same bits as
// the float32 route above, in integer lanes the compiler vectorises.
template <>
void BinaryRange<BinaryOp::kReluBackward, BFloat16>(const BFloat16* pa, const BFloat16* pb,
                                                    int64_t b_step, BFloat16* po, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t a = pa[i].bits, b = pb[i * b_step].bits;
    const bool nan = (a & 0x7f80u) == 0x7f80u && (a & 0x007fu) != 0;
    const uint16_t kept = nan ? static_cast<uint16_t>(a | 0x0040u) : a;
    po[i].bits = static_cast<uint16_t>(b - 1u) < 0x7f80u ? kept : uint16_t{0};
  }
}

template <BinaryOp kOp, typename T>
void BinaryLoop(const T* pa, const T* pb, int64_t b_step, T* po, int64_t n) {
  ParallelFor(n, kMinPerThread, [&](int64_t begin, int64_t end) {
    BinaryRange<kOp, T>(pa + begin, pb + begin * b_step, b_step, po + begin, end - begin);
  });
}

template <typename T>
void BinaryLoop(BinaryOp op, const T* pa, const T* pb, int64_t b_step, T* po, int64_t n) {
  switch (op) {
    case BinaryOp::kAdd: return BinaryLoop<BinaryOp::kAdd, T>(pa, pb, b_step, po, n);
    case BinaryOp::kSub: return BinaryLoop<BinaryOp::kSub, T>(pa, pb, b_step, po, n);
    case BinaryOp::kMul: return BinaryLoop<BinaryOp::kMul, T>(pa, pb, b_step, po, n);
    case BinaryOp::kDiv: return BinaryLoop<BinaryOp::kDiv, T>(pa, pb, b_step, po, n);
    case BinaryOp::kReluBackward:
      return BinaryLoop<BinaryOp::kReluBackward, T>(pa, pb, b_step, po, n);
    case BinaryOp::kSigmoidBackward:
      return BinaryLoop<BinaryOp::kSigmoidBackward, T>(pa, pb, b_step, po, n);
    case BinaryOp::kTanhBackward:
      return BinaryLoop<BinaryOp::kTanhBackward, T>(pa, pb, b_step, po, n);
    case BinaryOp::kRelu6Backward:
      return BinaryLoop<BinaryOp::kRelu6Backward, T>(pa, pb, b_step, po, n);
  }
}
}  // namespace

void BinaryCpu(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
               const BroadcastPlan& plan) {
  const int64_t n = out.numel();
  TANDEM_DISPATCH_FLOATING(a.dtype(), "binary op", [&]<typename T>() {
    const T* pa = a.host_data<T>();
    const T* pb = b.host_data<T>();
    T* po = out.host_data<T>();
    if (plan.same_shape) return BinaryLoop(op, pa, pb, 1, po, n);
    if (b.numel() == 1) return BinaryLoop(op, pa, pb, 0, po, n);
    // General case: walk the output with a multi-index, advancing both operands.
    int64_t index[kMaxDims] = {};
    int64_t ia = 0, ib = 0;
    for (int64_t i = 0; i < n; ++i) {
      po[i] = Store<T>(ApplyBinary(op, Load(pa[ia]), Load(pb[ib])));
      for (int d = plan.ndim - 1; d >= 0; --d) {
        ia += plan.a_strides[d];
        ib += plan.b_strides[d];
        if (++index[d] < plan.out_sizes[d]) break;
        ia -= plan.a_strides[d] * plan.out_sizes[d];
        ib -= plan.b_strides[d] * plan.out_sizes[d];
        index[d] = 0;
      }
    }
  });
}

namespace {
// The op a compile-time constant, so the loop has no switch and vectorises
// where the op allows (affine, rdiv, relu). C = Compute<T>: for float and double
// Load/Store are the identity and the loop is the plain one.
template <UnaryOp kOp, typename T>
void UnaryRange(const T* __restrict px, T* __restrict po, int64_t n, Compute<T> a, Compute<T> b) {
  for (int64_t i = 0; i < n; ++i) po[i] = Store<T>(ApplyUnary(kOp, Load(px[i]), a, b));
}

template <UnaryOp kOp, typename T>
void UnaryLoop(const T* px, T* po, int64_t n, Compute<T> a, Compute<T> b) {
  ParallelFor(n, kMinPerThread, [&](int64_t begin, int64_t end) {
    UnaryRange<kOp, T>(px + begin, po + begin, end - begin, a, b);
  });
}
}  // namespace

void UnaryCpu(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1) {
  const int64_t n = x.numel();
  TANDEM_DISPATCH_FLOATING(x.dtype(), "unary op", [&]<typename T>() {
    using C = Compute<T>;
    const T* px = x.host_data<T>();
    T* po = out.host_data<T>();
    const C a = static_cast<C>(s0), b = static_cast<C>(s1);
    switch (op) {
      case UnaryOp::kAffine: return UnaryLoop<UnaryOp::kAffine, T>(px, po, n, a, b);
      case UnaryOp::kRDiv: return UnaryLoop<UnaryOp::kRDiv, T>(px, po, n, a, b);
      case UnaryOp::kPow: return UnaryLoop<UnaryOp::kPow, T>(px, po, n, a, b);
      case UnaryOp::kExp: return UnaryLoop<UnaryOp::kExp, T>(px, po, n, a, b);
      case UnaryOp::kLog: return UnaryLoop<UnaryOp::kLog, T>(px, po, n, a, b);
      case UnaryOp::kRelu: return UnaryLoop<UnaryOp::kRelu, T>(px, po, n, a, b);
      case UnaryOp::kSigmoid: return UnaryLoop<UnaryOp::kSigmoid, T>(px, po, n, a, b);
      case UnaryOp::kTanh: return UnaryLoop<UnaryOp::kTanh, T>(px, po, n, a, b);
      case UnaryOp::kRelu6: return UnaryLoop<UnaryOp::kRelu6, T>(px, po, n, a, b);
    }
  });
}

void SumToCpu(const Tensor& x, const Tensor& out) {
  // out's shape broadcasts to x's: accumulate each x element into its out slot.
  const BroadcastPlan plan = PlanBroadcast(out.shape(), x.shape(), "sum_to");
  const int64_t n = x.numel();
  const int64_t n_out = out.numel();
  TANDEM_DISPATCH_FLOATING(x.dtype(), "sum_to", [&]<typename T>() {
    using C = Compute<T>;
    const T* px = x.host_data<T>();
    // float and double accumulate in the output itself; bfloat16 in a float
    // buffer, rounded once per output element at the end.
    std::vector<C> buffer;
    C* acc;
    if constexpr (std::is_same_v<T, C>) {
      acc = out.host_data<T>();
    } else {
      buffer.resize(static_cast<size_t>(n_out));
      acc = buffer.data();
    }
    std::fill(acc, acc + n_out, C(0));
    int64_t index[kMaxDims] = {};
    int64_t io = 0;
    for (int64_t i = 0; i < n; ++i) {
      acc[io] += Load(px[i]);
      for (int d = plan.ndim - 1; d >= 0; --d) {
        io += plan.a_strides[d];
        if (++index[d] < plan.out_sizes[d]) break;
        io -= plan.a_strides[d] * plan.out_sizes[d];
        index[d] = 0;
      }
    }
    if constexpr (!std::is_same_v<T, C>) {
      T* po = out.host_data<T>();
      for (int64_t i = 0; i < n_out; ++i) po[i] = Store<T>(acc[i]);
    }
  });
}

}  // namespace tandem::nn::ops::internal
