// tandem's model definitions, as torchvision.models and paddle.vision.models give
// theirs: the models the programs train and the benchmarks (bench/) time. They
// are part of the installed package: link tandem::models (find_package(tandem))
// and #include "apps/models.h".
// Each builds a new model on nn::current_device(), initialised from the calling
// thread's generator (seed it first with nn::manual_seed for a reproducible one).
//
// Parameter names are those of nn::Sequential ("1.weight", ...) and the layer
// order, shapes and initialisation are PyTorch's: bench/torch_bench.py
// builds the same models as torch.nn.Sequential and loads these weights by name.
#ifndef TANDEM_APPS_MODELS_H_
#define TANDEM_APPS_MODELS_H_

#include <cstdint>
#include <memory>

#include "nn/module.h"

namespace tandem::apps {

// flatten, fc 784 -> 512 + ReLU, fc 512 -> 10. Input (N, 1, 28, 28) (or (N, 784)).
std::shared_ptr<nn::Module> MakeMlp();

// conv 5x5 20 ch pad 2 + ReLU, max-pool 2, conv 5x5 20 ch pad 2 + ReLU,
// max-pool 2, flatten, fc 20*7*7 -> 10. Input (N, 1, 28, 28).
std::shared_ptr<nn::Module> MakeLeNet();

// conv3x3 32 + ReLU, max-pool 2, conv3x3 64 + ReLU, max-pool 2, conv3x3 64 +
// ReLU, flatten, fc 64*4*4 -> 64 + ReLU, fc 64 -> 10. Input (N, 3, 32, 32):
// 30 -> 15 -> 13 -> 6 -> 4.
std::shared_ptr<nn::Module> MakeConvNet();

// MobileNetV2 as torchvision defines it (torchvision.models.mobilenet_v2, width
// 1.0) with num_classes 10: conv3x3 32 stride 2 + BN + ReLU6, the 17 inverted
// residual blocks (t, c, n, s) = (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2),
// (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1) (1x1 expansion
// + BN + ReLU6 when t != 1, depthwise 3x3 + BN + ReLU6, 1x1 projection + BN,
// plus x where stride 1 and channels in == out), conv1x1 1280 + BN + ReLU6,
// adaptive average pool to 1x1, flatten, Dropout(0.2), Linear(1280, 10).
// Convolutions have no bias. Input (N, 3, 32, 32) as torchvision takes it, no
// change to the strides: 32 -> 16 -> 8 -> 4 -> 2 -> 1 before the pool.
// Parameter names are torchvision's ("features.1.conv.0.0.weight",
// "classifier.1.bias", ...), 2,236,682 parameters; init as torchvision:
// convolutions kaiming-normal (fan_out), BatchNorm ones / zeros, the Linear
// normal(0, 0.01) with a zero bias. `dropout`: the classifier's Dropout p (the
// benchmark's loss comparison with PyTorch uses 0: masks are not shared).
std::shared_ptr<nn::Module> MakeMobileNetV2(double dropout = 0.2);

struct ResNetOptions {
  int64_t num_classes = 1000;
  // The CIFAR-10 stem: conv1 is 3x3 stride 1 padding 1 and there is no max-pool,
  // so a 32x32 image reaches layer4 at 4x4 (torchvision's ImageNet stem, conv1
  // 7x7 stride 2 padding 3 and a 3x3 stride 2 max-pool, would leave 1x1).
  bool cifar_stem = false;
};

// ResNet-18 and ResNet-50 as torchvision 0.14 defines them
// (torchvision.models.resnet18 / resnet50, weights=None): conv1 7x7 64 stride 2
// + bn1 + ReLU + max-pool 3x3 stride 2 padding 1 (or the CIFAR stem above),
// layer1..layer4 of 64, 128, 256, 512 planes with stride 1, 2, 2, 2 in their
// first block, adaptive average pool to 1x1, fc. ResNet-18: [2, 2, 2, 2]
// BasicBlocks (conv1 3x3 + bn1 + ReLU, conv2 3x3 + bn2, plus x, ReLU);
// ResNet-50: [3, 4, 6, 3] Bottlenecks (conv1 1x1 + bn1 + ReLU, conv2 3x3 with
// the stride + bn2 + ReLU, conv3 1x1 to 4x the planes + bn3, plus x, ReLU). A
// block whose stride or channels change adds "downsample" (conv 1x1 with the
// stride + BN) to x. Convolutions have no bias. Names are torchvision's
// ("layer1.0.conv1.weight", "layer2.0.downsample.1.running_var", "fc.bias"),
// and so are the parameter counts: ResNet-18 11,689,512 (1000 classes) /
// 11,181,642 (10), ResNet-50 25,557,032 / 23,528,522 (tests/apps/resnet_test.cc
// compares them with torchvision's). Init as torchvision: convolutions
// kaiming-normal (fan_out), BatchNorm ones / zeros, fc PyTorch's Linear default.
// Input (N, 3, H, W).
std::shared_ptr<nn::Module> MakeResNet18(const ResNetOptions& options = {});
std::shared_ptr<nn::Module> MakeResNet50(const ResNetOptions& options = {});

}  // namespace tandem::apps

#endif  // TANDEM_APPS_MODELS_H_
