// Kernel interface of the conv family, shared by the CPU file (im2col + OpenBLAS)
// and the CUDA files (cuDNN; bfloat16 bias kernels). Internal to nn.
// The Cpu kernels take float32, float64 or bfloat16 (the latter computed in
// float32 on widened copies and rounded once).
#ifndef TANDEM_NN_OPS_INTERNAL_CONV_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_CONV_KERNELS_H_

#include <cstdint>

#include "nn/ops/conv.h"
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// Sizes of one conv2d call, checked by conv.cc; also the key of the CUDA
// algorithm cache (with dtype and device).
struct Conv2dGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0;  // x: (n, c, h, w)
  int64_t o = 0, kh = 0, kw = 0;       // weight: (o, c, kh, kw)
  int64_t oh = 0, ow = 0;              // y: (n, o, oh, ow)
  Conv2dParams params;
};

// y = conv(x, weight) + bias (bias undefined: none).
void Conv2dForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dGeometry& g, const Tensor& y);
// dx = gradient of x from dy (overwritten, not accumulated).
void Conv2dBackwardDataCpu(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                           const Tensor& dx);
// dweight = gradient of weight from dy and x (overwritten).
void Conv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                             const Tensor& dweight);
// dbias (o) = dy summed over n, oh, ow.
void Conv2dBackwardBiasCpu(const Tensor& dy, const Tensor& dbias);

#if TANDEM_WITH_CUDA
void Conv2dForwardCuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Conv2dGeometry& g, const Tensor& y);
void Conv2dBackwardDataCuda(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                            const Tensor& dx);
void Conv2dBackwardFilterCuda(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                              const Tensor& dweight);
void Conv2dBackwardBiasCuda(const Tensor& dy, const Tensor& dbias);
// bfloat16 bias kernels (conv_bf16_cuda.cu), float32 arithmetic, one rounding:
// y (n, o, oh, ow) += bias (o), and dbias (o) = dy (n, o, oh, ow) summed over
// n, oh, ow in float32 in a fixed order (deterministic).
void ConvBiasAddBFloat16Cuda(const Tensor& bias, const Conv2dGeometry& g, const Tensor& y);
void ConvBiasGradBFloat16Cuda(const Tensor& dy, const Tensor& dbias);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_CONV_KERNELS_H_
