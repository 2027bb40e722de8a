// CPU/GPU parity of the fused optimizer kernels and of clip_grad_norm_ (label gpu).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "nn/cuda/internal/call_counter.h"
#include "nn/graph.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "optim/lr_scheduler.h"
#include "optim/sgd.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace tandem::optim {
using ::tandem::testing::ErrorOf;
using ::tandem::testing::ExpectSameBits;
namespace {

// Parameters of several sizes (more than one chunk, a chunk boundary inside a
// tensor, a tiny one) on `device`, with zero gradients; same values everywhere.
std::vector<nn::Tensor> MakeParams(nn::Device device, nn::DType dtype) {
  std::vector<nn::Tensor> params;
  nn::manual_seed(7);
  for (int64_t n : {5000, 3, 4096, 10000}) {
    nn::Tensor p = nn::randn({n}, {.dtype = dtype}).to(device);
    p.set_requires_grad(true);
    p.set_grad(nn::zeros_like(p));
    params.push_back(p);
  }
  return params;
}

// Writes grads of f = sum(0.5 * w^2 + w * sin-like constant) computed on the CPU.
void SetGrads(const std::vector<nn::Tensor>& params) {
  nn::NoGradGuard no_grad;
  for (const nn::Tensor& p : params) {
    std::vector<double> w = p.to_vector<double>();
    for (size_t i = 0; i < w.size(); ++i) w[i] = w[i] + 0.01 * static_cast<double>(i % 7) - 0.03;
    nn::Tensor g = p.grad();
    g.copy_(nn::from_vector(w, p.shape()));
  }
}

using Factory = std::function<std::unique_ptr<Optimizer>(std::vector<nn::Tensor>)>;

// The parameters of MakeParams with parameter i on devices[i % devices.size()].
std::vector<nn::Tensor> MakeParamsOn(const std::vector<nn::Device>& devices, nn::DType dtype) {
  std::vector<std::vector<nn::Tensor>> each;
  for (const nn::Device& device : devices) each.push_back(MakeParams(device, dtype));
  std::vector<nn::Tensor> params;
  for (size_t i = 0; i < each.front().size(); ++i) params.push_back(each[i % each.size()][i]);
  return params;
}

void ExpectParity(const Factory& make, nn::DType dtype, double tol,
                  const std::vector<nn::Device>& devices = {nn::Device::CUDA(0)}) {
  std::vector<nn::Tensor> cpu = MakeParams(nn::Device::CPU(), dtype);
  std::vector<nn::Tensor> gpu = MakeParamsOn(devices, dtype);
  auto opt_cpu = make(cpu);
  auto opt_gpu = make(gpu);
  for (int step = 0; step < 10; ++step) {
    SetGrads(cpu);
    SetGrads(gpu);
    opt_cpu->step();
    opt_gpu->step();
    opt_gpu->zero_grad();
    opt_cpu->zero_grad();
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const std::vector<double> a = cpu[i].to_vector<double>(), b = gpu[i].to_vector<double>();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], tol) << "tensor " << i << " " << k;
  }
}

class OptimGpuTest : public ::tandem::testing::GpuTest {};

TEST_F(OptimGpuTest, FusedUpdatesMatchCpu) {
  for (nn::DType dtype : {nn::kFloat64, nn::kFloat32}) {
    const double tol = dtype == nn::kFloat64 ? 1e-12 : 1e-5;
    ExpectParity([](auto p) { return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true}); }, dtype, tol);
    ExpectParity([](auto p) { return std::make_unique<Adagrad>(p, AdagradOptions{.lr = 0.1, .lr_decay = 0.01}); }, dtype, tol);
    ExpectParity([](auto p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 0.01, .weight_decay = 0.1, .amsgrad = true}); }, dtype, tol);
    ExpectParity([](auto p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01}); }, dtype, tol);
  }
}

TEST_F(OptimGpuTest, ClipGradNormMatchesCpu) {
  std::vector<nn::Tensor> cpu = MakeParams(nn::Device::CPU(), nn::kFloat64);
  std::vector<nn::Tensor> gpu = MakeParams(nn::Device::CUDA(0), nn::kFloat64);
  SetGrads(cpu);
  SetGrads(gpu);
  const nn::Tensor n_cpu = clip_grad_norm_(cpu, 1.0);
  const nn::Tensor n_gpu = clip_grad_norm_(gpu, 1.0);
  EXPECT_TRUE(n_gpu.is_cuda());
  EXPECT_NEAR(n_cpu.item(), n_gpu.item(), 1e-9 * n_cpu.item());
  for (size_t i = 0; i < cpu.size(); ++i) {
    const auto a = cpu[i].grad().to_vector<double>(), b = gpu[i].grad().to_vector<double>();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-12);
  }
}

// One parameter group across two GPUs (PyTorch groups its foreach and fused
// launches by device; so does tandem): with cuda:0 current, the launches of the
// cuda:1 parameters (and the fill of a state that starts non-zero) run with
// cuda:1 made current, and every optimizer matches the CPU.
TEST(OptimTwoGpuTest, GroupAcrossTwoDevicesMatchesCpu) {
  TANDEM_REQUIRE_GPUS(2);
  nn::DeviceGuard current(nn::Device::CUDA(0));
  const std::vector<nn::Device> two = {nn::Device::CUDA(0), nn::Device::CUDA(1)};
  ExpectParity([](auto p) { return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9}); }, nn::kFloat64, 1e-12, two);
  // A state that starts at a non-zero value is filled by a kernel on its
  // parameter's device when it is made, at the first step.
  ExpectParity(
      [](auto p) {
        return std::make_unique<Adagrad>(
            p, AdagradOptions{.lr = 0.1, .initial_accumulator_value = 0.1});
      },
      nn::kFloat64, 1e-12, two);
  ExpectParity([](auto p) { return std::make_unique<Adam>(p, AdamOptions{.lr = 0.01, .amsgrad = true}); }, nn::kFloat64, 1e-12, two);
  ExpectParity([](auto p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01}); }, nn::kFloat32, 1e-5, two);
  EXPECT_EQ(nn::current_device(), nn::Device::CUDA(0)) << "the step left another device current";
}

TEST(OptimTwoGpuTest, ClipGradNormAcrossTwoDevicesMatchesCpu) {
  TANDEM_REQUIRE_GPUS(2);
  nn::DeviceGuard current(nn::Device::CUDA(1));  // not the first gradient's device
  std::vector<nn::Tensor> cpu = MakeParams(nn::Device::CPU(), nn::kFloat64);
  std::vector<nn::Tensor> gpu =
      MakeParamsOn({nn::Device::CUDA(0), nn::Device::CUDA(1)}, nn::kFloat64);
  SetGrads(cpu);
  SetGrads(gpu);
  const nn::Tensor n_cpu = clip_grad_norm_(cpu, 1.0);
  const nn::Tensor n_gpu = clip_grad_norm_(gpu, 1.0);
  EXPECT_EQ(n_gpu.device(), nn::Device::CUDA(0)) << "the total is on the first gradient's device";
  EXPECT_NEAR(n_cpu.item(), n_gpu.item(), 1e-9 * n_cpu.item());
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_EQ(gpu[i].grad().device(), gpu[i].device());
    const auto a = cpu[i].grad().to_vector<double>(), b = gpu[i].grad().to_vector<double>();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-12) << "tensor " << i;
  }
  EXPECT_EQ(nn::current_device(), nn::Device::CUDA(1));
}

// More gradient sets than the pointer tables a thread keeps for the clip
// kernels (4): every call rewrites a table. The rewrite takes a fresh pinned
// buffer from the cache instead of waiting on the host for the previous upload
// out of the old one (a wait per call, in every step, before), and each set
// keeps its own results.
TEST_F(OptimGpuTest, ClipGradNormOverMoreSetsThanTablesMakesNoHostWait) {
  constexpr int kSets = 6;
  constexpr int kRounds = 3;
  std::vector<std::vector<nn::Tensor>> cpu(kSets), gpu(kSets);
  for (int s = 0; s < kSets; ++s) {
    nn::manual_seed(100 + s);
    for (int64_t n : {int64_t{300} + 10 * s, int64_t{7}}) {
      nn::Tensor p = nn::randn({n}, {.dtype = nn::kFloat64});
      p.set_requires_grad(true);
      p.set_grad(nn::randn({n}, {.dtype = nn::kFloat64}));
      nn::Tensor q = p.detach().to(nn::Device::CUDA(0));
      q.set_requires_grad(true);
      q.set_grad(p.grad().to(nn::Device::CUDA(0)));
      cpu[s].push_back(p);
      gpu[s].push_back(q);
    }
  }
  // max_norm 0.5 / (s + 1): a different scale per set, so a set clipped with
  // another set's table would show in its gradients.
  auto clip_all = [&](std::vector<std::vector<nn::Tensor>>& sets, std::vector<nn::Tensor>* norms) {
    for (int s = 0; s < kSets; ++s) norms->push_back(clip_grad_norm_(sets[s], 0.5 / (s + 1)));
  };
  std::vector<nn::Tensor> norms_cpu, norms_gpu;
  clip_all(cpu, &norms_cpu);
  clip_all(gpu, &norms_gpu);  // warm-up: the tables and the pinned cache's blocks
  const nn::internal::CudaCallCounts before = nn::internal::ThreadCudaCalls();
  for (int round = 0; round < kRounds; ++round) clip_all(gpu, &norms_gpu);
  const nn::internal::CudaCallCounts made = nn::internal::ThreadCudaCalls() - before;
  // Six sets over four tables, least recently used first: every call uploads.
  EXPECT_EQ(made[nn::internal::CudaCall::kMemcpyAsync], kRounds * kSets) << made.ToString();
  EXPECT_EQ(made[nn::internal::CudaCall::kHostWait], 0) << made.ToString();
  for (int round = 0; round < kRounds; ++round) clip_all(cpu, &norms_cpu);
  ASSERT_EQ(norms_cpu.size(), norms_gpu.size());
  for (size_t k = 0; k < norms_cpu.size(); ++k) {
    EXPECT_NEAR(norms_cpu[k].item(), norms_gpu[k].item(), 1e-12) << "call " << k;
  }
  for (int s = 0; s < kSets; ++s) {
    for (size_t i = 0; i < cpu[s].size(); ++i) {
      const auto a = cpu[s][i].grad().to_vector<double>();
      const auto b = gpu[s][i].grad().to_vector<double>();
      for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 1e-12) << "set " << s;
    }
  }
}

// --- CUDA graph capture of a training step ------------------------------------
//
// K steps trained eagerly vs 1 eager step + capture + K-1 replays with the
// batches copied into static input tensors: the same losses, weights and step
// counts, bit for bit. Why bitwise: each replay launches the kernels the eager
// step launched, with the same arguments except that the optimizer's scalars
// come from device memory, written before the replay with the very doubles the
// eager step passed by value (same step count, same lr after the schedule).

struct Mlp : nn::Module {
  Mlp()
      : l1(register_module("l1", nn::Linear(16, 32))), l2(register_module("l2", nn::Linear(32, 1))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

using ::tandem::testing::FlatParams;

std::pair<nn::Tensor, nn::Tensor> Batch(int k) {
  nn::manual_seed(200 + k);
  nn::Tensor x = nn::randn({8, 16}), y = nn::randn({8, 1});
  return {x.to(nn::Device::CUDA(0)), y.to(nn::Device::CUDA(0))};
}

struct Run {
  std::vector<float> losses, weights;
  std::vector<int64_t> steps;  // per parameter, from the optimizer
};

using MakeOptimizer = std::function<std::unique_ptr<Optimizer>(std::vector<nn::Tensor>)>;
// Between steps (host side): e.g. an LR schedule or set_lr.
using BetweenSteps = std::function<void(Optimizer&, int step)>;

// K steps; `captured`: step 0 eager, then capture and K-1 replays.
Run Train(const MakeOptimizer& make, const BetweenSteps& between, bool clip, bool captured,
          int steps) {
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  nn::manual_seed(3);
  Mlp net;
  std::unique_ptr<Optimizer> opt = make(net.parameters());
  nn::Tensor x = nn::empty({8, 16}), y = nn::empty({8, 1});
  nn::Tensor loss;
  auto step = [&] {
    loss = nn::mse_loss(net(x), y);
    loss.backward();
    if (clip) clip_grad_norm_(net.parameters(), 0.5);
    opt->step();
    opt->zero_grad();
  };
  Run run;
  std::optional<nn::CudaGraph> graph;
  for (int k = 0; k < steps; ++k) {
    auto [xk, yk] = Batch(k);
    x.copy_(xk);
    y.copy_(yk);
    if (!captured || k == 0) {
      step();
    } else {
      if (!graph) {
        graph.emplace();
        graph->Capture(step);
      }
      graph->Replay();
    }
    run.losses.push_back(static_cast<float>(loss.item()));
    if (between) between(*opt, k);
  }
  run.weights = FlatParams(net);
  for (int64_t i = 0; i < static_cast<int64_t>(opt->params(0).size()); ++i) {
    run.steps.push_back(opt->step_count(0, i));
  }
  return run;
}

void ExpectCapturedMatchesEager(const MakeOptimizer& make, const BetweenSteps& between, bool clip) {
  constexpr int kSteps = 7;
  const Run eager = Train(make, between, clip, false, kSteps);
  const Run replayed = Train(make, between, clip, true, kSteps);
  ExpectSameBits(replayed.losses, eager.losses, "losses");
  ExpectSameBits(replayed.weights, eager.weights, "weights");
  EXPECT_EQ(replayed.steps, eager.steps);
  EXPECT_EQ(replayed.steps, std::vector<int64_t>(replayed.steps.size(), kSteps));
}

TEST_F(OptimGpuTest, CapturedAdamWithStepLrMatchesEager) {
  std::shared_ptr<StepLR> schedule;
  ExpectCapturedMatchesEager(
      [&](std::vector<nn::Tensor> params) {
        auto adam = std::make_unique<Adam>(std::move(params), AdamOptions{.lr = 1e-2});
        schedule = std::make_shared<StepLR>(*adam, /*step_size=*/2, /*gamma=*/0.5);
        return adam;
      },
      [&](Optimizer&, int) { schedule->step(); }, /*clip=*/false);
}

TEST_F(OptimGpuTest, CapturedAdamWWithClippingMatchesEager) {
  ExpectCapturedMatchesEager(
      [](std::vector<nn::Tensor> params) {
        return std::make_unique<AdamW>(std::move(params),
                                       AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
      },
      nullptr, /*clip=*/true);
}

TEST_F(OptimGpuTest, CapturedSgdMomentumWithLrChangesMatchesEager) {
  ExpectCapturedMatchesEager(
      [](std::vector<nn::Tensor> params) {
        return std::make_unique<SGD>(std::move(params),
                                     SGDOptions{.lr = 0.05, .momentum = 0.9, .nesterov = true});
      },
      [](Optimizer& opt, int k) { opt.set_lr(0.05 / (k + 2)); }, /*clip=*/false);
}

TEST_F(OptimGpuTest, CaptureBeforeAnyEagerStepIsAnError) {
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  Mlp net;
  Adam adam(net.parameters());
  nn::Tensor x = nn::randn({8, 16}), y = nn::randn({8, 1});
  nn::CudaGraph graph;
  const std::string what = ErrorOf([&] {
    graph.Capture([&] {
      nn::mse_loss(net(x), y).backward();
      adam.step();
    });
  });
  EXPECT_NE(what.find("run one eager step before capturing"), std::string::npos) << what;
  EXPECT_FALSE(graph.captured());
  EXPECT_EQ(adam.step_count(0, 0), 0);
  // The thread still trains eagerly: a fresh backward (the abandoned capture's
  // gradients lived in its graph memory), then a step that counts.
  adam.zero_grad();
  nn::mse_loss(net(x), y).backward();
  adam.step();
  EXPECT_EQ(adam.step_count(0, 0), 1);
}

TEST_F(OptimGpuTest, ReplayAfterLoadStateDictOrDestructionIsAnError) {
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  Mlp net;
  auto sgd = std::make_unique<SGD>(net.parameters(), SGDOptions{.lr = 0.1, .momentum = 0.9});
  nn::Tensor x = nn::randn({8, 16}), y = nn::randn({8, 1});
  auto step = [&] {
    nn::mse_loss(net(x), y).backward();
    sgd->step();
    sgd->zero_grad();
  };
  step();
  nn::CudaGraph graph;
  graph.Capture(step);
  graph.Replay();
  EXPECT_EQ(sgd->step_count(0, 0), 2);
  const StateDict saved = sgd->state_dict();
  EXPECT_EQ(saved.scalars.at("state.0.0.step"), 2.0);
  ASSERT_TRUE(sgd->load_state_dict(saved).ok());
  const std::string what = ErrorOf([&] { graph.Replay(); });
  EXPECT_NE(what.find("capture the step again"), std::string::npos) << what;
  EXPECT_EQ(sgd->step_count(0, 0), 2);  // nothing advanced

  step();  // the loaded state has new addresses: one eager step caches them
  nn::CudaGraph again;
  again.Capture(step);
  again.Replay();
  EXPECT_EQ(sgd->step_count(0, 0), 4);
  sgd.reset();
  const std::string gone = ErrorOf([&] { again.Replay(); });
  EXPECT_NE(gone.find("optimizer used by the captured step has been destroyed"), std::string::npos)
      << gone;
}

}  // namespace
}  // namespace tandem::optim
