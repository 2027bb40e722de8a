// CPU kernels of the index family: row copies for index_select (any dtype)
// and the in-order row adds of its backward (index_add).
#include <cstring>

#include "nn/ops/internal/index_kernels.h"

namespace tandem::nn::ops::internal {

void IndexSelectCpu(const Tensor& source, const Tensor& indices, const Tensor& out) {
  const int64_t n = source.size(0);
  const int64_t count = indices.size(0);
  const int64_t row_bytes = n > 0 ? source.nbytes() / n : out.nbytes() / count;
  const int64_t* index = indices.host_data<int64_t>();
  const char* src = static_cast<const char*>(source.host_ptr());
  char* dst = static_cast<char*>(out.host_ptr());
  for (int64_t b = 0; b < count; ++b) {
    const int64_t i = index[b];
    TANDEM_CHECK(i >= 0 && i < n, "index_select: indices[", b, "] = ", i,
                 " is out of range for source ", source.ToString(), " (N = ", n, ")");
    std::memcpy(dst + b * row_bytes, src + i * row_bytes, static_cast<size_t>(row_bytes));
  }
}

void IndexAddCpu(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_source) {
  const int64_t count = indices.size(0);
  const int64_t row = count > 0 ? grad_out.numel() / count : 0;
  const int64_t* index = indices.host_data<int64_t>();
  TANDEM_DISPATCH_FLOAT(grad_out.dtype(), "index_select backward", [&]<typename T>() {
    const T* g = grad_out.host_data<T>();
    T* gx = grad_source.host_data<T>();
    for (int64_t b = 0; b < count; ++b) {
      T* dst = gx + index[b] * row;
      const T* src = g + b * row;
      for (int64_t c = 0; c < row; ++c) dst[c] += src[c];
    }
  });
}

}  // namespace tandem::nn::ops::internal
