// The CUDA-graph column of docs/guide.md's table "Which features combine": on one
// GPU, a 1-rank world (spawn with gpus "0": NCCL carries DataParallel's
// all-reduce), 4 training steps of SGD with momentum on static input tensors,
// run eagerly and captured (the first step eager, then nn::CudaGraph::Capture of
// the step and a replay per later step, each step's rows copied into the
// captured inputs first). For each feature (the bf16 comm hook, SyncBatchNorm,
// find_unused_parameters, bf16 autocast, accumulation of K = 2 micro-batches)
// the captured run's parameters match the eager run's within 1e-6 relative (the
// same kernels replayed; the difference is printed). ZeroRedundancyOptimizer is
// not here: its step is not captured (the programs refuse --zero with
// --cuda_graph). Skipped without a GPU.
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/autocast.h"
#include "nn/graph.h"
#include "nn/nn.h"
#include "spawn/spawn.h"
#include "spawn/train/comm_hooks.h"
#include "spawn/train/sync_batch_norm.h"
#include "tests/gpu_test_util.h"
#include "tests/spawn/train/compose_net.h"
#include "tests/spawn/train/join_net.h"
#include "tests/spawn/train/sync_bn_net.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using ::tandem::testing::ScaledError;

constexpr int kGraphSteps = 4;
constexpr int64_t kGraphRows = 4;

// One rank's 4 steps of Combo `c` (hook, sync_bn, unused, autocast, accum),
// eager or captured; the flat parameters at the end.
template <typename Net>
Tensor TrainGraphCombo(Context& ctx, const Combo& c, bool captured) {
  nn::manual_seed(5);
  const int64_t per_step = c.accum * kGraphRows;
  const Tensor x_all = nn::add_scalar(nn::randn({kGraphSteps * per_step, 2, 5, 5}), 0.5);
  const Tensor y_all = nn::randn({kGraphSteps * per_step, 2});
  WithSpare<Net> net(!c.unused);
  if (c.sync_bn) ConvertSyncBatchNorm(net);
  DataParallelOptions options{.find_unused_parameters = c.unused};
  if (c.hook) options.comm_hook = Bf16CompressHook();
  DataParallel dp(net, ctx, options);
  std::unique_ptr<optim::Optimizer> sgd = MakeJoinOptimizer("momentum", dp.parameters());
  // The step's static inputs: micro-batch i of the current step.
  std::vector<Tensor> xs, ys;
  for (int i = 0; i < c.accum; ++i) {
    xs.push_back(x_all.slice(0, kGraphRows).clone());
    ys.push_back(y_all.slice(0, kGraphRows).clone());
  }
  auto load = [&](int s) {
    for (int i = 0; i < c.accum; ++i) {
      const int64_t lo = s * per_step + i * kGraphRows;
      xs[i].copy_(x_all.slice(lo, lo + kGraphRows));
      ys[i].copy_(y_all.slice(lo, lo + kGraphRows));
    }
  };
  auto step = [&] {
    sgd->zero_grad();
    for (int i = 0; i < c.accum; ++i) {
      std::optional<DataParallel::NoSyncGuard> no_sync;
      if (i + 1 < c.accum) no_sync.emplace(&dp);
      Tensor loss;
      {
        nn::AutocastGuard autocast(c.autocast ? nn::kBFloat16 : nn::kFloat32);
        loss = nn::mse_loss(dp(xs[i]), ys[i]);
      }
      (c.accum > 1 ? loss / static_cast<double>(c.accum) : loss).backward();
    }
    sgd->step();
  };
  load(0);
  step();  // eager either way: caches and the optimizer's state exist before a capture
  std::optional<nn::CudaGraph> graph;
  if (captured) {
    graph.emplace();
    graph->Capture(step);
  }
  for (int s = 1; s < kGraphSteps; ++s) {
    load(s);
    if (graph) {
      graph->Replay();
    } else {
      step();
    }
  }
  return Flat(net.parameters());
}

class GraphComposeGpuTest : public ::testing::Test {
 protected:
  void SetUp() override { TANDEM_REQUIRE_GPUS(1); }
  std::ostringstream console_;
  SpawnOptions options_{.timeout_s = 120, .seed = 7, .console = &console_};
};

TEST_F(GraphComposeGpuTest, CapturedStepMatchesTheEagerStepWithEachFeature) {
  const std::vector<Combo> combos = {
      {.name = "CUDA graph + bf16 hook", .hook = true},
      {.name = "CUDA graph + SyncBatchNorm", .sync_bn = true},
      {.name = "CUDA graph + find_unused_parameters", .unused = true},
      {.name = "CUDA graph + bf16 autocast", .autocast = true},
      {.name = "CUDA graph + accumulation", .accum = 2},
  };
  for (const Combo& c : combos) {
    auto run = [&](bool captured) {
      return spawn([&](Context& ctx) {
        return c.sync_bn ? TrainGraphCombo<BnNet>(ctx, c, captured)
                         : TrainGraphCombo<PlainNet>(ctx, c, captured);
      }, 1, "0", options_);
    };
    auto eager = run(false);
    auto captured = run(true);
    ASSERT_TRUE(eager.ok() && captured.ok())
        << c.name << ": " << eager.status() << captured.status() << console_.str();
    const double error = ScaledError((*captured)[0], (*eager)[0]);
    std::printf("%s: captured vs eager, 4 steps on 1 GPU rank: max relative difference "
                "parameters %.3g (bound 1e-6)\n", c.name, error);
    EXPECT_LE(error, 1e-6) << c.name;
  }
}

}  // namespace
}  // namespace tandem::dist
