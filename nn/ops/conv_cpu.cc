// CPU kernels of the conv family: im2col + OpenBLAS gemm, per sample.
#include <vector>

#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// cols (c*kh*kw, oh*ow): row (ci, i, j) holds x[ci] at the window tap (i, j) of
// every output position; zero where the tap falls in the padding.
template <typename T>
void Im2Col(const T* x, const Conv2dGeometry& g, T* cols) {
  const auto& p = g.params;
  const int64_t positions = g.oh * g.ow;
  for (int64_t ci = 0; ci < g.c; ++ci) {
    const T* plane = x + ci * g.h * g.w;
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        T* row = cols + ((ci * g.kh + i) * g.kw + j) * positions;
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t iy = oy * p.stride[0] - p.padding[0] + i * p.dilation[0];
          T* out = row + oy * g.ow;
          if (iy < 0 || iy >= g.h) {
            for (int64_t ox = 0; ox < g.ow; ++ox) out[ox] = T(0);
            continue;
          }
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t ix = ox * p.stride[1] - p.padding[1] + j * p.dilation[1];
            out[ox] = (ix >= 0 && ix < g.w) ? plane[iy * g.w + ix] : T(0);
          }
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
  for (int64_t ci = 0; ci < g.c; ++ci) {
    T* plane = dx + ci * g.h * g.w;
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* row = cols + ((ci * g.kh + i) * g.kw + j) * positions;
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          const int64_t iy = oy * p.stride[0] - p.padding[0] + i * p.dilation[0];
          if (iy < 0 || iy >= g.h) continue;
          const T* in = row + oy * g.ow;
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            const int64_t ix = ox * p.stride[1] - p.padding[1] + j * p.dilation[1];
            if (ix >= 0 && ix < g.w) plane[iy * g.w + ix] += in[ox];
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
    std::vector<T> cols(static_cast<size_t>(taps * positions));
    const T* px = x.data<T>();
    const T* pw = weight.data<T>();
    const T* pb = bias.defined() ? bias.data<T>() : nullptr;
    T* py = y.data<T>();
    for (int64_t s = 0; s < g.n; ++s) {
      Im2Col(px + s * g.c * g.h * g.w, g, cols.data());
      T* out = py + s * g.o * positions;
      // y[s] (o, positions) = weight (o, taps) cols (taps, positions).
      GemmRaw<T>(false, false, g.o, positions, taps, T(1), pw, taps, cols.data(), positions, T(0),
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
    std::vector<T> cols(static_cast<size_t>(taps * positions));
    const T* pdy = dy.data<T>();
    const T* pw = weight.data<T>();
    T* pdx = dx.data<T>();
    for (int64_t i = 0; i < dx.numel(); ++i) pdx[i] = T(0);
    for (int64_t s = 0; s < g.n; ++s) {
      // dcols (taps, positions) = weight^T (taps, o) dy[s] (o, positions).
      GemmRaw<T>(true, false, taps, positions, g.o, T(1), pw, taps, pdy + s * g.o * positions,
                 positions, T(0), cols.data(), positions);
      Col2Im(cols.data(), g, pdx + s * g.c * g.h * g.w);
    }
  });
}

void Conv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                             const Tensor& dweight) {
  const int64_t taps = g.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_filter", [&]<typename T>() {
    std::vector<T> cols(static_cast<size_t>(taps * positions));
    const T* pdy = dy.data<T>();
    const T* px = x.data<T>();
    T* pdw = dweight.data<T>();
    for (int64_t i = 0; i < dweight.numel(); ++i) pdw[i] = T(0);
    for (int64_t s = 0; s < g.n; ++s) {
      Im2Col(px + s * g.c * g.h * g.w, g, cols.data());
      // dweight (o, taps) += dy[s] (o, positions) cols^T (positions, taps).
      GemmRaw<T>(false, true, g.o, taps, positions, T(1), pdy + s * g.o * positions, positions,
                 cols.data(), positions, T(1), pdw, taps);
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
