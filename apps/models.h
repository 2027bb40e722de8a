// The models the programs train and the benchmark harness (apps/bench) times.
// Each builds a new model on nn::current_device(), initialised from the calling
// thread's generator (seed it first with nn::manual_seed for a reproducible one).
//
// Parameter names are those of nn::Sequential ("1.weight", ...) and the layer
// order, shapes and initialisation are PyTorch's: scripts/bench/torch_bench.py
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

}  // namespace tandem::apps

#endif  // TANDEM_APPS_MODELS_H_
