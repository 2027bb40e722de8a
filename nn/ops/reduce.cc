// Reductions: shape checks, device dispatch and autograd wiring.
#include "nn/ops/reduce.h"

#include "nn/autograd.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/reduce_kernels.h"

namespace tandem::nn {
namespace {

using ops::internal::DimSplit;

// g (shape of x with `dim` removed or kept as 1) repeated along dim, times scale:
// the gradient of a sum or mean. Only called from backward, which the engine runs
// with grad mode off, so it records nothing.
Tensor ExpandDim(const Tensor& g, const Shape& x_shape, int64_t dim, double scale) {
  const DimSplit split = ops::internal::SplitAt(x_shape, dim);
  TANDEM_CHECK(g.numel() == split.outer * split.inner, "expand: gradient ", g.ToString(),
               " does not match ", ShapeToString(x_shape), " reduced over dim ", dim);
  Tensor out = empty(x_shape, {.dtype = g.dtype(), .device = g.device()});
  TANDEM_ON_DEVICE(g, ops::internal::ExpandDim, g, out, split, scale);
  return out;
}

Tensor SumAll(const Tensor& x, double scale, const char* name) {
  CheckDefined(x, name, "x");
  CheckFloating(x, name);
  Tensor out = empty({}, {.dtype = x.dtype(), .device = x.device()});
  TANDEM_ON_DEVICE(x, ops::internal::SumAll, x, out, scale);
  const Shape x_shape = x.shape();
  return autograd::Record(name, {x}, out, [x_shape, scale](const Tensor& g) {
    // All of x as one dim of size numel: g (0-dim) repeated numel times.
    const Shape flat = {NumElements(x_shape)};
    return std::vector<Tensor>{ExpandDim(g, flat, 0, scale).reshape(x_shape)};
  });
}

Tensor SumDim(const Tensor& x, int64_t dim, bool keepdim, bool mean, const char* name) {
  CheckDefined(x, name, "x");
  CheckFloating(x, name);
  const int64_t d = ops::internal::WrapDim(dim, x.shape(), name);
  const DimSplit split = ops::internal::SplitAt(x.shape(), d);
  Shape out_shape = x.shape();
  if (keepdim) {
    out_shape[d] = 1;
  } else {
    out_shape.erase(out_shape.begin() + d);
  }
  // mean over an empty dim is 0/0 = NaN, as in PyTorch.
  const double scale = mean ? 1.0 / static_cast<double>(split.size) : 1.0;
  Tensor out = empty(out_shape, {.dtype = x.dtype(), .device = x.device()});
  TANDEM_ON_DEVICE(x, ops::internal::SumDim, x, out, split, scale);
  const Shape x_shape = x.shape();
  return autograd::Record(name, {x}, out, [x_shape, d, scale](const Tensor& g) {
    return std::vector<Tensor>{ExpandDim(g, x_shape, d, scale)};
  });
}

}  // namespace

// Under autocast a bfloat16 x becomes float32 (AutocastFloat32) at each entry.
Tensor sum(const Tensor& x) { return SumAll(ops::internal::AutocastFloat32(x), 1.0, "sum"); }

Tensor mean(const Tensor& x_in) {
  const Tensor x = ops::internal::AutocastFloat32(x_in);
  CheckDefined(x, "mean", "x");
  return SumAll(x, 1.0 / static_cast<double>(x.numel()), "mean");
}

Tensor sum(const Tensor& x, int64_t dim, bool keepdim) {
  return SumDim(ops::internal::AutocastFloat32(x), dim, keepdim, /*mean=*/false, "sum");
}

Tensor mean(const Tensor& x, int64_t dim, bool keepdim) {
  return SumDim(ops::internal::AutocastFloat32(x), dim, keepdim, /*mean=*/true, "mean");
}

Tensor argmax(const Tensor& x_in, int64_t dim) {
  const Tensor x = ops::internal::AutocastFloat32(x_in);
  CheckDefined(x, "argmax", "x");
  CheckFloating(x, "argmax");
  const int64_t d = ops::internal::WrapDim(dim, x.shape(), "argmax");
  const DimSplit split = ops::internal::SplitAt(x.shape(), d);
  TANDEM_CHECK(split.size > 0, "argmax: dim ", dim, " of shape ", ShapeToString(x.shape()),
               " is empty");
  Shape out_shape = x.shape();
  out_shape.erase(out_shape.begin() + d);
  Tensor out = empty(out_shape, {.dtype = kInt64, .device = x.device()});
  TANDEM_ON_DEVICE(x, ops::internal::ArgmaxDim, x, out, split);
  return out;
}

}  // namespace tandem::nn
