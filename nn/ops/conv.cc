// Conv family: shape checks, device dispatch and autograd wiring.
#include "nn/ops/conv.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "nn/autograd.h"
#include "nn/ops/internal/autocast.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn {
namespace {

std::string PairToString(const std::array<int64_t, 2>& v) {
  return absl::StrCat("(", v[0], ", ", v[1], ")");
}

// set_cudnn_graph's switch; TANDEM_CUDNN_GRAPH=0 starts it off.
std::atomic<bool> cudnn_graph_on{[] {
  const char* v = std::getenv("TANDEM_CUDNN_GRAPH");
  return v == nullptr || std::strcmp(v, "0") != 0;
}()};

}  // namespace

void set_cudnn_graph(bool enable) { cudnn_graph_on.store(enable, std::memory_order_relaxed); }
bool cudnn_graph() { return cudnn_graph_on.load(std::memory_order_relaxed); }

namespace ops::internal {

Conv2dGeometry Conv2dGeometryOf(const Shape& x, const Shape& weight, const Conv2dParams& params) {
  constexpr const char* kOp = "conv2d";
  Conv2dGeometry g;
  g.n = x[0], g.c = x[1], g.h = x[2], g.w = x[3];
  g.o = weight[0], g.kh = weight[2], g.kw = weight[3];
  g.params = params;
  const int64_t groups = params.groups;
  TANDEM_CHECK(groups >= 1, kOp, ": groups must be >= 1, got ", groups);
  TANDEM_CHECK(g.c % groups == 0, kOp, ": in_channels ", g.c, " of x ", ShapeToString(x),
               " is not divisible by groups ", groups);
  TANDEM_CHECK(g.o % groups == 0, kOp, ": out_channels ", g.o, " of weight ",
               ShapeToString(weight), " is not divisible by groups ", groups);
  if (groups == 1) {
    TANDEM_CHECK(g.c == weight[1], kOp, ": x ", ShapeToString(x), " has ", g.c,
                 " channels but weight ", ShapeToString(weight), " expects ", weight[1]);
  } else {
    TANDEM_CHECK(g.c / groups == weight[1], kOp, ": x ", ShapeToString(x), " has ", g.c,
                 " channels, ", g.c / groups, " per group for groups ", groups, ", but weight ",
                 ShapeToString(weight), " expects ", weight[1], " per group");
  }
  TANDEM_CHECK(g.c > 0 && g.o > 0 && g.kh > 0 && g.kw > 0, kOp, ": empty channels or kernel: x ",
               ShapeToString(x), ", weight ", ShapeToString(weight));
  for (int d = 0; d < 2; ++d) {
    TANDEM_CHECK(params.stride[d] >= 1 && params.dilation[d] >= 1 && params.padding[d] >= 0, kOp,
                 ": stride ", PairToString(params.stride), " and dilation ",
                 PairToString(params.dilation), " must be >= 1, padding ",
                 PairToString(params.padding), " >= 0");
  }
  const int64_t span_h = params.dilation[0] * (g.kh - 1) + 1;
  const int64_t span_w = params.dilation[1] * (g.kw - 1) + 1;
  const int64_t padded_h = g.h + 2 * params.padding[0], padded_w = g.w + 2 * params.padding[1];
  TANDEM_CHECK(padded_h >= span_h && padded_w >= span_w, kOp, ": kernel ", ShapeToString(weight),
               " with dilation ", PairToString(params.dilation),
               " is larger than the padded input ", ShapeToString(x), " + padding ",
               PairToString(params.padding));
  g.oh = (padded_h - span_h) / params.stride[0] + 1;
  g.ow = (padded_w - span_w) / params.stride[1] + 1;
  return g;
}

}  // namespace ops::internal

namespace {

using ops::internal::Conv2dGeometry;
using ops::internal::Pool2dGeometry;

Conv2dGeometry CheckConv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Conv2dParams& params) {
  constexpr const char* kOp = "conv2d";
  CheckDefined(x, kOp, "x");
  CheckDefined(weight, kOp, "weight");
  CheckSameDevice(x, weight, kOp);
  CheckSameDType(x, weight, kOp);
  TANDEM_CHECK(IsFloating(x.dtype()), kOp, ": expected float32, float64 or bfloat16 tensors, got ",
               x.ToString());
  CheckDim(x, 4, kOp, "x (N, C, H, W)");
  CheckDim(weight, 4, kOp, "weight (O, C / groups, KH, KW)");
  const Conv2dGeometry g = ops::internal::Conv2dGeometryOf(x.shape(), weight.shape(), params);
  if (bias.defined()) {
    CheckSameDevice(x, bias, kOp);
    CheckSameDType(x, bias, kOp);
    TANDEM_CHECK(bias.dim() == 1 && bias.size(0) == g.o, kOp, ": bias must be (", g.o,
                 ") for weight ", ShapeToString(weight.shape()), " but is ",
                 ShapeToString(bias.shape()));
  }
  return g;
}

}  // namespace

namespace {

// conv2d, and with relu conv2d_relu: the forward kernels apply max(y, 0) as
// they finish y, and backward masks dy with y > 0 (relu's own rule) before the
// convolution's gradients.
Tensor Conv2dOp(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in,
                const Conv2dParams& params, bool relu) {
  // Under autocast float32 operands become bfloat16 (differentiable casts).
  const Tensor x = ops::internal::AutocastLower(x_in);
  const Tensor weight = ops::internal::AutocastLower(weight_in);
  const Tensor bias = ops::internal::AutocastLower(bias_in);
  const Conv2dGeometry g = CheckConv2d(x, weight, bias, params);
  const TensorOptions like_x{.dtype = x.dtype(), .device = x.device()};
  Tensor y = empty({g.n, g.o, g.oh, g.ow}, like_x);
  const bool gx = x.requires_grad(), gw = weight.requires_grad();
  const bool gb = bias.defined() && bias.requires_grad();
  // The weight gradient reads x; the CPU kernels hand over the copy of x they
  // reordered, so that backward need not reorder it again.
  ops::internal::Conv2dSavedInput saved_x;
  if (g.n > 0) {
#if TANDEM_WITH_CUDA
    if (x.is_cuda()) {
      ops::internal::Conv2dForwardCuda(x, weight, bias, g, y, relu);
    } else
#endif
    {
      ops::internal::Conv2dForwardCpu(x, weight, bias, g, y, relu,
                                      gw && grad_mode_enabled() ? &saved_x : nullptr);
    }
  }
  return autograd::Record(
      relu ? "conv2d_relu" : "conv2d", {x, weight, bias}, y,
      // dx needs only the weight and dweight only x: keep just what backward reads
      // (and y for relu's mask).
      [x = gw ? x.detach() : Tensor(), w = gx ? weight.detach() : Tensor(),
       y_kept = relu ? y.detach() : Tensor(), saved_x = std::move(saved_x), x_shape = x.shape(),
       w_shape = weight.shape(), g, gx, gw, gb, like_x](const Tensor& dy_in) {
        Tensor dy = dy_in;
        if (y_kept.defined()) {  // relu: at y == 0 the subgradient 0, as relu()
          dy = empty_like(dy_in);
          const auto plan =
              ops::internal::PlanBroadcast(dy_in.shape(), y_kept.shape(), "conv2d_relu");
          TANDEM_ON_DEVICE(dy_in, ops::internal::Binary, ops::internal::BinaryOp::kReluBackward,
                           dy_in, y_kept, dy, plan);
        }
        Tensor dx = gx ? empty(x_shape, like_x) : Tensor();
        Tensor dw = gw ? empty(w_shape, like_x) : Tensor();
        Tensor db = gb ? empty({g.o}, like_x) : Tensor();
        if (g.n > 0) {
#if TANDEM_WITH_CUDA
          if (dy.is_cuda()) {
            ops::internal::Conv2dBackwardCuda(dy, x, w, g, dx, dw, db);
          } else
#endif
          {
            ops::internal::Conv2dBackwardCpu(dy, x, w, g, dx, dw, db, saved_x);
          }
        } else {  // an empty batch: zero gradients (dx is empty)
          if (gw) dw.fill_(0.0);
          if (gb) db.fill_(0.0);
        }
        return std::vector<Tensor>{dx, dw, db};
      });
}

// conv2d_relu_max_pool2d on the fused CPU path, y in `layout`
// (Conv2dReluMaxPoolLayoutCpu).
Tensor ConvReluMaxPoolFused(const Tensor& x, const Tensor& weight, const Tensor& bias,
                            const Conv2dGeometry& g, const Pool2dGeometry& pool,
                            const ops::internal::Conv2dReluMaxPoolLayout& layout) {
  const TensorOptions like_x{.dtype = x.dtype(), .device = x.device()};
  Tensor out = empty({g.n, g.o, pool.oh, pool.ow}, like_x);
  Tensor where = empty({out.numel()}, {.dtype = kUInt8, .device = x.device()});
  const bool gx = x.requires_grad(), gw = weight.requires_grad();
  const bool gb = bias.defined() && bias.requires_grad();
  ops::internal::Conv2dSavedInput saved_x;
  ops::internal::Conv2dReluMaxPoolForwardCpu(x, weight, bias, g, pool, layout, out, where,
                                             gw && grad_mode_enabled() ? &saved_x : nullptr);
  return autograd::Record(
      "conv2d_relu_max_pool2d", {x, weight, bias}, out,
      [x = gw ? x.detach() : Tensor(), w = gx ? weight.detach() : Tensor(), where,
       saved_x = std::move(saved_x), x_shape = x.shape(), w_shape = weight.shape(), g, pool,
       layout, gx, gw, gb, like_x](const Tensor& dout) {
        Tensor dx = gx ? empty(x_shape, like_x) : Tensor();
        Tensor dw = gw ? empty(w_shape, like_x) : Tensor();
        Tensor db = gb ? empty({g.o}, like_x) : Tensor();
        ops::internal::Conv2dReluMaxPoolBackwardCpu(dout, where, x, w, g, pool, layout, dx, dw,
                                                    db, saved_x);
        return std::vector<Tensor>{dx, dw, db};
      });
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
              const Conv2dParams& params) {
  return Conv2dOp(x, weight, bias, params, /*relu=*/false);
}

Tensor conv2d_relu(const Tensor& x, const Tensor& weight, const Tensor& bias,
                   const Conv2dParams& params) {
  return Conv2dOp(x, weight, bias, params, /*relu=*/true);
}

Tensor conv2d_relu_max_pool2d(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in,
                              const Conv2dParams& params, const Pool2dParams& pool_params) {
  if (x_in.defined() && weight_in.defined() && !x_in.is_cuda()) {
    // Under autocast float32 operands become bfloat16 (differentiable casts),
    // as conv2d_relu's would.
    const Tensor x = ops::internal::AutocastLower(x_in);
    const Tensor weight = ops::internal::AutocastLower(weight_in);
    const Tensor bias = ops::internal::AutocastLower(bias_in);
    if (x.dtype() == kFloat32 || x.dtype() == kBFloat16) {
      const Conv2dGeometry g = CheckConv2d(x, weight, bias, params);
      const Pool2dGeometry pool =
          ops::internal::Pool2dGeometryOf({g.n, g.o, g.oh, g.ow}, pool_params, "max_pool2d");
      const ops::internal::Conv2dReluMaxPoolLayout layout =
          ops::internal::Conv2dReluMaxPoolLayoutCpu(x.dtype(), g, pool, bias.defined());
      if (layout.group > 0) return ConvReluMaxPoolFused(x, weight, bias, g, pool, layout);
    }
    return max_pool2d(conv2d_relu(x, weight, bias, params), pool_params);
  }
  return max_pool2d(conv2d_relu(x_in, weight_in, bias_in, params), pool_params);
}

}  // namespace tandem::nn
