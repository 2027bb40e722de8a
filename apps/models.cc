#include "apps/models.h"

#include <cmath>

#include "nn/layers.h"
#include "nn/ops/elementwise.h"

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

}  // namespace tandem::apps
