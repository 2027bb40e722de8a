// Softmax family: shape checks, device dispatch and autograd wiring.
#include "nn/ops/softmax.h"

#include "nn/autograd.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/softmax_kernels.h"

namespace tandem::nn {
namespace {

Tensor Softmax(const Tensor& x, int64_t dim, bool log, const char* name) {
  CheckDefined(x, name, "x");
  CheckFloating(x, name);
  const int64_t d = ops::internal::WrapDim(dim, x.shape(), name);
  const ops::internal::DimSplit split = ops::internal::SplitAt(x.shape(), d);
  Tensor y = empty_like(x);
  if (x.numel() > 0) TANDEM_ON_DEVICE(x, ops::internal::SoftmaxForward, x, y, split, log);
  return autograd::Record(name, {x}, y, [y = y.detach(), split, log](const Tensor& gy) {
    Tensor gx = empty_like(y);
    if (y.numel() > 0) {
      TANDEM_ON_DEVICE(y, ops::internal::SoftmaxBackward, gy, y, gx, split, log);
    }
    return std::vector<Tensor>{gx};
  });
}

}  // namespace

// Under autocast a bfloat16 x becomes float32 (AutocastFloat32) at each entry.
Tensor softmax(const Tensor& x, int64_t dim) {
  return Softmax(ops::internal::AutocastFloat32(x), dim, false, "softmax");
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return Softmax(ops::internal::AutocastFloat32(x), dim, true, "log_softmax");
}

}  // namespace tandem::nn
