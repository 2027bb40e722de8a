// Kernel interface of the index family (index_select and its backward,
// index_add), shared by the CPU and CUDA files. Arguments are checked by
// index.cc: indices (B) int64 on the tensors' device, row_elements = elements
// per row of dim 0 (source.numel() / N), outputs allocated with the right shape.
#ifndef TANDEM_NN_OPS_INTERNAL_INDEX_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_INDEX_KERNELS_H_

#include <cstdint>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// out[b, :] = source[indices[b], :] for any dtype. The CPU version throws
// tandem::Error for an index outside [0, source.size(0)); the CUDA version
// assumes valid indices (see index.h).
void IndexSelectCpu(const Tensor& source, const Tensor& indices, const Tensor& out);
// grad_source[indices[b], :] += grad_out[b, :], float32 / float64;
// grad_source zero-filled by the caller, indices already checked.
void IndexAddCpu(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_source);
#if TANDEM_WITH_CUDA
void IndexSelectCuda(const Tensor& source, const Tensor& indices, const Tensor& out);
// atomicAdd: the order of adds into a repeated row is not fixed.
void IndexAddCuda(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_source);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_INDEX_KERNELS_H_
