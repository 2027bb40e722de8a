// Matrix products. CPU: OpenBLAS sgemm/dgemm (matmul_cpu.cc); CUDA: cuBLASLt
// with bias / bias+ReLU epilogues (matmul_cuda.cc).
#ifndef TANDEM_NN_OPS_MATMUL_H_
#define TANDEM_NN_OPS_MATMUL_H_

#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads, set_cpu_primitive_cache_capacity
#include "nn/tensor.h"

namespace tandem::nn {

// a: (M, K), b: (K, N) -> (M, N).
Tensor matmul(const Tensor& a, const Tensor& b);

// x: (N, in), weight: (out, in), bias: (out) or undefined -> (N, out) = x W^T + b.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// relu(linear(x, weight, bias)) in one op (one cuBLASLt call with a fused epilogue on CUDA).
Tensor linear_relu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// Errors: each op throws tandem::Error naming the op and the shapes when the
// operands are not 2-D, their inner sizes differ, or dtypes/devices differ.
// Supported dtypes: float32, float64, bfloat16 (all operands one dtype). bfloat16
// products accumulate in float32 (CUDA: cuBLASLt, bfloat16 data, float32 compute;
// CPU: oneDNN's bfloat16 matmul primitive with a float32 result where
// cpu_bf16_native() (nn/ops/conv.h: avx512_bf16 or AMX), else sgemm on the
// operands widened to float32), bias and relu are applied in
// float32 and each result is rounded to bfloat16 once; the bias gradient sums in
// float32. Under nn::AutocastGuard(kBFloat16) float32 operands are cast to
// bfloat16 first (differentiable) and the result is bfloat16 (nn/autocast.h).

// Lets float32 matmuls and convolutions on CUDA use TF32 tensor cores (about 10
// mantissa bits per product). Off by default: float32 results then match the
// CPU to float32 rounding. Process-wide; calls already enqueued keep their mode.
void set_allow_tf32(bool allow);
bool allow_tf32();

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_MATMUL_H_
