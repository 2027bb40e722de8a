// Direct depthwise conv2d on the CPU (internal/conv_depthwise_kernels.h).
#include <algorithm>
#include <vector>

#include "nn/ops/internal/conv_depthwise_kernels.h"
#include "nn/ops/internal/cpu_isa.h"
#include "nn/ops/internal/cpu_parallel.h"

namespace tandem::nn::ops::internal {
namespace {

// The kernels twice: for the baseline instruction set, and with AVX2 and FMA (8
// floats per vector, fused multiply-adds) for the CPUs that have them (chosen
// once per process, UseAvx2Kernels in internal/cpu_isa.h; the bits differ
// between the two, as oneDNN's do between instruction sets).
#define TANDEM_CPU_ISA_KERNELS "nn/ops/conv_depthwise_kernels.inc"
#include "nn/ops/internal/cpu_isa_builds.inc"

}  // namespace

bool IsDepthwise(const Conv2dGeometry& g) {
  return g.params.groups == g.c && g.o == g.c && g.h > 0 && g.w > 0;
}

void DepthwiseConv2dForwardCpu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                               const Conv2dGeometry& g, const Tensor& y, bool relu) {
  TANDEM_CHECK(IsDepthwise(g), "depthwise conv2d: groups ", g.params.groups, ", in_channels ",
               g.c, ", out_channels ", g.o, " is not depthwise");
  TANDEM_DISPATCH_FLOAT(x.dtype(), "depthwise conv2d", [&]<typename T>() {
    TANDEM_CPU_ISA_KERNEL(Forward<T>)(x, weight, bias, g, y, relu);
  });
}

void DepthwiseConv2dBackwardDataCpu(const Tensor& dy, const Tensor& weight,
                                    const Conv2dGeometry& g, const Tensor& dx) {
  TANDEM_CHECK(IsDepthwise(g), "depthwise conv2d backward: groups ", g.params.groups,
               ", in_channels ", g.c, ", out_channels ", g.o, " is not depthwise");
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "depthwise conv2d backward", [&]<typename T>() {
    TANDEM_CPU_ISA_KERNEL(BackwardData<T>)(dy, weight, g, dx);
  });
}

void DepthwiseConv2dBackwardFilterCpu(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                                      const Tensor& dweight) {
  TANDEM_CHECK(IsDepthwise(g), "depthwise conv2d backward: groups ", g.params.groups,
               ", in_channels ", g.c, ", out_channels ", g.o, " is not depthwise");
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "depthwise conv2d backward", [&]<typename T>() {
    TANDEM_CPU_ISA_KERNEL(BackwardFilter<T>)(dy, x, g, dweight);
  });
}

}  // namespace tandem::nn::ops::internal
