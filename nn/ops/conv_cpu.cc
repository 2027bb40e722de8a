// CPU kernels of the conv family: im2col + OpenBLAS gemm, per sample.
#include <algorithm>
#include <vector>

#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// cols (c*kh*kw, oh*ow): row (ci, i, j) holds x[ci] at the window tap (i, j) of
// every output position; zero where the tap falls in the padding.
// The output columns [lo, hi) whose tap j falls inside the input row (0 <= ix < w
// for ix = ox * stride - pad + j * dilation): outside them the tap reads padding.
struct TapRange {
  int64_t lo, hi;
};
inline TapRange ValidColumns(int64_t ow, int64_t w, int64_t stride, int64_t offset) {
  // offset = j * dilation - pad; ix = ox * stride + offset.
  int64_t lo = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  int64_t hi = w - offset <= 0 ? 0 : (w - offset + stride - 1) / stride;  // first ox with ix >= w
  lo = std::min(lo, ow);
  hi = std::max(lo, std::min(hi, ow));
  return {lo, hi};
}

template <typename T>
void Im2Col(const T* x, const Conv2dGeometry& g, T* cols) {
  const auto& p = g.params;
  const int64_t positions = g.oh * g.ow;
  const int64_t sx = p.stride[1];
  for (int64_t ci = 0; ci < g.c; ++ci) {
    const T* plane = x + ci * g.h * g.w;
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        T* row = cols + ((ci * g.kh + i) * g.kw + j) * positions;
        const int64_t offset = j * p.dilation[1] - p.padding[1];
        const TapRange r = ValidColumns(g.ow, g.w, sx, offset);
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t iy = oy * p.stride[0] - p.padding[0] + i * p.dilation[0];
          T* out = row + oy * g.ow;
          if (iy < 0 || iy >= g.h) {
            std::fill(out, out + g.ow, T(0));
            continue;
          }
          std::fill(out, out + r.lo, T(0));
          if (r.lo < r.hi) {
            const T* in = plane + iy * g.w + r.lo * sx + offset;  // tap of column r.lo
            if (sx == 1) {
              std::copy(in, in + (r.hi - r.lo), out + r.lo);
            } else {
              for (int64_t ox = r.lo; ox < r.hi; ++ox) out[ox] = in[(ox - r.lo) * sx];
            }
          }
          std::fill(out + r.hi, out + g.ow, T(0));
        }
      }
    }
  }
}

// The adjoint of Im2Col: dx (c, h, w) += each column entry at its tap.
template <typename T>
void Col2Im(const T* cols, const Conv2dGeometry& g, T* dx) {
  const auto& p = g.params;
  const int64_t positions = g.oh * g.ow;
  const int64_t sx = p.stride[1];
  for (int64_t ci = 0; ci < g.c; ++ci) {
    T* plane = dx + ci * g.h * g.w;
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* row = cols + ((ci * g.kh + i) * g.kw + j) * positions;
        const int64_t offset = j * p.dilation[1] - p.padding[1];
        const TapRange r = ValidColumns(g.ow, g.w, sx, offset);
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t iy = oy * p.stride[0] - p.padding[0] + i * p.dilation[0];
          if (iy < 0 || iy >= g.h) continue;
          if (r.lo >= r.hi) continue;
          const T* in = row + oy * g.ow + r.lo;
          T* out = plane + iy * g.w + r.lo * sx + offset;  // tap of column r.lo
          const int64_t count = r.hi - r.lo;
          if (sx == 1) {
            for (int64_t k = 0; k < count; ++k) out[k] += in[k];
          } else {
            for (int64_t k = 0; k < count; ++k) out[k * sx] += in[k];
          }
        }
      }
    }
  }
}

}  // namespace

void Conv2dForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dGeometry& g, const Tensor& y) {
  const int64_t taps = g.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(x.dtype(), "conv2d", [&]<typename T>() {
    // From the host allocator's cache: no fresh pages (and their faults) per call.
    const Tensor cols_buffer =
        empty({taps * positions}, {.dtype = DTypeOf<T>::value, .device = Device::CPU()});
    T* cols = cols_buffer.data<T>();
    const T* px = x.data<T>();
    const T* pw = weight.data<T>();
    const T* pb = bias.defined() ? bias.data<T>() : nullptr;
    T* py = y.data<T>();
    for (int64_t s = 0; s < g.n; ++s) {
      Im2Col(px + s * g.c * g.h * g.w, g, cols);
      T* out = py + s * g.o * positions;
      // y[s] (o, positions) = weight (o, taps) cols (taps, positions).
      GemmRaw<T>(false, false, g.o, positions, taps, T(1), pw, taps, cols, positions, T(0),
                 out, positions);
      if (pb == nullptr) continue;
      for (int64_t oc = 0; oc < g.o; ++oc) {
        for (int64_t q = 0; q < positions; ++q) out[oc * positions + q] += pb[oc];
      }
    }
  });
}

void Conv2dBackwardDataCpu(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                           const Tensor& dx) {
  const int64_t taps = g.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_data", [&]<typename T>() {
    // From the host allocator's cache: no fresh pages (and their faults) per call.
    const Tensor cols_buffer =
        empty({taps * positions}, {.dtype = DTypeOf<T>::value, .device = Device::CPU()});
    T* cols = cols_buffer.data<T>();
    const T* pdy = dy.data<T>();
    const T* pw = weight.data<T>();
    T* pdx = dx.data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    for (int64_t s = 0; s < g.n; ++s) {
      // dcols (taps, positions) = weight^T (taps, o) dy[s] (o, positions).
      GemmRaw<T>(true, false, taps, positions, g.o, T(1), pw, taps, pdy + s * g.o * positions,
                 positions, T(0), cols, positions);
      Col2Im(cols, g, pdx + s * g.c * g.h * g.w);
    }
  });
}

void Conv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                             const Tensor& dweight) {
  const int64_t taps = g.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_filter", [&]<typename T>() {
    // From the host allocator's cache: no fresh pages (and their faults) per call.
    const Tensor cols_buffer =
        empty({taps * positions}, {.dtype = DTypeOf<T>::value, .device = Device::CPU()});
    T* cols = cols_buffer.data<T>();
    const T* pdy = dy.data<T>();
    const T* px = x.data<T>();
    T* pdw = dweight.data<T>();
    std::fill(pdw, pdw + dweight.numel(), T(0));
    for (int64_t s = 0; s < g.n; ++s) {
      Im2Col(px + s * g.c * g.h * g.w, g, cols);
      // dweight (o, taps) += dy[s] (o, positions) cols^T (positions, taps).
      GemmRaw<T>(false, true, g.o, taps, positions, T(1), pdy + s * g.o * positions, positions,
                 cols, positions, T(1), pdw, taps);
    }
  });
}

void Conv2dBackwardBiasCpu(const Tensor& dy, const Tensor& dbias) {
  const int64_t n = dy.size(0), o = dy.size(1), positions = dy.size(2) * dy.size(3);
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_bias", [&]<typename T>() {
    const T* pdy = dy.data<T>();
    T* pdb = dbias.data<T>();
    for (int64_t oc = 0; oc < o; ++oc) {
      T sum = T(0);
      for (int64_t s = 0; s < n; ++s) {
        const T* plane = pdy + (s * o + oc) * positions;
        for (int64_t q = 0; q < positions; ++q) sum += plane[q];
      }
      pdb[oc] = sum;
    }
  });
}

}  // namespace tandem::nn::ops::internal
