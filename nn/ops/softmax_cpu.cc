// CPU kernels of the softmax family: one pass per (outer, inner) column for the
// max, one for the sum of exponentials, one to write; sums in double.
#include <algorithm>
#include <cmath>

#include "nn/ops/internal/softmax_kernels.h"

namespace tandem::nn::ops::internal {

void SoftmaxForwardCpu(const Tensor& x, const Tensor& y, DimSplit split, bool log) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), log ? "log_softmax" : "softmax", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    const int64_t stride = split.inner;
    for (int64_t o = 0; o < split.outer; ++o) {
      for (int64_t i = 0; i < split.inner; ++i) {
        const int64_t base = o * split.size * stride + i;
        T max_value = px[base];
        for (int64_t d = 1; d < split.size; ++d) max_value = std::max(max_value, px[base + d * stride]);
        double total = 0;
        for (int64_t d = 0; d < split.size; ++d) {
          total += std::exp(static_cast<double>(px[base + d * stride] - max_value));
        }
        if (log) {
          const double log_total = std::log(total);
          for (int64_t d = 0; d < split.size; ++d) {
            const int64_t k = base + d * stride;
            py[k] = static_cast<T>(static_cast<double>(px[k] - max_value) - log_total);
          }
        } else {
          const double inv_total = 1.0 / total;
          for (int64_t d = 0; d < split.size; ++d) {
            const int64_t k = base + d * stride;
            py[k] = static_cast<T>(std::exp(static_cast<double>(px[k] - max_value)) * inv_total);
          }
        }
      }
    }
  });
}

void SoftmaxBackwardCpu(const Tensor& gy, const Tensor& y, const Tensor& gx, DimSplit split,
                        bool log) {
  TANDEM_DISPATCH_FLOAT(y.dtype(), log ? "log_softmax_backward" : "softmax_backward",
                        [&]<typename T>() {
    const T* pg = gy.host_data<T>();
    const T* py = y.host_data<T>();
    T* pgx = gx.host_data<T>();
    const int64_t stride = split.inner;
    for (int64_t o = 0; o < split.outer; ++o) {
      for (int64_t i = 0; i < split.inner; ++i) {
        const int64_t base = o * split.size * stride + i;
        double dot = 0;  // softmax: sum(gy * y); log_softmax: sum(gy)
        for (int64_t d = 0; d < split.size; ++d) {
          const int64_t k = base + d * stride;
          dot += log ? static_cast<double>(pg[k]) : static_cast<double>(pg[k]) * py[k];
        }
        const T s = static_cast<T>(dot);
        for (int64_t d = 0; d < split.size; ++d) {
          const int64_t k = base + d * stride;
          pgx[k] = log ? pg[k] - static_cast<T>(std::exp(static_cast<double>(py[k]))) * s
                       : py[k] * (pg[k] - s);
        }
      }
    }
  });
}

}  // namespace tandem::nn::ops::internal
