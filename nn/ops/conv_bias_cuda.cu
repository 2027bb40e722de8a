// The bias kernels of the conv family (the convolutions themselves are cuDNN's,
// conv_cuda.cc): y += bias per channel, and the bias gradient. Our own kernels
// for every dtype, as PyTorch adds the bias of its cuDNN convolutions with its
// own elementwise kernel: cuDNN 9's cudnnAddTensor and
// cudnnConvolutionBackwardBias cost tens of microseconds of host time per call
// for a tiny kernel. Arithmetic in float32 for float32 and bfloat16 (one
// rounding to bfloat16 per result), float64 for float64; int64 indices; on the
// thread's stream.
#include "nn/cuda/bf16.cuh"
#include "nn/cuda/context.h"
#include "nn/ops/internal/conv_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

// The kernel-side element type and its accumulation type.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__nv_bfloat16> { using type = float; };
template <typename T> __device__ typename Acc<T>::type Load(T v) { return v; }
template <> __device__ float Load(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ T Store(typename Acc<T>::type v) { return v; }
template <> __device__ __nv_bfloat16 Store<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// y[i] += bias[channel of i]; y is (n, o, plane) with plane = oh * ow.
template <typename T>
__global__ void BiasAddKernel(const T* bias, T* y, int64_t numel, int64_t o, int64_t plane) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= numel) return;
  const int64_t c = (i / plane) % o;
  y[i] = Store<T>(Load(y[i]) + Load(bias[c]));
}

// One block per channel c: db[c] = sum over (n, plane) of dy, each thread a
// strided partial sum, then a tree in shared memory (fixed order: deterministic).
template <typename T>
__global__ void BiasGradKernel(const T* dy, T* db, int64_t n, int64_t o, int64_t plane) {
  using A = typename Acc<T>::type;
  __shared__ A partial[kThreads];
  const int64_t c = blockIdx.x;
  const int64_t count = n * plane;
  A acc = 0;
  for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
    const int64_t b = k / plane, s = k - b * plane;
    acc += Load(dy[(b * o + c) * plane + s]);
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int step = kThreads / 2; step > 0; step /= 2) {
    if (static_cast<int>(threadIdx.x) < step) partial[threadIdx.x] += partial[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[c] = Store<T>(partial[0]);
}

template <typename T> T* Ptr(const Tensor& t);
template <> float* Ptr<float>(const Tensor& t) { return t.data<float>(); }
template <> double* Ptr<double>(const Tensor& t) { return t.data<double>(); }
template <> __nv_bfloat16* Ptr<__nv_bfloat16>(const Tensor& t) {
  return ::tandem::nn::internal::DevPtr<BFloat16>(t);
}

template <typename T>
void BiasAdd(const Tensor& bias, const Conv2dGeometry& g, const Tensor& y) {
  BiasAddKernel<T><<<Blocks(y.numel()), kThreads, 0, nn::internal::ThreadStream(y.device())>>>(
      Ptr<T>(bias), Ptr<T>(y), y.numel(), g.o, g.oh * g.ow);
  TANDEM_CHECK_LAUNCH("conv2d BiasAddKernel", y.device());
}

template <typename T>
void BiasGrad(const Tensor& dy, const Tensor& dbias) {
  const int64_t o = dy.size(1);
  BiasGradKernel<T><<<o, kThreads, 0, nn::internal::ThreadStream(dy.device())>>>(
      Ptr<T>(dy), Ptr<T>(dbias), dy.size(0), o, dy.size(2) * dy.size(3));
  TANDEM_CHECK_LAUNCH("conv2d BiasGradKernel", dy.device());
}

}  // namespace

void ConvBiasAddCuda(const Tensor& bias, const Conv2dGeometry& g, const Tensor& y) {
  if (y.numel() == 0) return;
  switch (y.dtype()) {
    case kFloat32: return BiasAdd<float>(bias, g, y);
    case kFloat64: return BiasAdd<double>(bias, g, y);
    case kBFloat16: return BiasAdd<__nv_bfloat16>(bias, g, y);
    default: Fail("conv2d: no CUDA bias add for ", DTypeName(y.dtype()));
  }
}

void Conv2dBackwardBiasCuda(const Tensor& dy, const Tensor& dbias) {
  if (dy.size(1) == 0) return;
  switch (dy.dtype()) {
    case kFloat32: return BiasGrad<float>(dy, dbias);
    case kFloat64: return BiasGrad<double>(dy, dbias);
    case kBFloat16: return BiasGrad<__nv_bfloat16>(dy, dbias);
    default: Fail("conv2d backward: no CUDA bias gradient for ", DTypeName(dy.dtype()));
  }
}

}  // namespace tandem::nn::ops::internal
