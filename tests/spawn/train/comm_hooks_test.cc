// DataParallel's comm hooks on CPU ranks: AllReduceHook gives the bits of no
// hook; a hook that returns a sum is divided by DataParallel; Bf16CompressHook
// and Fp16CompressHook give exactly h(sum_r h(g_r)) / N (float32 addition, one
// rounding to the 16-bit type h); float16 overflows to infinity;
// a hook with a result of the wrong size, dtype or no Work is an error naming it.
#include <cmath>
#include <map>
#include <sstream>

#include "gtest/gtest.h"
#include "nn/layers.h"
#include "nn/ops/loss.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "spawn/spawn.h"
#include "spawn/train/comm_hooks.h"
#include "tests/spawn/train/dp_models.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

// Every gradient of ConvNet after one backward of rank-dependent data, flattened.
std::vector<float> GradsAfterBackward(Context& ctx, const CommHook& hook) {
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

class CommHookTest : public ::testing::TestWithParam<int> {
 protected:
  std::ostringstream console_;
  SpawnOptions options_{.seed = 7, .console = &console_};
};

TEST_P(CommHookTest, AllReduceHookGivesTheBitsOfNoHook) {
  const int ranks = GetParam();
  auto none = spawn([](Context& ctx) { return GradsAfterBackward(ctx, nullptr); }, ranks, "cpu",
                    options_);
  auto hooked = spawn([](Context& ctx) { return GradsAfterBackward(ctx, AllReduceHook()); }, ranks,
                      "cpu", options_);
  ASSERT_TRUE(none.ok() && hooked.ok()) << none.status() << hooked.status();
  for (int r = 0; r < ranks; ++r) testing::ExpectSameBits((*hooked)[r], (*none)[0], "AllReduceHook");
}

// A hook that sums (averaged false): DataParallel divides by the world size.
// With a power-of-two world size x * (1/N) is x / N exactly, so the bits match.
TEST_P(CommHookTest, SumHookIsDividedByDataParallel) {
  const int ranks = GetParam();
  if ((ranks & (ranks - 1)) != 0) GTEST_SKIP() << "bits match kAvg for power-of-two worlds";
  CommHook sum = [](GradBucket& b) {
    return BucketReduction{.work = b.comm->all_reduce_async(b.buffer, ReduceOp::kSum)};
  };
  auto none = spawn([](Context& ctx) { return GradsAfterBackward(ctx, nullptr); }, ranks, "cpu",
                    options_);
  auto hooked = spawn([&](Context& ctx) { return GradsAfterBackward(ctx, sum); }, ranks, "cpu",
                      options_);
  ASSERT_TRUE(none.ok() && hooked.ok()) << none.status() << hooked.status();
  for (int r = 0; r < ranks; ++r) testing::ExpectSameBits((*hooked)[r], (*none)[0], "sum hook");
}

// Each bucket's local gradients are kept (a hook around `compress`, which
// sends the 16-bit type H), gathered after backward, and the expected result
// computed on the host: every element exactly H(sum_r H(g_r)) / N, the sum in
// float32. Returns each rank's worst difference from the float32 mean,
// relative to the gradients' largest magnitude.
template <typename H>
absl::StatusOr<std::vector<double>> CompressedAgainstHost(const CommHook& compress, int ranks,
                                                          const SpawnOptions& options) {
  return spawn(
      [&compress](Context& ctx) {
        std::map<int, Tensor> local;
        CommHook keep = [&](GradBucket& b) {
          local[b.index] = b.buffer.clone();
          return compress(b);
        };
        ConvNet net;
        DataParallel dp(net, ctx,
                        {.bucket_bytes = 512, .first_bucket_bytes = 256, .comm_hook = keep});
        nn::manual_seed(100 + ctx.rank());
        Tensor x = nn::randn({5, 1, 6, 6}), y = nn::randn({5, 2});
        nn::mse_loss(dp(x), y).backward();
        EXPECT_GT(dp.num_buckets(), 1);
        double err = 0, scale = 0;
        for (int b = 0; b < dp.num_buckets(); ++b) {
          const std::vector<float> all = ctx.communicator().all_gather(local.at(b)).to_vector<float>();
          const std::vector<float> got = dp.bucket(b).buffer.to_vector<float>();
          const size_t n = got.size();
          for (size_t i = 0; i < n; ++i) {
            float sum = 0;
            for (int r = 0; r < ctx.world_size(); ++r) sum += static_cast<float>(H(all[r * n + i]));
            // DataParallel's division: Tensor::mul_ by float(1 / N).
            const float expected =
                static_cast<float>(H(sum)) * static_cast<float>(1.0 / ctx.world_size());
            EXPECT_EQ(got[i], expected) << "bucket " << b << " element " << i;
            double mean = 0;
            for (int r = 0; r < ctx.world_size(); ++r) {
              mean += all[r * n + i];
              scale = std::max(scale, std::fabs(static_cast<double>(all[r * n + i])));
            }
            mean /= ctx.world_size();
            err = std::max(err, std::fabs(got[i] - mean));
          }
        }
        return err / scale;
      },
      ranks, "cpu", options);
}

TEST_P(CommHookTest, Bf16CompressHookRoundsTheInputsAndTheSumOnly) {
  auto result = CompressedAgainstHost<nn::BFloat16>(Bf16CompressHook(), GetParam(), options_);
  ASSERT_TRUE(result.ok()) << result.status();
  // bf16 rounding (2^-8 relative) of the inputs and the sum, not more.
  for (double worst : *result) EXPECT_LT(worst, 2.0 / 256);
}

TEST_P(CommHookTest, Fp16CompressHookRoundsTheInputsAndTheSumOnly) {
  auto result = CompressedAgainstHost<nn::Float16>(Fp16CompressHook(), GetParam(), options_);
  ASSERT_TRUE(result.ok()) << result.status();
  // float16 rounding (2^-11 relative) of the inputs and the sum, not more.
  for (double worst : *result) EXPECT_LT(worst, 2.0 / 2048);
}

// float16's range ends at 65504: a gradient of 1e5 (or a sum that reaches
// 65520) comes back infinite, the documented limit of Fp16CompressHook; the
// other elements of the bucket are unaffected.
TEST_P(CommHookTest, Fp16CompressHookOverflowsToInfinity) {
  const int ranks = GetParam();
  auto result = spawn(
      [](Context& ctx) {
        nn::Linear net(3, 1);
        DataParallel dp(*net, ctx, {.comm_hook = Fp16CompressHook()});
        // d(sum(w x))/dw = sum of x's rows: 1e5 (out of range on every rank),
        // 4e4 (in range, but 2 ranks sum to 8e4) and 0.5.
        Tensor x = nn::from_vector<float>({1e5f, 4e4f, 0.5f}, {1, 3});
        nn::sum(dp(x)).backward();
        return net->weight.grad().to_vector<float>();
      },
      ranks, "cpu", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const std::vector<float>& g : *result) {
    EXPECT_TRUE(std::isinf(g[0]) && g[0] > 0) << g[0];
    if (ranks == 1) {
      EXPECT_EQ(g[1], 40000.0f);
    } else {
      EXPECT_TRUE(std::isinf(g[1]) && g[1] > 0) << g[1];
    }
    EXPECT_EQ(g[2], 0.5f);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommHookTest, ::testing::Values(1, 2, 3, 4));

std::string HookError(const CommHook& hook) {
  std::ostringstream console;
  absl::Status s = spawn([&](Context& ctx) { GradsAfterBackward(ctx, hook); }, 2, "cpu",
                         {.console = &console});
  return s.ok() ? "" : std::string(s.message());
}

TEST(CommHookErrorTest, ResultOfTheWrongSizeNamesBoth) {
  const std::string e = HookError([](GradBucket& b) {
    Tensor half = b.buffer.slice(0, b.buffer.numel() / 2).clone();
    return BucketReduction{.work = b.comm->all_reduce_async(half), .result = half};
  });
  EXPECT_NE(e.find("comm_hook: bucket 0: the hook's result"), std::string::npos) << e;
  EXPECT_NE(e.find("elements, the bucket range"), std::string::npos) << e;
}

TEST(CommHookErrorTest, ResultOfAnIntegerDtypeIsAnError) {
  const std::string e = HookError([](GradBucket& b) {
    Tensor ints = b.buffer.to(nn::kInt64);
    return BucketReduction{.work = b.comm->all_reduce_async(ints), .result = ints};
  });
  EXPECT_NE(e.find("the hook's result is int64"), std::string::npos) << e;
}

TEST(CommHookErrorTest, NoWorkIsAnError) {
  const std::string e = HookError([](GradBucket&) { return BucketReduction{}; });
  EXPECT_NE(e.find("the hook returned no Work"), std::string::npos) << e;
}


// The handle DataParallel keeps for a hooked bucket carries the collective's
// sequence number, and is complete only when the result is in place: at once
// for an in-place average on CPU ranks, after wait() when a compressed result
// must still be copied back and divided.
TEST(CommHookWorkTest, HookedWorkReportsItsSequenceAndCompletesWithTheResultInPlace) {
  std::ostringstream console;
  absl::Status s = spawn(
      [](Context& ctx) {
        for (bool compressed : {false, true}) {
          GradBucket bucket{.buffer = nn::ones({8}), .comm = &ctx.communicator()};
          int64_t wire_bytes = 0;
          std::shared_ptr<Work> work = internal::LaunchCommHook(
              compressed ? Bf16CompressHook() : AllReduceHook(), bucket, &wire_bytes);
          EXPECT_GT(work->sequence(), 0u);
          EXPECT_EQ(work->sequence(), ctx.communicator().collectives_entered());
          EXPECT_EQ(work->is_completed(), !compressed) << "compressed " << compressed;
          work->wait();
          EXPECT_TRUE(work->is_completed());
          EXPECT_EQ(bucket.buffer.to_vector<float>(), std::vector<float>(8, 1.0f));
        }
      },
      2, "cpu", {.console = &console});
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace tandem::dist
