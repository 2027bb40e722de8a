// Kernel interface of the matmul family (matmul, linear, linear_relu), shared by
// the CPU file (OpenBLAS) and the CUDA file (cuBLASLt). The conv family's CPU
// kernels reuse GemmRaw. Internal to nn.
#ifndef TANDEM_NN_OPS_INTERNAL_MATMUL_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_MATMUL_KERNELS_H_

#include <cstdint>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// Whether float32 matmuls and convolutions on CUDA may use TF32 tensor cores
// (set_allow_tf32 in matmul.h). Process-wide, read at each call.
bool AllowTf32();

// Row-major C (m, n) = alpha * op(A) op(B) + beta * C on the host, where op(A) is
// (m, k) (A is (k, m) when trans_a) and lda/ldb/ldc are row strides in elements.
// T is float (sgemm) or double (dgemm). Safe to call from several threads at once.
template <typename T>
void GemmRaw(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
             int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// Where GemmRaw<float> runs: kAuto = oneDNN's dnnl_sgemm where tandem is built
// with it (TANDEM_WITH_DNNL), else OpenBLAS. float64 always runs on OpenBLAS.
// Process-wide, atomic; for tests and benchmarks that compare them.
enum class CpuGemmPath { kAuto, kOpenBlas, kDnnl };
void SetCpuGemmPath(CpuGemmPath path);
// True when GemmRaw<float> runs on oneDNN now.
bool CpuGemmUsesDnnl();

// nn::cpu_primitive_cache_capacity()'s start value, read now: the whole number
// in TANDEM_CPU_PRIMITIVE_CACHE_CAPACITY, or the default where it is unset;
// tandem::Error naming the variable's value when that is not a number >= 1.
int64_t CpuPrimitiveCacheCapacityFromEnvironment();

#if TANDEM_WITH_DNNL
// GemmRaw<float>'s contract on dnnl_sgemm (conv_dnnl.cc), with the calling
// thread's OpenMP team at nn::cpu_blas_threads() threads. k > 0.
void SgemmDnnl(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc);
// matmul_dnnl.cc: c (float32, m x n) = op(a) op(b) on bfloat16 operands, float32
// accumulation, on oneDNN's matmul primitive; m, n, k > 0. For CpuBf16Native().
void GemmBf16Dnnl(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const BFloat16* a,
                  int64_t lda, const BFloat16* b, int64_t ldb, float* c, int64_t ldc);
// How many primitives GemmBf16Dnnl's cache holds on the calling thread.
size_t GemmBf16DnnlCacheSize();
#endif

// out (m, n) = op(a) op(b); a, b, out 2-D, contiguous, one dtype (float32,
// float64 or bfloat16) and device. Shapes are checked by the caller. bfloat16:
// products accumulate in float32 (CPU: sgemm on the widened operands; CUDA:
// cuBLASLt with bfloat16 data and float32 compute), bias and relu are applied
// in float32, and each output element is rounded to bfloat16 once.
void GemmCpu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& out);
// out (N, out) = x (N, in) W^T (W: (out, in)) + bias (out, or undefined), then
// relu when `relu`.
void LinearCpu(const Tensor& x, const Tensor& weight, const Tensor& bias, bool relu,
               const Tensor& out);
// db (out) = sum over rows of dy (N, out); bfloat16: float32 accumulation, one rounding.
void BiasGradCpu(const Tensor& dy, const Tensor& db);

#if TANDEM_WITH_CUDA
void GemmCuda(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& out);
void LinearCuda(const Tensor& x, const Tensor& weight, const Tensor& bias, bool relu,
                const Tensor& out);
void BiasGradCuda(const Tensor& dy, const Tensor& db);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_MATMUL_KERNELS_H_
