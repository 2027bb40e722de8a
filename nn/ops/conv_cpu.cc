// CPU kernels of the conv family: im2col + OpenBLAS gemm, per chunk of samples
// and (grouped convolutions) per group.
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "nn/error.h"
#include "nn/ops/internal/conv_depthwise_kernels.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// cols (c*kh*kw, oh*ow), rows `ld` elements apart: row (ci, i, j) holds x[ci] at
// the window tap (i, j) of every output position; zero where the tap falls in the
// padding. ld > oh*ow puts several images' columns side by side.
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

// out[0, n) = in[0, n) for the short rows of small images: a plain loop the
// compiler vectorises, without a call per row.
template <typename T>
inline void CopyRow(const T* __restrict in, int64_t n, T* __restrict out) {
  for (int64_t k = 0; k < n; ++k) out[k] = in[k];
}
template <typename T>
inline void ZeroRow(T* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) out[k] = T(0);
}

template <typename T>
void Im2Col(const T* x, const Conv2dGeometry& g, T* cols, int64_t ld) {
  const auto& p = g.params;
  const int64_t sx = p.stride[1];
  // At stride 1 with as many output as input columns ("same" padding), input and
  // output rows are both w long and output row oy reads input row oy + y_offset,
  // so a tap's valid rows are one shifted span of the plane: one copy, then the
  // columns the tap puts in the padding are zeroed.
  const bool flat = sx == 1 && p.stride[0] == 1 && g.ow == g.w;
  for (int64_t ci = 0; ci < g.c; ++ci) {
    const T* plane = x + ci * g.h * g.w;
    for (int64_t i = 0; i < g.kh; ++i) {
      // Output rows [ry.lo, ry.hi) read input rows inside the plane.
      const int64_t y_offset = i * p.dilation[0] - p.padding[0];
      const TapRange ry = ValidColumns(g.oh, g.h, p.stride[0], y_offset);
      for (int64_t j = 0; j < g.kw; ++j) {
        T* row = cols + ((ci * g.kh + i) * g.kw + j) * ld;
        const int64_t offset = j * p.dilation[1] - p.padding[1];
        const TapRange r = ValidColumns(g.ow, g.w, sx, offset);
        std::fill(row, row + ry.lo * g.ow, T(0));
        std::fill(row + ry.hi * g.ow, row + g.oh * g.ow, T(0));
        if (r.lo >= r.hi) {
          std::fill(row + ry.lo * g.ow, row + ry.hi * g.ow, T(0));
          continue;
        }
        if (flat) {
          if (ry.lo >= ry.hi) continue;
          // Flat index f = oy * w + ox reads plane[f + y_offset * w + offset]; the
          // span from the first valid tap to the last stays inside the plane.
          const int64_t begin = ry.lo * g.w + r.lo, end = (ry.hi - 1) * g.w + r.hi;
          std::copy(plane + begin + y_offset * g.w + offset, plane + end + y_offset * g.w + offset,
                    row + begin);
          for (int64_t oy = ry.lo; oy < ry.hi; ++oy) {
            ZeroRow(row + oy * g.ow, r.lo);
            ZeroRow(row + oy * g.ow + r.hi, g.ow - r.hi);
          }
          continue;
        }
        for (int64_t oy = ry.lo; oy < ry.hi; ++oy) {
          const int64_t iy = oy * p.stride[0] + y_offset;
          T* out = row + oy * g.ow;
          ZeroRow(out, r.lo);
          const T* in = plane + iy * g.w + r.lo * sx + offset;  // tap of column r.lo
          if (sx == 1) {
            CopyRow(in, r.hi - r.lo, out + r.lo);
          } else {
            for (int64_t ox = r.lo; ox < r.hi; ++ox) out[ox] = in[(ox - r.lo) * sx];
          }
          ZeroRow(out + r.hi, g.ow - r.hi);
        }
      }
    }
  }
}

// The adjoint of Im2Col (same layout): dx (c, h, w) += each column entry at its tap.
template <typename T>
void Col2Im(const T* cols, int64_t ld, const Conv2dGeometry& g, T* dx) {
  const auto& p = g.params;
  const int64_t sx = p.stride[1];
  for (int64_t ci = 0; ci < g.c; ++ci) {
    T* plane = dx + ci * g.h * g.w;
    for (int64_t i = 0; i < g.kh; ++i) {
      for (int64_t j = 0; j < g.kw; ++j) {
        const T* row = cols + ((ci * g.kh + i) * g.kw + j) * ld;
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

// Bytes of im2col columns per chunk and OpenBLAS thread: about half a core's
// L2 (1 MiB here), so the columns written by im2col are still in cache when the
// GEMM reads them. Measured on the 2-core build machine (docs/benchmarks.md):
// 256 KiB to 1 MiB perform alike, 8-16 MiB chunks up to 20% slower.
constexpr int64_t kColBytesPerThread = int64_t{512} << 10;

// OpenBLAS splits a GEMM's columns across its threads: each thread's share of a
// chunk stays at kColBytesPerThread. The chunking, and with it the summation
// order of dweight, depends on the shapes and OpenBLAS's thread count only.
int64_t ColBytes() { return kColBytesPerThread * std::max(1, openblas_get_num_threads()); }

// The geometry of one group of a grouped convolution: c / groups input and
// o / groups output channels, groups 1. g itself when groups is 1. Im2Col and
// Col2Im take it with x / dx pointing at the group's first channel.
Conv2dGeometry OneGroup(const Conv2dGeometry& g) {
  Conv2dGeometry one = g;
  one.c = g.c / g.params.groups;
  one.o = g.o / g.params.groups;
  one.params.groups = 1;
  return one;
}

// Images per chunk: as many as keep the chunk's column matrix
// (taps, chunk * positions) within ColBytes() (at least one, at most n).
int64_t ChunkImages(const Conv2dGeometry& g, int64_t elem_bytes) {
  const int64_t per_image = g.c * g.kh * g.kw * g.oh * g.ow * elem_bytes;
  const int64_t cap = ColBytes();
  return std::clamp<int64_t>(per_image > 0 ? cap / per_image : g.n, 1, std::max<int64_t>(g.n, 1));
}

// dst (o, count, positions) = src[s] (o, positions) for the count images of src
// (count, o, positions): the chunk's dy with the images side by side.
template <typename T>
void GatherChunk(const T* src, int64_t o, int64_t positions, int64_t count, T* dst) {
  for (int64_t oc = 0; oc < o; ++oc) {
    for (int64_t s = 0; s < count; ++s) {
      const T* in = src + (s * o + oc) * positions;
      std::copy(in, in + positions, dst + (oc * count + s) * positions);
    }
  }
}

// bfloat16 off oneDNN's bfloat16 primitives (TakesDnnl false: no avx512_bf16 /
// AMX, nn::set_cpu_bf16_native(false), the im2col path): each kernel runs its float32 self
// on float32 copies of the operands (exact: every bfloat16 is a float32) and
// rounds the float32 result into `out` once.
Tensor Float32Of(const Tensor& t) { return t.defined() ? t.detach().to(kFloat32) : t; }

template <typename Kernel>
void IntoBFloat16(const Tensor& out, Kernel&& kernel) {
  Tensor out32 = empty(out.shape(), {.dtype = kFloat32});
  kernel(out32);
  out.detach().copy_(out32);
}

std::atomic<CpuConvPath> cpu_conv_path{CpuConvPath::kAuto};

// kAuto's Winograd choice (UseWinograd): at least 64 input and output channels
// and 64Ki (tiles of 4x4 outputs per image) x c x o. Below that the transforms
// and the small GEMMs cost what the fewer multiplications save: measured on a
// 2-core AVX2 machine against oneDNN's direct kernels (docs/benchmarks.md),
// ResNet-18's 3x3 layers (64-512 channels, 32x32-4x4, 256Ki each) ran 1.3-2.2x
// faster forward + backward, 64 channels on 16x16 (64Ki) broke even, smaller
// ones (the ConvNet's 32 -> 64 and 64 -> 64 on 6x6) ran 0.5-0.9x as fast.
constexpr int64_t kWinogradMinChannels = 64;
constexpr int64_t kWinogradMinWork = int64_t{1} << 16;

// nn::set_cpu_winograd's switch: kAuto's Winograd choice on or off.
std::atomic<bool> winograd_on{true};

// nn::set_cpu_bf16_native's switch.
std::atomic<bool> bf16_native_on{true};

}  // namespace

void SetCpuConvPath(CpuConvPath path) { cpu_conv_path.store(path, std::memory_order_relaxed); }
CpuConvPath GetCpuConvPath() { return cpu_conv_path.load(std::memory_order_relaxed); }

bool UseWinograd(DType dtype, const Conv2dGeometry& g) {
  // bfloat16 is never Winograd's: on oneDNN's bfloat16 primitives it stays there, and
  // emulated its kernels re-enter as float32 on widened
  // copies and take float32's choice. Depthwise shapes (one channel) take the
  // direct kernels first on both paths that allow Winograd.
  if (dtype != kFloat32 || !WinogradApplies(g) || IsDepthwise(g)) return false;
  switch (GetCpuConvPath()) {
    case CpuConvPath::kWinograd:
      return true;
    case CpuConvPath::kAuto:
      return winograd_on.load(std::memory_order_relaxed) && g.c >= kWinogradMinChannels &&
             g.o >= kWinogradMinChannels &&
             ((g.oh + 3) / 4) * ((g.ow + 3) / 4) * g.c * g.o >= kWinogradMinWork;
    default:
      return false;
  }
}

bool CpuBf16Native() {
#if TANDEM_WITH_DNNL
  return bf16_native_on.load(std::memory_order_relaxed) && DnnlHasBf16();
#else
  return false;
#endif
}

bool CpuConvUsesDnnl() {
#if TANDEM_WITH_DNNL
  return GetCpuConvPath() != CpuConvPath::kIm2col;
#else
  const CpuConvPath path = GetCpuConvPath();
  TANDEM_CHECK(path == CpuConvPath::kAuto || path == CpuConvPath::kIm2col ||
                   path == CpuConvPath::kWinograd,
               "conv2d: the oneDNN path was asked for but tandem was built without oneDNN "
               "(TANDEM_DNNL=OFF or libdnnl-dev missing)");
  return false;
#endif
}

}  // namespace tandem::nn::ops::internal

namespace tandem::nn {

std::string cpu_conv_backend() {
#if TANDEM_WITH_DNNL
  std::string backend = ops::internal::DnnlVersion();
#else
  std::string backend = "im2col + OpenBLAS";
#endif
  if (cpu_winograd()) backend += "; Winograd F(4x4, 3x3) for large 3x3 layers";
  return backend;
}

void set_cpu_winograd(bool enable) {
  ops::internal::winograd_on.store(enable, std::memory_order_relaxed);
}
bool cpu_winograd() { return ops::internal::winograd_on.load(std::memory_order_relaxed); }

bool cpu_bf16_supported() {
#if TANDEM_WITH_DNNL
  return ops::internal::DnnlHasBf16();
#else
  return false;
#endif
}
bool cpu_bf16_native() { return ops::internal::CpuBf16Native(); }
void set_cpu_bf16_native(bool enable) {
  ops::internal::bf16_native_on.store(enable, std::memory_order_relaxed);
}
std::string cpu_bf16_backend() {
  if (cpu_bf16_native()) return "oneDNN bfloat16 primitives (avx512_core_bf16)";
#if TANDEM_WITH_DNNL
  if (cpu_bf16_supported()) return "emulated in float32 (switched off)";
  return "emulated in float32 (no avx512_bf16 / amx_bf16 for oneDNN)";
#else
  return "emulated in float32 (built without oneDNN)";
#endif
}

}  // namespace tandem::nn

namespace tandem::nn::ops::internal {

// Each kernel works on chunks of ChunkImages images: the chunk's im2col columns
// side by side in one (taps, chunk * positions) matrix and one GEMM per chunk
// instead of one small GEMM per image (OpenBLAS is far from peak, and slower
// with its threads than without, on the per-image sizes of small convs).
// Results are deterministic: same inputs and OpenBLAS thread count, same bits.

namespace {
// float32 depthwise calls on the default path take the direct kernels
// (conv_depthwise_cpu.cc): on oneDNN their layout reorders cost more than the
// convolution. The other paths keep them, for the tests that compare paths.
bool DirectDepthwise(DType dtype, const Conv2dGeometry& g) {
  const CpuConvPath path = GetCpuConvPath();
  return dtype == kFloat32 && IsDepthwise(g) &&
         (path == CpuConvPath::kAuto || path == CpuConvPath::kWinograd);
}

#if TANDEM_WITH_DNNL
// Whether a call of `dtype` on sizes g runs on oneDNN now, the one place that
// decides it: float32 with a non-empty input (an empty one, H or W 0 and the
// output all padding, takes im2col, whose windows see only zeros) on a path that
// uses oneDNN, unless the direct depthwise or the Winograd kernels take it first.
bool TakesDnnl(DType dtype, const Conv2dGeometry& g) {
  return (dtype == kFloat32 || (dtype == kBFloat16 && CpuBf16Native())) && g.h > 0 && g.w > 0 && CpuConvUsesDnnl() &&
         !DirectDepthwise(dtype, g) && !UseWinograd(dtype, g);
}
#endif
}  // namespace

void Conv2dForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dGeometry& g, const Tensor& y, bool relu,
                      Conv2dSavedInput* saved_x) {
  if (DirectDepthwise(x.dtype(), g)) return DepthwiseConv2dForwardCpu(x, weight, bias, g, y, relu);
  if (UseWinograd(x.dtype(), g)) return Conv2dForwardWinograd(x, weight, bias, g, y, relu);
#if TANDEM_WITH_DNNL
  if (TakesDnnl(x.dtype(), g)) {
    return Conv2dForwardDnnl(x, weight, bias, g, y, relu, saved_x);
  }
#endif
  (void)saved_x;  // only the oneDNN path reorders x
  if (relu) {  // im2col: the convolution, then relu's own kernel in place
    Conv2dForwardCpu(x, weight, bias, g, y, false);
    return UnaryCpu(UnaryOp::kRelu, y, y, 0, 0);
  }
  if (x.dtype() == kBFloat16) {
    return IntoBFloat16(y, [&](const Tensor& y32) {
      Conv2dForwardCpu(Float32Of(x), Float32Of(weight), Float32Of(bias), g, y32);
    });
  }
  // Per group k: y[:, k og : (k+1) og] = weight[k og : (k+1) og] im2col(x[:, k cg : (k+1) cg]),
  // one GEMM per group and chunk (og, cg: the group's output / input channels).
  const Conv2dGeometry one = OneGroup(g);
  const int64_t groups = g.params.groups, og = one.o, cg = one.c;
  const int64_t taps = one.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(x.dtype(), "conv2d", [&]<typename T>() {
    const int64_t chunk = ChunkImages(one, sizeof(T));
    // From the host allocator's cache: no fresh pages (and their faults) per call.
    const TensorOptions host{.dtype = DTypeOf<T>::value, .device = Device::CPU()};
    const Tensor cols_buffer = empty({taps * chunk * positions}, host);
    const Tensor out_buffer = empty({chunk > 1 ? g.o * chunk * positions : 0}, host);
    T* cols = cols_buffer.host_data<T>();
    const T* px = x.host_data<T>();
    const T* pw = weight.host_data<T>();
    const T* pb = bias.defined() ? bias.host_data<T>() : nullptr;
    T* py = y.host_data<T>();
    for (int64_t first = 0; first < g.n; first += chunk) {
      const int64_t count = std::min(chunk, g.n - first), ld = count * positions;
      T* y_first = py + first * g.o * positions;
      if (count == 1) {
        // y[first] (o, positions) = weight (o, taps) cols (taps, positions), by group.
        for (int64_t k = 0; k < groups; ++k) {
          Im2Col(px + (first * g.c + k * cg) * g.h * g.w, one, cols, ld);
          GemmRaw<T>(false, false, og, positions, taps, T(1), pw + k * og * taps, taps, cols,
                     positions, T(0), y_first + k * og * positions, positions);
        }
        if (pb == nullptr) continue;
        for (int64_t oc = 0; oc < g.o; ++oc) {
          T* plane = y_first + oc * positions;
          for (int64_t q = 0; q < positions; ++q) plane[q] += pb[oc];
        }
        continue;
      }
      // out (o, count * positions) = weight (o, taps) cols (taps, count * positions),
      // then y[first + s] (o, positions) = out[:, s] (+ bias).
      T* out = out_buffer.host_data<T>();
      for (int64_t k = 0; k < groups; ++k) {
        for (int64_t s = 0; s < count; ++s) {
          Im2Col(px + ((first + s) * g.c + k * cg) * g.h * g.w, one, cols + s * positions, ld);
        }
        GemmRaw<T>(false, false, og, ld, taps, T(1), pw + k * og * taps, taps, cols, ld, T(0),
                   out + k * og * ld, ld);
      }
      for (int64_t s = 0; s < count; ++s) {
        for (int64_t oc = 0; oc < g.o; ++oc) {
          const T* in = out + oc * ld + s * positions;
          T* plane = y_first + (s * g.o + oc) * positions;
          if (pb == nullptr) {
            std::copy(in, in + positions, plane);
          } else {
            const T b = pb[oc];
            for (int64_t q = 0; q < positions; ++q) plane[q] = in[q] + b;
          }
        }
      }
    }
  });
}

void Conv2dBackwardDataCpu(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                           const Tensor& dx) {
  if (DirectDepthwise(dy.dtype(), g)) return DepthwiseConv2dBackwardDataCpu(dy, weight, g, dx);
  if (UseWinograd(dy.dtype(), g)) return Conv2dBackwardDataWinograd(dy, weight, g, dx);
#if TANDEM_WITH_DNNL
  if (TakesDnnl(dy.dtype(), g)) {
    return Conv2dBackwardDataDnnl(dy, weight, g, dx);
  }
#endif
  if (dy.dtype() == kBFloat16) {
    return IntoBFloat16(dx, [&](const Tensor& dx32) {
      Conv2dBackwardDataCpu(Float32Of(dy), Float32Of(weight), g, dx32);
    });
  }
  const Conv2dGeometry one = OneGroup(g);
  const int64_t groups = g.params.groups, og = one.o, cg = one.c;
  const int64_t taps = one.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_data", [&]<typename T>() {
    const int64_t chunk = ChunkImages(one, sizeof(T));
    // From the host allocator's cache: no fresh pages (and their faults) per call.
    const TensorOptions host{.dtype = DTypeOf<T>::value, .device = Device::CPU()};
    const Tensor cols_buffer = empty({taps * chunk * positions}, host);
    const Tensor dy_buffer = empty({chunk > 1 ? g.o * chunk * positions : 0}, host);
    T* cols = cols_buffer.host_data<T>();
    const T* pdy = dy.host_data<T>();
    const T* pw = weight.host_data<T>();
    T* pdx = dx.host_data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    for (int64_t first = 0; first < g.n; first += chunk) {
      const int64_t count = std::min(chunk, g.n - first), ld = count * positions;
      const T* dy_chunk = pdy + first * g.o * positions;
      if (count > 1) {
        GatherChunk(dy_chunk, g.o, positions, count, dy_buffer.host_data<T>());
        dy_chunk = dy_buffer.host_data<T>();
      }
      // Per group: dcols (taps, count * positions) = weight^T (taps, og) dy (og, count * positions).
      for (int64_t k = 0; k < groups; ++k) {
        GemmRaw<T>(true, false, taps, ld, og, T(1), pw + k * og * taps, taps,
                   dy_chunk + k * og * ld, ld, T(0), cols, ld);
        for (int64_t s = 0; s < count; ++s) {
          Col2Im(cols + s * positions, ld, one, pdx + ((first + s) * g.c + k * cg) * g.h * g.w);
        }
      }
    }
  });
}

void Conv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                             const Tensor& dweight) {
  if (DirectDepthwise(dy.dtype(), g)) return DepthwiseConv2dBackwardFilterCpu(dy, x, g, dweight);
  if (UseWinograd(dy.dtype(), g)) return Conv2dBackwardFilterWinograd(dy, x, g, dweight);
#if TANDEM_WITH_DNNL
  if (TakesDnnl(dy.dtype(), g)) {
    return Conv2dBackwardFilterDnnl(dy, x, g, dweight);
  }
#endif
  if (dy.dtype() == kBFloat16) {
    return IntoBFloat16(dweight, [&](const Tensor& dw32) {
      Conv2dBackwardFilterCpu(Float32Of(dy), Float32Of(x), g, dw32);
    });
  }
  const Conv2dGeometry one = OneGroup(g);
  const int64_t groups = g.params.groups, og = one.o, cg = one.c;
  const int64_t taps = one.c * g.kh * g.kw, positions = g.oh * g.ow;
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_filter", [&]<typename T>() {
    const int64_t chunk = ChunkImages(one, sizeof(T));
    // From the host allocator's cache: no fresh pages (and their faults) per call.
    const TensorOptions host{.dtype = DTypeOf<T>::value, .device = Device::CPU()};
    const Tensor cols_buffer = empty({taps * chunk * positions}, host);
    const Tensor dy_buffer = empty({chunk > 1 ? g.o * chunk * positions : 0}, host);
    T* cols = cols_buffer.host_data<T>();
    const T* pdy = dy.host_data<T>();
    const T* px = x.host_data<T>();
    T* pdw = dweight.host_data<T>();
    for (int64_t first = 0; first < g.n; first += chunk) {
      const int64_t count = std::min(chunk, g.n - first), ld = count * positions;
      const T* dy_chunk = pdy + first * g.o * positions;
      if (count > 1) {
        GatherChunk(dy_chunk, g.o, positions, count, dy_buffer.host_data<T>());
        dy_chunk = dy_buffer.host_data<T>();
      }
      for (int64_t k = 0; k < groups; ++k) {
        for (int64_t s = 0; s < count; ++s) {
          Im2Col(px + ((first + s) * g.c + k * cg) * g.h * g.w, one, cols + s * positions, ld);
        }
        // dweight (og, taps) (+)= dy (og, count * positions) cols^T (count * positions, taps).
        GemmRaw<T>(false, true, og, taps, ld, T(1), dy_chunk + k * og * ld, ld, cols, ld,
                   first == 0 ? T(0) : T(1), pdw + k * og * taps, taps);
      }
    }
  });
}

void Conv2dBackwardCpu(const Tensor& dy, const Tensor& x, const Tensor& weight,
                       const Conv2dGeometry& g, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Conv2dSavedInput& saved_x) {
#if TANDEM_WITH_DNNL
  if (TakesDnnl(dy.dtype(), g)) {
    return Conv2dBackwardDnnl(dy, x, weight, g, dx, dweight, dbias, saved_x);
  }
#endif
  (void)saved_x;
  if (dx.defined()) Conv2dBackwardDataCpu(dy, weight, g, dx);
  if (dweight.defined()) Conv2dBackwardFilterCpu(dy, x, g, dweight);
  if (dbias.defined()) Conv2dBackwardBiasCpu(dy, dbias);
}

Conv2dReluMaxPoolLayout Conv2dReluMaxPoolLayoutCpu(DType dtype, const Conv2dGeometry& g,
                                                   const Pool2dGeometry& pool, bool bias) {
#if TANDEM_WITH_DNNL
  // bfloat16's max pooling always runs on tandem's kernels (oneDNN's pooling
  // path is float32's).
  const bool applies = g.n > 0 && (dtype == kFloat32 || dtype == kBFloat16) &&
                       TakesDnnl(dtype, g) && MaxPoolTilesChannelsLast(pool) && pool.oh > 0 &&
                       pool.ow > 0 &&
                       (dtype == kBFloat16 ||
                        ResolveCpuPoolPath(pool, /*max=*/true) == CpuPoolPath::kOwn);
  return applies ? Conv2dReluMaxPoolLayoutDnnl(dtype, g, bias) : Conv2dReluMaxPoolLayout{};
#else
  (void)dtype, (void)g, (void)pool, (void)bias;
  return {};
#endif
}

void Conv2dReluMaxPoolForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                 const Conv2dGeometry& g, const Pool2dGeometry& pool,
                                 const Conv2dReluMaxPoolLayout& layout, const Tensor& out,
                                 const Tensor& where, Conv2dSavedInput* saved_x) {
#if TANDEM_WITH_DNNL
  Conv2dReluMaxPoolForwardDnnl(x, weight, bias, g, pool, layout, out, where, saved_x);
#else
  (void)x, (void)weight, (void)bias, (void)g, (void)pool, (void)layout, (void)out, (void)where,
      (void)saved_x;
  TANDEM_CHECK(false, "conv2d_relu_max_pool2d: the fused path needs oneDNN");
#endif
}

void Conv2dReluMaxPoolBackwardCpu(const Tensor& dout, const Tensor& where, const Tensor& x,
                                  const Tensor& weight, const Conv2dGeometry& g,
                                  const Pool2dGeometry& pool,
                                  const Conv2dReluMaxPoolLayout& layout, const Tensor& dx,
                                  const Tensor& dweight, const Tensor& dbias,
                                  const Conv2dSavedInput& saved_x) {
#if TANDEM_WITH_DNNL
  // Conv2dBackwardCpu's choice now (the path may have changed since forward).
  Conv2dReluMaxPoolBackwardDnnl(dout, where, x, weight, g, pool, layout, TakesDnnl(dout.dtype(), g),
                                dx, dweight, dbias, saved_x);
#else
  (void)dout, (void)where, (void)x, (void)weight, (void)g, (void)pool, (void)layout, (void)dx,
      (void)dweight, (void)dbias, (void)saved_x;
  TANDEM_CHECK(false, "conv2d_relu_max_pool2d: the fused path needs oneDNN");
#endif
}

void Conv2dBackwardBiasCpu(const Tensor& dy, const Tensor& dbias) {
  if (dy.dtype() == kBFloat16) {
    return IntoBFloat16(dbias,
                        [&](const Tensor& db32) { Conv2dBackwardBiasCpu(Float32Of(dy), db32); });
  }
  const int64_t n = dy.size(0), o = dy.size(1), positions = dy.size(2) * dy.size(3);
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "conv2d_backward_bias", [&]<typename T>() {
    // kLanes partial sums (element q of a plane goes to lane q % kLanes), added
    // in a fixed order at the end: vectorisable and deterministic.
    constexpr int64_t kLanes = 16;
    const T* pdy = dy.host_data<T>();
    T* pdb = dbias.host_data<T>();
    for (int64_t oc = 0; oc < o; ++oc) {
      T lanes[kLanes] = {};
      for (int64_t s = 0; s < n; ++s) {
        const T* plane = pdy + (s * o + oc) * positions;
        int64_t q = 0;
        for (; q + kLanes <= positions; q += kLanes) {
          for (int64_t l = 0; l < kLanes; ++l) lanes[l] += plane[q + l];
        }
        for (int64_t l = 0; q < positions; ++q, ++l) lanes[l] += plane[q];
      }
      T sum = T(0);
      for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
      pdb[oc] = sum;
    }
  });
}

}  // namespace tandem::nn::ops::internal
