// Pool family: shape checks, device dispatch and autograd wiring.
#include "nn/ops/pool.h"

#include "nn/autograd.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn {
namespace {

using ops::internal::CpuPoolPath;
using ops::internal::Pool2dGeometry;

std::string PairToString(const std::array<int64_t, 2>& v) {
  return absl::StrCat("(", v[0], ", ", v[1], ")");
}

}  // namespace

namespace ops::internal {

Pool2dGeometry Pool2dGeometryOf(const Shape& x_shape, const Pool2dParams& params, const char* op) {
  Pool2dGeometry g;
  g.n = x_shape[0], g.c = x_shape[1], g.h = x_shape[2], g.w = x_shape[3];
  g.kh = params.kernel[0], g.kw = params.kernel[1];
  g.sh = params.stride[0] == 0 ? g.kh : params.stride[0];
  g.sw = params.stride[1] == 0 ? g.kw : params.stride[1];
  g.ph = params.padding[0], g.pw = params.padding[1];
  TANDEM_CHECK(g.kh >= 1 && g.kw >= 1 && g.sh >= 1 && g.sw >= 1, op, ": kernel ",
               PairToString(params.kernel), " must be >= 1 and stride ",
               PairToString(params.stride), " >= 0 (0: the kernel)");
  // At most half the kernel, so every window of a non-empty input holds at least
  // one real element. (H or W 0 with padding gives all-padding windows: avg 0, max
  // 0 on tandem's loops, -FLT_MAX on an explicitly chosen oneDNN max path.)
  TANDEM_CHECK(g.ph >= 0 && g.pw >= 0 && 2 * g.ph <= g.kh && 2 * g.pw <= g.kw, op, ": padding ",
               PairToString(params.padding), " must be in [0, kernel / 2] for kernel ",
               PairToString(params.kernel));
  TANDEM_CHECK(g.h + 2 * g.ph >= g.kh && g.w + 2 * g.pw >= g.kw, op, ": kernel ",
               PairToString(params.kernel), " is larger than the padded input ",
               ShapeToString(x_shape), " + padding ", PairToString(params.padding));
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

}  // namespace ops::internal

namespace {

Pool2dGeometry CheckPool2d(const Tensor& x, const Pool2dParams& params, const char* op) {
  CheckDefined(x, op, "x");
  TANDEM_CHECK(IsFloating(x.dtype()), op, ": expected a float32, float64 or bfloat16 tensor, got ",
               x.ToString());
  CheckDim(x, 4, op, "x (N, C, H, W)");
  return ops::internal::Pool2dGeometryOf(x.shape(), params, op);
}

// The float32 CPU implementation for g (kOwn elsewhere: CUDA, other dtypes).
CpuPoolPath CpuPathOf(const Tensor& x, const Pool2dGeometry& g, bool max) {
  return !x.is_cuda() && x.dtype() == kFloat32 ? ops::internal::ResolveCpuPoolPath(g, max)
                                             : CpuPoolPath::kOwn;
}

}  // namespace

Tensor max_pool2d(const Tensor& x, const Pool2dParams& params) {
  const Pool2dGeometry g = CheckPool2d(x, params, "max_pool2d");
  Tensor y = empty({g.n, g.c, g.oh, g.ow}, {.dtype = x.dtype(), .device = x.device()});
  // The CPU and the bfloat16 CUDA kernels keep argmax positions for backward,
  // oneDNN its workspace; cuDNN (float32 / float64 on CUDA) recomputes them from
  // x and y.
  const bool cudnn = x.is_cuda() && x.dtype() != kBFloat16;
  const CpuPoolPath path = CpuPathOf(x, g, true);
  const bool dnnl = path != CpuPoolPath::kOwn;
  Tensor indices;  // or oneDNN's workspace
  if (dnnl) {
    if (y.numel() > 0) indices = ops::internal::MaxPool2dForwardDnnl(x, g, path, y);
  } else {
    if (!cudnn) indices = empty(y.shape(), {.dtype = kInt64, .device = x.device()});
    if (y.numel() > 0) TANDEM_ON_DEVICE(x, ops::internal::MaxPool2dForward, x, g, y, indices);
  }
  return autograd::Record(
      "max_pool2d", {x}, y,
      [x = cudnn ? x.detach() : Tensor(), y = cudnn ? y.detach() : Tensor(), indices, g, path,
       shape = x.shape(), options = TensorOptions{.dtype = x.dtype(), .device = x.device()}](
          const Tensor& dy) {
        Tensor dx = empty(shape, options);
        if (dy.numel() == 0) return std::vector<Tensor>{dx.fill_(0.0)};
        if (path != CpuPoolPath::kOwn) {
          ops::internal::MaxPool2dBackwardDnnl(indices, dy, g, path, dx);
        } else {
          TANDEM_ON_DEVICE(dy, ops::internal::MaxPool2dBackward, x, y, indices, dy, g, dx);
        }
        return std::vector<Tensor>{dx};
      });
}

Tensor avg_pool2d(const Tensor& x, const Pool2dParams& params) {
  const Pool2dGeometry g = CheckPool2d(x, params, "avg_pool2d");
  Tensor y = empty({g.n, g.c, g.oh, g.ow}, {.dtype = x.dtype(), .device = x.device()});
  const CpuPoolPath path = CpuPathOf(x, g, false);
  if (y.numel() > 0) {
    if (path != CpuPoolPath::kOwn) {
      ops::internal::AvgPool2dForwardDnnl(x, g, path, y);
    } else {
      TANDEM_ON_DEVICE(x, ops::internal::AvgPool2dForward, x, g, y);
    }
  }
  return autograd::Record(
      "avg_pool2d", {x}, y,
      [g, path, shape = x.shape(),
       options = TensorOptions{.dtype = x.dtype(), .device = x.device()}](const Tensor& dy) {
        Tensor dx = empty(shape, options);
        if (dy.numel() == 0) return std::vector<Tensor>{dx.fill_(0.0)};
        if (path != CpuPoolPath::kOwn) {
          ops::internal::AvgPool2dBackwardDnnl(dy, g, path, dx);
        } else {
          TANDEM_ON_DEVICE(dy, ops::internal::AvgPool2dBackward, dy, g, dx);
        }
        return std::vector<Tensor>{dx};
      });
}

Tensor adaptive_avg_pool2d(const Tensor& x, std::array<int64_t, 2> output_size) {
  constexpr const char* kOp = "adaptive_avg_pool2d";
  CheckDefined(x, kOp, "x");
  TANDEM_CHECK(IsFloating(x.dtype()), kOp, ": expected a float32, float64 or bfloat16 tensor, got ",
               x.ToString());
  CheckDim(x, 4, kOp, "x (N, C, H, W)");
  TANDEM_CHECK(output_size[0] >= 1 && output_size[1] >= 1, kOp, ": output size ",
               PairToString(output_size), " must be >= 1");
  TANDEM_CHECK(x.size(2) >= 1 && x.size(3) >= 1, kOp, ": x ", ShapeToString(x.shape()),
               " has an empty plane; every output cell needs at least one input");
  Pool2dGeometry g;
  g.n = x.size(0), g.c = x.size(1), g.h = x.size(2), g.w = x.size(3);
  g.oh = output_size[0], g.ow = output_size[1];
  const TensorOptions options{.dtype = x.dtype(), .device = x.device()};
  Tensor y = empty({g.n, g.c, g.oh, g.ow}, options);
  if (y.numel() > 0) TANDEM_ON_DEVICE(x, ops::internal::AdaptiveAvgPool2dForward, x, g, y);
  return autograd::Record("adaptive_avg_pool2d", {x}, y,
                          [g, shape = x.shape(), options](const Tensor& dy) {
                            Tensor dx = empty(shape, options);
                            if (dy.numel() == 0) return std::vector<Tensor>{dx.fill_(0.0)};
                            TANDEM_ON_DEVICE(dy, ops::internal::AdaptiveAvgPool2dBackward, dy, g,
                                             dx);
                            return std::vector<Tensor>{dx};
                          });
}

}  // namespace tandem::nn
