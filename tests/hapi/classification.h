// The hapi tests' data set: n examples of 4 features with labels in [0, 3)
// from a fixed rule on the features, and a network that learns it.
#ifndef TANDEM_TESTS_HAPI_CLASSIFICATION_H_
#define TANDEM_TESTS_HAPI_CLASSIFICATION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "data/dataset.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "nn/ops/elementwise.h"
#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::testing {

inline std::shared_ptr<const data::Dataset> Classification(int64_t n, uint64_t seed) {
  nn::manual_seed(seed);
  nn::Tensor x = nn::randn({n, 4});
  std::vector<float> xs = x.to_vector<float>();
  std::vector<int64_t> labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float s = xs[i * 4] + 0.5f * xs[i * 4 + 1] - xs[i * 4 + 2];
    labels[i] = s < -0.4f ? 0 : (s < 0.4f ? 1 : 2);
  }
  return std::make_shared<data::TensorDataset>(
      x, nn::from_vector(labels, {n}, {.dtype = nn::kInt64}));
}

// 4 features -> Linear -> ReLU -> Linear -> 3 class scores.
struct TwoLayerNet : nn::Module {
  TwoLayerNet()
      : l1(register_module("l1", nn::Linear(4, 8))), l2(register_module("l2", nn::Linear(8, 3))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_HAPI_CLASSIFICATION_H_
