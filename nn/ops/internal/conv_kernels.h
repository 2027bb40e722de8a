// Kernel interface of the conv family, shared by the CPU file (im2col + OpenBLAS)
// and the CUDA files (cuDNN; bfloat16 bias kernels). Internal to nn.
// The Cpu kernels take float32, float64 or bfloat16 (the latter computed in
// float32 on widened copies and rounded once).
#ifndef TANDEM_NN_OPS_INTERNAL_CONV_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_CONV_KERNELS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "nn/ops/conv.h"
#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

struct Pool2dGeometry;  // pool_kernels.h

// Sizes of one conv2d call, checked by conv.cc; also the key of the CUDA
// algorithm cache (with dtype and device).
struct Conv2dGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0;  // x: (n, c, h, w)
  int64_t o = 0, kh = 0, kw = 0;       // weight: (o, c / params.groups, kh, kw)
  int64_t oh = 0, ow = 0;              // y: (n, o, oh, ow)
  Conv2dParams params;                 // params.groups divides c and o

  auto operator<=>(const Conv2dGeometry&) const = default;
};

// conv2d's sizes for x (N, C, H, W) and weight (O, C / groups, KH, KW), both of 4
// dimensions (the caller checks), or an error naming the bad value (conv.cc).
Conv2dGeometry Conv2dGeometryOf(const Shape& x, const Shape& weight, const Conv2dParams& params);

// x as a forward call's primitive read it, kept for the backward call of the same
// convolution: the oneDNN path reorders x into its blocked layout in forward and
// its weight gradient reads the same layout, so backward reuses the copy instead
// of reordering x again. Empty (data undefined) where forward did not reorder x.
struct Conv2dSavedInput {
  Tensor data;                         // x in `layout`
  std::shared_ptr<const void> layout;  // conv_dnnl.cc's description of the layout
};

// y = conv(x, weight) + bias (bias undefined: none); relu: y = max(y, 0) after
// the bias, with the bits of relu() on the unfused result (oneDNN's JIT kernels:
// a post-op of the primitive; the other kernels: in place after the convolution).
// saved_x: when given, receives x as the primitive read it (see Conv2dSavedInput).
void Conv2dForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dGeometry& g, const Tensor& y, bool relu = false,
                      Conv2dSavedInput* saved_x = nullptr);
// dx = gradient of x from dy (overwritten, not accumulated).
void Conv2dBackwardDataCpu(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                           const Tensor& dx);
// dweight = gradient of weight from dy and x (overwritten).
void Conv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                             const Tensor& dweight);
// dbias (o) = dy summed over n, oh, ow.
void Conv2dBackwardBiasCpu(const Tensor& dy, const Tensor& dbias);
// All three gradients of one call: each of dx, dweight, dbias that is defined is
// overwritten as above (x is read only for dweight, weight only for dx). The
// oneDNN path reorders dy once for both primitives, reads x from saved_x (the
// forward's copy) where its layout is the one the dweight primitive reads, and
// sums dbias inside the dweight pass; the others run the three kernels above.
void Conv2dBackwardCpu(const Tensor& dy, const Tensor& x, const Tensor& weight,
                       const Conv2dGeometry& g, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Conv2dSavedInput& saved_x = {});

// conv2d_relu_max_pool2d's fused CPU path: float32, or bfloat16 where
// CpuBf16Native() (autocast's; y and dy then bfloat16 in the primitive's
// layout), on a oneDNN JIT convolution with relu as its post-op and y channels-last (NHWC) or blocked nChw8c /
// nChw16c with the output channels filling the blocks, then max pooling whose
// windows tile y (no padding, kernel == stride, < 255 positions) on tandem's
// own pooling path. y stays in the primitive's layout: the pooling reads it
// there (as images of `group` channels-last channels: NHWC is one group of all
// channels, a blocked layout one per block) and writes `out` (NCHW) and `where`
// (uint8, numel of out; pool_kernels.h's MaxPool2dReluChannelsLastForwardCpu);
// backward scatters dout into a dy in the same layout, which the backward
// primitives read as they get it (no reorders of y or dy and no pass for relu's
// mask, where their layout is forward's). Same bits as conv2d_relu then
// max_pool2d (conv_relu_pool_test): the gradient of the bias alone (weight
// frozen) takes an NCHW copy of dy, and where the CPU path changed since
// forward to one whose backward is not oneDNN's, the ops' own backward runs on
// an NCHW copy of dy.
struct Conv2dReluMaxPoolLayout {
  int64_t group = 0;  // 0: the fused path does not apply to the call
  std::shared_ptr<const void> y_layout;  // conv_dnnl.cc's description of y's layout
};
// For float32 CPU operands, or bfloat16 ones (the caller's checks); bias:
// whether the convolution has one.
Conv2dReluMaxPoolLayout Conv2dReluMaxPoolLayoutCpu(DType dtype, const Conv2dGeometry& g,
                                                   const Pool2dGeometry& pool, bool bias);
void Conv2dReluMaxPoolForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                 const Conv2dGeometry& g, const Pool2dGeometry& pool,
                                 const Conv2dReluMaxPoolLayout& layout, const Tensor& out,
                                 const Tensor& where, Conv2dSavedInput* saved_x);
// dx, dweight, dbias: as Conv2dBackwardCpu's, from dout (the pooled output's gradient).
void Conv2dReluMaxPoolBackwardCpu(const Tensor& dout, const Tensor& where, const Tensor& x,
                                  const Tensor& weight, const Conv2dGeometry& g,
                                  const Pool2dGeometry& pool,
                                  const Conv2dReluMaxPoolLayout& layout, const Tensor& dx,
                                  const Tensor& dweight, const Tensor& dbias,
                                  const Conv2dSavedInput& saved_x);
// The float32 CPU implementation (float64 always takes im2col + OpenBLAS; bfloat16
// runs on oneDNN's bfloat16 primitives in the layouts chosen here where
// CpuBf16Native(), else the float32 kernels chosen here on widened copies). kAuto: Winograd for the
// 3x3 shapes where it pays (UseWinograd), else oneDNN where tandem is built with it
// (TANDEM_WITH_DNNL), in blocked or channels-last layouts chosen by shape
// (conv_dnnl.cc, AutoLayout), else im2col. kDnnl: oneDNN on the plain NCHW / OIHW
// layouts; kDnnlBlocked and kDnnlNhwc: oneDNN in blocked / channels-last layouts for
// every shape, reordered from and to ours inside each call. kWinograd: Winograd for
// every shape it applies to (WinogradApplies), kAuto's choice for the others.
// Process-wide, atomic; for tests and benchmarks that compare them (a call mid-step
// changes the kernels of the following calls only).
enum class CpuConvPath { kAuto, kIm2col, kDnnl, kDnnlBlocked, kDnnlNhwc, kWinograd };
void SetCpuConvPath(CpuConvPath path);
CpuConvPath GetCpuConvPath();
// True when float32 CPU convolutions that do not take Winograd run on oneDNN now.
bool CpuConvUsesDnnl();
// True when a float32 convolution of these sizes runs on the Winograd kernels
// now (emulated bfloat16 ones too: they run the float32 kernels on widened copies):
// WinogradApplies, not depthwise, and the path kWinograd, or kAuto (while
// nn::cpu_winograd() is on) on shapes large enough to pay for the transforms
// (conv_cpu.cc, kWinogradMinChannels and kWinogradMinWork). dtype: the dtype of
// the float32 kernel call, false for any other.
bool UseWinograd(DType dtype, const Conv2dGeometry& g);

// conv_winograd_cpu.cc: float32 convolutions by Winograd's F(4x4, 3x3) (each 4x4
// block of outputs from a 6x6 input patch in 36 multiplications per channel
// pair instead of 144), for 3x3 filters at stride 1 and dilation 1, one group,
// padding at most 2. The contracts of the Cpu kernels above (the bias of
// forward added and relu applied in the output transform).
bool WinogradApplies(const Conv2dGeometry& g);
void Conv2dForwardWinograd(const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Conv2dGeometry& g, const Tensor& y, bool relu);
void Conv2dBackwardDataWinograd(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                                const Tensor& dx);
void Conv2dBackwardFilterWinograd(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                                  const Tensor& dweight);

// Whether bfloat16 CPU convolutions run on oneDNN's bfloat16 primitives now
// (nn::cpu_bf16_native()).
bool CpuBf16Native();

#if TANDEM_WITH_DNNL
// "oneDNN <major>.<minor>.<patch>" of the loaded library.
std::string DnnlVersion();
// Whether oneDNN's effective ISA has bfloat16 instructions (avx512_core_bf16,
// or AMX which includes it). Decided once per process.
bool DnnlHasBf16();
// conv_dnnl.cc: float32, and bfloat16 where CpuBf16Native(); the contracts of the
// Cpu kernels above.
void Conv2dForwardDnnl(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Conv2dGeometry& g, const Tensor& y, bool relu = false,
                       Conv2dSavedInput* saved_x = nullptr);
void Conv2dBackwardDataDnnl(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                            const Tensor& dx);
void Conv2dBackwardFilterDnnl(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                              const Tensor& dweight);
void Conv2dBackwardDnnl(const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Conv2dGeometry& g, const Tensor& dx, const Tensor& dweight,
                        const Tensor& dbias, const Conv2dSavedInput& saved_x = {});
Conv2dReluMaxPoolLayout Conv2dReluMaxPoolLayoutDnnl(DType dtype, const Conv2dGeometry& g,
                                                    bool bias);
void Conv2dReluMaxPoolForwardDnnl(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                  const Conv2dGeometry& g, const Pool2dGeometry& pool,
                                  const Conv2dReluMaxPoolLayout& layout, const Tensor& out,
                                  const Tensor& where, Conv2dSavedInput* saved_x);
// on_dnnl: whether conv2d's backward runs on oneDNN now (else Conv2dBackwardCpu).
void Conv2dReluMaxPoolBackwardDnnl(const Tensor& dout, const Tensor& where, const Tensor& x,
                                   const Tensor& weight, const Conv2dGeometry& g,
                                   const Pool2dGeometry& pool,
                                   const Conv2dReluMaxPoolLayout& layout, bool on_dnnl,
                                   const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                   const Conv2dSavedInput& saved_x);
// How many primitives conv_dnnl.cc's cache holds on the calling thread (forward,
// backward data and backward weights count one each per shape).
size_t Conv2dDnnlCacheSize();
#endif

#if TANDEM_WITH_CUDA
void Conv2dForwardCuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Conv2dGeometry& g, const Tensor& y, bool relu = false);
void Conv2dBackwardDataCuda(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                            const Tensor& dx);
void Conv2dBackwardFilterCuda(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                              const Tensor& dweight);
void Conv2dBackwardBiasCuda(const Tensor& dy, const Tensor& dbias);
// Conv2dBackwardCpu's contract: the three kernels above, for the defined ones.
void Conv2dBackwardCuda(const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Conv2dGeometry& g, const Tensor& dx, const Tensor& dweight,
                        const Tensor& dbias);
// cuDNN's graph API with cached execution plans (conv_cudnn_graph.cc). Runs one
// direction of one convolution, the pointers being x, w, y for kForward; dx, w,
// dy for kBackwardData; x, dw, dy for kBackwardFilter. Returns false, having
// enqueued nothing, when nn::cudnn_graph() is off, the graph API has no plan for
// the shape or a pointer is less than 16-byte aligned: the caller runs the
// legacy API.
enum class ConvDirection { kForward, kBackwardData, kBackwardFilter };
// What a thread's cached CUDA convolution state depends on besides the
// direction: the shape, the dtype, the device and whether TF32 is allowed (the
// legacy path's plans in conv_cuda.cc, the graph API's in conv_cudnn_graph.cc).
struct ConvCacheKey {
  Conv2dGeometry g;
  DType dtype;
  int device;
  bool tf32;
  auto operator<=>(const ConvCacheKey&) const = default;
};
bool CudnnGraphConv(ConvDirection direction, const Conv2dGeometry& g, DType dtype, Device device,
                    const void* x, const void* w, const void* y);
// The bias kernels (conv_bias_cuda.cu): y (n, o, oh, ow) += bias (o). The bias
// gradient (Conv2dBackwardBiasCuda above, same file) sums dy over n, oh, ow in a
// fixed order (deterministic); float32 arithmetic for float32 and bfloat16 (one
// rounding), float64 for float64.
void ConvBiasAddCuda(const Tensor& bias, const Conv2dGeometry& g, const Tensor& y);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_CONV_KERNELS_H_
