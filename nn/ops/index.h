// Gathering rows by index (dim 0). CPU: index_cpu.cc; CUDA: index_cuda.cu.
#ifndef TANDEM_NN_OPS_INDEX_H_
#define TANDEM_NN_OPS_INDEX_H_

#include "nn/tensor.h"

namespace tandem::nn {

// out[b] = source[indices[b]]: rows of dim 0 stacked in the order of `indices`.
//   source: (N, ...) of any dtype (a view is fine)
//   indices: (B) int64 on source's device; repeats and any order allowed
//   returns: (B, ...) with source's dtype, on source's device
// One pass over the output; on CUDA one kernel launch on the calling thread's
// stream, no host synchronisation (rows are moved in the widest words, up to
// 16 bytes, that the row size and the two base addresses allow).
//
// Index range: on the CPU an index outside [0, N) throws tandem::Error naming
// its position, its value and N. On CUDA the indices are on the device and
// checking them would need a host read, so the kernel does NOT check: an index
// outside [0, N) reads outside `source` (garbage or an illegal-address error
// reported later). Check host-side indices before uploading them (as
// data::DeviceDataset does); indices computed on the device must be valid by
// construction.
//
// Autograd: differentiable with respect to `source` when it is float32 or
// float64 (a source of another dtype that requires grad throws). The backward
// pass is index_add: grad_source = zeros(N, ...) with grad_out[b] added into
// row indices[b]. On the CPU the rows are added in order b = 0, 1, ... (bitwise
// reproducible). On CUDA the adds are atomicAdd, so where an index repeats the
// order of the additions into that row, and hence the rounding of the gradient,
// can differ from run to run (not bitwise reproducible); without repeats each
// element gets one add and the result is exact.
Tensor index_select(const Tensor& source, const Tensor& indices);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_INDEX_H_
