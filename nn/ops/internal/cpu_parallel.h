// Splitting a CPU kernel's loop over the process's kernel threads. Internal to nn.
//
// Threads: where tandem is built with oneDNN (TANDEM_WITH_DNNL), the ranges run on
// the calling thread's OpenMP team, the runtime oneDNN's convolutions and
// dnnl_sgemm already use, sized nn::cpu_blas_threads(); so a step's kernels
// share one pool of that many threads and never oversubscribe the cores. Without
// oneDNN (and so under ThreadSanitizer, whose builds leave it out) everything
// runs on the calling thread.
// Determinism: the split depends only on n, min_per_range and the thread
// count. Kernels whose per-element results do not depend on where the ranges
// start (elementwise maps, per-channel reductions done whole by one range)
// give the same bits for any thread count.
// fn must not throw (an exception cannot leave an OpenMP region): check inputs
// before calling ParallelFor.
#ifndef TANDEM_NN_OPS_INTERNAL_CPU_PARALLEL_H_
#define TANDEM_NN_OPS_INTERNAL_CPU_PARALLEL_H_

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace tandem::nn::ops::internal {

// Calls fn(begin, end) on disjoint contiguous ranges covering [0, n), at most one
// per thread, each at least min_per_range long (one range, on the calling thread,
// when n < 2 * min_per_range or there is one thread).
void ParallelFor(int64_t n, int64_t min_per_range,
                 absl::FunctionRef<void(int64_t begin, int64_t end)> fn);

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_CPU_PARALLEL_H_
