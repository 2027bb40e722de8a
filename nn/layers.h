// Layers and losses as modules. Each FooImpl is the module; Foo is its shared
// holder (see module.h): `nn::Linear fc(784, 10); Tensor y = fc(x); fc->weight`.
// Parameters are created on nn::current_device() and initialised from the
// calling thread's generator (nn::rand), so one seed gives one model.
#ifndef TANDEM_NN_LAYERS_H_
#define TANDEM_NN_LAYERS_H_

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>

#include "nn/module.h"
#include "nn/ops/batch_norm.h"  // BatchNormReducer
#include "nn/ops/conv.h"
#include "nn/ops/elementwise.h"  // GeluApproximate
#include "nn/ops/loss.h"  // Reduction
#include "nn/ops/pool.h"
#include "nn/tensor.h"

namespace tandem::nn {

// y = x W^T + b. x: (N, in) -> (N, out). weight: (out, in); bias: (out), undefined
// without bias. Init as PyTorch: weight and bias uniform in +-1/sqrt(in)
// (kaiming-uniform with a = sqrt(5)).
class LinearImpl : public Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  Tensor forward(const Tensor& x) override;

  int64_t in_features, out_features;
  Tensor weight, bias;
};
TANDEM_MODULE(Linear);

// x: (N, in, H, W) -> (N, out, OH, OW) (see conv2d). weight: (out, in / G, KH, KW)
// with G = params.groups (in and out multiples of G; G == in: depthwise);
// bias: (out). Init uniform in +-1/sqrt(in / G * KH * KW), as PyTorch.
class Conv2dImpl : public Module {
 public:
  Conv2dImpl(int64_t in_channels, int64_t out_channels, std::array<int64_t, 2> kernel,
             const Conv2dParams& params = {}, bool bias = true);
  Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel,
             const Conv2dParams& params = {}, bool bias = true)
      : Conv2dImpl(in_channels, out_channels, {kernel, kernel}, params, bias) {}
  Tensor forward(const Tensor& x) override;
  // relu(forward(x)) as one op (conv2d_relu): what Sequential runs for a Conv2d
  // followed by a ReLU.
  Tensor forward_relu(const Tensor& x);
  // max_pool2d(relu(forward(x)), pool) as one op (conv2d_relu_max_pool2d): what
  // Sequential runs for a Conv2d followed by a ReLU and a MaxPool2d.
  Tensor forward_relu_max_pool(const Tensor& x, const Pool2dParams& pool);

  Conv2dParams params;
  Tensor weight, bias;
};
class Conv2d : public ModuleHolder<Conv2dImpl> {
 public:
  using ModuleHolder<Conv2dImpl>::ModuleHolder;
  // Spelled out so that `Conv2d(1, 6, 5, {.padding = {2, 2}})` compiles.
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel,
         const Conv2dParams& params = {}, bool bias = true)
      : ModuleHolder(std::make_shared<Conv2dImpl>(in_channels, out_channels, kernel, params, bias)) {}
};

// x: (N, C, H, W) -> (N, C, OH, OW) (see pool.h).
class MaxPool2dImpl : public Module {
 public:
  explicit MaxPool2dImpl(const Pool2dParams& params = {}) : params(params) {}
  explicit MaxPool2dImpl(int64_t kernel) : params{.kernel = {kernel, kernel}} {}
  Tensor forward(const Tensor& x) override;
  Pool2dParams params;
};
class MaxPool2d : public ModuleHolder<MaxPool2dImpl> {
 public:
  using ModuleHolder<MaxPool2dImpl>::ModuleHolder;
  MaxPool2d(const Pool2dParams& params) : ModuleHolder(std::make_shared<MaxPool2dImpl>(params)) {}
};

class AvgPool2dImpl : public Module {
 public:
  explicit AvgPool2dImpl(const Pool2dParams& params = {}) : params(params) {}
  explicit AvgPool2dImpl(int64_t kernel) : params{.kernel = {kernel, kernel}} {}
  Tensor forward(const Tensor& x) override;
  Pool2dParams params;
};
class AvgPool2d : public ModuleHolder<AvgPool2dImpl> {
 public:
  using ModuleHolder<AvgPool2dImpl>::ModuleHolder;
  AvgPool2d(const Pool2dParams& params) : ModuleHolder(std::make_shared<AvgPool2dImpl>(params)) {}
};

// x: (N, C, H, W) -> (N, C, OH, OW) for output_size (OH, OW) (see
// adaptive_avg_pool2d); AdaptiveAvgPool2d({1, 1}) is the global average pool.
class AdaptiveAvgPool2dImpl : public Module {
 public:
  explicit AdaptiveAvgPool2dImpl(std::array<int64_t, 2> output_size);
  Tensor forward(const Tensor& x) override;
  std::array<int64_t, 2> output_size;
};
class AdaptiveAvgPool2d : public ModuleHolder<AdaptiveAvgPool2dImpl> {
 public:
  using ModuleHolder<AdaptiveAvgPool2dImpl>::ModuleHolder;
  // Spelled out so that `AdaptiveAvgPool2d({1, 1})` compiles.
  AdaptiveAvgPool2d(std::array<int64_t, 2> output_size)
      : ModuleHolder(std::make_shared<AdaptiveAvgPool2dImpl>(output_size)) {}
};

// Activations: any shape, elementwise.
class ReLUImpl : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};
TANDEM_MODULE(ReLU);
class ReLU6Impl : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};
TANDEM_MODULE(ReLU6);
class SigmoidImpl : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};
TANDEM_MODULE(Sigmoid);
class TanhImpl : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};
TANDEM_MODULE(Tanh);
// gelu(x, approximate): the exact erf form by default, GeluApproximate::kTanh as
// PyTorch's approximate="tanh".
class GELUImpl : public Module {
 public:
  explicit GELUImpl(GeluApproximate approximate = GeluApproximate::kNone)
      : approximate(approximate) {}
  Tensor forward(const Tensor& x) override;

  GeluApproximate approximate;
};
TANDEM_MODULE(GELU);
class LeakyReLUImpl : public Module {
 public:
  explicit LeakyReLUImpl(double negative_slope = 0.01);  // finite, else an error naming it
  Tensor forward(const Tensor& x) override;

  double negative_slope;
};
TANDEM_MODULE(LeakyReLU);
class SiLUImpl : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};
TANDEM_MODULE(SiLU);

// Zeroes elements with probability p while is_training(), scaling the rest by
// 1/(1-p); the identity in eval mode. p in [0, 1) (checked here).
class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  double p;
};
TANDEM_MODULE(Dropout);

// Collapses dims start_dim.. into one: (N, C, H, W) -> (N, C*H*W) for start_dim 1.
class FlattenImpl : public Module {
 public:
  explicit FlattenImpl(int64_t start_dim = 1) : start_dim(start_dim) {}
  Tensor forward(const Tensor& x) override;
  int64_t start_dim;
};
TANDEM_MODULE(Flatten);

// x: (N, C, H, W). Parameters weight (ones) and bias (zeros), buffers
// running_mean (zeros) and running_var (ones), all (C), and num_batches_tracked
// (int64, 0-dim, zero): PyTorch's state-dict entries, in its order. Training mode
// normalises with batch statistics, updates the running ones and adds 1 to
// num_batches_tracked (on the tensor's device, no host wait); eval mode uses the
// running ones (see batch_norm2d). The count is bookkeeping only (momentum is
// always a number here), kept so that state dicts match torchvision's.
// `reducer`, when set, makes the training statistics those of every worker's slice
// together (dist::ConvertSyncBatchNorm sets it).
class BatchNorm2dImpl : public Module {
 public:
  explicit BatchNorm2dImpl(int64_t num_features, double eps = 1e-5, double momentum = 0.1);
  Tensor forward(const Tensor& x) override;

  int64_t num_features;
  double eps, momentum;
  Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  std::shared_ptr<BatchNormReducer> reducer;

 private:
  void CountBatch();
  Tensor one_;  // 1 in num_batches_tracked's dtype and on its device, made on first use
};
TANDEM_MODULE(BatchNorm2d);

// Adds a zero num_batches_tracked to `state` for every BatchNorm2d of `model`
// whose entry `state` lacks (state dicts saved before BatchNorm2d kept the
// count), so that such files still load strictly. Other keys are untouched.
void AddMissingBatchCounts(const Module& model, StateDict& state);

// Chains its children: forward(x) = m_k(...m_1(m_0(x))). Children are named
// "0", "1", ... in order. A Conv2d directly followed by a ReLU (exactly these
// classes, not subclasses) runs as one op, Conv2dImpl::forward_relu: the same
// values and gradients; on the CPU's oneDNN JIT kernels one pass over y fewer
// (not while a ForwardRecorder is installed: then each child is called alone).
class SequentialImpl : public Module {
 public:
  SequentialImpl() = default;
  SequentialImpl(std::initializer_list<AnyModule> modules);
  void push_back(const AnyModule& module);
  Tensor forward(const Tensor& x) override;
  int64_t size() const { return static_cast<int64_t>(modules_.size()); }
  // The i-th child; throws when out of range.
  const std::shared_ptr<Module>& operator[](int64_t i) const;

 private:
  std::vector<std::shared_ptr<Module>> modules_;
};
class Sequential : public ModuleHolder<SequentialImpl> {
 public:
  using ModuleHolder<SequentialImpl>::ModuleHolder;
  Sequential(std::initializer_list<AnyModule> modules)
      : ModuleHolder(std::make_shared<SequentialImpl>(modules)) {}
};

// Losses: loss_fn(pred, target) -> the loss reduced by `reduction` (0-dim mean
// by default; `nn::MSELoss loss_fn(nn::Reduction::kSum)` sums). No parameters.
// pred, target: same shapes (see mse_loss).
class MSELossImpl : public Module {
 public:
  explicit MSELossImpl(Reduction reduction = Reduction::kMean) : reduction(reduction) {}
  using Module::forward;
  Tensor forward(const Tensor& pred, const Tensor& target);

  Reduction reduction;
};
TANDEM_MODULE(MSELoss);
// logits: (N, C) float; labels: (N) int64 (see cross_entropy). Built from a
// Reduction or from CrossEntropyOptions (weight, ignore_index, label_smoothing);
// the weight, when given, is a buffer named "weight" (moves with to(), in the
// state dict, as PyTorch's CrossEntropyLoss). label_smoothing outside [0, 1] or a
// weight that is not 1-D or requires grad fails here, naming it (NLLLoss's weight too).
class CrossEntropyLossImpl : public Module {
 public:
  explicit CrossEntropyLossImpl(Reduction reduction = Reduction::kMean) : reduction(reduction) {}
  explicit CrossEntropyLossImpl(const CrossEntropyOptions& options);
  using Module::forward;
  Tensor forward(const Tensor& logits, const Tensor& labels);

  Reduction reduction;
  Tensor weight;  // undefined when not given
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
};
TANDEM_MODULE(CrossEntropyLoss);
// log_probs: (N, C) float; labels: (N) int64 (see nll_loss). Built from a Reduction
// or from NllLossOptions (weight, a buffer as in CrossEntropyLoss; ignore_index).
class NLLLossImpl : public Module {
 public:
  explicit NLLLossImpl(Reduction reduction = Reduction::kMean) : reduction(reduction) {}
  explicit NLLLossImpl(const NllLossOptions& options);
  using Module::forward;
  Tensor forward(const Tensor& log_probs, const Tensor& labels);

  Reduction reduction;
  Tensor weight;  // undefined when not given
  int64_t ignore_index = -100;
};
TANDEM_MODULE(NLLLoss);
// pred, target: same shapes (see l1_loss).
class L1LossImpl : public Module {
 public:
  explicit L1LossImpl(Reduction reduction = Reduction::kMean) : reduction(reduction) {}
  using Module::forward;
  Tensor forward(const Tensor& pred, const Tensor& target);

  Reduction reduction;
};
TANDEM_MODULE(L1Loss);
// pred, target: same shapes; beta >= 0 (see smooth_l1_loss).
class SmoothL1LossImpl : public Module {
 public:
  explicit SmoothL1LossImpl(Reduction reduction = Reduction::kMean, double beta = 1.0);
  using Module::forward;
  Tensor forward(const Tensor& pred, const Tensor& target);

  Reduction reduction;
  double beta;
};
TANDEM_MODULE(SmoothL1Loss);
// logits, target: same shapes (see binary_cross_entropy_with_logits). pos_weight,
// when given, is a buffer named "pos_weight" (moves with to(), in the state dict, as
// PyTorch's BCEWithLogitsLoss).
class BCEWithLogitsLossImpl : public Module {
 public:
  explicit BCEWithLogitsLossImpl(Reduction reduction = Reduction::kMean,
                                 std::optional<Tensor> pos_weight = std::nullopt);
  using Module::forward;
  Tensor forward(const Tensor& logits, const Tensor& target);

  Reduction reduction;
  Tensor pos_weight;  // undefined when not given
};
TANDEM_MODULE(BCEWithLogitsLoss);

}  // namespace tandem::nn

#endif  // TANDEM_NN_LAYERS_H_
