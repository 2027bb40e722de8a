// fit_circle: the guide's hapi::Model example (docs/guide.md, "The high-level
// API"), built against the installed package. It trains on every visible GPU, or
// on one CPU rank without one, and exits 0 when the accuracy passes 0.9.
#include <cstdio>
#include <iostream>
#include <memory>
#include <vector>

#include "hapi/model.h"
#include "nn/nn.h"
#include "optim/adam.h"

namespace hapi = tandem::hapi;
namespace nn = tandem::nn;

struct Net : nn::Module {
  Net() : l1(register_module("l1", nn::Linear(2, 32))), l2(register_module("l2", nn::Linear(32, 2))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

int main() {
  // 1024 points in the plane, label 1 inside the circle of radius 1.
  nn::Tensor x = nn::randn({1024, 2});
  std::vector<float> p = x.to_vector<float>();
  std::vector<int64_t> y;
  for (size_t i = 0; i < p.size(); i += 2) y.push_back(p[i] * p[i] + p[i + 1] * p[i + 1] < 1);
  auto data = std::make_shared<tandem::data::TensorDataset>(
      x, nn::from_vector(y, {1024}, {.dtype = nn::kInt64}));

  hapi::Model model([] { return std::make_shared<Net>(); });  // every GPU, or a CPU rank
  model.prepare([](auto params) { return std::make_unique<tandem::optim::Adam>(params); },
                hapi::CrossEntropy(), {hapi::MakeMetric<hapi::Accuracy>()});
  auto history = model.fit(data, {.epochs = 30, .batch_size = 64, .log_freq = 8});
  if (!history.ok()) {
    std::cerr << history.status() << "\n";
    return 1;
  }
  auto logs = model.evaluate(data);
  if (!logs.ok()) {
    std::cerr << logs.status() << "\n";
    return 1;
  }
  std::printf("loss %.4f accuracy %.3f\n", history->epochs.back().at("loss"), logs->at("eval_acc"));
  return logs->at("eval_acc") > 0.9 ? 0 : 1;
}
