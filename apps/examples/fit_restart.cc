// docs/guide.md's hapi fit with in-process restarts, exactly as written there
// (tests/apps checks both; built as fit_restart, not installed).
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "hapi/model.h"
#include "nn/nn.h"
#include "optim/sgd.h"

namespace hapi = tandem::hapi;
namespace nn = tandem::nn;

struct Net : nn::Module {
  Net() : l1(register_module("l1", nn::Linear(2, 16))), l2(register_module("l2", nn::Linear(16, 2))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

// A stand-in for a real fault: rank 1 throws after step 10, on the first attempt only.
struct FailOnce : hapi::Callback {
  std::string name() const override { return "FailOnce"; }
  void on_train_batch_end(hapi::RunState& s) override {
    if (s.ctx->attempt() == 0 && s.ctx->rank() == 1 && s.step == 10) throw tandem::Error("fault");
  }
};

int main() {
  nn::Tensor x = nn::randn({256, 2});  // label 1 where x0 > x1
  std::vector<float> p = x.to_vector<float>();
  std::vector<int64_t> y;
  for (size_t i = 0; i < p.size(); i += 2) y.push_back(p[i] > p[i + 1]);
  auto data = std::make_shared<tandem::data::TensorDataset>(
      x, nn::from_vector(y, {256}, {.dtype = nn::kInt64}));
  hapi::LaunchOptions launch{.gpus = "cpu", .nprocs = 2};
  launch.spawn.restart = {.max_restarts = 2};  // spawn/restart.h
  hapi::Model model([] { return std::make_shared<Net>(); }, launch);
  model.prepare([](auto params) {
    return std::make_unique<tandem::optim::SGD>(params, tandem::optim::SGDOptions{.lr = 0.1});
  }, hapi::CrossEntropy());
  // 8 steps an epoch (2 ranks x 16 rows of 256), a snapshot every 4 steps.
  auto history = model.fit(data, {.epochs = 4, .batch_size = 16, .snapshot_every_steps = 4,
                                  .callbacks = {hapi::MakeCallback<FailOnce>()}});
  if (!history.ok()) {
    std::cerr << history.status() << "\n";
    return 1;
  }
  // "resumed from step 8; 32 steps; final loss ..."
  std::cout << "resumed from step " << history->restored_snapshot_step << "; " << history->steps
            << " steps; final loss " << history->epochs.back().at("loss") << "\n";
}
