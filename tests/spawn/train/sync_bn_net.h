// The model and training loop of SyncBatchNorm's equivalence tests, shared by the
// in-process tests (sync_batch_norm_test.cc) and the multi-process ones
// (sync_bn_join_mpi_test.cc): N ranks x batch B with SyncBatchNorm must train
// as 1 rank x batch N*B with BatchNorm.
#ifndef TANDEM_TESTS_SPAWN_TRAIN_SYNC_BN_NET_H_
#define TANDEM_TESTS_SPAWN_TRAIN_SYNC_BN_NET_H_

#include <vector>

#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "spawn/spawn.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

// x: (N, 2, 5, 5) -> (N, 2); BatchNorms held as typed members, as a ResNet block
// holds `bn1`.
struct BnNet : nn::Module {
  BnNet()
      : conv1(register_module("conv1", nn::Conv2d(2, 3, 3, {.padding = {1, 1}}))),
        bn1(register_module("bn1", nn::BatchNorm2d(3))),
        conv2(register_module("conv2", nn::Conv2d(3, 4, 3))),
        bn2(register_module("bn2", nn::BatchNorm2d(4))),
        fc(register_module("fc", nn::Linear(4 * 3 * 3, 2))) {}
  Tensor forward(const Tensor& x) override {
    const Tensor h = nn::relu(bn1(conv1(x)));
    return fc(nn::relu(bn2(conv2(h))).flatten(1));
  }
  nn::Conv2d conv1;
  nn::BatchNorm2d bn1;
  nn::Conv2d conv2;
  nn::BatchNorm2d bn2;
  nn::Linear fc;
};

struct BnRun {
  std::vector<double> losses;  // the global batch's loss at each step
  Tensor first_grads;          // every gradient after the first backward, flat
  Tensor params;               // at the end, flat
  Tensor buffers;              // running statistics at the end, flat
};

inline Tensor Flat(const std::vector<Tensor>& tensors) {
  std::vector<float> out;
  for (const Tensor& t : tensors) {
    for (float v : t.to_vector<float>()) out.push_back(v);
  }
  return nn::from_vector(out, {static_cast<int64_t>(out.size())}, {.device = nn::Device::CPU()});
}

// The running statistics: the floating-point buffers (num_batches_tracked, an
// int64 count, would enter the comparisons' scale).
inline std::vector<Tensor> RunningStatistics(const nn::Module& net) {
  std::vector<Tensor> out;
  for (const Tensor& b : net.buffers()) {
    if (nn::IsFloatingPoint(b.dtype())) out.push_back(b);
  }
  return out;
}

// `steps` of SGD (lr 0.1) through DataParallel; rank r takes rows [r*B, (r+1)*B)
// of each step's global batch of world*B. sync: ConvertSyncBatchNorm first.
inline BnRun TrainBn(Context& ctx, int64_t per_rank, int steps, bool sync) {
  BnNet net;
  if (sync) ConvertSyncBatchNorm(net);
  DataParallel dp(net, ctx);
  const int64_t batch = per_rank * ctx.world_size();
  BnRun run;
  for (int step = 0; step < steps; ++step) {
    nn::manual_seed(1000 + step);  // the same global batch on every rank
    const Tensor x = nn::add_scalar(nn::mul_scalar(nn::randn({batch, 2, 5, 5}), 2.0), 0.5);
    const Tensor y = nn::randn({batch, 2});
    const int64_t lo = ctx.rank() * per_rank;
    Tensor loss = nn::mse_loss(dp(x.slice(lo, lo + per_rank)), y.slice(lo, lo + per_rank));
    loss.backward();
    Tensor global = loss.detach().clone();
    ctx.communicator().all_reduce(global, ReduceOp::kAvg);  // equal slices: the batch's mean
    run.losses.push_back(global.item());
    std::vector<Tensor> grads;
    for (const Tensor& p : dp.parameters()) grads.push_back(p.grad());
    if (step == 0) run.first_grads = Flat(grads);
    nn::NoGradGuard no_grad;
    for (Tensor p : dp.parameters()) {
      p.add_(p.grad(), -0.1);
      p.set_grad(Tensor());
    }
  }
  run.params = Flat(net.parameters());
  run.buffers = Flat(RunningStatistics(net));
  return run;
}

}  // namespace
}  // namespace tandem::dist

#endif  // TANDEM_TESTS_SPAWN_TRAIN_SYNC_BN_NET_H_
