// cat and stack: argument checks and their composition of copies and index_select.
#include "nn/ops/join.h"

#include <cstddef>
#include <string>

#include "nn/autograd.h"
#include "nn/error.h"
#include "nn/ops/index.h"

namespace tandem::nn {
namespace {

// `dim` in [-rank, rank) made non-negative; throws naming op and the value.
int64_t WrapDim(int64_t dim, int64_t rank, const char* op) {
  TANDEM_CHECK(dim >= -rank && dim < rank, op, ": dim ", dim, " is out of range for ", rank,
               "-dim tensors (expected [", -rank, ", ", rank - 1, "])");
  return dim < 0 ? dim + rank : dim;
}

// Checks what every input of cat/stack shares (defined, dtype, device, rank).
void CheckJoinable(const std::vector<Tensor>& tensors, const char* op) {
  TANDEM_CHECK(!tensors.empty(), op, ": expected at least one tensor, got none");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TANDEM_CHECK(tensors[i].defined(), op, ": tensors[", i, "] is an undefined tensor");
  }
  const Tensor& first = tensors[0];
  for (size_t i = 1; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    TANDEM_CHECK(t.dtype() == first.dtype() && t.device() == first.device(), op, ": tensors[", i,
                 "] is ", t.ToString(), ", tensors[0] ", first.ToString(),
                 " (one dtype and one device)");
    TANDEM_CHECK(t.dim() == first.dim(), op, ": tensors[", i, "] has ", t.dim(),
                 " dims, tensors[0] ", first.dim(), " (", t.ToString(), " vs ", first.ToString(),
                 ")");
  }
}

// The inputs' elements one after another in a 1-D tensor: one copy per input.
// Each input's gradient is its slice of the output's gradient.
Tensor Concat1d(const std::vector<Tensor>& tensors) {
  int64_t total = 0;
  for (const Tensor& t : tensors) total += t.numel();
  Tensor out = empty({total}, {.dtype = tensors[0].dtype(), .device = tensors[0].device()});
  {
    NoGradGuard no_grad;
    int64_t at = 0;
    for (const Tensor& t : tensors) {
      if (t.numel() > 0) out.slice(at, at + t.numel()).copy_(t.detach().reshape({t.numel()}));
      at += t.numel();
    }
  }
  if (!autograd::NeedsGrad(tensors)) return out;
  std::vector<Shape> shapes;
  for (const Tensor& t : tensors) shapes.push_back(t.shape());
  return autograd::Record("cat", tensors, out, [shapes](const Tensor& gy) {
    NoGradGuard no_grad;
    std::vector<Tensor> grads;
    int64_t at = 0;
    for (const Shape& shape : shapes) {
      const int64_t n = NumElements(shape);
      // A copy: a leaf may keep (and later add into) the gradient it is given.
      grads.push_back(n > 0 ? gy.slice(at, at + n).reshape(shape).clone()
                            : zeros(shape, {.dtype = gy.dtype(), .device = gy.device()}));
      at += n;
    }
    return grads;
  });
}

}  // namespace

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  CheckJoinable(tensors, "cat");
  const Shape& first = tensors[0].shape();
  TANDEM_CHECK(!first.empty(), "cat: cannot join 0-dim tensors (stack them instead)");
  dim = WrapDim(dim, static_cast<int64_t>(first.size()), "cat");
  Shape out_shape = first;
  out_shape[dim] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Shape& shape = tensors[i].shape();
    for (size_t d = 0; d < shape.size(); ++d) {
      TANDEM_CHECK(static_cast<int64_t>(d) == dim || shape[d] == first[d], "cat: tensors[", i,
                   "] is ", tensors[i].ToString(), ", tensors[0] ", tensors[0].ToString(),
                   ": sizes must match except in dim ", dim);
    }
    out_shape[dim] += shape[dim];
  }
  const bool needs_grad = autograd::NeedsGrad(tensors);
  TANDEM_CHECK(!needs_grad || tensors[0].dtype() == kFloat32 || tensors[0].dtype() == kFloat64,
               "cat: the gradient needs float32 or float64 tensors, got ", tensors[0].ToString(),
               " that requires grad");
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= first[d];
  int64_t inner = 1;
  for (size_t d = static_cast<size_t>(dim) + 1; d < first.size(); ++d) inner *= first[d];
  Tensor flat = Concat1d(tensors);
  if (outer == 1 || tensors.size() == 1 || flat.numel() == 0) return flat.reshape(out_shape);
  // Joined along an inner dim: output element (a, c, e) (a over the dims before
  // `dim`, c along it, e over the dims after) is input i's (a, c - offset_i, e),
  // gathered from `flat` by one index_select.
  std::vector<int64_t> index;
  index.reserve(static_cast<size_t>(flat.numel()));
  for (int64_t a = 0; a < outer; ++a) {
    int64_t base = 0;  // where input i starts in flat
    for (const Tensor& t : tensors) {
      const int64_t block = t.size(dim) * inner;  // input i's elements per a
      for (int64_t e = 0; e < block; ++e) index.push_back(base + a * block + e);
      base += t.numel();
    }
  }
  const Tensor positions = from_vector(index, {static_cast<int64_t>(index.size())},
                                       {.dtype = kInt64, .device = flat.device()});
  return index_select(flat.reshape({flat.numel(), 1}), positions).reshape(out_shape);
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  CheckJoinable(tensors, "stack");
  const Shape& shape = tensors[0].shape();
  for (size_t i = 1; i < tensors.size(); ++i) {
    TANDEM_CHECK(tensors[i].shape() == shape, "stack: tensors[", i, "] is ",
                 tensors[i].ToString(), ", tensors[0] ", tensors[0].ToString(),
                 " (stack needs one shape)");
  }
  dim = WrapDim(dim, static_cast<int64_t>(shape.size()) + 1, "stack");
  Shape unsqueezed = shape;
  unsqueezed.insert(unsqueezed.begin() + dim, 1);
  std::vector<Tensor> parts;
  parts.reserve(tensors.size());
  for (const Tensor& t : tensors) parts.push_back(t.reshape(unsqueezed));
  return cat(parts, dim);
}

}  // namespace tandem::nn
