// SyncBatchNorm and DataParallel::join() (plain, with ZeroRedundancyOptimizer, with
// a compress hook) on GPU ranks: ranks sharing GPU 0 (the in-process
// communicator's CUDA kernels) train as one GPU rank on the whole batch,
// as the CPU tests (sync_batch_norm_test.cc, join_test.cc) show for CPU ranks; and
// with NCCL on GPUs 0 and 1 where two are visible. Skipped without a GPU.
#include <cstdio>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "nn/nn.h"
#include "spawn/spawn.h"
#include "spawn/train/comm_hooks.h"
#include "spawn/train/sync_batch_norm.h"
#include "tests/gpu_test_util.h"
#include "tests/spawn/train/join_net.h"
#include "tests/spawn/train/sync_bn_net.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using ::tandem::testing::ScaledError;

// GetParam(): the gpus string of the multi-rank run ("0,0" shares GPU 0).
class SyncBnJoinGpuTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    shared_ = std::string(GetParam()).find('1') == std::string::npos;
    TANDEM_REQUIRE_GPUS(shared_ ? 1 : 2);
    options_.share_devices = shared_;
  }
  bool shared_ = true;
  std::ostringstream console_;
  SpawnOptions options_{.timeout_s = 120, .seed = 7, .console = &console_};
  SpawnOptions one_{.timeout_s = 120, .seed = 7, .console = &console_};
};

TEST_P(SyncBnJoinGpuTest, SyncBatchNormTwoRanksMatchOneRankOnTheWholeBatch) {
  constexpr int64_t kPerRank = 3;
  constexpr int kSteps = 4;
  auto one =
      spawn([&](Context& ctx) { return TrainBn(ctx, 2 * kPerRank, kSteps, false); }, 1, "0", one_);
  auto two = spawn([&](Context& ctx) { return TrainBn(ctx, kPerRank, kSteps, true); }, 2,
                   GetParam(), options_);
  ASSERT_TRUE(one.ok() && two.ok()) << one.status() << two.status();
  for (int r = 0; r < 2; ++r) {
    const BnRun& run = (*two)[r];
    const double grads = ScaledError(run.first_grads, (*one)[0].first_grads);
    const double params = ScaledError(run.params, (*one)[0].params);
    const double buffers = ScaledError(run.buffers, (*one)[0].buffers);
    std::printf(
        "SyncBatchNorm on gpus %s, 2 ranks x 3 vs 1 rank x 6, rank %d: first gradients "
        "%.3g, parameters %.3g, running statistics %.3g\n",
        GetParam(), r, grads, params, buffers);
    EXPECT_LE(grads, 1e-5) << "rank " << r;
    EXPECT_LE(params, 1e-5) << "rank " << r;
    EXPECT_LE(buffers, 1e-5) << "rank " << r;
  }
}

TEST_P(SyncBnJoinGpuTest, JoinWithUnevenStepsMatchesOneRankOnEachStepsUnion) {
  constexpr int kWorld = 2;
  for (bool sync : {false, true}) {
    auto one = [&](Context& ctx) {
      return sync ? TrainUneven<BnNet>(ctx, kWorld, true, false)
                  : TrainUneven<PlainNet>(ctx, kWorld, true, false);
    };
    auto many = [&](Context& ctx) {
      return sync ? TrainUneven<BnNet>(ctx, kWorld, false, true)
                  : TrainUneven<PlainNet>(ctx, kWorld, false, false);
    };
    auto ref = spawn(one, 1, "0", one_);
    auto run = spawn(many, kWorld, GetParam(), options_);
    ASSERT_TRUE(ref.ok() && run.ok()) << ref.status() << run.status();
    for (int r = 0; r < kWorld; ++r) {
      const double params = ScaledError((*run)[r].params, (*ref)[0].params);
      const double buffers = ScaledError((*run)[r].buffers, (*ref)[0].buffers);
      std::printf(
          "join on gpus %s%s, 2 ranks with 10/7 steps vs 1 rank, rank %d: parameters "
          "%.3g, buffers %.3g\n",
          GetParam(), sync ? " with SyncBatchNorm" : "", r, params, buffers);
      EXPECT_LE(params, 1e-5) << "rank " << r << (sync ? " sync" : "");
      EXPECT_LE(buffers, 1e-5) << "rank " << r << (sync ? " sync" : "");
    }
  }
}

TEST_P(SyncBnJoinGpuTest, ZeroAndCompressHookInsideJoinMatchOneRank) {
  constexpr int kWorld = 2;
  auto one_adam = spawn(
      [](Context& ctx) {
        return TrainJoin<PlainNet>(ctx, kWorld, {.one_rank = true, .optimizer = "adam"});
      },
      1, "0", one_);
  auto zero = spawn(
      [](Context& ctx) {
        return TrainJoin<PlainNet>(ctx, kWorld, {.optimizer = "adam", .zero = true});
      },
      kWorld, GetParam(), options_);
  auto one_sgd =
      spawn([](Context& ctx) { return TrainJoin<PlainNet>(ctx, kWorld, {.one_rank = true}); }, 1,
            "0", one_);
  auto bf16 = spawn(
      [](Context& ctx) { return TrainJoin<PlainNet>(ctx, kWorld, {.hook = Bf16CompressHook()}); },
      kWorld, GetParam(), options_);
  ASSERT_TRUE(one_adam.ok() && zero.ok() && one_sgd.ok() && bf16.ok())
      << one_adam.status() << zero.status() << one_sgd.status() << bf16.status();
  for (int r = 0; r < kWorld; ++r) {
    const double sharded = ScaledError((*zero)[r].params, (*one_adam)[0].params);
    const double compressed = ScaledError((*bf16)[r].params, (*one_sgd)[0].params);
    std::printf(
        "join on gpus %s, 2 ranks with 10/7 steps vs 1 rank, rank %d: ZeRO (Adam) "
        "parameters %.3g; Bf16CompressHook parameters %.3g\n",
        GetParam(), r, sharded, compressed);
    EXPECT_LE(sharded, 1e-5) << "rank " << r;
    EXPECT_LE(compressed, 2.0 / 256) << "rank " << r;
    EXPECT_GT(compressed, 0) << "rank " << r << ": no rounding, so the hook did not run";
  }
}

INSTANTIATE_TEST_SUITE_P(SharedGpuAndNccl, SyncBnJoinGpuTest, ::testing::Values("0,0", "0,1"));

}  // namespace
}  // namespace tandem::dist
