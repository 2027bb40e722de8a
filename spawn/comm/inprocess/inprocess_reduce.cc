// CPU loops of the in-process communicator; contract in
// spawn/internal/inprocess_reduce.h.
//
// Each block of the range is combined in a small accumulator that stays in L1:
// the first pass combines in[0] .. in[3], each later pass folds up to four more
// inputs into it (the last one also divides, for avg), and the result is then
// copied to every output. (One input per pass cost 4 ranks 2.4x the time of 2
// on the same elements instead of about 2x: three trips of the accumulator
// through L1 where one does.) The inner loops are plain
// element-wise loops over restrict-free pointers into a local array, which the
// compiler vectorises; the op is a compile-time constant so there is no branch
// per element. Nothing reassociates: element i sees exactly the operations, in
// exactly the order, of a scalar loop over the ranks.
#include "spawn/comm/inprocess/internal/inprocess_reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace tandem::dist::internal {
namespace {

// Bytes of the accumulator block: well inside L1, large enough that per-block
// overhead (n_in + n_out short loops) is amortised.
constexpr int64_t kBlockBytes = 8192;

enum Op { kSum = 0, kAvg = 1, kMax = 2 };

template <typename T>
struct AccOf {
  using type = T;
};
template <>
struct AccOf<nn::BFloat16> {
  using type = float;
};
template <>
struct AccOf<nn::Float16> {
  using type = float;
};

template <typename T>
inline typename AccOf<T>::type Widen(T v) {
  return v;
}
template <>
inline float Widen<nn::BFloat16>(nn::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <>
inline float Widen<nn::Float16>(nn::Float16 v) {
  return nn::Float16::ToFloat(v.bits);
}

// The one rounding of a float32 accumulator to a 16-bit storage type.
inline void Narrow(float a, nn::BFloat16* o) { o->bits = nn::BFloat16::FromFloat(a); }
inline void Narrow(float a, nn::Float16* o) { o->bits = nn::Float16::FromFloat(a); }

template <int kOp, typename A>
inline A Combine(A acc, A v) {
  if constexpr (kOp == kMax) {
    return v > acc ? v : acc;
  } else {
    return static_cast<A>(acc + v);
  }
}

// What the last pass applies to each result: nothing (sum, max) or avg's / n.
struct Keep {
  template <typename A>
  A operator()(A x) const {
    return x;
  }
};
template <typename A>
struct MultiplyBy {  // avg when n is a power of two (see ReduceTyped)
  A factor;
  A operator()(A x) const { return static_cast<A>(x * factor); }
};
template <typename A>
struct DivideBy {
  A divisor;
  A operator()(A x) const { return static_cast<A>(x / divisor); }
};

// acc[i] = f(((a op in[0][i]) op in[1][i]) ... op in[kN-1][i]) for i < len,
// where a is in[0][i] itself (kFirst: then in[1..kN) are folded) or acc[i].
// One pass folds up to four inputs, so the accumulator makes one trip through
// L1 per four ranks instead of one per rank.
template <typename T, typename A, int kOp, int kN, bool kFirst, typename F>
inline void Fold(const void* const* in, int64_t lo, int64_t len, A* acc, F f) {
  const T* p[kN];
  for (int k = 0; k < kN; ++k) p[k] = static_cast<const T*>(in[k]) + lo;
  for (int64_t i = 0; i < len; ++i) {
    A a = kFirst ? Widen(p[0][i]) : acc[i];
    for (int k = kFirst ? 1 : 0; k < kN; ++k) a = Combine<kOp, A>(a, Widen(p[k][i]));
    acc[i] = f(a);
  }
}

// One pass of Fold over in[0..m), 1 <= m <= 4, applying `final` if it is the last.
template <typename T, typename A, int kOp, bool kFirst, typename Final>
void FoldPass(const void* const* in, int m, bool last, int64_t lo, int64_t len, A* acc,
              Final final) {
  auto pass = [&](auto f) {
    switch (m) {
      case 1: return Fold<T, A, kOp, 1, kFirst>(in, lo, len, acc, f);
      case 2: return Fold<T, A, kOp, 2, kFirst>(in, lo, len, acc, f);
      case 3: return Fold<T, A, kOp, 3, kFirst>(in, lo, len, acc, f);
      default: return Fold<T, A, kOp, 4, kFirst>(in, lo, len, acc, f);
    }
  };
  if (last) {
    pass(final);
  } else {
    pass(Keep{});
  }
}

// Folds in[0..n) into acc, the first pass from in[0] itself, up to four inputs
// per pass, `final` applied in the last pass. The order is (((in0 op in1) op
// in2) op ...) whatever the grouping.
template <typename T, typename A, int kOp, typename Final>
void FoldAll(const void* const* in, int n, int64_t lo, int64_t len, A* acc, Final final) {
  int done = std::min(n, 4);
  FoldPass<T, A, kOp, true>(in, done, done == n, lo, len, acc, final);
  while (done < n) {
    const int m = std::min(n - done, 4);
    FoldPass<T, A, kOp, false>(in + done, m, done + m == n, lo, len, acc, final);
    done += m;
  }
}

template <typename T, int kOp, typename Final>
void ReduceBlocks(const void* const* in, int n_in, void* const* out, int n_out, int64_t begin,
                  int64_t end, Final final) {
  using A = typename AccOf<T>::type;
  constexpr int64_t kBlock = kBlockBytes / static_cast<int64_t>(sizeof(A));
  alignas(64) A acc[kBlock];
  for (int64_t lo = begin; lo < end; lo += kBlock) {
    const int64_t len = std::min(kBlock, end - lo);
    FoldAll<T, A, kOp>(in, n_in, lo, len, acc, final);
    for (int j = 0; j < n_out; ++j) {
      T* o = static_cast<T*>(out[j]) + lo;
      if constexpr (std::is_same_v<T, A>) {
        std::memcpy(o, acc, static_cast<size_t>(len) * sizeof(T));
      } else {
        for (int64_t i = 0; i < len; ++i) Narrow(acc[i], &o[i]);
      }
    }
  }
}

template <typename T, int kOp>
void ReduceTyped(const void* const* in, int n_in, void* const* out, int n_out, int64_t begin,
                 int64_t end) {
  using A = typename AccOf<T>::type;
  if constexpr (kOp != kAvg) {
    ReduceBlocks<T, kOp>(in, n_in, out, n_out, begin, end, Keep{});
  } else if (std::is_floating_point_v<A> && (n_in & (n_in - 1)) == 0) {
    // n a power of two: 1/n is exact, so x * (1/n) is the same rounding of the
    // same real number as x / n (same bits, subnormals, infinities and NaNs
    // included), and a multiply costs a fraction of a divide.
    ReduceBlocks<T, kSum>(in, n_in, out, n_out, begin, end,
                          MultiplyBy<A>{static_cast<A>(static_cast<A>(1) / static_cast<A>(n_in))});
  } else {
    ReduceBlocks<T, kSum>(in, n_in, out, n_out, begin, end, DivideBy<A>{static_cast<A>(n_in)});
  }
}

template <typename T>
void ReduceOp(const void* const* in, int n_in, void* const* out, int n_out, int64_t begin,
              int64_t end, int op) {
  if (begin >= end) return;
  switch (op) {
    case kSum: return ReduceTyped<T, kSum>(in, n_in, out, n_out, begin, end);
    case kAvg: return ReduceTyped<T, kAvg>(in, n_in, out, n_out, begin, end);
    default: return ReduceTyped<T, kMax>(in, n_in, out, n_out, begin, end);
  }
}

}  // namespace

bool ReduceCpu(const void* const* in, int n_in, void* const* out, int n_out, int64_t begin,
               int64_t end, nn::DType dtype, int op) {
  // The dtype is checked even for an empty range, so that every rank of a
  // collective rejects it (a rank whose slice is empty as well).
  switch (dtype) {
    case nn::DType::kFloat32: ReduceOp<float>(in, n_in, out, n_out, begin, end, op); return true;
    case nn::DType::kFloat64: ReduceOp<double>(in, n_in, out, n_out, begin, end, op); return true;
    case nn::DType::kBFloat16:
      ReduceOp<nn::BFloat16>(in, n_in, out, n_out, begin, end, op);
      return true;
    case nn::DType::kFloat16:
      ReduceOp<nn::Float16>(in, n_in, out, n_out, begin, end, op);
      return true;
    case nn::DType::kInt64: ReduceOp<int64_t>(in, n_in, out, n_out, begin, end, op); return true;
    default: return false;
  }
}

}  // namespace tandem::dist::internal
