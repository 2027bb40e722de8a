// index_select: argument checks, device dispatch and autograd (index_add).
#include "nn/ops/index.h"

#include "nn/autograd.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/index_kernels.h"

namespace tandem::nn {

Tensor index_select(const Tensor& source, const Tensor& indices) {
  CheckDefined(source, "index_select", "source");
  CheckDefined(indices, "index_select", "indices");
  TANDEM_CHECK(source.dim() >= 1, "index_select: source must have a dim 0 to select from, got ",
               source.ToString());
  TANDEM_CHECK(indices.dtype() == kInt64 && indices.dim() == 1,
               "index_select: indices must be a 1-dim int64 tensor, got ", indices.ToString());
  CheckSameDevice(source, indices, "index_select");
  const bool needs_grad = autograd::NeedsGrad({source});
  TANDEM_CHECK(!needs_grad || source.dtype() == kFloat32 || source.dtype() == kFloat64,
               "index_select: the gradient needs a float32 or float64 source, got ",
               source.ToString(), " that requires grad");
  Shape shape = source.shape();
  shape[0] = indices.size(0);
  Tensor out = empty(shape, {.dtype = source.dtype(), .device = source.device()});
  if (out.numel() > 0) {
    TANDEM_ON_DEVICE(source, ops::internal::IndexSelect, source, indices, out);
  } else if (!source.is_cuda()) {
    // Rows of zero elements: nothing to copy, but the indices must still be valid.
    const int64_t n = source.size(0);
    const int64_t* p = indices.host_data<int64_t>();
    for (int64_t b = 0; b < indices.size(0); ++b) {
      TANDEM_CHECK(p[b] >= 0 && p[b] < n, "index_select: indices[", b, "] = ", p[b],
                   " is out of range for source ", source.ToString(), " (N = ", n, ")");
    }
  }
  if (!needs_grad) return out;
  const Shape source_shape = source.shape();
  const Tensor saved_indices = indices.detach();
  return autograd::Record("index_select", {source}, out,
                          [source_shape, saved_indices](const Tensor& gy) {
    Tensor gx = zeros(source_shape, {.dtype = gy.dtype(), .device = gy.device()});
    if (gy.numel() > 0) {
      TANDEM_ON_DEVICE(gy, ops::internal::IndexAdd, gy, saved_indices, gx);
    }
    return std::vector<Tensor>{gx};
  });
}

}  // namespace tandem::nn
