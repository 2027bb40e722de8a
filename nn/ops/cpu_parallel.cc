// ParallelFor (internal/cpu_parallel.h): OpenMP where tandem is built with oneDNN,
// serial otherwise. The only file of tandem's own compiled with -fopenmp.
#include "nn/ops/internal/cpu_parallel.h"

#include <algorithm>

#if TANDEM_WITH_DNNL
#include <omp.h>
#endif

#include "nn/ops/cpu_settings.h"  // cpu_blas_threads

namespace tandem::nn::ops::internal {

void ParallelFor(int64_t n, int64_t min_per_range,
                 absl::FunctionRef<void(int64_t begin, int64_t end)> fn) {
  if (n <= 0) return;
  const int64_t by_size = n / std::max<int64_t>(1, min_per_range);
  const int threads =
      static_cast<int>(std::min<int64_t>(std::max(1, cpu_blas_threads()), by_size));
#if TANDEM_WITH_DNNL
  if (threads > 1) {
    // Range k of `threads`: [n k / threads, n (k + 1) / threads).
#pragma omp parallel num_threads(threads)
    {
      const int64_t k = omp_get_thread_num(), count = omp_get_num_threads();
      const int64_t begin = n * k / count, end = n * (k + 1) / count;
      if (begin < end) fn(begin, end);
    }
    return;
  }
#endif
  (void)threads;
  fn(0, n);
}

}  // namespace tandem::nn::ops::internal
