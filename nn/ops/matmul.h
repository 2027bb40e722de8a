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

// Threads of one CPU matmul / convolution. Process-wide: OpenBLAS has one thread
// pool, shared by every rank's thread (concurrent callers queue on it); with
// oneDNN (TANDEM_WITH_DNNL: float32 GEMMs and convolutions) each calling thread
// runs its own OpenMP team, sized to this count at each call. n >= 1, else
// tandem::Error naming n. Without a call, OpenBLAS's own default
// (OPENBLAS_NUM_THREADS, else one per core). Needs the pthreads build of
// OpenBLAS (Debian's default libopenblas0-pthread): an OpenMP build keeps one
// count per calling thread, which this call does not set for other threads.
void set_cpu_blas_threads(int n);
int cpu_blas_threads();

// How many oneDNN primitives (with their memory objects and reorders) each
// thread keeps per cache: the CPU convolutions', poolings' and bfloat16 GEMMs'
// (TANDEM_WITH_DNNL), one per shape, layout and thread count, ~0.07 MB each.
// Past it the least recently used is dropped, and made again when its shape
// comes back (~10 us where oneDNN's own cache still has the primitive, else
// its JIT compilation, up to milliseconds). Default 256 (matmul_cpu.cc says
// why); the environment variable TANDEM_CPU_PRIMITIVE_CACHE_CAPACITY sets the
// start value, read at the first miss unless set_cpu_primitive_cache_capacity
// came first (then never). n >= 1, else tandem::Error naming n; a bad
// environment value is an error naming it at every miss (or call of
// cpu_primitive_cache_capacity) until a value is set. Process-wide; each
// thread's caches shrink to a new value at their next miss. oneDNN's own
// process-wide cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, default 1024) is apart.
void set_cpu_primitive_cache_capacity(int64_t n);
int64_t cpu_primitive_cache_capacity();

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_MATMUL_H_
