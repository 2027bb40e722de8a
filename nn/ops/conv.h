// 2-D convolution, grouped and depthwise included. CPU: float32 on oneDNN where
// tandem is built with it (conv_dnnl.cc; primitives cached per shape and thread;
// grouped weights as oneDNN's goihw, depthwise on its depthwise kernels), else and
// for float64 / bfloat16 im2col + OpenBLAS gemm, one GEMM per group (conv_cpu.cc);
// CUDA: cuDNN with the group count on the convolution descriptor and the
// algorithm chosen once per shape and cached (conv_cuda.cc).
#ifndef TANDEM_NN_OPS_CONV_H_
#define TANDEM_NN_OPS_CONV_H_

#include <array>
#include <compare>
#include <string>

#include "nn/ops/pool.h"
#include "nn/tensor.h"

namespace tandem::nn {

struct Conv2dParams {
  std::array<int64_t, 2> stride{1, 1};    // (h, w)
  std::array<int64_t, 2> padding{0, 0};   // zeros on each side, (h, w)
  std::array<int64_t, 2> dilation{1, 1};  // (h, w)
  // Channels split into `groups` independent convolutions: input channels
  // [k C/G, (k+1) C/G) meet weight rows [k O/G, (k+1) O/G) only. groups == C
  // (and O a multiple of C) is the depthwise convolution.
  int64_t groups = 1;

  auto operator<=>(const Conv2dParams&) const = default;
};

// x: (N, C, H, W), weight: (O, C / G, KH, KW) with G = params.groups, bias: (O)
// or undefined -> (N, O, OH, OW) with OH = (H + 2 ph - dh (KH - 1) - 1) / sh + 1
// (likewise OW). C and O must be multiples of G.
// Supported dtypes: float32, float64, bfloat16, one dtype for all operands.
// bfloat16: products accumulate in float32 and the result is rounded to bfloat16
// once (CPU: the float32 kernels on the bfloat16 values; CUDA: cuDNN with
// bfloat16 data and float32 compute); gradients are bfloat16, the bias gradient
// summed in float32. Under nn::AutocastGuard (nn/autocast.h) float32 operands
// are cast to bfloat16 first and the result is bfloat16.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
              const Conv2dParams& params = {});

// relu(conv2d(x, weight, bias, params)) as one op, with the same values and
// gradients bit for bit (the gradient at 0 is 0, as relu's). Where the CPU's
// float32 convolution runs on a oneDNN JIT kernel the ReLU is its post-op (no
// pass of its own over y); elsewhere (oneDNN's gemm kernels, im2col, CUDA)
// relu's kernel runs in place on y. nn::Sequential uses it for a Conv2d followed
// by a ReLU.
Tensor conv2d_relu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                   const Conv2dParams& params = {});

// max_pool2d(conv2d_relu(x, weight, bias, params), pool) as one op, with the
// same values and gradients bit for bit. Fused on the CPU for float32, and for
// bfloat16 (autocast's: float32 operands are cast first) where cpu_bf16_native(),
// where the convolution runs on a oneDNN JIT kernel (relu its post-op)
// channels-last (channel counts off the 16-block; first convolutions without
// AVX-512) or blocked with the output channels filling the blocks, and max
// pooling runs on tandem's kernels with windows that tile the output (no
// padding, kernel == stride): y never leaves the primitive's layout. The
// pooling reads it there and writes the NCHW output, and backward builds the
// convolution's dy in the same layout in one pass: no reorders of y or dy, no
// pass for relu's mask. Elsewhere (CUDA, other dtypes and layouts, overlapping
// or padded windows, emulated bfloat16) the two ops run one after the other.
// nn::Sequential uses it for a Conv2d, a ReLU and a MaxPool2d in a row.
Tensor conv2d_relu_max_pool2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                              const Conv2dParams& params, const Pool2dParams& pool);

// What float32 CPU convolutions (and GEMMs) run on in this build, for reports:
// "oneDNN <version>" (libdnnl, when tandem is built with it) or "im2col +
// OpenBLAS", followed by "; Winograd F(4x4, 3x3) for large 3x3 layers" while
// cpu_winograd() is on. float64 CPU convolutions take im2col + OpenBLAS;
// bfloat16 ones: see cpu_bf16_native().
std::string cpu_conv_backend();

// bfloat16 CPU convolutions (autocast's on the CPU, nn/autocast.h) run on
// oneDNN's bfloat16 primitives (forward, backward data, backward weights;
// bfloat16 operands, float32 accumulation, each result rounded to bfloat16 once,
// the weight and bias gradients accumulated in float32 over the batch; fused
// with relu and max pooling as conv2d_relu_max_pool2d says), and so do the
// bfloat16 GEMMs of matmul and linear (oneDNN's matmul primitive, nn/ops/matmul.h),
// where the CPU has
// bfloat16 instructions: oneDNN's effective ISA (dnnl::get_effective_cpu_isa(),
// which follows the CPU's cpuid flags avx512_bf16 / amx_bf16 and is capped by
// ONEDNN_MAX_CPU_ISA) includes avx512_core_bf16 (AMD Zen 4, Intel Cooper Lake,
// Sapphire Rapids and newer). Elsewhere, in builds without oneDNN, on the
// kIm2col path (convolutions) or while set_cpu_bf16_native(false), they are
// emulated: the float32 kernels on widened copies, each result rounded once
// (slower than float32). The two agree within bfloat16 rounding (summation order differs).
// cpu_bf16_supported(): the CPU and build allow the primitives.
// cpu_bf16_native(): supported and not switched off (the path of the next call).
// set_cpu_bf16_native(false) forces the emulation (tests, comparisons); on by
// default; process-wide, read at each call.
bool cpu_bf16_supported();
bool cpu_bf16_native();
void set_cpu_bf16_native(bool enable);
// For reports: "oneDNN bfloat16 primitives (avx512_core_bf16)" or
// "emulated in float32 (<why>)".
std::string cpu_bf16_backend();

// Whether float32 (and bfloat16) CPU convolutions with 3x3 filters at stride 1,
// 64 or more input and output channels and large enough planes (ResNet's) run
// on tandem's Winograd F(4x4, 3x3) kernels: a quarter of a direct
// convolution's multiplications (1.3-2.2x faster forward + backward on
// ResNet-18's layers, docs/benchmarks.md) and about ten times its rounding
// error (within 2e-5 of the largest value against float64); a non-finite input
// can make the whole 4x4 block of outputs around it non-finite. On by default;
// off: those layers run on oneDNN's direct kernels (or im2col) as the others.
// Process-wide, read at each call.
void set_cpu_winograd(bool enable);
bool cpu_winograd();

// Whether CUDA convolutions run through cuDNN's graph API with an execution plan
// built once per thread and shape (on by default; a shape it cannot plan runs
// on cuDNN's legacy API), or always through the legacy cudnnConvolution* calls,
// whose host time per call is 2-4x higher (docs/gpu.md, "CUDA calls and host
// time per op"). The environment variable TANDEM_CUDNN_GRAPH=0 starts a process
// with it off. Process-wide, read at each call; no effect without CUDA.
void set_cudnn_graph(bool enable);
bool cudnn_graph();

}  // namespace tandem::nn

#endif  // TANDEM_NN_OPS_CONV_H_
