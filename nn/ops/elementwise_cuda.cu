// CUDA kernels of the elementwise family: broadcasting binary ops, unary ops and
// sum_to. int64 indices, everything on the calling thread's stream, no host sync.
// sum_to reduces in a fixed order (no float atomics): same input, same bits.
// bfloat16 tensors are __nv_bfloat16 in the kernels: loaded as float, math in
// float, each output rounded once (__float2bfloat16_rn); sum_to accumulates in float.
#include <cuda_bf16.h>

#include <type_traits>

#include "nn/cuda/bf16.cuh"
#include "nn/cuda/context.h"
#include "nn/ops/internal/elementwise_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

using ::tandem::nn::internal::DevPtr;
using ::tandem::nn::internal::DeviceCompute;
using ::tandem::nn::internal::DeviceType;
using ::tandem::nn::internal::LoadDev;
using ::tandem::nn::internal::StoreDev;

// BroadcastPlan without its std::vector, passed to kernels by value.
struct DevicePlan {
  int ndim;
  int64_t out_sizes[kMaxDims];
  int64_t a_strides[kMaxDims];
  int64_t b_strides[kMaxDims];
};

DevicePlan ToDevicePlan(const BroadcastPlan& plan) {
  DevicePlan d{};
  d.ndim = plan.ndim;
  for (int i = 0; i < kMaxDims; ++i) {
    d.out_sizes[i] = plan.out_sizes[i];
    d.a_strides[i] = plan.a_strides[i];
    d.b_strides[i] = plan.b_strides[i];
  }
  return d;
}

template <typename T>
__global__ void BinarySameShapeKernel(BinaryOp op, const T* a, const T* b, T* out, int64_t n,
                                      DeviceCompute<T> s0, DeviceCompute<T> s1) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = StoreDev<T>(ApplyBinary(op, LoadDev(a[i]), LoadDev(b[i]), s0, s1));
}

template <typename T>
__global__ void BinaryScalarKernel(BinaryOp op, const T* a, const T* b, T* out, int64_t n,
                                   DeviceCompute<T> s0, DeviceCompute<T> s1) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = StoreDev<T>(ApplyBinary(op, LoadDev(a[i]), LoadDev(b[0]), s0, s1));
}

template <typename T>
__global__ void BinaryBroadcastKernel(BinaryOp op, const T* a, const T* b, T* out, int64_t n,
                                      DevicePlan plan, DeviceCompute<T> s0, DeviceCompute<T> s1) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  int64_t rest = i, ia = 0, ib = 0;
  for (int d = plan.ndim - 1; d >= 0; --d) {
    const int64_t idx = rest % plan.out_sizes[d];
    rest /= plan.out_sizes[d];
    ia += idx * plan.a_strides[d];
    ib += idx * plan.b_strides[d];
  }
  out[i] = StoreDev<T>(ApplyBinary(op, LoadDev(a[ia]), LoadDev(b[ib]), s0, s1));
}

template <typename T>
__global__ void UnaryKernel(UnaryOp op, const T* x, T* out, int64_t n, DeviceCompute<T> s0,
                            DeviceCompute<T> s1) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = StoreDev<T>(ApplyUnary(op, LoadDev(x[i]), s0, s1));
}

// sum_to: the dims of x split into kept dims (present in out) and reduced dims
// (broadcast in out). Output element o is the sum over the reduced index r of
// x[base(o) + offset(r)], in increasing r.
struct SumToPlan {
  int kept_ndim = 0;
  int reduced_ndim = 0;
  int64_t kept_sizes[kMaxDims] = {};
  int64_t kept_strides[kMaxDims] = {};  // in x
  int64_t reduced_sizes[kMaxDims] = {};
  int64_t reduced_strides[kMaxDims] = {};  // in x
  int64_t reduced_count = 1;
};

__device__ int64_t Offset(int64_t linear, int ndim, const int64_t* sizes, const int64_t* strides) {
  int64_t off = 0;
  for (int d = ndim - 1; d >= 0; --d) {
    off += (linear % sizes[d]) * strides[d];
    linear /= sizes[d];
  }
  return off;
}

// One thread per output element: for few reduced elements each.
template <typename T>
__global__ void SumToThreadKernel(const T* x, T* out, int64_t n_out, SumToPlan plan) {
  const int64_t o = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (o >= n_out) return;
  const int64_t base = Offset(o, plan.kept_ndim, plan.kept_sizes, plan.kept_strides);
  using C = DeviceCompute<T>;
  C acc = C(0);
  for (int64_t r = 0; r < plan.reduced_count; ++r) {
    acc += LoadDev(
        x[base + Offset(r, plan.reduced_ndim, plan.reduced_sizes, plan.reduced_strides)]);
  }
  out[o] = StoreDev<T>(acc);
}

// One block per output element (grid-strided): each thread sums a fixed strided
// subset, then a fixed-shape tree combines the partial sums.
template <typename T>
__global__ void SumToBlockKernel(const T* x, T* out, int64_t n_out, SumToPlan plan) {
  using C = DeviceCompute<T>;
  __shared__ C partial[kThreads];
  for (int64_t o = blockIdx.x; o < n_out; o += gridDim.x) {
    const int64_t base = Offset(o, plan.kept_ndim, plan.kept_sizes, plan.kept_strides);
    C acc = C(0);
    for (int64_t r = threadIdx.x; r < plan.reduced_count; r += blockDim.x) {
      acc += LoadDev(
          x[base + Offset(r, plan.reduced_ndim, plan.reduced_sizes, plan.reduced_strides)]);
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) out[o] = StoreDev<T>(partial[0]);
    __syncthreads();
  }
}

}  // namespace

void BinaryCuda(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out,
                const BroadcastPlan& plan, double s0, double s1) {
  const int64_t n = out.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(out.device());
  TANDEM_DISPATCH_FLOATING(a.dtype(), "binary op", [&]<typename T>() {
    using D = DeviceType<T>;
    using C = DeviceCompute<D>;
    const C c0 = static_cast<C>(s0), c1 = static_cast<C>(s1);
    const D* pa = DevPtr<T>(a);
    const D* pb = DevPtr<T>(b);
    D* po = DevPtr<T>(out);
    if (plan.same_shape) {
      BinarySameShapeKernel<D><<<Blocks(n), kThreads, 0, stream>>>(op, pa, pb, po, n, c0, c1);
    } else if (b.numel() == 1 && a.numel() == n) {
      BinaryScalarKernel<D><<<Blocks(n), kThreads, 0, stream>>>(op, pa, pb, po, n, c0, c1);
    } else {
      BinaryBroadcastKernel<D><<<Blocks(n), kThreads, 0, stream>>>(op, pa, pb, po, n,
                                                                   ToDevicePlan(plan), c0, c1);
    }
  });
  TANDEM_CHECK_LAUNCH("BinaryKernel", out.device());
}

void UnaryCuda(UnaryOp op, const Tensor& x, const Tensor& out, double s0, double s1) {
  const int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOATING(x.dtype(), "unary op", [&]<typename T>() {
    using D = DeviceType<T>;
    using C = DeviceCompute<D>;
    UnaryKernel<D><<<Blocks(n), kThreads, 0, stream>>>(op, DevPtr<T>(x), DevPtr<T>(out), n,
                                                       static_cast<C>(s0), static_cast<C>(s1));
  });
  TANDEM_CHECK_LAUNCH("UnaryKernel", x.device());
}

void SumToCuda(const Tensor& x, const Tensor& out) {
  const int64_t n_out = out.numel();
  if (n_out == 0) return;
  const BroadcastPlan bplan = PlanBroadcast(out.shape(), x.shape(), "sum_to");
  // The strides below walk x as the broadcast shape: an out that is not
  // broadcastable *to* x (e.g. (2, 3) for x (3)) would make the kernel read past
  // x, a sticky device fault; the dispatcher only checks the sizes afterwards.
  TANDEM_CHECK(NumElements(bplan.out_shape) == x.numel(), "sum_to: ", ShapeToString(out.shape()),
               " does not broadcast to ", ShapeToString(x.shape()));
  SumToPlan plan;
  int64_t x_stride = 1;
  // Walk from the last dim, collecting x's strides; reverse into row-major order after.
  int64_t kept_sizes[kMaxDims], kept_strides[kMaxDims];
  int64_t red_sizes[kMaxDims], red_strides[kMaxDims];
  int nk = 0, nr = 0;
  for (int d = bplan.ndim - 1; d >= 0; --d) {
    const int64_t size = bplan.out_sizes[d];
    if (size != 1) {
      if (bplan.a_strides[d] == 0) {
        red_sizes[nr] = size;
        red_strides[nr++] = x_stride;
      } else {
        kept_sizes[nk] = size;
        kept_strides[nk++] = x_stride;
      }
    }
    x_stride *= size;
  }
  plan.kept_ndim = nk;
  plan.reduced_ndim = nr;
  for (int i = 0; i < nk; ++i) {
    plan.kept_sizes[i] = kept_sizes[nk - 1 - i];
    plan.kept_strides[i] = kept_strides[nk - 1 - i];
  }
  for (int i = 0; i < nr; ++i) {
    plan.reduced_sizes[i] = red_sizes[nr - 1 - i];
    plan.reduced_strides[i] = red_strides[nr - 1 - i];
    plan.reduced_count *= plan.reduced_sizes[i];
  }
  cudaStream_t stream = nn::internal::ThreadStream(x.device());
  TANDEM_DISPATCH_FLOATING(x.dtype(), "sum_to", [&]<typename T>() {
    using D = DeviceType<T>;
    if (plan.reduced_count < 64) {
      SumToThreadKernel<D><<<Blocks(n_out), kThreads, 0, stream>>>(DevPtr<T>(x), DevPtr<T>(out),
                                                                   n_out, plan);
    } else {
      const int64_t grid = n_out < 65535 ? n_out : 65535;
      SumToBlockKernel<D><<<grid, kThreads, 0, stream>>>(DevPtr<T>(x), DevPtr<T>(out), n_out,
                                                         plan);
    }
  });
  TANDEM_CHECK_LAUNCH("SumToKernel", x.device());
}

}  // namespace tandem::nn::ops::internal
