#include "apps/models.h"

#include "nn/layers.h"

namespace tandem::apps {

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

}  // namespace tandem::apps
