// The memory and bandwidth features on GPU ranks against the same runs on CPU
// ranks: ZeroRedundancyOptimizer (Adam), Bf16CompressHook and Fp16CompressHook on
// two ranks sharing GPU 0 (the in-process communicator's CUDA kernels, bfloat16 and
// float16 included) and on GPUs 0 and 1 (NCCL: reduce_scatter_async in place,
// bfloat16 and float16 all-reduces).
// Skipped without a GPU (the NCCL case without two).
#include <memory>
#include <sstream>

#include "gtest/gtest.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "spawn/train/comm_hooks.h"
#include "spawn/train/zero_redundancy_optimizer.h"
#include "tests/spawn/train/dp_models.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

enum class Mode { kUnsharded, kZero, kBf16Hook, kFp16Hook };

CommHook HookOf(Mode mode) {
  if (mode == Mode::kBf16Hook) return Bf16CompressHook();
  if (mode == Mode::kFp16Hook) return Fp16CompressHook();
  return CommHook();
}

// Three Adam steps of ConvNet on a global batch of 8 rows split over the ranks.
std::vector<float> Steps(Context& ctx, Mode mode) {
  ConvNet net;
  DataParallel dp(net, ctx, {.bucket_bytes = 400, .first_bucket_bytes = 100,
                             .comm_hook = HookOf(mode)});
  auto make = [](std::vector<Tensor> p) {
    return std::make_unique<optim::Adam>(std::move(p), optim::AdamOptions{.lr = 1e-2});
  };
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> plain;
  if (mode == Mode::kZero) {
    zero = std::make_unique<ZeroRedundancyOptimizer>(dp, make);
  } else {
    plain = make(net.parameters());
  }
  const int64_t per_rank = 8 / ctx.world_size();
  for (int step = 0; step < 3; ++step) {
    nn::manual_seed(3000 + step);
    Tensor x = nn::randn({8, 1, 6, 6}, {.device = nn::Device::CPU()});
    Tensor y = nn::randn({8, 2}, {.device = nn::Device::CPU()});
    const int64_t lo = ctx.rank() * per_rank;
    if (zero) zero->zero_grad(); else plain->zero_grad();
    nn::mse_loss(dp(x.slice(lo, lo + per_rank).to(ctx.device())),
                 y.slice(lo, lo + per_rank).to(ctx.device()))
        .backward();
    if (zero) zero->step(); else plain->step();
  }
  return testing::FlatParams(net);
}

class MemoryGpuTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const int needed = std::string(GetParam()) == "0,1" ? 2 : 1;
    if (nn::cuda_device_count() < needed) {
      GTEST_SKIP() << "needs " << needed << " GPU(s), " << nn::cuda_device_count() << " visible";
    }
    options_.share_devices = std::string(GetParam()) == "0,0";
  }
  std::ostringstream console_;
  SpawnOptions options_{.seed = 7, .console = &console_};
};

TEST_P(MemoryGpuTest, ZeroAndCompressHooksMatchTheCpuRuns) {
  for (Mode mode : {Mode::kZero, Mode::kBf16Hook, Mode::kFp16Hook}) {
    auto gpu = spawn([&](Context& ctx) { return Steps(ctx, mode); }, 2, GetParam(), options_);
    auto cpu = spawn([&](Context& ctx) { return Steps(ctx, mode); }, 2, "cpu",
                     SpawnOptions{.seed = 7, .console = &console_});
    auto unsharded = spawn([&](Context& ctx) { return Steps(ctx, Mode::kUnsharded); }, 2,
                           GetParam(), options_);
    ASSERT_TRUE(gpu.ok() && cpu.ok() && unsharded.ok())
        << gpu.status() << cpu.status() << unsharded.status();
    testing::ExpectSameBits((*gpu)[1], (*gpu)[0], "ranks agree");
    if (mode == Mode::kZero) {
      EXPECT_LE(testing::ScaledError((*gpu)[0], (*unsharded)[0]), 1e-6) << GetParam();
      EXPECT_LE(testing::ScaledError((*gpu)[0], (*cpu)[0]), 1e-5) << GetParam();
    } else {
      // 16 bits on the wire: close to the float32 run, and to the CPU's 16-bit run.
      EXPECT_LE(testing::ScaledError((*gpu)[0], (*unsharded)[0]), 1e-2) << GetParam();
      EXPECT_LE(testing::ScaledError((*gpu)[0], (*cpu)[0]), 1e-2) << GetParam();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(SharedGpuAndNccl, MemoryGpuTest, ::testing::Values("0,0", "0,1"));

}  // namespace
}  // namespace tandem::dist
