// The README's quick start, as written there (tests/apps: quick_start_matches_readme
// checks that the two stay the same, quick_start_runs that it runs).
#include <iostream>

#include "nn/nn.h"            // 1. import: Tensor, Module, layers, losses
#include "optim/adam.h"
#include "spawn/spawn.h"      //    dist::spawn, dist::Context, dist::DataParallel

namespace nn = tandem::nn;
namespace dist = tandem::dist;

struct LinearNet : nn::Module {
  LinearNet() : l1(register_module("l1", nn::Linear(10, 10))),
                l2(register_module("l2", nn::Linear(10, 1))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(l1(x)); }
  nn::Linear l1, l2;
};

void train(dist::Context& ctx, bool print_result) {
  // 2. initialise: spawn already made the communicator and set this thread's device
  LinearNet net;                                   // built on ctx.device()
  dist::DataParallel dp(net, ctx);                 // 3. wrap the model
  tandem::optim::Adam adam(net.parameters(), {.lr = 1e-3});  // 4. wrap the optimizer
  nn::MSELoss loss_fn;
  for (int step = 0; step < 20; ++step) {
    // 5. shard the data: here each rank draws its own random batch; real data uses
    //    data::DistributedBatchSampler + data::DataLoader (see hapi/fit_loop.cc)
    auto loss = loss_fn(dp(nn::randn({10, 10})), nn::randn({10, 1}));
    if (print_result) ctx.log().Info("step:{} loss:{:.4f}", step, loss.item());
    loss.backward();                               // gradients all-reduced in buckets
    adam.step();
    adam.zero_grad();
  }
}

int main() {
  // 6. launch: 2 ranks on the first 2 visible GPUs, or 2 CPU ranks without a GPU
  absl::Status s = dist::spawn(train, std::make_tuple(true), /*nprocs=*/2, /*gpus=*/"");
  if (!s.ok()) { std::cerr << s << "\n"; return 1; }   // names the failing rank
}
