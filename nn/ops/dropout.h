// Dropout. The mask comes from the calling thread's Philox generator (element i
// keeps iff uniform(counter offset + i) >= p), so CPU and GPU masks match, and
// the mask does not depend on the dtype: a bfloat16 tensor keeps the positions a
// float32 tensor of its shape would keep for the same generator state.
// float32, float64 and bfloat16 (scaled in float32, rounded once per element).
// CPU: dropout_cpu.cc; CUDA: dropout_cuda.cu.
#ifndef TANDEM_NN_OPS_DROPOUT_H_
#define TANDEM_NN_OPS_DROPOUT_H_

#include "nn/tensor.h"

namespace tandem::nn {

// training: zero each element with probability p, scale kept ones by 1/(1-p).
// Not training (or p == 0): x unchanged. p in [0, 1).
// Inside a CUDA graph capture (nn/graph.h) the counters are reserved at each
// replay, on the replaying thread's generator, so every replay draws a fresh
// mask, the same one an eager step would have drawn (one extra one-thread
// kernel per captured dropout per replay writes the offset).
Tensor dropout(const Tensor& x, double p, bool training);

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_DROPOUT_H_
