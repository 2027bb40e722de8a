// CPU kernels of the reduce family. Sums accumulate in double (float32 inputs
// too), in increasing index order.
#include <algorithm>
#include <vector>

#include "nn/ops/internal/reduce_kernels.h"

namespace tandem::nn::ops::internal {

void SumDimCpu(const Tensor& x, const Tensor& out, DimSplit split, double scale) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), "sum", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* po = out.host_data<T>();
    if (split.inner == 1) {
      for (int64_t o = 0; o < split.outer; ++o) {
        const T* row = px + o * split.size;
        double acc = 0;
        for (int64_t d = 0; d < split.size; ++d) acc += static_cast<double>(row[d]);
        po[o] = static_cast<T>(acc * scale);
      }
      return;
    }
    // Rows of `inner` contiguous elements: accumulate row by row into a double buffer.
    std::vector<double> acc(static_cast<size_t>(split.inner));
    for (int64_t o = 0; o < split.outer; ++o) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t d = 0; d < split.size; ++d) {
        const T* row = px + (o * split.size + d) * split.inner;
        for (int64_t i = 0; i < split.inner; ++i) acc[i] += static_cast<double>(row[i]);
      }
      for (int64_t i = 0; i < split.inner; ++i) {
        po[o * split.inner + i] = static_cast<T>(acc[i] * scale);
      }
    }
  });
}

void SumAllCpu(const Tensor& x, const Tensor& out, double scale) {
  const int64_t n = x.numel();
  TANDEM_DISPATCH_FLOAT(x.dtype(), "sum", [&]<typename T>() {
    const T* px = x.host_data<T>();
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(px[i]);
    *out.host_data<T>() = static_cast<T>(acc * scale);
  });
}

void ExpandDimCpu(const Tensor& g, const Tensor& out, DimSplit split, double scale) {
  TANDEM_DISPATCH_FLOAT(g.dtype(), "expand", [&]<typename T>() {
    const T* pg = g.host_data<T>();
    T* po = out.host_data<T>();
    const T s = static_cast<T>(scale);
    for (int64_t o = 0; o < split.outer; ++o) {
      for (int64_t d = 0; d < split.size; ++d) {
        T* row = po + (o * split.size + d) * split.inner;
        const T* src = pg + o * split.inner;
        for (int64_t i = 0; i < split.inner; ++i) row[i] = src[i] * s;
      }
    }
  });
}

void ArgmaxDimCpu(const Tensor& x, const Tensor& out, DimSplit split) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), "argmax", [&]<typename T>() {
    const T* px = x.host_data<T>();
    int64_t* po = out.host_data<int64_t>();
    for (int64_t o = 0; o < split.outer; ++o) {
      for (int64_t i = 0; i < split.inner; ++i) {
        const T* p = px + o * split.size * split.inner + i;
        int64_t best = 0;
        T best_value = p[0];
        for (int64_t d = 1; d < split.size; ++d) {
          const T v = p[d * split.inner];
          if (v > best_value) {  // strict: the first maximum wins
            best_value = v;
            best = d;
          }
        }
        po[o * split.inner + i] = best;
      }
    }
  });
}

}  // namespace tandem::nn::ops::internal
