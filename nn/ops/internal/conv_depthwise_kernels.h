// Direct CPU kernels of depthwise conv2d (groups == in_channels == out_channels,
// any kernel, stride, padding, dilation) on our plain NCHW tensors. Internal to nn.
//
// Why: on oneDNN every depthwise call reorders x, y, dy, dx and the weights to
// and from its blocked layouts, which costs more than the convolution (a 3x3
// depthwise layer does 9 multiply-adds per output element), and on the small
// spatial sizes of late MobileNetV2 layers (2x2, 1x1 inputs with padding 1) its
// backward-weights primitive falls back to a per-group GEMM that is slower still.
// conv_cpu.cc sends float32 depthwise calls here on the default path
// (CpuConvPath::kAuto); float64 instantiations exist for the gradient checks.
//
// Stride 1 (most of MobileNetV2's layers): a chunk of images' planes of one
// channel zero-padded side by side, each tap one shifted multiply-add (or, for
// the weight gradient, one dot product) over the whole chunk; other strides row
// by row.
// Threads: ParallelFor over the channels (stride 1, and every weight gradient) or
// the (image, channel) planes (other strides); each channel or plane is computed
// whole by one thread in a fixed order, so the bits do not depend on the thread
// count.
#ifndef TANDEM_NN_OPS_INTERNAL_CONV_DEPTHWISE_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_CONV_DEPTHWISE_KERNELS_H_

#include "nn/ops/internal/conv_kernels.h"

namespace tandem::nn::ops::internal {

// True for the shapes these kernels take: groups == c == o, a non-empty input.
bool IsDepthwise(const Conv2dGeometry& g);

// Contracts of Conv2dForwardCpu / Conv2dBackwardDataCpu / Conv2dBackwardFilterCpu
// (conv_kernels.h) for IsDepthwise(g) shapes; float32 or float64 tensors.
// y[n, c] = sum over taps (kh, kw) in order of weight[c, 0, kh, kw] * x[n, c, ...],
// then + bias[c], then max(y, 0) with relu (relu()'s bits).
void DepthwiseConv2dForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                               const Conv2dGeometry& g, const Tensor& y, bool relu);
void DepthwiseConv2dBackwardDataCpu(const Tensor& dy, const Tensor& weight,
                                    const Conv2dGeometry& g, const Tensor& dx);
// Per channel and tap: dy * x summed in 8 float lanes over chunks of images,
// the chunks' sums added in double.
void DepthwiseConv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                                      const Tensor& dweight);

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_CONV_DEPTHWISE_KERNELS_H_
