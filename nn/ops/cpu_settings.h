// Process-wide settings of the CPU kernels of every op family: the threads of
// one matmul or convolution, and the capacity of the per-thread oneDNN primitive
// caches of the convolutions, poolings and bfloat16 GEMMs. (Switches of one op
// family stay in its header: set_cpu_winograd in nn/ops/conv.h, set_allow_tf32
// for CUDA in nn/ops/matmul.h, which includes this header.)
#ifndef TANDEM_NN_OPS_CPU_SETTINGS_H_
#define TANDEM_NN_OPS_CPU_SETTINGS_H_

#include <cstdint>

namespace tandem::nn {

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
// its JIT compilation, up to milliseconds). Default 256 (cpu_settings.cc says
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

#endif  // TANDEM_NN_OPS_CPU_SETTINGS_H_
