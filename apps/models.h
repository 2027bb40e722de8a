// The models the programs train and the benchmarks (bench/) time.
// Each builds a new model on nn::current_device(), initialised from the calling
// thread's generator (seed it first with nn::manual_seed for a reproducible one).
//
// Parameter names are those of nn::Sequential ("1.weight", ...) and the layer
// order, shapes and initialisation are PyTorch's: bench/torch_bench.py
// builds the same models as torch.nn.Sequential and loads these weights by name.
#ifndef TANDEM_APPS_MODELS_H_
#define TANDEM_APPS_MODELS_H_

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

}  // namespace tandem::apps

#endif  // TANDEM_APPS_MODELS_H_
