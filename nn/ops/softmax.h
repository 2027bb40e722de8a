// Softmax family. CPU: softmax_cpu.cc; CUDA: softmax_cuda.cu.
#ifndef TANDEM_NN_OPS_SOFTMAX_H_
#define TANDEM_NN_OPS_SOFTMAX_H_

#include "nn/tensor.h"

namespace tandem::nn {

// Along `dim` (negative counts from the end), max-subtracted for stability.
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_SOFTMAX_H_
