#include "nn/layers.h"

#include <cmath>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unordered_set>

#include "nn/ops/batch_norm.h"
#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"

namespace tandem::nn {
namespace {

// Uniform in [-bound, bound) from the thread's generator, on the current device.
Tensor UniformParameter(const Shape& shape, double bound) {
  NoGradGuard no_grad;
  Tensor u = rand(shape);
  return mul_scalar(add_scalar(u, -0.5), 2.0 * bound);
}

}  // namespace

// --- Linear ----------------------------------------------------------------------
LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool bias)
    : in_features(in_features), out_features(out_features) {
  TANDEM_CHECK(in_features > 0 && out_features > 0, "Linear(", in_features, ", ", out_features,
               "): feature counts must be positive");
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight = register_parameter("weight", UniformParameter({out_features, in_features}, bound));
  if (bias) this->bias = register_parameter("bias", UniformParameter({out_features}, bound));
}

Tensor LinearImpl::forward(const Tensor& x) { return linear(x, weight, bias); }

// --- Conv2d ----------------------------------------------------------------------
Conv2dImpl::Conv2dImpl(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel,
                       const Conv2dParams& params, bool bias)
    : params(params) {
  TANDEM_CHECK(in_channels > 0 && out_channels > 0 && kernel[0] > 0 && kernel[1] > 0, "Conv2d(",
               in_channels, ", ", out_channels, ", kernel (", kernel[0], ", ", kernel[1],
               ")): channel counts and kernel sizes must be positive");
  const int64_t groups = params.groups;
  TANDEM_CHECK(groups >= 1, "Conv2d(", in_channels, ", ", out_channels, "): groups must be >= 1, got ",
               groups);
  TANDEM_CHECK(in_channels % groups == 0, "Conv2d(", in_channels, ", ", out_channels,
               "): in_channels ", in_channels, " is not divisible by groups ", groups);
  TANDEM_CHECK(out_channels % groups == 0, "Conv2d(", in_channels, ", ", out_channels,
               "): out_channels ", out_channels, " is not divisible by groups ", groups);
  const int64_t group_in = in_channels / groups;
  const double fan_in = static_cast<double>(group_in * kernel[0] * kernel[1]);
  const double bound = 1.0 / std::sqrt(fan_in);
  weight = register_parameter(
      "weight", UniformParameter({out_channels, group_in, kernel[0], kernel[1]}, bound));
  if (bias) this->bias = register_parameter("bias", UniformParameter({out_channels}, bound));
}

Tensor Conv2dImpl::forward(const Tensor& x) { return conv2d(x, weight, bias, params); }
Tensor Conv2dImpl::forward_relu(const Tensor& x) { return conv2d_relu(x, weight, bias, params); }
Tensor Conv2dImpl::forward_relu_max_pool(const Tensor& x, const Pool2dParams& pool) {
  return conv2d_relu_max_pool2d(x, weight, bias, params, pool);
}

// --- Pooling and activations ---------------------------------------------------------
Tensor MaxPool2dImpl::forward(const Tensor& x) { return max_pool2d(x, params); }
Tensor AvgPool2dImpl::forward(const Tensor& x) { return avg_pool2d(x, params); }
AdaptiveAvgPool2dImpl::AdaptiveAvgPool2dImpl(std::array<int64_t, 2> output_size)
    : output_size(output_size) {
  TANDEM_CHECK(output_size[0] >= 1 && output_size[1] >= 1, "AdaptiveAvgPool2d({", output_size[0],
               ", ", output_size[1], "}): the output size must be >= 1");
}
Tensor AdaptiveAvgPool2dImpl::forward(const Tensor& x) {
  return adaptive_avg_pool2d(x, output_size);
}
Tensor ReLUImpl::forward(const Tensor& x) { return relu(x); }
Tensor ReLU6Impl::forward(const Tensor& x) { return relu6(x); }
Tensor SigmoidImpl::forward(const Tensor& x) { return sigmoid(x); }
Tensor TanhImpl::forward(const Tensor& x) { return tanh(x); }
Tensor GELUImpl::forward(const Tensor& x) { return gelu(x, approximate); }
LeakyReLUImpl::LeakyReLUImpl(double negative_slope) : negative_slope(negative_slope) {
  TANDEM_CHECK(std::isfinite(negative_slope), "LeakyReLU(", negative_slope,
               "): negative_slope must be finite");
}
Tensor LeakyReLUImpl::forward(const Tensor& x) { return leaky_relu(x, negative_slope); }
Tensor SiLUImpl::forward(const Tensor& x) { return silu(x); }

DropoutImpl::DropoutImpl(double p) : p(p) {
  TANDEM_CHECK(p >= 0.0 && p < 1.0, "Dropout(", p, "): p must be in [0, 1)");
}
Tensor DropoutImpl::forward(const Tensor& x) { return dropout(x, p, is_training()); }

Tensor FlattenImpl::forward(const Tensor& x) { return x.flatten(start_dim); }

// --- BatchNorm2d ---------------------------------------------------------------------
BatchNorm2dImpl::BatchNorm2dImpl(int64_t num_features, double eps, double momentum)
    : num_features(num_features), eps(eps), momentum(momentum) {
  TANDEM_CHECK(num_features > 0, "BatchNorm2d(", num_features,
               "): the channel count must be positive");
  TANDEM_CHECK(eps > 0 && momentum >= 0 && momentum <= 1, "BatchNorm2d(", num_features, ", eps ",
               eps, ", momentum ", momentum, "): eps must be > 0 and momentum in [0, 1]");
  weight = register_parameter("weight", ones({num_features}));
  bias = register_parameter("bias", zeros({num_features}));
  running_mean = register_buffer("running_mean", zeros({num_features}));
  running_var = register_buffer("running_var", ones({num_features}));
  num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, {.dtype = kInt64}));
}

Tensor BatchNorm2dImpl::forward(const Tensor& x) {
  Tensor y = batch_norm2d(x, weight, bias, running_mean, running_var, is_training(), momentum, eps,
                          reducer);
  if (is_training()) CountBatch();
  return y;
}

void BatchNorm2dImpl::CountBatch() {
  // The module may have moved (to()) or been converted since the last call.
  if (!one_.defined() || one_.device() != num_batches_tracked.device() ||
      one_.dtype() != num_batches_tracked.dtype()) {
    one_ = ones({}, {.dtype = num_batches_tracked.dtype(), .device = num_batches_tracked.device()});
  }
  num_batches_tracked.add_(one_);
}

void AddMissingBatchCounts(const Module& model, StateDict& state) {
  std::unordered_set<std::string> present;
  for (const auto& [name, unused] : state) present.insert(name);
  constexpr std::string_view kCount = "num_batches_tracked";
  for (const auto& [name, buffer] : model.named_buffers()) {
    if (!name.ends_with(kCount) || present.contains(name)) continue;
    const std::string prefix = name.substr(0, name.size() - kCount.size());
    // Only where the rest of that BatchNorm2d is in the state (not a missing layer).
    if (!present.contains(prefix + "running_mean")) continue;
    state.emplace_back(name, zeros({}, {.dtype = buffer.dtype(), .device = Device::CPU()}));
  }
}

// --- Sequential ----------------------------------------------------------------------
SequentialImpl::SequentialImpl(std::initializer_list<AnyModule> modules) {
  for (const AnyModule& m : modules) push_back(m);
}

void SequentialImpl::push_back(const AnyModule& module) {
  register_module(std::to_string(modules_.size()), module.ptr());
  modules_.push_back(module.ptr());
}

Tensor SequentialImpl::forward(const Tensor& x) {
  Tensor y = x;
  for (size_t i = 0; i < modules_.size(); ++i) {
    // Exact types only: a subclass may override forward.
    // Conv2d, ReLU [, MaxPool2d]: one fused op (conv.h), the same bits.
    // Unfused while a ForwardRecorder watches, so that each layer reports its output.
    const Module& m = *modules_[i];
    if (internal::forward_recorder == nullptr && typeid(m) == typeid(Conv2dImpl) &&
        i + 1 < modules_.size() &&
        typeid(*modules_[i + 1]) == typeid(ReLUImpl)) {
      auto& conv = static_cast<Conv2dImpl&>(*modules_[i]);
      if (i + 2 < modules_.size() && typeid(*modules_[i + 2]) == typeid(MaxPool2dImpl)) {
        y = conv.forward_relu_max_pool(y, static_cast<MaxPool2dImpl&>(*modules_[i + 2]).params);
        i += 2;
      } else {
        y = conv.forward_relu(y);
        ++i;
      }
      continue;
    }
    y = (*modules_[i])(y);
  }
  return y;
}

const std::shared_ptr<Module>& SequentialImpl::operator[](int64_t i) const {
  TANDEM_CHECK(i >= 0 && i < size(), "Sequential[", i, "]: index out of range for ", size(),
               " modules");
  return modules_[static_cast<size_t>(i)];
}

// --- Losses --------------------------------------------------------------------------
Tensor MSELossImpl::forward(const Tensor& pred, const Tensor& target) {
  return mse_loss(pred, target, reduction);
}
namespace {

// A class weight for a loss module: 1-D (its length is checked against the input
// at forward), a constant (the loss refuses one that requires grad: refused here,
// at construction), registered as the buffer "weight".
Tensor RegisterClassWeight(Module& module, const std::optional<Tensor>& weight, const char* name) {
  if (!weight.has_value()) return Tensor();
  TANDEM_CHECK(weight->defined() && weight->dim() == 1, name, ": weight of shape ",
               weight->defined() ? ShapeToString(weight->shape()) : "(undefined)",
               " must be 1-D, one weight per class");
  TANDEM_CHECK(!weight->requires_grad(), name,
               ": weight requires grad; class weights are constants (detach it)");
  return module.register_buffer("weight", *weight);
}

std::optional<Tensor> OptionalWeight(const Tensor& weight) {
  return weight.defined() ? std::optional<Tensor>(weight) : std::nullopt;
}

}  // namespace

CrossEntropyLossImpl::CrossEntropyLossImpl(const CrossEntropyOptions& options)
    : reduction(options.reduction),
      ignore_index(options.ignore_index),
      label_smoothing(options.label_smoothing) {
  TANDEM_CHECK(label_smoothing >= 0 && label_smoothing <= 1, "CrossEntropyLoss: label_smoothing ",
               label_smoothing, " is outside [0, 1]");
  weight = RegisterClassWeight(*this, options.weight, "CrossEntropyLoss");
}
Tensor CrossEntropyLossImpl::forward(const Tensor& logits, const Tensor& labels) {
  return cross_entropy(logits, labels,
                       {.reduction = reduction, .weight = OptionalWeight(weight),
                        .ignore_index = ignore_index, .label_smoothing = label_smoothing});
}
NLLLossImpl::NLLLossImpl(const NllLossOptions& options)
    : reduction(options.reduction), ignore_index(options.ignore_index) {
  weight = RegisterClassWeight(*this, options.weight, "NLLLoss");
}
Tensor NLLLossImpl::forward(const Tensor& log_probs, const Tensor& labels) {
  return nll_loss(log_probs, labels,
                  {.reduction = reduction, .weight = OptionalWeight(weight),
                   .ignore_index = ignore_index});
}
Tensor L1LossImpl::forward(const Tensor& pred, const Tensor& target) {
  return l1_loss(pred, target, reduction);
}
SmoothL1LossImpl::SmoothL1LossImpl(Reduction reduction, double beta)
    : reduction(reduction), beta(beta) {
  TANDEM_CHECK(beta >= 0 && std::isfinite(beta), "SmoothL1Loss: beta ", beta,
               " must be finite and >= 0");
}
Tensor SmoothL1LossImpl::forward(const Tensor& pred, const Tensor& target) {
  return smooth_l1_loss(pred, target, reduction, beta);
}
BCEWithLogitsLossImpl::BCEWithLogitsLossImpl(Reduction reduction, std::optional<Tensor> pos_weight)
    : reduction(reduction) {
  if (pos_weight.has_value()) this->pos_weight = register_buffer("pos_weight", *pos_weight);
}
Tensor BCEWithLogitsLossImpl::forward(const Tensor& logits, const Tensor& target) {
  return binary_cross_entropy_with_logits(
      logits, target, pos_weight.defined() ? std::optional<Tensor>(pos_weight) : std::nullopt,
      reduction);
}

}  // namespace tandem::nn
