// Kernel interface of the reduce family, shared by the CPU and CUDA files, plus
// the dim helpers and (for .cu files) the deterministic block reductions that the
// softmax, batch-norm and loss kernels reuse. Internal to nn.
#ifndef TANDEM_NN_OPS_INTERNAL_REDUCE_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_REDUCE_KERNELS_H_

#include <cstdint>
#include <limits>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// A contiguous tensor viewed as (outer, size, inner) around one of its dims.
struct DimSplit {
  int64_t outer = 1;
  int64_t size = 1;
  int64_t inner = 1;
};

// `dim` in [-ndim, ndim) -> [0, ndim); otherwise throws naming `op` and the shape.
inline int64_t WrapDim(int64_t dim, const Shape& shape, const char* op) {
  const int64_t ndim = static_cast<int64_t>(shape.size());
  TANDEM_CHECK(dim >= -ndim && dim < ndim, op, ": dim ", dim, " out of range for shape ",
               ShapeToString(shape));
  return dim < 0 ? dim + ndim : dim;
}

// `dim` must already be wrapped.
inline DimSplit SplitAt(const Shape& shape, int64_t dim) {
  DimSplit s;
  for (int64_t i = 0; i < dim; ++i) s.outer *= shape[i];
  s.size = shape[dim];
  for (size_t i = static_cast<size_t>(dim) + 1; i < shape.size(); ++i) s.inner *= shape[i];
  return s;
}

// x: (outer, size, inner) -> out: (outer, inner) = scale * sum over size.
void SumDimCpu(const Tensor& x, const Tensor& out, DimSplit split, double scale);
// out: 0-dim = scale * sum of all of x.
void SumAllCpu(const Tensor& x, const Tensor& out, double scale);
// out: (outer, size, inner) = scale * g (outer, inner) repeated along size.
void ExpandDimCpu(const Tensor& g, const Tensor& out, DimSplit split, double scale);
// x: (outer, size, inner) float -> out: (outer, inner) int64, index of the first max.
void ArgmaxDimCpu(const Tensor& x, const Tensor& out, DimSplit split);
#if TANDEM_WITH_CUDA
void SumDimCuda(const Tensor& x, const Tensor& out, DimSplit split, double scale);
void SumAllCuda(const Tensor& x, const Tensor& out, double scale);
void ExpandDimCuda(const Tensor& g, const Tensor& out, DimSplit split, double scale);
void ArgmaxDimCuda(const Tensor& x, const Tensor& out, DimSplit split);
#endif

#if defined(__CUDACC__)
// Block-wide reductions for blockDim.x a multiple of 32 (at most 1024). Every
// thread must call them; every thread gets the result. The order of combination
// depends only on blockDim.x, so results are bitwise reproducible (no atomics).
struct SumOp {
  template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <typename T> __device__ T operator()(T a, T b) const { return a > b ? a : b; }
};

template <typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T v, Op op, T identity) {
  __shared__ T warp_values[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  __syncthreads();  // an earlier call's readers are done with warp_values
  if (lane == 0) warp_values[warp] = v;
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x / 32);
  if (warp == 0) {
    v = lane < warps ? warp_values[lane] : identity;
    for (int offset = 16; offset > 0; offset /= 2) {
      v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
    }
    if (lane == 0) warp_values[0] = v;
  }
  __syncthreads();
  return warp_values[0];
}

template <typename T> __device__ __forceinline__ T BlockSum(T v) {
  return BlockReduce(v, SumOp{}, T(0));
}
template <typename T> __device__ __forceinline__ T BlockMax(T v) {
  return BlockReduce(v, MaxOp{}, -std::numeric_limits<T>::infinity());
}
#endif  // __CUDACC__

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_REDUCE_KERNELS_H_
