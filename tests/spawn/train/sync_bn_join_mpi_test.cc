// SyncBatchNorm and DataParallel::join() across processes (ctest label mpi; run
// by mpirun): P processes x 1 rank give the bits of 1 process x P ranks; P
// processes x L ranks x batch B with SyncBatchNorm train as 1 rank x batch P*L*B
// with BatchNorm; ranks of different processes with different step counts train
// under join() as one rank on each step's union, also with a
// ZeroRedundancyOptimizer (the rank that joined early keeps stepping its shard)
// and with Bf16CompressHook. Without mpirun every test skips.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "spawn/spawn.h"
#include "spawn/train/comm_hooks.h"
#include "tests/spawn/mpi_fixture.h"
#include "tests/spawn/train/compose_net.h"
#include "tests/spawn/train/join_net.h"
#include "tests/spawn/train/sync_bn_net.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using testing::LaunchedProcesses;

class SyncBatchNormMpiTest : public testing::MpiFixture {};

TEST_F(SyncBatchNormMpiTest, OneRankPerProcessHasTheInProcessBits) {
  const int world = LaunchedProcesses();
  auto across = spawn([](Context& ctx) { return TrainBn(ctx, 3, 3, true); }, 1, "cpu", Options());
  auto local = spawn([](Context& ctx) { return TrainBn(ctx, 3, 3, true); }, world, "cpu", Local());
  ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
  const BnRun& a = (*across)[0];
  const BnRun& b = (*local)[0];
  EXPECT_EQ(a.losses, b.losses);
  ::tandem::testing::ExpectSameBits(a.first_grads.to_vector<float>(),
                                    b.first_grads.to_vector<float>(), "first gradients");
  ::tandem::testing::ExpectSameBits(a.params.to_vector<float>(), b.params.to_vector<float>(),
                                    "parameters");
  ::tandem::testing::ExpectSameBits(a.buffers.to_vector<float>(), b.buffers.to_vector<float>(),
                                    "running statistics");
}

TEST_F(SyncBatchNormMpiTest, ProcessesTimesRanksMatchOneRankOnTheWholeBatch) {
  for (int local : {1, 2}) {
    const int world = LaunchedProcesses() * local;
    auto one = spawn([&](Context& ctx) { return TrainBn(ctx, 3 * world, 3, false); }, 1, "cpu",
                     Local());
    auto many = spawn([](Context& ctx) { return TrainBn(ctx, 3, 3, true); }, local, "cpu",
                      Options());
    ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
    const BnRun& ref = (*one)[0];
    for (const BnRun& run : *many) {
      const double grads = ::tandem::testing::ScaledError(run.first_grads, ref.first_grads);
      const double params = ::tandem::testing::ScaledError(run.params, ref.params);
      const double buffers = ::tandem::testing::ScaledError(run.buffers, ref.buffers);
      std::printf("SyncBatchNorm %d processes x %d ranks x 3 vs 1 rank x %d: max relative "
                  "difference first gradients %.3g, parameters %.3g, running statistics %.3g\n",
                  LaunchedProcesses(), local, 3 * world, grads, params, buffers);
      EXPECT_LE(grads, 1e-5);
      EXPECT_LE(params, 1e-5);
      EXPECT_LE(buffers, 1e-5);
    }
  }
}

// One rank per process, the last with 7 steps where the others have 10.
TEST_F(SyncBatchNormMpiTest, JoinAcrossProcessesMatchesOneRankAndTheInProcessBits) {
  const int world = LaunchedProcesses();
  for (bool sync : {false, true}) {
    auto one = spawn([&](Context& ctx) { return TrainUneven<BnNet>(ctx, world, true, false); }, 1,
                     "cpu", Local());
    auto across = spawn([&](Context& ctx) { return TrainUneven<BnNet>(ctx, world, false, sync); },
                        1, "cpu", Options());
    auto local = spawn([&](Context& ctx) { return TrainUneven<BnNet>(ctx, world, false, sync); },
                       world, "cpu", Local());
    ASSERT_TRUE(one.ok() && across.ok() && local.ok())
        << one.status() << across.status() << local.status();
    const double params = ::tandem::testing::ScaledError((*across)[0].params, (*one)[0].params);
    std::printf("join across %d processes (%s): max relative difference of the parameters to 1 "
                "rank on each step's union %.3g\n",
                world, sync ? "SyncBatchNorm" : "per-rank BatchNorm", params);
    if (sync) EXPECT_LE(params, 1e-5);  // per-rank BatchNorm is not one rank's
    ::tandem::testing::ExpectSameBits((*across)[0].params.to_vector<float>(),
                                      (*local)[0].params.to_vector<float>(), "parameters");
    ::tandem::testing::ExpectSameBits((*across)[0].buffers.to_vector<float>(),
                                      (*local)[0].buffers.to_vector<float>(), "buffers");
  }
}

// One rank per process, the last with 7 steps: the sharded optimizer (SGD with
// momentum, Adam) under join() across processes ends at the parameters of one
// rank with the unsharded optimizer, and at the bits of the same ranks in one
// process; so does a bfloat16-compressed join, with and without ZeRO (within
// its rounding of one rank).
TEST_F(SyncBatchNormMpiTest, JoinWithZeroAndCompressionAcrossProcesses) {
  const int world = LaunchedProcesses();
  struct Case {
    std::string name;
    JoinSetup setup;
    double bound;  // against one rank in float32 with the unsharded optimizer
  };
  const std::vector<Case> cases = {
      {"ZeroRedundancyOptimizer (momentum)", {.optimizer = "momentum", .zero = true}, 1e-5},
      {"ZeroRedundancyOptimizer (adam)", {.optimizer = "adam", .zero = true}, 1e-5},
      {"Bf16CompressHook", {.hook = Bf16CompressHook()}, 2.0 / 256},
      {"ZeroRedundancyOptimizer (adam) + Bf16CompressHook",
       {.optimizer = "adam", .zero = true, .hook = Bf16CompressHook()}, 2.0 / 256},
  };
  for (const Case& c : cases) {
    JoinSetup single = c.setup;
    single.one_rank = true;
    auto one = spawn([&](Context& ctx) { return TrainJoin<PlainNet>(ctx, world, single); }, 1,
                     "cpu", Local());
    auto across = spawn([&](Context& ctx) { return TrainJoin<PlainNet>(ctx, world, c.setup); }, 1,
                        "cpu", Options());
    auto local = spawn([&](Context& ctx) { return TrainJoin<PlainNet>(ctx, world, c.setup); },
                       world, "cpu", Local());
    ASSERT_TRUE(one.ok() && across.ok() && local.ok())
        << one.status() << across.status() << local.status();
    const double params = ::tandem::testing::ScaledError((*across)[0].params, (*one)[0].params);
    std::printf("join + %s across %d processes (process %d, 10/7 steps): max relative difference "
                "of the parameters to 1 rank on each step's union %.3g\n",
                c.name.c_str(), world, testing::LaunchedIndex(), params);
    EXPECT_LE(params, c.bound) << c.name;
    ::tandem::testing::ExpectSameBits((*across)[0].params.to_vector<float>(),
                                      (*local)[testing::LaunchedIndex()].params.to_vector<float>(),
                                      "parameters");
  }
}

// Pairs of DataParallel's features (compose_net.h) across processes, one rank
// per process: the bits of the same ranks in one process, and within the
// pair's bound of one rank on the union of the rows.
TEST_F(SyncBatchNormMpiTest, FeaturesCombinedAcrossProcesses) {
  const int world = LaunchedProcesses();
  const std::vector<Combo> combos = {
      {.name = "accumulation", .accum = 3},
      {.name = "find_unused_parameters", .unused = true},
      {.name = "bf16 autocast", .autocast = true},
      {.name = "accumulation + join", .accum = 2, .join = true},
      {.name = "evaluation inside join", .join = true, .evaluate = true},
      {.name = "ZeRO + accumulation + SyncBatchNorm", .zero = true, .accum = 2, .sync_bn = true},
  };
  for (const Combo& c : combos) {
    auto train = [&](int ranks, bool one_rank, const SpawnOptions& options) {
      return spawn([&](Context& ctx) {
        return c.sync_bn ? TrainCombo<BnNet>(ctx, c, world, one_rank)
                         : TrainCombo<PlainNet>(ctx, c, world, one_rank);
      }, ranks, "cpu", options);
    };
    auto one = train(1, true, Local());
    auto across = train(1, false, Options());
    auto local = train(world, false, Local());
    ASSERT_TRUE(one.ok() && across.ok() && local.ok())
        << c.name << ": " << one.status() << across.status() << local.status();
    const double error = ::tandem::testing::ScaledError((*across)[0], (*one)[0]);
    const double bound = c.autocast ? 1e-2 : 1e-5;  // as in compose_test.cc
    std::printf("%s across %d processes (process %d): max relative difference of the "
                "parameters to 1 rank %.3g (bound %.3g)\n",
                c.name, world, testing::LaunchedIndex(), error, bound);
    EXPECT_LE(error, bound) << c.name;
    ::tandem::testing::ExpectSameBits((*across)[0].to_vector<float>(),
                                      (*local)[testing::LaunchedIndex()].to_vector<float>(),
                                      c.name);
  }
}

}  // namespace
}  // namespace tandem::dist
