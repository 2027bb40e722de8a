// CPU kernels of the pool family: direct loops over each window.
#include <algorithm>

#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {

void MaxPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                         const Tensor& indices) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOAT(x.dtype(), "max_pool2d", [&]<typename T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
    int64_t* pi = indices.data<int64_t>();
    for (int64_t p = 0; p < planes; ++p) {
      const T* plane = px + p * g.h * g.w;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          int64_t best = -1;
          T best_value = T(0);
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t iy = oy * g.sh - g.ph + i;
            if (iy < 0 || iy >= g.h) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t ix = ox * g.sw - g.pw + j;
              if (ix < 0 || ix >= g.w) continue;
              const T v = plane[iy * g.w + ix];
              // Strict '>' keeps the first maximum on ties.
              if (best < 0 || v > best_value) {
                best = iy * g.w + ix;
                best_value = v;
              }
            }
          }
          const int64_t out = (p * g.oh + oy) * g.ow + ox;
          py[out] = best_value;
          pi[out] = best;
        }
      }
    }
  });
}

void MaxPool2dBackwardCpu(const Tensor& /*x*/, const Tensor& /*y*/, const Tensor& indices,
                          const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t planes = g.n * g.c, outs = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "max_pool2d_backward", [&]<typename T>() {
    const T* pdy = dy.data<T>();
    const int64_t* pi = indices.data<int64_t>();
    T* pdx = dx.data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    for (int64_t p = 0; p < planes; ++p) {
      T* plane = pdx + p * g.h * g.w;
      for (int64_t q = 0; q < outs; ++q) {
        const int64_t k = p * outs + q;
        if (pi[k] >= 0) plane[pi[k]] += pdy[k];
      }
    }
  });
}

void AvgPool2dForwardCpu(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOAT(x.dtype(), "avg_pool2d", [&]<typename T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const T scale = T(1) / static_cast<T>(g.kh * g.kw);
    for (int64_t p = 0; p < planes; ++p) {
      const T* plane = px + p * g.h * g.w;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          T sum = T(0);
          for (int64_t i = 0; i < g.kh; ++i) {
            const int64_t iy = oy * g.sh - g.ph + i;
            if (iy < 0 || iy >= g.h) continue;
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t ix = ox * g.sw - g.pw + j;
              if (ix >= 0 && ix < g.w) sum += plane[iy * g.w + ix];
            }
          }
          py[(p * g.oh + oy) * g.ow + ox] = sum * scale;
        }
      }
    }
  });
}

void AvgPool2dBackwardCpu(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  const int64_t planes = g.n * g.c;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "avg_pool2d_backward", [&]<typename T>() {
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    const T scale = T(1) / static_cast<T>(g.kh * g.kw);
    for (int64_t p = 0; p < planes; ++p) {
      T* plane = pdx + p * g.h * g.w;
      for (int64_t oy = 0; oy < g.oh; ++oy) {
        for (int64_t ox = 0; ox < g.ow; ++ox) {
          const T v = pdy[(p * g.oh + oy) * g.ow + ox] * scale;
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
    }
  });
}

}  // namespace tandem::nn::ops::internal
