// Matrix products. CPU: OpenBLAS sgemm/dgemm (matmul_cpu.cc); CUDA: cuBLASLt
// with bias / bias+ReLU epilogues (matmul_cuda.cc).
#ifndef TANDEM_NN_OPS_MATMUL_H_
#define TANDEM_NN_OPS_MATMUL_H_

#include "nn/tensor.h"

namespace tandem::nn {

// a: (M, K), b: (K, N) -> (M, N).
Tensor matmul(const Tensor& a, const Tensor& b);

// x: (N, in), weight: (out, in), bias: (out) or undefined -> (N, out) = x W^T + b.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// relu(linear(x, weight, bias)) in one op (one cuBLASLt call with a fused epilogue on CUDA).
Tensor linear_relu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_MATMUL_H_
