// Kernel-side element types for CUDA files (.cu only): a tensor element type's
// storage type in kernels (BFloat16 -> __nv_bfloat16, the same 2-byte layout), the
// type its arithmetic runs in (float for bfloat16), the load/store conversions
// (one round-to-nearest-even per stored bfloat16), and a tensor's data pointer as
// the kernel-side type.
#ifndef TANDEM_NN_CUDA_BF16_CUH_
#define TANDEM_NN_CUDA_BF16_CUH_

#include <cuda_bf16.h>

#include <type_traits>

#include "nn/dtype.h"
#include "nn/tensor.h"

namespace tandem::nn::internal {

template <typename T> struct DeviceTypeOf { using type = T; };
template <> struct DeviceTypeOf<BFloat16> { using type = __nv_bfloat16; };
template <typename T> using DeviceType = typename DeviceTypeOf<T>::type;
template <typename D>
using DeviceCompute = std::conditional_t<std::is_same_v<D, __nv_bfloat16>, float, D>;

template <typename D> __device__ __forceinline__ DeviceCompute<D> LoadDev(D v) {
  if constexpr (std::is_same_v<D, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return v;
  }
}
template <typename D> __device__ __forceinline__ D StoreDev(DeviceCompute<D> v) {
  if constexpr (std::is_same_v<D, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return v;
  }
}

// A tensor's data (element type T) as the kernel-side type.
template <typename T> DeviceType<T>* DevPtr(const Tensor& t) {
  return reinterpret_cast<DeviceType<T>*>(t.data<T>());
}

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_CUDA_BF16_CUH_
