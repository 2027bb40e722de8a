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
void BinaryRange(const T* pa, const T* pb, int64_t b_step, T* po, int64_t n, Compute<T> s0,
                 Compute<T> s1) {
  if (b_step == 0) {
    const Compute<T> vb = Load(pb[0]);
    for (int64_t i = 0; i < n; ++i) po[i] = Store<T>(ApplyBinary(kOp, Load(pa[i]), vb, s0, s1));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      po[i] = Store<T>(ApplyBinary(kOp, Load(pa[i]), Load(pb[i]), s0, s1));
    }
  }
}

// relu's backward on bfloat16 (conv2d_relu's mask under autocast), on the bits:
// b > 0 is b in [0x0001, 0x7f80] (positive, nonzero, not NaN; +inf included),
// then a as Store would give it (exact; a NaN quietened) or +0. The same bits as
// the float32 route above, in integer lanes the compiler vectorises.
template <>
void BinaryRange<BinaryOp::kReluBackward, BFloat16>(const BFloat16* pa, const BFloat16* pb,
                                                    int64_t b_step, BFloat16* po, int64_t n,
                                                    float /*s0*/, float /*s1*/) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t a = pa[i].bits, b = pb[i * b_step].bits;
    const bool nan = (a & 0x7f80u) == 0x7f80u && (a & 0x007fu) != 0;
    const uint16_t kept = nan ? static_cast<uint16_t>(a | 0x0040u) : a;
    po[i].bits = static_cast<uint16_t>(b - 1u) < 0x7f80u ? kept : uint16_t{0};
  }
}

template <BinaryOp kOp, typename T>
void BinaryLoop(const T* pa, const T* pb, int64_t b_step, T* po, int64_t n, Compute<T> s0,
                Compute<T> s1) {
  ParallelFor(n, kMinPerThread, [&](int64_t begin, int64_t end) {
    BinaryRange<kOp, T>(pa + begin, pb + begin * b_step, b_step, po + begin, end - begin, s0, s1);
  });
}

template <typename T>
void BinaryLoop(BinaryOp op, const T* pa, const T* pb, int64_t b_step, T* po, int64_t n,
                Compute<T> s0, Compute<T> s1) {
  switch (op) {
#define TANDEM_BINARY_CASE(kOp) \
  case BinaryOp::kOp: return BinaryLoop<BinaryOp::kOp, T>(pa, pb, b_step, po, n, s0, s1);
    TANDEM_BINARY_CASE(kAdd)
    TANDEM_BINARY_CASE(kSub)
    TANDEM_BINARY_CASE(kMul)
    TANDEM_BINARY_CASE(kDiv)
    TANDEM_BINARY_CASE(kReluBackward)
    TANDEM_BINARY_CASE(kSigmoidBackward)
    TANDEM_BINARY_CASE(kTanhBackward)
    TANDEM_BINARY_CASE(kRelu6Backward)
    TANDEM_BINARY_CASE(kMaximum)
    TANDEM_BINARY_CASE(kMinimum)
    TANDEM_BINARY_CASE(kMaximumShare)
    TANDEM_BINARY_CASE(kMinimumShare)
    TANDEM_BINARY_CASE(kAbsBackward)
    TANDEM_BINARY_CASE(kSqrtBackward)
    TANDEM_BINARY_CASE(kClampBackward)
    TANDEM_BINARY_CASE(kLeakyReluBackward)
    TANDEM_BINARY_CASE(kGeluBackward)
    TANDEM_BINARY_CASE(kGeluTanhBackward)
    TANDEM_BINARY_CASE(kSiluBackward)
    TANDEM_BINARY_CASE(kSmoothL1Backward)
#undef TANDEM_BINARY_CASE
  }
}
}  // namespace

void BinaryCpu(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
               const BroadcastPlan& plan, double s0_in, double s1_in) {
  const int64_t n = out.numel();
  TANDEM_DISPATCH_FLOATING(a.dtype(), "binary op", [&]<typename T>() {
    using C = Compute<T>;
    const C s0 = static_cast<C>(s0_in), s1 = static_cast<C>(s1_in);
    const T* pa = a.host_data<T>();
    const T* pb = b.host_data<T>();
    T* po = out.host_data<T>();
    if (plan.same_shape) return BinaryLoop(op, pa, pb, 1, po, n, s0, s1);
    if (b.numel() == 1 && a.numel() == n) return BinaryLoop(op, pa, pb, 0, po, n, s0, s1);
    // General case: walk the output with a multi-index, advancing both operands.
    int64_t index[kMaxDims] = {};
    int64_t ia = 0, ib = 0;
    for (int64_t i = 0; i < n; ++i) {
      po[i] = Store<T>(ApplyBinary(op, Load(pa[ia]), Load(pb[ib]), s0, s1));
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

// One case of UnaryCpu's switch (defined outside the dispatch macro's argument).
#define TANDEM_UNARY_CASE(kOp) \
  case UnaryOp::kOp: return UnaryLoop<UnaryOp::kOp, T>(px, po, n, a, b);

void UnaryCpu(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1) {
  const int64_t n = x.numel();
  TANDEM_DISPATCH_FLOATING(x.dtype(), "unary op", [&]<typename T>() {
    using C = Compute<T>;
    const T* px = x.host_data<T>();
    T* po = out.host_data<T>();
    const C a = static_cast<C>(s0), b = static_cast<C>(s1);
    switch (op) {
      TANDEM_UNARY_CASE(kAffine)
      TANDEM_UNARY_CASE(kRDiv)
      TANDEM_UNARY_CASE(kPow)
      TANDEM_UNARY_CASE(kExp)
      TANDEM_UNARY_CASE(kLog)
      TANDEM_UNARY_CASE(kRelu)
      TANDEM_UNARY_CASE(kSigmoid)
      TANDEM_UNARY_CASE(kTanh)
      TANDEM_UNARY_CASE(kRelu6)
      TANDEM_UNARY_CASE(kAbs)
      TANDEM_UNARY_CASE(kSqrt)
      TANDEM_UNARY_CASE(kClamp)
      TANDEM_UNARY_CASE(kLeakyRelu)
      TANDEM_UNARY_CASE(kGelu)
      TANDEM_UNARY_CASE(kGeluTanh)
      TANDEM_UNARY_CASE(kSilu)
      TANDEM_UNARY_CASE(kSoftplus)
      TANDEM_UNARY_CASE(kSmoothL1)
    }
  });
}

#undef TANDEM_UNARY_CASE

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
