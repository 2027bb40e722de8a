// CUDA kernels of the reduce family. Deterministic: every sum combines its terms
// in an order fixed by the shapes and the launch configuration alone (strided
// per-thread sums, then BlockReduce's fixed tree; no float atomics), so the same
// input gives the same bits. int64 indices; all on the thread's stream.
#include "nn/cuda/context.h"
#include "nn/ops/internal/reduce_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;
constexpr int64_t kBlockPerOutputMin = 64;  // reduced size from which a block shares one output
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }
int64_t GridFor(int64_t outputs) { return outputs < kMaxGrid ? outputs : kMaxGrid; }

// Few terms per output: one thread per output element.
template <typename T>
__global__ void SumDimThreadKernel(const T* x, T* out, int64_t outer, int64_t size,
                                   int64_t inner, T scale) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= outer * inner) return;
  const int64_t o = k / inner, i = k % inner;
  const T* p = x + o * size * inner + i;
  T acc = T(0);
  for (int64_t d = 0; d < size; ++d) acc += p[d * inner];
  out[k] = acc * scale;
}

// Many terms per output: one block per output element (grid-strided).
template <typename T>
__global__ void SumDimBlockKernel(const T* x, T* out, int64_t outer, int64_t size,
                                  int64_t inner, T scale) {
  for (int64_t k = blockIdx.x; k < outer * inner; k += gridDim.x) {
    const int64_t o = k / inner, i = k % inner;
    const T* p = x + o * size * inner + i;
    T acc = T(0);
    for (int64_t d = threadIdx.x; d < size; d += blockDim.x) acc += p[d * inner];
    acc = BlockSum(acc);
    if (threadIdx.x == 0) out[k] = acc * scale;
  }
}

// Sum of everything, pass 1: block b sums the elements b, b + grid, ... (per
// thread strided) into partial[b].
template <typename T>
__global__ void SumPartialKernel(const T* x, int64_t n, T* partial) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  T acc = T(0);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    acc += x[i];
  }
  acc = BlockSum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Pass 2: one block sums the partials.
template <typename T>
__global__ void SumFinalKernel(const T* partial, int64_t count, T* out, T scale) {
  T acc = T(0);
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = BlockSum(acc);
  if (threadIdx.x == 0) *out = acc * scale;
}

template <typename T>
__global__ void ExpandDimKernel(const T* g, T* out, int64_t outer, int64_t size, int64_t inner,
                                T scale) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= outer * size * inner) return;
  const int64_t i = k % inner;
  const int64_t o = k / (size * inner);
  out[k] = g[o * inner + i] * scale;
}

// The better of two (value, index) candidates: larger value, then smaller index.
template <typename T>
__device__ __forceinline__ bool Better(T v, int64_t i, T best_v, int64_t best_i) {
  return v > best_v || (v == best_v && i < best_i);
}

template <typename T>
__global__ void ArgmaxThreadKernel(const T* x, int64_t* out, int64_t outer, int64_t size,
                                   int64_t inner) {
  const int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (k >= outer * inner) return;
  const int64_t o = k / inner, i = k % inner;
  const T* p = x + o * size * inner + i;
  T best_v = p[0];
  int64_t best = 0;
  for (int64_t d = 1; d < size; ++d) {
    if (p[d * inner] > best_v) {
      best_v = p[d * inner];
      best = d;
    }
  }
  out[k] = best;
}

template <typename T>
__global__ void ArgmaxBlockKernel(const T* x, int64_t* out, int64_t outer, int64_t size,
                                  int64_t inner) {
  __shared__ T values[kThreads];
  __shared__ int64_t indices[kThreads];
  for (int64_t k = blockIdx.x; k < outer * inner; k += gridDim.x) {
    const int64_t o = k / inner, i = k % inner;
    const T* p = x + o * size * inner + i;
    T best_v = -std::numeric_limits<T>::infinity();
    int64_t best = size;  // "none yet": loses every tie against a real index
    for (int64_t d = threadIdx.x; d < size; d += blockDim.x) {
      if (Better(p[d * inner], d, best_v, best)) {
        best_v = p[d * inner];
        best = d;
      }
    }
    values[threadIdx.x] = best_v;
    indices[threadIdx.x] = best;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s &&
          Better(values[threadIdx.x + s], indices[threadIdx.x + s], values[threadIdx.x],
                 indices[threadIdx.x])) {
        values[threadIdx.x] = values[threadIdx.x + s];
        indices[threadIdx.x] = indices[threadIdx.x + s];
      }
      __syncthreads();
    }
    // As the CPU kernel (which starts from element 0 and takes strictly greater
    // values): index 0 when element 0 is NaN (nothing compares greater) or when
    // no candidate was taken (all NaN).
    if (threadIdx.x == 0) out[k] = (p[0] != p[0] || indices[0] >= size) ? 0 : indices[0];
    __syncthreads();
  }
}

}  // namespace

void SumDimCuda(const Tensor& x, const Tensor& out, DimSplit split, double scale) {
  const int64_t outputs = split.outer * split.inner;
  if (outputs == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), "sum", [&]<typename T>() {
    const T s = static_cast<T>(scale);
    if (split.size < kBlockPerOutputMin) {
      SumDimThreadKernel<T><<<Blocks(outputs), kThreads, 0, stream>>>(
          x.data<T>(), out.data<T>(), split.outer, split.size, split.inner, s);
    } else {
      SumDimBlockKernel<T><<<GridFor(outputs), kThreads, 0, stream>>>(
          x.data<T>(), out.data<T>(), split.outer, split.size, split.inner, s);
    }
  });
  TANDEM_CHECK_LAUNCH("SumDimKernel", x.device());
}

void SumAllCuda(const Tensor& x, const Tensor& out, double scale) {
  const int64_t n = x.numel();
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  // The grid depends only on n, so the combination order does too.
  const int64_t grid = n == 0 ? 1 : (Blocks(n) < 1024 ? Blocks(n) : 1024);
  Tensor partial = empty({grid}, {.dtype = x.dtype(), .device = x.device()});
  TANDEM_DISPATCH_FLOAT(x.dtype(), "sum", [&]<typename T>() {
    SumPartialKernel<T><<<grid, kThreads, 0, stream>>>(x.data<T>(), n, partial.data<T>());
    TANDEM_CHECK_LAUNCH("SumPartialKernel", x.device());
    SumFinalKernel<T><<<1, 1024, 0, stream>>>(partial.data<T>(), grid, out.data<T>(),
                                              static_cast<T>(scale));
    TANDEM_CHECK_LAUNCH("SumFinalKernel", x.device());
  });
}

void ExpandDimCuda(const Tensor& g, const Tensor& out, DimSplit split, double scale) {
  const int64_t n = out.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(g.device());
  TANDEM_DISPATCH_FLOAT(g.dtype(), "expand", [&]<typename T>() {
    ExpandDimKernel<T><<<Blocks(n), kThreads, 0, stream>>>(
        g.data<T>(), out.data<T>(), split.outer, split.size, split.inner, static_cast<T>(scale));
  });
  TANDEM_CHECK_LAUNCH("ExpandDimKernel", g.device());
}

void ArgmaxDimCuda(const Tensor& x, const Tensor& out, DimSplit split) {
  const int64_t outputs = split.outer * split.inner;
  if (outputs == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOAT(x.dtype(), "argmax", [&]<typename T>() {
    if (split.size < kBlockPerOutputMin) {
      ArgmaxThreadKernel<T><<<Blocks(outputs), kThreads, 0, stream>>>(
          x.data<T>(), out.data<int64_t>(), split.outer, split.size, split.inner);
    } else {
      ArgmaxBlockKernel<T><<<GridFor(outputs), kThreads, 0, stream>>>(
          x.data<T>(), out.data<int64_t>(), split.outer, split.size, split.inner);
    }
  });
  TANDEM_CHECK_LAUNCH("ArgmaxKernel", x.device());
}

}  // namespace tandem::nn::ops::internal
