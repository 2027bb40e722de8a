// Kernels behind the core's in-place tensor methods and random factories.
// Each dispatches on the tensor's device: CPU loops in fill_cpu.cc, CUDA kernels
// in fill_cuda.cu. Internal to nn.
#ifndef TANDEM_NN_OPS_INTERNAL_FILL_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_FILL_KERNELS_H_

#include <cstdint>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

void Fill(const Tensor& t, double value);                       // t[i] = value
void Axpy(const Tensor& y, const Tensor& x, double alpha);      // y += alpha * x
void Scale(const Tensor& t, double value);                      // t *= value
// t[i] = Normal or Uniform from Philox counter (offset + i) of (seed, stream).
void FillRandom(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, bool normal);

#if TANDEM_WITH_CUDA
void FillCuda(const Tensor& t, double value);
void AxpyCuda(const Tensor& y, const Tensor& x, double alpha);
void ScaleCuda(const Tensor& t, double value);
void FillRandomCuda(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, bool normal);
void ConvertCuda(const Tensor& src, const Tensor& dst);  // same device, any dtypes
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_FILL_KERNELS_H_
