// Across processes (run under mpirun; ctest does: label mpi), e.g.
//   tests/spawn/mpirun.sh -np 2 build-cpu/tests/spawn/comm/spawn_mpi_bf16_scatter_test
// bfloat16 and float16 reductions and reduce_scatter_async through the
// hierarchical communicator: with one rank per process they give the bits of
// one process with as many in-process ranks (float32 addition, one rounding);
// with two ranks per process reduce_scatter_async gives reduce_scatter's bits;
// DataParallel with Bf16CompressHook or Fp16CompressHook gives the gradients of
// the in-process run; and
// ZeroRedundancyOptimizer across processes gives the unsharded parameters.
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "gtest/gtest.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "spawn/spawn.h"
#include "tests/spawn/mpi_fixture.h"
#include "optim/adam.h"
#include "spawn/train/comm_hooks.h"
#include "spawn/train/zero_redundancy_optimizer.h"
#include "tests/spawn/train/dp_models.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using testing::LaunchedProcesses;

using nn::Tensor;

class MpiBf16ScatterTest : public testing::MpiFixture {};

Tensor RankData(int rank, int64_t n, nn::DType dtype) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = std::sin(0.37 * i + rank) * std::pow(10.0, (i + rank) % 5 - 2);
  }
  return nn::from_vector<double>(v, {n}, {.dtype = nn::kFloat64}).to(dtype);
}

std::vector<float> AsFloats(const Tensor& t) { return t.to(nn::kFloat32).to_vector<float>(); }

// All-reduce (sum, avg) and in-place reduce_scatter_async of bfloat16, float16
// and float32 data.
std::vector<std::vector<float>> Collectives(Context& ctx, int64_t per_rank) {
  std::vector<std::vector<float>> out;
  for (nn::DType dtype : {nn::kBFloat16, nn::kFloat16, nn::kFloat32}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      Tensor x = RankData(ctx.rank(), per_rank * ctx.world_size(), dtype);
      Tensor all = x.clone();
      ctx.communicator().all_reduce(all, op);
      out.push_back(AsFloats(all));
      Tensor block = x.slice(ctx.rank() * per_rank, (ctx.rank() + 1) * per_rank);
      ctx.communicator().reduce_scatter_async(x, block, op)->wait();
      out.push_back(AsFloats(block));
    }
  }
  return out;
}

TEST_F(MpiBf16ScatterTest, OneRankPerProcessGivesTheInProcessBits) {
  const int processes = LaunchedProcesses();
  for (const int64_t per_rank : {int64_t{5}, int64_t{4000}}) {
    auto across = spawn([&](Context& ctx) { return Collectives(ctx, per_rank); }, 1, "cpu",
                        Options());
    auto local = spawn([&](Context& ctx) { return Collectives(ctx, per_rank); }, processes, "cpu",
                       Local());
    ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
    const int me = std::atoi(std::getenv("OMPI_COMM_WORLD_RANK"));
    const auto& mine = (*across)[0];
    const auto& reference = (*local)[me];
    ASSERT_EQ(mine.size(), reference.size());
    for (size_t i = 0; i < mine.size(); ++i) testing::ExpectSameBits(mine[i], reference[i], "collective");
  }
}

TEST_F(MpiBf16ScatterTest, ReduceScatterAsyncGivesReduceScattersBitsWithTwoRanksPerProcess) {
  auto result = spawn(
      [](Context& ctx) {
        std::vector<std::vector<float>> out;
        for (nn::DType dtype : {nn::kBFloat16, nn::kFloat16, nn::kFloat32}) {
          const int64_t k = 3000;
          Tensor x = RankData(ctx.rank(), k * ctx.world_size(), dtype);
          out.push_back(AsFloats(ctx.communicator().reduce_scatter(x, ReduceOp::kAvg)));
          Tensor block = x.slice(ctx.rank() * k, (ctx.rank() + 1) * k);
          ctx.communicator().reduce_scatter_async(x, block, ReduceOp::kAvg)->wait();
          out.push_back(AsFloats(block));
        }
        return out;
      },
      2, "cpu", Options());
  ASSERT_TRUE(result.ok()) << result.status();
  for (const auto& r : *result) {
    testing::ExpectSameBits(r[1], r[0], "bfloat16");
    testing::ExpectSameBits(r[3], r[2], "float16");
    testing::ExpectSameBits(r[5], r[4], "float32");
  }
}

std::vector<float> HookedGrads(Context& ctx, const CommHook& hook) {
  ConvNet net;
  DataParallel dp(net, ctx, {.bucket_bytes = 512, .first_bucket_bytes = 256, .comm_hook = hook});
  nn::manual_seed(100 + ctx.rank());
  Tensor x = nn::randn({5, 1, 6, 6}), y = nn::randn({5, 2});
  nn::mse_loss(dp(x), y).backward();
  std::vector<float> grads;
  for (const Tensor& p : net.parameters()) {
    for (float v : p.grad().to_vector<float>()) grads.push_back(v);
  }
  return grads;
}

TEST_F(MpiBf16ScatterTest, Bf16CompressHookGivesTheInProcessGradients) {
  auto grads = [](Context& ctx) { return HookedGrads(ctx, Bf16CompressHook()); };
  auto across = spawn(grads, 1, "cpu", Options());
  auto local = spawn(grads, LaunchedProcesses(), "cpu", Local());
  ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
  testing::ExpectSameBits((*across)[0], (*local)[0], "Bf16CompressHook across processes");
}

TEST_F(MpiBf16ScatterTest, Fp16CompressHookGivesTheInProcessGradients) {
  auto grads = [](Context& ctx) { return HookedGrads(ctx, Fp16CompressHook()); };
  auto across = spawn(grads, 1, "cpu", Options());
  auto local = spawn(grads, LaunchedProcesses(), "cpu", Local());
  ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
  testing::ExpectSameBits((*across)[0], (*local)[0], "Fp16CompressHook across processes");
}

// Three Adam steps of ConvNet, sharded or not, on a global batch of 12 rows.
std::vector<float> AdamSteps(Context& ctx, bool sharded) {
  ConvNet net;
  DataParallel dp(net, ctx, {.bucket_bytes = 400, .first_bucket_bytes = 100});
  auto make = [](std::vector<Tensor> p) {
    return std::make_unique<optim::Adam>(std::move(p), optim::AdamOptions{.lr = 1e-2});
  };
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> plain;
  if (sharded) {
    zero = std::make_unique<ZeroRedundancyOptimizer>(dp, make);
  } else {
    plain = make(net.parameters());
  }
  const int64_t per_rank = 12 / ctx.world_size();
  for (int step = 0; step < 3; ++step) {
    nn::manual_seed(3000 + step);
    Tensor x = nn::randn({12, 1, 6, 6}), y = nn::randn({12, 2});
    const int64_t lo = ctx.rank() * per_rank;
    if (zero) zero->zero_grad(); else plain->zero_grad();
    nn::mse_loss(dp(x.slice(lo, lo + per_rank)), y.slice(lo, lo + per_rank)).backward();
    if (zero) zero->step(); else plain->step();
  }
  return testing::FlatParams(net);
}

TEST_F(MpiBf16ScatterTest, ZeroRedundancyOptimizerGivesTheUnshardedParameters) {
  // One rank per process: the in-process bits; two: the unsharded job's bits.
  auto across = spawn([](Context& ctx) { return AdamSteps(ctx, true); }, 1, "cpu", Options());
  auto local = spawn([](Context& ctx) { return AdamSteps(ctx, false); }, LaunchedProcesses(),
                     "cpu", Local());
  ASSERT_TRUE(across.ok() && local.ok()) << across.status() << local.status();
  testing::ExpectSameBits((*across)[0], (*local)[0], "ZeRO, 1 rank per process");
  auto across2 = spawn([](Context& ctx) { return AdamSteps(ctx, true); }, 2, "cpu", Options());
  auto plain2 = spawn([](Context& ctx) { return AdamSteps(ctx, false); }, 2, "cpu", Options());
  ASSERT_TRUE(across2.ok() && plain2.ok()) << across2.status() << plain2.status();
  testing::ExpectSameBits((*across2)[1], (*plain2)[0], "ZeRO, 2 ranks per process");
}

}  // namespace
}  // namespace tandem::dist
