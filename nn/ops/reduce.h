// Reductions. CPU: reduce_cpu.cc; CUDA: reduce_cuda.cu.
#ifndef TANDEM_NN_OPS_REDUCE_H_
#define TANDEM_NN_OPS_REDUCE_H_

#include "nn/tensor.h"

namespace tandem::nn {

// Over all elements -> a 0-dim tensor.
Tensor sum(const Tensor& x);
Tensor mean(const Tensor& x);
// Over one dim (negative counts from the end); keepdim keeps it with size 1.
Tensor sum(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& x, int64_t dim, bool keepdim = false);
// Index of the first maximum along `dim` -> int64, that dim removed. Not differentiable.
Tensor argmax(const Tensor& x, int64_t dim);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_REDUCE_H_
