// CPU kernels of the pool family: direct loops over each window. bfloat16
// compares and sums in float32 (Acc<T>) and rounds each result once; float32
// and float64 compute in their own type.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "nn/error.h"
#include "nn/ops/internal/cpu_parallel.h"
#include "nn/ops/internal/elementwise_kernels.h"  // Compute<T>
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// The arithmetic type of an element type (float for bfloat16).
template <typename T>
using Acc = Compute<T>;

// dx (planes of plane_size elements) = sums that add_plane(p, sums) adds into
// the zeroed sums of plane p. float32 / float64 sum in dx itself; bfloat16 sums
// a plane in a float32 buffer and rounds each element once.
template <typename T, typename AddPlane>
void SumIntoPlanes(T* dx, int64_t planes, int64_t plane_size, AddPlane&& add_plane) {
  if constexpr (std::is_same_v<T, Acc<T>>) {
    std::fill(dx, dx + planes * plane_size, T(0));
    for (int64_t p = 0; p < planes; ++p) add_plane(p, dx + p * plane_size);
  } else {
    std::vector<Acc<T>> sums(plane_size);
    for (int64_t p = 0; p < planes; ++p) {
      std::fill(sums.begin(), sums.end(), Acc<T>(0));
      add_plane(p, sums.data());
      T* out = dx + p * plane_size;
      for (int64_t i = 0; i < plane_size; ++i) out[i] = T(sums[i]);
    }
  }
}

// Fast paths of max-pool for float32 / float64 without padding, where every
// window lies inside the input: the same comparisons in the same order as the
// generic loops below (strict '>' from the window's first element on, so the
// first maximum in row-major window order wins ties and a NaN is kept only as
// a window's first element), hence bit-identical values and indices.

// True when max-pool's fast forward applies: no padding (every window inside).
bool MaxPoolFastForward(const Pool2dGeometry& g) { return g.ph == 0 && g.pw == 0; }

// True when max-pool's fast backward applies: no padding and windows that tile
// the input without overlap (kernel == stride), so each dx element receives at
// most one gradient and is written once.
bool MaxPoolFastBackward(const Pool2dGeometry& g) {
  return g.ph == 0 && g.pw == 0 && g.kh == g.sh && g.kw == g.sw;
}

#if defined(__SSE2__)
// SSE2 kernels of 2x2 stride 2: one group of kLanes outputs from the window
// rows r0 / r1 (2 * kLanes elements each), `first` = the plane offset of r0[0];
// writes y[0, kLanes) and idx[0, kLanes). The lanes run the scalar selects of
// MaxPoolRow2x2 below ('>' is cmpgt, false on NaN), so values and indices are
// the same.
struct MaxPool2x2Float {
  static constexpr int64_t kLanes = 4;
  static void Group(const float* r0, const float* r1, int64_t first, int64_t w, float* y,
                    int64_t* idx) {
    const __m128 r0lo = _mm_loadu_ps(r0), r0hi = _mm_loadu_ps(r0 + 4);
    const __m128 r1lo = _mm_loadu_ps(r1), r1hi = _mm_loadu_ps(r1 + 4);
    __m128 best = _mm_shuffle_ps(r0lo, r0hi, _MM_SHUFFLE(2, 0, 2, 0));
    __m128i lo = _mm_setzero_si128(), hi = _mm_setzero_si128();  // offsets, int64 lanes
    auto step = [&](__m128 v, int64_t off) {
      const __m128 m = _mm_cmpgt_ps(v, best);
      best = _mm_or_ps(_mm_and_ps(m, v), _mm_andnot_ps(m, best));
      const __m128i mi = _mm_castps_si128(m), o = _mm_set1_epi64x(off);
      const __m128i mlo = _mm_unpacklo_epi32(mi, mi), mhi = _mm_unpackhi_epi32(mi, mi);
      lo = _mm_or_si128(_mm_and_si128(mlo, o), _mm_andnot_si128(mlo, lo));
      hi = _mm_or_si128(_mm_and_si128(mhi, o), _mm_andnot_si128(mhi, hi));
    };
    step(_mm_shuffle_ps(r0lo, r0hi, _MM_SHUFFLE(3, 1, 3, 1)), 1);
    step(_mm_shuffle_ps(r1lo, r1hi, _MM_SHUFFLE(2, 0, 2, 0)), w);
    step(_mm_shuffle_ps(r1lo, r1hi, _MM_SHUFFLE(3, 1, 3, 1)), w + 1);
    _mm_storeu_ps(y, best);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(idx),
                     _mm_add_epi64(_mm_set_epi64x(first + 2, first), lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(idx + 2),
                     _mm_add_epi64(_mm_set_epi64x(first + 6, first + 4), hi));
  }
  // One output with the same selects in lane 0 (no branches to mispredict).
  static void One(const float* r0, const float* r1, int64_t first, int64_t w, float* y,
                  int64_t* idx) {
    __m128 best = _mm_load_ss(r0);
    int64_t at = 0;
    auto step = [&](const float* p, int64_t off) {
      const __m128 v = _mm_load_ss(p), m = _mm_cmpgt_ss(v, best);
      best = _mm_or_ps(_mm_and_ps(m, v), _mm_andnot_ps(m, best));
      const int64_t mi = _mm_cvtsi128_si32(_mm_castps_si128(m));  // 0 or -1
      at = (mi & off) | (~mi & at);
    };
    step(r0 + 1, 1);
    step(r1, w);
    step(r1 + 1, w + 1);
    _mm_store_ss(y, best);
    *idx = first + at;
  }
};

struct MaxPool2x2Double {
  static constexpr int64_t kLanes = 2;
  static void Group(const double* r0, const double* r1, int64_t first, int64_t w, double* y,
                    int64_t* idx) {
    const __m128d r0lo = _mm_loadu_pd(r0), r0hi = _mm_loadu_pd(r0 + 2);
    const __m128d r1lo = _mm_loadu_pd(r1), r1hi = _mm_loadu_pd(r1 + 2);
    __m128d best = _mm_unpacklo_pd(r0lo, r0hi);
    __m128i at = _mm_setzero_si128();
    auto step = [&](__m128d v, int64_t off) {
      const __m128d m = _mm_cmpgt_pd(v, best);
      best = _mm_or_pd(_mm_and_pd(m, v), _mm_andnot_pd(m, best));
      const __m128i mi = _mm_castpd_si128(m);
      at = _mm_or_si128(_mm_and_si128(mi, _mm_set1_epi64x(off)), _mm_andnot_si128(mi, at));
    };
    step(_mm_unpackhi_pd(r0lo, r0hi), 1);
    step(_mm_unpacklo_pd(r1lo, r1hi), w);
    step(_mm_unpackhi_pd(r1lo, r1hi), w + 1);
    _mm_storeu_pd(y, best);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(idx),
                     _mm_add_epi64(_mm_set_epi64x(first + 2, first), at));
  }
  static void One(const double* r0, const double* r1, int64_t first, int64_t w, double* y,
                  int64_t* idx) {
    __m128d best = _mm_load_sd(r0);
    int64_t at = 0;
    auto step = [&](const double* p, int64_t off) {
      const __m128d v = _mm_load_sd(p), m = _mm_cmpgt_sd(v, best);
      best = _mm_or_pd(_mm_and_pd(m, v), _mm_andnot_pd(m, best));
      const int64_t mi = _mm_cvtsi128_si32(_mm_castpd_si128(m));  // 0 or -1
      at = (mi & off) | (~mi & at);
    };
    step(r0 + 1, 1);
    step(r1, w);
    step(r1 + 1, w + 1);
    _mm_store_sd(y, best);
    *idx = first + at;
  }
};

// One output row of 2x2 stride 2 (ow outputs, r0 at plane offset row0) in
// groups of K::kLanes, the rest one by one.
template <typename K, typename T>
void MaxPoolRow2x2Simd(const T* r0, const T* r1, int64_t row0, int64_t w, int64_t ow, T* y,
                       int64_t* idx) {
  constexpr int64_t kLanes = K::kLanes;
  const int64_t full = ow / kLanes * kLanes;
  for (int64_t ox = 0; ox < full; ox += kLanes) {
    K::Group(r0 + 2 * ox, r1 + 2 * ox, row0 + 2 * ox, w, y + ox, idx + ox);
  }
  for (int64_t ox = full; ox < ow; ++ox) {
    K::One(r0 + 2 * ox, r1 + 2 * ox, row0 + 2 * ox, w, y + ox, idx + ox);
  }
}
#endif

#if !defined(__SSE2__)
// 2x2 stride 2 over one output row, scalar: the window's elements a b / c d
// compared in that order, as selects.
template <typename T>
void MaxPoolRow2x2(const T* r0, const T* r1, int64_t row0, int64_t w, int64_t ow, T* y,
                   int64_t* idx) {
  for (int64_t ox = 0; ox < ow; ++ox) {
    const T a = r0[2 * ox], b = r0[2 * ox + 1], c = r1[2 * ox], d = r1[2 * ox + 1];
    T best = a;
    int64_t at = 0;
    bool m = b > best;
    best = m ? b : best;
    at = m ? 1 : at;
    m = c > best;
    best = m ? c : best;
    at = m ? w : at;
    m = d > best;
    best = m ? d : best;
    at = m ? w + 1 : at;
    y[ox] = best;
    idx[ox] = row0 + 2 * ox + at;
  }
}
#endif

// One plane (h, w) -> (oh, ow) of the fast forward; 2x2 stride 2 specialised.
template <typename T>
void MaxPoolPlaneFast(const T* plane, T* y, int64_t* idx, const Pool2dGeometry& g) {
  if (g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2) {
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      const int64_t row0 = 2 * oy * g.w;
      const T* r0 = plane + row0;
      const T* r1 = r0 + g.w;
      T* yr = y + oy * g.ow;
      int64_t* ir = idx + oy * g.ow;
#if defined(__SSE2__)
      using K = std::conditional_t<std::is_same_v<T, float>, MaxPool2x2Float, MaxPool2x2Double>;
      MaxPoolRow2x2Simd<K>(r0, r1, row0, g.w, g.ow, yr, ir);
#else
      MaxPoolRow2x2(r0, r1, row0, g.w, g.ow, yr, ir);
#endif
    }
    return;
  }
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      const int64_t first = oy * g.sh * g.w + ox * g.sw;
      T best = plane[first];
      int64_t at = first;
      for (int64_t i = 0; i < g.kh; ++i) {
        for (int64_t j = 0; j < g.kw; ++j) {
          const int64_t k = first + i * g.w + j;
          if (plane[k] > best) best = plane[k], at = k;
        }
      }
      y[oy * g.ow + ox] = best;
      idx[oy * g.ow + ox] = at;
    }
  }
}

// One plane of the fast backward: dx (h, w) = dy routed through idx, zero
// elsewhere (rows and columns past the last window included), one band of kh
// rows at a time so the band stays in cache between zeroing and routing. Each
// routed value is 0 + dy, as in the generic path's sum into a zeroed plane
// (a -0 gradient becomes +0 in both).
template <typename T>
void MaxPoolBackwardPlaneFast(const T* dy, const int64_t* idx, T* dx, const Pool2dGeometry& g) {
  const int64_t band = g.kh * g.w;
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    std::fill(dx + oy * band, dx + (oy + 1) * band, T(0));
    const int64_t* ir = idx + oy * g.ow;
    const T* dyr = dy + oy * g.ow;
    for (int64_t ox = 0; ox < g.ow; ++ox) dx[ir[ox]] = T(0) + dyr[ox];
  }
  std::fill(dx + g.oh * band, dx + g.h * g.w, T(0));
}

// bfloat16's MaxPoolPlaneFast: the window's elements compared as float32 in the
// same order with the same strict '>' (the first maximum on ties, NaN only where
// it comes first), the winner's bits copied: the generic loop's values and
// indices, without its per-element bounds checks.
void MaxPoolPlaneFastBf16(const BFloat16* plane, BFloat16* y, int64_t* idx,
                          const Pool2dGeometry& g) {
#if defined(__SSE2__)
  if (g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2 && g.w <= 1024) {
    // The float32 kernel on the two rows widened (exact), its outputs rounded
    // back (exact: each is one of the inputs).
    float rows[2][1024], out[512];
    for (int64_t oy = 0; oy < g.oh; ++oy) {
      const int64_t row0 = 2 * oy * g.w;
      for (int64_t k = 0; k < 2 * g.ow; ++k) {
        rows[0][k] = static_cast<float>(plane[row0 + k]);
        rows[1][k] = static_cast<float>(plane[row0 + g.w + k]);
      }
      int64_t* ir = idx + oy * g.ow;
      MaxPoolRow2x2Simd<MaxPool2x2Float>(rows[0], rows[1], row0, g.w, g.ow, out, ir);
      for (int64_t ox = 0; ox < g.ow; ++ox) y[oy * g.ow + ox] = plane[ir[ox]];
    }
    return;
  }
#endif
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      const int64_t first = oy * g.sh * g.w + ox * g.sw;
      float best = static_cast<float>(plane[first]);
      int64_t at = first;
      for (int64_t i = 0; i < g.kh; ++i) {
        for (int64_t j = 0; j < g.kw; ++j) {
          const int64_t k = first + i * g.w + j;
          const float v = static_cast<float>(plane[k]);
          if (v > best) best = v, at = k;
        }
      }
      y[oy * g.ow + ox] = plane[at];
      idx[oy * g.ow + ox] = at;
    }
  }
}

// bfloat16's MaxPoolBackwardPlaneFast: each routed value is 0 + dy in float32,
// rounded (exact), as the generic path's float32 sum into a zeroed plane.
void MaxPoolBackwardPlaneFastBf16(const BFloat16* dy, const int64_t* idx, BFloat16* dx,
                                  const Pool2dGeometry& g) {
  const int64_t band = g.kh * g.w;
  for (int64_t oy = 0; oy < g.oh; ++oy) {
    std::fill(dx + oy * band, dx + (oy + 1) * band, BFloat16(0.0f));
    const int64_t* ir = idx + oy * g.ow;
    const BFloat16* dyr = dy + oy * g.ow;
    for (int64_t ox = 0; ox < g.ow; ++ox) {
      dx[ir[ox]] = BFloat16(0.0f + static_cast<float>(dyr[ox]));
    }
  }
  std::fill(dx + g.oh * band, dx + g.h * g.w, BFloat16(0.0f));
}

std::atomic<CpuPoolPath> cpu_pool_path{CpuPoolPath::kAuto};

}  // namespace

void SetCpuPoolPath(CpuPoolPath path) { cpu_pool_path.store(path, std::memory_order_relaxed); }
CpuPoolPath GetCpuPoolPath() { return cpu_pool_path.load(std::memory_order_relaxed); }

bool CpuPoolDnnlBuilt() { return TANDEM_WITH_DNNL; }

CpuPoolPath ResolveCpuPoolPath(const Pool2dGeometry& /*g*/, bool max) {
  const CpuPoolPath path = GetCpuPoolPath();
#if TANDEM_WITH_DNNL
  // kAuto, by nn_ops_bench forward + backward on the models' 2x2/2 pools at
  // batch 32-512, 1 and 2 threads (docs/benchmarks.md, "Pooling: own kernels vs
  // oneDNN"): max pooling on our loops (the 2x2/2 fast path and the int64
  // indices beat oneDNN 2.6 in every layout, 1.2-3.8x); average pooling on
  // oneDNN in NCHW (our generic loops have no fast path: 1.5-3.2x slower).
  // NHWC / blocked pay two reorders per call and won no row beyond noise. Only
  // 2x2/2 pools were measured; other shapes follow the same choice.
  if (path != CpuPoolPath::kAuto) return path;
  return max ? CpuPoolPath::kOwn : CpuPoolPath::kDnnl;
#else
  TANDEM_CHECK(path == CpuPoolPath::kAuto || path == CpuPoolPath::kOwn,
               "pool2d: a oneDNN path was asked for but tandem was built without oneDNN "
               "(TANDEM_DNNL=OFF or libdnnl-dev missing)");
  return CpuPoolPath::kOwn;
#endif
}

#if !TANDEM_WITH_DNNL
// Never called: ResolveCpuPoolPath returns kOwn in builds without oneDNN.
Tensor MaxPool2dForwardDnnl(const Tensor&, const Pool2dGeometry&, CpuPoolPath, const Tensor&) {
  TANDEM_CHECK(false, "max_pool2d: tandem was built without oneDNN");
  return Tensor();
}
void MaxPool2dBackwardDnnl(const Tensor&, const Tensor&, const Pool2dGeometry&, CpuPoolPath,
                           const Tensor&) {
  TANDEM_CHECK(false, "max_pool2d: tandem was built without oneDNN");
}
void AvgPool2dForwardDnnl(const Tensor&, const Pool2dGeometry&, CpuPoolPath, const Tensor&) {
  TANDEM_CHECK(false, "avg_pool2d: tandem was built without oneDNN");
}
void AvgPool2dBackwardDnnl(const Tensor&, const Pool2dGeometry&, CpuPoolPath, const Tensor&) {
  TANDEM_CHECK(false, "avg_pool2d: tandem was built without oneDNN");
}
#endif

void MaxPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                         const Tensor& indices) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(x.dtype(), "max_pool2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    int64_t* pi = indices.host_data<int64_t>();
    if constexpr (std::is_same_v<T, Acc<T>>) {
      if (MaxPoolFastForward(g)) {
        const int64_t outs = g.oh * g.ow;
        for (int64_t p = 0; p < planes; ++p) {
          MaxPoolPlaneFast(px + p * g.h * g.w, py + p * outs, pi + p * outs, g);
        }
        return;
      }
    } else if constexpr (std::is_same_v<T, BFloat16>) {
      if (MaxPoolFastForward(g)) {
        const int64_t outs = g.oh * g.ow;
        for (int64_t p = 0; p < planes; ++p) {
          MaxPoolPlaneFastBf16(px + p * g.h * g.w, py + p * outs, pi + p * outs, g);
        }
        return;
      }
    }
    for (int64_t p = 0; p < planes; ++p) {
      const T* plane = px + p * g.h * g.w;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          int64_t best = -1;
          Acc<T> best_value = Acc<T>(0);
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t iy = oy * g.sh - g.ph + i;
            if (iy < 0 || iy >= g.h) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t ix = ox * g.sw - g.pw + j;
              if (ix < 0 || ix >= g.w) continue;
              const Acc<T> v = static_cast<Acc<T>>(plane[iy * g.w + ix]);
              // Strict '>' keeps the first maximum on ties.
              if (best < 0 || v > best_value) {
                best = iy * g.w + ix;
                best_value = v;
              }
            }
          }
          const int64_t out = (p * g.oh + oy) * g.ow + ox;
          py[out] = T(best_value);  // bfloat16: exact, the value came from x
          pi[out] = best;
        }
      }
    }
  });
}

void MaxPool2dBackwardCpu(const Tensor& /*x*/, const Tensor& /*y*/, const Tensor& indices,
                          const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t planes = g.n * g.c, outs = g.oh * g.ow;
  TANDEM_DISPATCH_FLOATING(dy.dtype(), "max_pool2d_backward", [&]<typename T>() {
    const T* pdy = dy.host_data<T>();
    const int64_t* pi = indices.host_data<int64_t>();
    if constexpr (std::is_same_v<T, Acc<T>>) {
      if (MaxPoolFastBackward(g)) {
        T* pdx = dx.host_data<T>();
        for (int64_t p = 0; p < planes; ++p) {
          MaxPoolBackwardPlaneFast(pdy + p * outs, pi + p * outs, pdx + p * g.h * g.w, g);
        }
        return;
      }
    } else if constexpr (std::is_same_v<T, BFloat16>) {
      if (MaxPoolFastBackward(g)) {
        T* pdx = dx.host_data<T>();
        for (int64_t p = 0; p < planes; ++p) {
          MaxPoolBackwardPlaneFastBf16(pdy + p * outs, pi + p * outs, pdx + p * g.h * g.w, g);
        }
        return;
      }
    }
    SumIntoPlanes(dx.host_data<T>(), planes, g.h * g.w, [&](int64_t p, Acc<T>* plane) {
      for (int64_t q = 0; q < outs; ++q) {
        const int64_t k = p * outs + q;
        if (pi[k] >= 0) plane[pi[k]] += static_cast<Acc<T>>(pdy[k]);
      }
    });
  });
}

bool MaxPoolTilesChannelsLast(const Pool2dGeometry& g) {
  return g.ph == 0 && g.pw == 0 && g.kh == g.sh && g.kw == g.sw &&
         g.kh * g.kw < kMaxPoolNoGradient;
}

namespace {

// Element access of the channels-last kernels: float32 as it is; bfloat16
// widened to float32 (exact) for the compares and narrowed back by dropping the
// low half, exact for the values they store (a window's maximum, 0 + dy, 0).
inline float Widen(float v) { return v; }
inline float Widen(BFloat16 v) { return static_cast<float>(v); }
template <typename T>
T Narrow(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    T out;
    out.bits = static_cast<uint16_t>(u >> 16);
    return out;
  }
}

#if defined(__SSE2__)
// Four consecutive elements as float32 lanes.
inline __m128 Load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 Load4(const BFloat16* p) {
  const __m128i halves = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), halves));
}
// Four float32 lanes (bfloat16-exact for T = BFloat16) stored as T.
inline void Store4(float* p, __m128 v) { _mm_storeu_ps(p, v); }
inline void Store4(BFloat16* p, __m128 v) {
  // The high half of each 32-bit lane, packed into the low 64 bits.
  __m128i u = _mm_castps_si128(v);
  u = _mm_shufflelo_epi16(u, _MM_SHUFFLE(3, 1, 3, 1));
  u = _mm_shufflehi_epi16(u, _MM_SHUFFLE(3, 1, 3, 1));
  u = _mm_shuffle_epi32(u, _MM_SHUFFLE(3, 1, 2, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), u);
}
#endif

// One output pixel of MaxPool2dReluChannelsLastForwardCpu: window points at the
// window's first element of channel 0 (channels-last), `offsets` at each window
// position's offset from it; y_pixel at channel 0's output (channel ch at
// ch * plane), where_pixel at the pixel's c positions. Scalar selects, and SSE2
// lanes running the same selects ('>' is cmpgt, false on NaN).
template <typename T>
void MaxPoolReluPixel(const T* window, const int64_t* offsets, int64_t positions, int64_t c,
                      int64_t plane, T* y_pixel, uint8_t* where_pixel) {
  int64_t ch = 0;
#if defined(__SSE2__)
  alignas(16) float best_out[4];
  for (; ch + 4 <= c; ch += 4) {
    __m128 best = Load4(window + ch);
    __m128i at = _mm_setzero_si128();
    for (int64_t k = 1; k < positions; ++k) {
      const __m128 v = Load4(window + offsets[k] + ch);
      const __m128 more = _mm_cmpgt_ps(v, best);
      best = _mm_or_ps(_mm_and_ps(more, v), _mm_andnot_ps(more, best));
      const __m128i m = _mm_castps_si128(more);
      at = _mm_or_si128(_mm_and_si128(m, _mm_set1_epi32(static_cast<int32_t>(k))),
                        _mm_andnot_si128(m, at));
    }
    const __m128i keep = _mm_castps_si128(_mm_cmpgt_ps(best, _mm_setzero_ps()));
    at = _mm_or_si128(_mm_and_si128(keep, at),
                      _mm_andnot_si128(keep, _mm_set1_epi32(kMaxPoolNoGradient)));
    // The four positions (0..positions-1 or 0xFF) as four bytes in one store.
    const __m128i at16 = _mm_packs_epi32(at, at);
    const int32_t at_bytes = _mm_cvtsi128_si32(_mm_packus_epi16(at16, at16));
    std::memcpy(where_pixel + ch, &at_bytes, sizeof at_bytes);
    _mm_store_ps(best_out, best);
    for (int l = 0; l < 4; ++l) y_pixel[(ch + l) * plane] = Narrow<T>(best_out[l]);
  }
#endif
  for (; ch < c; ++ch) {
    float best = Widen(window[ch]);
    int64_t at = 0;
    for (int64_t k = 1; k < positions; ++k) {
      const float v = Widen(window[offsets[k] + ch]);
      if (v > best) best = v, at = k;
    }
    y_pixel[ch * plane] = Narrow<T>(best);
    where_pixel[ch] = best > 0.0f ? static_cast<uint8_t>(at) : kMaxPoolNoGradient;
  }
}

// One window of MaxPool2dReluChannelsLastBackwardCpu: writes every element of
// the window (channels-last, at `window`): 0 + dy at the position `at` names, 0
// at the others and where `at` is kMaxPoolNoGradient; dy_pixel: channel 0's
// gradient (channel ch at ch * plane). Branch-free (the ReLU's mask is data).
template <typename T>
void MaxPoolReluPixelBackward(const T* dy_pixel, const uint8_t* at, const int64_t* offsets,
                              int64_t positions, int64_t c, int64_t plane, T* window) {
  int64_t ch = 0;
#if defined(__SSE2__)
  for (; ch + 4 <= c; ch += 4) {
    const __m128 d = _mm_add_ps(
        _mm_setzero_ps(),
        _mm_set_ps(Widen(dy_pixel[(ch + 3) * plane]), Widen(dy_pixel[(ch + 2) * plane]),
                   Widen(dy_pixel[(ch + 1) * plane]), Widen(dy_pixel[ch * plane])));
    const __m128i a = _mm_set_epi32(at[ch + 3], at[ch + 2], at[ch + 1], at[ch]);
    for (int64_t k = 0; k < positions; ++k) {
      const __m128i hit = _mm_cmpeq_epi32(a, _mm_set1_epi32(static_cast<int32_t>(k)));
      Store4(window + offsets[k] + ch, _mm_and_ps(_mm_castsi128_ps(hit), d));
    }
  }
#endif
  for (; ch < c; ++ch) {
    const float d = 0.0f + Widen(dy_pixel[ch * plane]);
    for (int64_t k = 0; k < positions; ++k) {
      window[offsets[k] + ch] = Narrow<T>(at[ch] == k ? d : 0.0f);
    }
  }
}

// Each window position's element offset from the window's first element, in
// row-major window order (the position numbers `where` holds).
std::vector<int64_t> ChannelsLastWindowOffsets(const Pool2dGeometry& g) {
  std::vector<int64_t> offsets;
  for (int64_t i = 0; i < g.kh; ++i) {
    for (int64_t j = 0; j < g.kw; ++j) offsets.push_back((i * g.w + j) * g.c);
  }
  return offsets;
}

// Rows (image, oy) split over the rank's threads; each output whole on one
// thread, so the bits do not depend on the thread count.
template <typename T>
void MaxPoolReluChannelsLastForward(const T* x, const Pool2dGeometry& g, T* y, uint8_t* where) {
  const std::vector<int64_t> offsets = ChannelsLastWindowOffsets(g);
  const int64_t c = g.c, h = g.h, w = g.w, oh = g.oh, ow = g.ow, sh = g.sh, sw = g.sw;
  const int64_t plane = oh * ow, positions = static_cast<int64_t>(offsets.size());
  ParallelFor(g.n * oh, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / oh, oy = row % oh;
      const T* x_row = x + (n * h + oy * sh) * w * c;
      T* y_row = y + n * c * plane + oy * ow;
      uint8_t* where_row = where + row * ow * c;
      for (int64_t ox = 0; ox < ow; ++ox) {
        MaxPoolReluPixel(x_row + ox * sw * c, offsets.data(), positions, c, plane, y_row + ox,
                         where_row + ox * c);
      }
    }
  });
}

template <typename T>
void MaxPoolReluChannelsLastBackward(const T* dy, const uint8_t* where, const Pool2dGeometry& g,
                                     T* dx) {
  const std::vector<int64_t> offsets = ChannelsLastWindowOffsets(g);
  const int64_t c = g.c, h = g.h, w = g.w, oh = g.oh, ow = g.ow, sh = g.sh, sw = g.sw;
  const int64_t plane = oh * ow, kh = g.kh, positions = static_cast<int64_t>(offsets.size());
  const T zero = Narrow<T>(0.0f);
  ParallelFor(g.n * oh, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / oh, oy = row % oh;
      T* dx_band = dx + (n * h + oy * sh) * w * c;
      const T* dy_row = dy + n * c * plane + oy * ow;
      const uint8_t* where_row = where + row * ow * c;
      for (int64_t ox = 0; ox < ow; ++ox) {
        MaxPoolReluPixelBackward(dy_row + ox, where_row + ox * c, offsets.data(), positions, c,
                                 plane, dx_band + ox * sw * c);
      }
      // Columns right of the last window and rows below it get no gradient.
      if (ow * sw < w) {
        for (int64_t i = 0; i < kh; ++i) {
          T* line = dx_band + i * w * c;
          std::fill(line + ow * sw * c, line + w * c, zero);
        }
      }
      if (oy == oh - 1) std::fill(dx_band + kh * w * c, dx + (n + 1) * h * w * c, zero);
    }
  });
}

}  // namespace

void MaxPool2dReluChannelsLastForwardCpu(const float* x, const Pool2dGeometry& g, float* y,
                                         uint8_t* where) {
  MaxPoolReluChannelsLastForward(x, g, y, where);
}
void MaxPool2dReluChannelsLastForwardCpu(const BFloat16* x, const Pool2dGeometry& g, BFloat16* y,
                                         uint8_t* where) {
  MaxPoolReluChannelsLastForward(x, g, y, where);
}
void MaxPool2dReluChannelsLastBackwardCpu(const float* dy, const uint8_t* where,
                                          const Pool2dGeometry& g, float* dx) {
  MaxPoolReluChannelsLastBackward(dy, where, g, dx);
}
void MaxPool2dReluChannelsLastBackwardCpu(const BFloat16* dy, const uint8_t* where,
                                          const Pool2dGeometry& g, BFloat16* dx) {
  MaxPoolReluChannelsLastBackward(dy, where, g, dx);
}

void AvgPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(x.dtype(), "avg_pool2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    const Acc<T> scale = Acc<T>(1) / static_cast<Acc<T>>(g.kh * g.kw);
    for (int64_t p = 0; p < planes; ++p) {
      const T* plane = px + p * g.h * g.w;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          Acc<T> sum = Acc<T>(0);
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t iy = oy * g.sh - g.ph + i;
            if (iy < 0 || iy >= g.h) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t ix = ox * g.sw - g.pw + j;
              if (ix >= 0 && ix < g.w) sum += static_cast<Acc<T>>(plane[iy * g.w + ix]);
            }
          }
          py[(p * g.oh + oy) * g.ow + ox] = T(sum * scale);
        }
      }
    }
  });
}

void AvgPool2dBackwardCpu(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(dy.dtype(), "avg_pool2d_backward", [&]<typename T>() {
    const T* pdy = dy.host_data<T>();
    const Acc<T> scale = Acc<T>(1) / static_cast<Acc<T>>(g.kh * g.kw);
    SumIntoPlanes(dx.host_data<T>(), planes, g.h * g.w, [&](int64_t p, Acc<T>* plane) {
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const Acc<T> v = static_cast<Acc<T>>(pdy[(p * g.oh + oy) * g.ow + ox]) * scale;
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t iy = oy * g.sh - g.ph + i;
            if (iy < 0 || iy >= g.h) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t ix = ox * g.sw - g.pw + j;
              if (ix >= 0 && ix < g.w) plane[iy * g.w + ix] += v;
            }
          }
        }
      }
    });
  });
}

void AdaptiveAvgPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(x.dtype(), "adaptive_avg_pool2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    for (int64_t p = 0; p < planes; ++p) {
      const T* plane = px + p * g.h * g.w;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        const int64_t y0 = AdaptiveStart(oy, g.h, g.oh), y1 = AdaptiveEnd(oy, g.h, g.oh);
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const int64_t x0 = AdaptiveStart(ox, g.w, g.ow), x1 = AdaptiveEnd(ox, g.w, g.ow);
          Acc<T> sum = Acc<T>(0);
          for (int64_t iy = y0; iy < y1; ++iy) {
            for (int64_t ix = x0; ix < x1; ++ix) sum += static_cast<Acc<T>>(plane[iy * g.w + ix]);
          }
          py[(p * g.oh + oy) * g.ow + ox] = T(sum / static_cast<Acc<T>>((y1 - y0) * (x1 - x0)));
        }
      }
    }
  });
}

void AdaptiveAvgPool2dBackwardCpu(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(dy.dtype(), "adaptive_avg_pool2d_backward", [&]<typename T>() {
    const T* pdy = dy.host_data<T>();
    T* pdx = dx.host_data<T>();
    // Gathered per dx element, in the order the CUDA kernel uses: same sums.
    for (int64_t p = 0; p < planes; ++p) {
      const T* dplane = pdy + p * g.oh * g.ow;
      for (int64_t iy = 0; iy < g.h; ++iy) {
        const int64_t oy0 = AdaptiveFirstOutput(iy, g.h, g.oh);
        const int64_t oy1 = AdaptiveLastOutput(iy, g.h, g.oh);
        for (int64_t ix = 0; ix < g.w; ++ix) {
          const int64_t ox0 = AdaptiveFirstOutput(ix, g.w, g.ow);
          const int64_t ox1 = AdaptiveLastOutput(ix, g.w, g.ow);
          Acc<T> sum = Acc<T>(0);
          for (int64_t oy = oy0; oy < oy1; ++oy) {
            const int64_t y0 = AdaptiveStart(oy, g.h, g.oh), y1 = AdaptiveEnd(oy, g.h, g.oh);
            if (iy < y0 || iy >= y1) continue;
            for (int64_t ox = ox0; ox < ox1; ++ox) {
              const int64_t x0 = AdaptiveStart(ox, g.w, g.ow), x1 = AdaptiveEnd(ox, g.w, g.ow);
              if (ix < x0 || ix >= x1) continue;
              sum += static_cast<Acc<T>>(dplane[oy * g.ow + ox]) /
                     static_cast<Acc<T>>((y1 - y0) * (x1 - x0));
            }
          }
          pdx[(p * g.h + iy) * g.w + ix] = T(sum);
        }
      }
    }
  });
}

}  // namespace tandem::nn::ops::internal
