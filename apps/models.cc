#include "apps/models.h"

#include <array>
#include <cmath>
#include <string>

#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/pool.h"

namespace tandem::apps {
namespace {

// torchvision's init of MobileNetV2's convolutions: kaiming_normal_(mode="fan_out"),
// std = sqrt(2 / fan_out) with fan_out = O * KH * KW (groups do not divide it).
nn::Conv2d KaimingNormalFanOut(nn::Conv2d conv) {
  nn::NoGradGuard no_grad;
  const nn::Tensor& w = conv->weight;
  const double fan_out = static_cast<double>(w.size(0) * w.size(2) * w.size(3));
  w.detach().copy_(nn::mul_scalar(nn::randn(w.shape()), std::sqrt(2.0 / fan_out)));
  return conv;
}

// torchvision's Conv2dNormActivation: conv (no bias, padding (k - 1) / 2) + BN + ReLU6.
nn::Sequential ConvBnRelu6(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1,
                           int64_t groups = 1) {
  const int64_t pad = (kernel - 1) / 2;
  return nn::Sequential(
      {KaimingNormalFanOut(nn::Conv2d(
           in, out, kernel, {.stride = {stride, stride}, .padding = {pad, pad}, .groups = groups},
           /*bias=*/false)),
       nn::BatchNorm2d(out), nn::ReLU6()});
}

// torchvision's InvertedResidual: child "conv" = [1x1 expansion CBR when t != 1,]
// depthwise 3x3 CBR, 1x1 projection conv, BN; x + conv(x) where stride is 1 and
// in == out.
class InvertedResidual : public nn::Module {
 public:
  InvertedResidual(int64_t in, int64_t out, int64_t stride, int64_t expand_ratio)
      : use_residual_(stride == 1 && in == out) {
    const int64_t hidden = in * expand_ratio;
    nn::Sequential layers;
    if (expand_ratio != 1) layers->push_back(ConvBnRelu6(in, hidden, 1));
    layers->push_back(ConvBnRelu6(hidden, hidden, 3, stride, /*groups=*/hidden));
    layers->push_back(KaimingNormalFanOut(nn::Conv2d(hidden, out, 1, {}, /*bias=*/false)));
    layers->push_back(nn::BatchNorm2d(out));
    conv_ = register_module("conv", layers);
  }
  nn::Tensor forward(const nn::Tensor& x) override {
    return use_residual_ ? nn::add(x, conv_(x)) : conv_(x);
  }

 private:
  bool use_residual_;
  nn::Sequential conv_{nullptr};
};

class MobileNetV2 : public nn::Module {
 public:
  MobileNetV2(int64_t num_classes, double dropout) {
    // (expand ratio t, channels c, blocks n, first stride s), width 1.0: every
    // channel count is already a multiple of 8 (torchvision's _make_divisible).
    struct Stage {
      int64_t t, c, n, s;
    };
    constexpr Stage kStages[] = {{1, 16, 1, 1}, {6, 24, 2, 2},  {6, 32, 3, 2},  {6, 64, 4, 2},
                                 {6, 96, 3, 1}, {6, 160, 3, 2}, {6, 320, 1, 1}};
    constexpr int64_t kLastChannels = 1280;
    nn::Sequential features;
    int64_t in = 32;
    features->push_back(ConvBnRelu6(3, in, 3, /*stride=*/2));
    for (const Stage& stage : kStages) {
      for (int64_t i = 0; i < stage.n; ++i) {
        features->push_back(
            std::make_shared<InvertedResidual>(in, stage.c, i == 0 ? stage.s : 1, stage.t));
        in = stage.c;
      }
    }
    features->push_back(ConvBnRelu6(in, kLastChannels, 1));
    features_ = register_module("features", features);
    nn::Linear fc(kLastChannels, num_classes);
    {
      nn::NoGradGuard no_grad;
      fc->weight.detach().copy_(nn::mul_scalar(nn::randn(fc->weight.shape()), 0.01));
      fc->bias.detach().fill_(0.0);
    }
    classifier_ = register_module("classifier", nn::Sequential({nn::Dropout(dropout), fc}));
  }
  nn::Tensor forward(const nn::Tensor& x) override {
    return classifier_(nn::adaptive_avg_pool2d(features_(x), {1, 1}).flatten(1));
  }

 private:
  nn::Sequential features_{nullptr}, classifier_{nullptr};
};

// --- ResNet ---------------------------------------------------------------------

nn::Conv2d ResNetConv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  const int64_t pad = (kernel - 1) / 2;
  return KaimingNormalFanOut(nn::Conv2d(
      in, out, kernel, {.stride = {stride, stride}, .padding = {pad, pad}}, /*bias=*/false));
}

// torchvision's `downsample`: conv1x1 with the block's stride + BN, applied to x
// where the block changes the resolution or the channels; empty otherwise.
nn::Sequential Downsample(int64_t in, int64_t out, int64_t stride) {
  if (stride == 1 && in == out) return nn::Sequential(nullptr);
  return nn::Sequential({ResNetConv(in, out, 1, stride), nn::BatchNorm2d(out)});
}

// torchvision's BasicBlock (expansion 1).
class BasicBlock : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t in, int64_t planes, int64_t stride)
      : conv1_(register_module("conv1", ResNetConv(in, planes, 3, stride))),
        bn1_(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2_(register_module("conv2", ResNetConv(planes, planes, 3, 1))),
        bn2_(register_module("bn2", nn::BatchNorm2d(planes))),
        downsample_(Downsample(in, planes, stride)) {
    if (!downsample_.is_empty()) register_module("downsample", downsample_);
  }
  nn::Tensor forward(const nn::Tensor& x) override {
    const nn::Tensor out = bn2_(conv2_(nn::relu(bn1_(conv1_(x)))));
    return nn::relu(nn::add(out, downsample_.is_empty() ? x : downsample_(x)));
  }

 private:
  nn::Conv2d conv1_;
  nn::BatchNorm2d bn1_;
  nn::Conv2d conv2_;
  nn::BatchNorm2d bn2_;
  nn::Sequential downsample_;
};

// torchvision's Bottleneck (ResNet v1.5: the stride on the 3x3 convolution).
class Bottleneck : public nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in, int64_t planes, int64_t stride)
      : conv1_(register_module("conv1", ResNetConv(in, planes, 1, 1))),
        bn1_(register_module("bn1", nn::BatchNorm2d(planes))),
        conv2_(register_module("conv2", ResNetConv(planes, planes, 3, stride))),
        bn2_(register_module("bn2", nn::BatchNorm2d(planes))),
        conv3_(register_module("conv3", ResNetConv(planes, planes * kExpansion, 1, 1))),
        bn3_(register_module("bn3", nn::BatchNorm2d(planes * kExpansion))),
        downsample_(Downsample(in, planes * kExpansion, stride)) {
    if (!downsample_.is_empty()) register_module("downsample", downsample_);
  }
  nn::Tensor forward(const nn::Tensor& x) override {
    nn::Tensor out = nn::relu(bn1_(conv1_(x)));
    out = nn::relu(bn2_(conv2_(out)));
    out = bn3_(conv3_(out));
    return nn::relu(nn::add(out, downsample_.is_empty() ? x : downsample_(x)));
  }

 private:
  nn::Conv2d conv1_;
  nn::BatchNorm2d bn1_;
  nn::Conv2d conv2_;
  nn::BatchNorm2d bn2_;
  nn::Conv2d conv3_;
  nn::BatchNorm2d bn3_;
  nn::Sequential downsample_;
};

template <typename Block>
class ResNet : public nn::Module {
 public:
  ResNet(const std::array<int64_t, 4>& blocks, const ResNetOptions& options)
      : cifar_stem_(options.cifar_stem) {
    TANDEM_CHECK(options.num_classes > 0, "ResNet: num_classes must be positive, not ",
                 options.num_classes);
    conv1_ = register_module("conv1", cifar_stem_ ? ResNetConv(3, 64, 3, 1)
                                                  : KaimingNormalFanOut(nn::Conv2d(
                                                        3, 64, 7, {.stride = {2, 2}, .padding = {3, 3}},
                                                        /*bias=*/false)));
    bn1_ = register_module("bn1", nn::BatchNorm2d(64));
    int64_t in = 64;
    constexpr int64_t kPlanes[] = {64, 128, 256, 512};
    for (int stage = 0; stage < 4; ++stage) {
      nn::Sequential layer;
      for (int64_t i = 0; i < blocks[stage]; ++i) {
        const int64_t stride = stage > 0 && i == 0 ? 2 : 1;
        layer->push_back(std::make_shared<Block>(in, kPlanes[stage], stride));
        in = kPlanes[stage] * Block::kExpansion;
      }
      layers_[stage] = register_module("layer" + std::to_string(stage + 1), layer);
    }
    fc_ = register_module("fc", nn::Linear(in, options.num_classes));
  }
  nn::Tensor forward(const nn::Tensor& x) override {
    nn::Tensor y = nn::relu(bn1_(conv1_(x)));
    if (!cifar_stem_) {
      y = nn::max_pool2d(y, {.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
    }
    for (nn::Sequential& layer : layers_) y = layer(y);
    return fc_(nn::adaptive_avg_pool2d(y, {1, 1}).flatten(1));
  }

 private:
  bool cifar_stem_;
  nn::Conv2d conv1_{nullptr};
  nn::BatchNorm2d bn1_{nullptr};
  std::array<nn::Sequential, 4> layers_{nullptr, nullptr, nullptr, nullptr};
  nn::Linear fc_{nullptr};
};

}  // namespace

std::shared_ptr<nn::Module> MakeMlp() {
  return nn::Sequential({nn::Flatten(), nn::Linear(28 * 28, 512), nn::ReLU(), nn::Linear(512, 10)})
      .ptr();
}

std::shared_ptr<nn::Module> MakeLeNet() {
  const nn::Conv2dParams pad2{.padding = {2, 2}};
  return nn::Sequential({nn::Conv2d(1, 20, 5, pad2), nn::ReLU(), nn::MaxPool2d(2),
                         nn::Conv2d(20, 20, 5, pad2), nn::ReLU(), nn::MaxPool2d(2),
                         nn::Flatten(), nn::Linear(20 * 7 * 7, 10)})
      .ptr();
}

std::shared_ptr<nn::Module> MakeConvNet() {
  return nn::Sequential({nn::Conv2d(3, 32, 3), nn::ReLU(), nn::MaxPool2d(2),
                         nn::Conv2d(32, 64, 3), nn::ReLU(), nn::MaxPool2d(2),
                         nn::Conv2d(64, 64, 3), nn::ReLU(), nn::Flatten(),
                         nn::Linear(64 * 4 * 4, 64), nn::ReLU(), nn::Linear(64, 10)})
      .ptr();
}

std::shared_ptr<nn::Module> MakeMobileNetV2(double dropout) {
  return std::make_shared<MobileNetV2>(10, dropout);
}

std::shared_ptr<nn::Module> MakeResNet18(const ResNetOptions& options) {
  return std::make_shared<ResNet<BasicBlock>>(std::array<int64_t, 4>{2, 2, 2, 2}, options);
}

std::shared_ptr<nn::Module> MakeResNet50(const ResNetOptions& options) {
  return std::make_shared<ResNet<Bottleneck>>(std::array<int64_t, 4>{3, 4, 6, 3}, options);
}

}  // namespace tandem::apps
