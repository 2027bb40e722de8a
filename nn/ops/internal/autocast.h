// The casts ops make under nn::AutocastGuard (nn/autocast.h). Each returns its
// argument unchanged when autocast is off or the dtype is not the one it casts.
#ifndef TANDEM_NN_OPS_INTERNAL_AUTOCAST_H_
#define TANDEM_NN_OPS_INTERNAL_AUTOCAST_H_

#include "nn/autocast.h"
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// For GEMM-like ops: a float32 tensor becomes bfloat16 (differentiable cast).
// An undefined tensor (an absent bias) stays undefined.
inline Tensor AutocastLower(const Tensor& t) {
  if (!autocast_enabled() || !t.defined() || t.dtype() != kFloat32) return t;
  return t.to(kBFloat16);
}

// For precision-sensitive ops: a bfloat16 tensor becomes float32 (differentiable cast).
inline Tensor AutocastFloat32(const Tensor& t) {
  if (!autocast_enabled() || !t.defined() || t.dtype() != kBFloat16) return t;
  return t.to(kFloat32);
}

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_AUTOCAST_H_
