// Kernel interface of the softmax family, shared by the CPU and CUDA files.
// Tensors are viewed as (outer, size, inner) around the softmax dim (DimSplit).
#ifndef TANDEM_NN_OPS_INTERNAL_SOFTMAX_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_SOFTMAX_KERNELS_H_

#include "nn/ops/internal/reduce_kernels.h"
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// y = softmax(x) or, when `log`, log_softmax(x), max-subtracted.
void SoftmaxForwardCpu(const Tensor& x, const Tensor& y, DimSplit split, bool log);
// From the saved output y and its gradient gy:
//   softmax:     gx = y * (gy - sum(gy * y))
//   log_softmax: gx = gy - exp(y) * sum(gy)
void SoftmaxBackwardCpu(const Tensor& gy, const Tensor& y, const Tensor& gx, DimSplit split,
                        bool log);
#if TANDEM_WITH_CUDA
void SoftmaxForwardCuda(const Tensor& x, const Tensor& y, DimSplit split, bool log);
void SoftmaxBackwardCuda(const Tensor& gy, const Tensor& y, const Tensor& gx, DimSplit split,
                         bool log);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_SOFTMAX_KERNELS_H_
