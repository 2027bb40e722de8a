// CUDA kernels of the core's in-place methods, random factories and dtype
// conversion. One thread per element, int64 indices, on the thread's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "nn/cuda/context.h"
#include "nn/ops/internal/fill_kernels.h"
#include "nn/random.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

// One element converted as the CPU's ConvertHost does: a direct cast (so
// int64 -> uint8 wraps and int64 -> float32 rounds once, not via double), and
// bfloat16 through float with round-to-nearest-even.
// float16 likewise through float (round to nearest even).
template <typename S> __device__ auto Widen(S s) {
  if constexpr (std::is_same_v<S, BFloat16>) {
    return __bfloat162float(__ushort_as_bfloat16(s.bits));
  } else if constexpr (std::is_same_v<S, Float16>) {
    return __half2float(__ushort_as_half(s.bits));
  } else {
    return s;
  }
}
template <typename S, typename D> __device__ D ConvertOne(S s) {
  if constexpr (std::is_same_v<S, D>) {
    return s;
  } else if constexpr (std::is_same_v<D, BFloat16>) {
    D d;
    d.bits = __bfloat16_as_ushort(__float2bfloat16_rn(static_cast<float>(Widen(s))));
    return d;
  } else if constexpr (std::is_same_v<D, Float16>) {
    // NaN as the host's Float16::FromFloat writes it (CUDA's own is 0x7fff).
    const float f = static_cast<float>(Widen(s));
    D d;
    d.bits = isnan(f) ? (signbit(f) ? 0xfe00 : 0x7e00) : __half_as_ushort(__float2half_rn(f));
    return d;
  } else {
    return static_cast<D>(Widen(s));
  }
}

template <typename T> __global__ void FillKernel(T* p, int64_t n, T v) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = v;
}
template <typename T> __global__ void AxpyKernel(T* y, const T* x, int64_t n, T a) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
// bfloat16: float arithmetic, one rounding per element.
__global__ void AxpyBf16Kernel(__nv_bfloat16* y, const __nv_bfloat16* x, int64_t n, float a) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + a * __bfloat162float(x[i]));
}
template <typename T> __global__ void ScaleKernel(T* p, int64_t n, T v) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] *= v;
}
__global__ void ScaleBf16Kernel(__nv_bfloat16* p, int64_t n, float v) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = __float2bfloat16_rn(__bfloat162float(p[i]) * v);
}
template <typename T>
__global__ void RandomKernel(T* p, int64_t n, uint64_t seed, uint64_t stream, uint64_t offset,
                             bool normal) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const Philox4x32 r = PhiloxAt(seed, stream, offset, static_cast<uint64_t>(i));
  p[i] = normal ? static_cast<T>(NormalFromBits(r.out[0], r.out[1]))
                : static_cast<T>(UniformFromBits(r.out[0]));
}
template <typename S, typename D> __global__ void ConvertKernel(const S* s, D* d, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) d[i] = ConvertOne<S, D>(s[i]);
}

}  // namespace

void FillCuda(const Tensor& t, double value) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(t.device());
  TANDEM_DISPATCH_ALL(t.dtype(), [&]<typename T>() {
    T v;
    if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>) {
      v = T(static_cast<float>(value));
    } else {
      v = static_cast<T>(value);
    }
    FillKernel<T><<<Blocks(n), kThreads, 0, stream>>>(t.data<T>(), n, v);
  });
  TANDEM_CHECK_LAUNCH("FillKernel", t.device());
}

void AxpyCuda(const Tensor& y, const Tensor& x, double alpha) {
  const int64_t n = y.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(y.device());
  if (y.dtype() == kInt64) {  // counters (BatchNorm2d's num_batches_tracked)
    AxpyKernel<int64_t><<<Blocks(n), kThreads, 0, stream>>>(y.data<int64_t>(), x.data<int64_t>(), n,
                                                            static_cast<int64_t>(alpha));
    TANDEM_CHECK_LAUNCH("AxpyKernel", y.device());
    return;
  }
  TANDEM_DISPATCH_FLOATING(y.dtype(), "add_", [&]<typename T>() {
    if constexpr (std::is_same_v<T, BFloat16>) {
      AxpyBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(
          reinterpret_cast<__nv_bfloat16*>(y.data<T>()),
          reinterpret_cast<const __nv_bfloat16*>(x.data<T>()), n, static_cast<float>(alpha));
    } else {
      AxpyKernel<T><<<Blocks(n), kThreads, 0, stream>>>(y.data<T>(), x.data<T>(), n,
                                                        static_cast<T>(alpha));
    }
  });
  TANDEM_CHECK_LAUNCH("AxpyKernel", y.device());
}

void ScaleCuda(const Tensor& t, double value) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(t.device());
  TANDEM_DISPATCH_FLOATING(t.dtype(), "mul_", [&]<typename T>() {
    if constexpr (std::is_same_v<T, BFloat16>) {
      ScaleBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(
          reinterpret_cast<__nv_bfloat16*>(t.data<T>()), n, static_cast<float>(value));
    } else {
      ScaleKernel<T><<<Blocks(n), kThreads, 0, stream>>>(t.data<T>(), n, static_cast<T>(value));
    }
  });
  TANDEM_CHECK_LAUNCH("ScaleKernel", t.device());
}

void FillRandomCuda(const Tensor& t, uint64_t seed, uint64_t stream_id, uint64_t offset,
                    bool normal) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(t.device());
  TANDEM_DISPATCH_FLOAT(t.dtype(), "randn", [&]<typename T>() {
    RandomKernel<T><<<Blocks(n), kThreads, 0, stream>>>(t.data<T>(), n, seed, stream_id, offset,
                                                        normal);
  });
  TANDEM_CHECK_LAUNCH("RandomKernel", t.device());
}

void ConvertCuda(const Tensor& src, const Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(src.device());
  TANDEM_DISPATCH_ALL(src.dtype(), [&]<typename S>() {
    TANDEM_DISPATCH_ALL(dst.dtype(), [&]<typename D>() {
      ConvertKernel<S, D><<<Blocks(n), kThreads, 0, stream>>>(src.data<S>(), dst.data<D>(), n);
    });
  });
  TANDEM_CHECK_LAUNCH("ConvertKernel", src.device());
}

}  // namespace tandem::nn::ops::internal
