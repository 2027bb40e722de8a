// CPU kernels of the pool family: direct loops over each window. bfloat16
// compares and sums in float32 (Acc<T>) and rounds each result once; float32
// and float64 compute in their own type.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// The arithmetic type of an element type.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, BFloat16>, float, T>;

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

}  // namespace

void MaxPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                         const Tensor& indices) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(x.dtype(), "max_pool2d", [&]<typename T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
    int64_t* pi = indices.data<int64_t>();
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
    const T* pdy = dy.data<T>();
    const int64_t* pi = indices.data<int64_t>();
    SumIntoPlanes(dx.data<T>(), planes, g.h * g.w, [&](int64_t p, Acc<T>* plane) {
      for (int64_t q = 0; q < outs; ++q) {
        const int64_t k = p * outs + q;
        if (pi[k] >= 0) plane[pi[k]] += static_cast<Acc<T>>(pdy[k]);
      }
    });
  });
}

void AvgPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOATING(x.dtype(), "avg_pool2d", [&]<typename T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
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
    const T* pdy = dy.data<T>();
    const Acc<T> scale = Acc<T>(1) / static_cast<Acc<T>>(g.kh * g.kw);
    SumIntoPlanes(dx.data<T>(), planes, g.h * g.w, [&](int64_t p, Acc<T>* plane) {
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

}  // namespace tandem::nn::ops::internal
