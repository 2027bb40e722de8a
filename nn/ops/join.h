// Joining tensors: cat (along an existing dim) and stack (along a new one),
// PyTorch's torch.cat / torch.stack.
//
// Both are compositions of ops with CPU and CUDA paths: the inputs are copied
// one after another into one flat buffer (Tensor::copy_ on the inputs' device,
// one copy per input), and when the joined dim is not the outermost one the
// elements are put in place by one index_select. No host synchronisation on
// CUDA.
//
// Autograd: differentiable with respect to every float32 / float64 input that
// requires grad (each input's gradient is its slice of the output's gradient,
// exact: no element is summed twice). Inputs of other dtypes join without a
// gradient.
//
// Errors: throw tandem::Error naming the op and the offending input for an
// empty list, an undefined tensor, mixed dtypes or devices, a different number
// of dims, sizes that differ outside `dim`, or `dim` out of range.
#ifndef TANDEM_NN_OPS_JOIN_H_
#define TANDEM_NN_OPS_JOIN_H_

#include <cstdint>
#include <vector>

#include "nn/tensor.h"

namespace tandem::nn {

// The inputs joined along `dim` (negative counts from the end).
//   tensors: (..., n_i, ...) with the same sizes in every other dim, same dtype
//            and device; at least one
//   returns: (..., sum n_i, ...) on their device
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);

// The inputs, all of one shape S, joined along a new dim `dim` in [-(S.dim()+1),
// S.dim()]: stack({a, b}, 0) is (2, ...S), stack({a, b}, -1) is (...S, 2).
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_JOIN_H_
