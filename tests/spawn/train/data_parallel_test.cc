// DataParallel on CPU ranks: N ranks on per-rank batch B end where 1 rank on
// batch N*B ends; buckets overlap backward; faults name the parameter.
#include "spawn/train/data_parallel.h"

#include <cmath>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nn/autocast.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/dp_models.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

class EquivalenceTest : public ::testing::TestWithParam<int> {
 protected:
  SpawnOptions options_{.seed = 7, .console = &console_};
  std::ostringstream console_;
};

TEST_P(EquivalenceTest, LinearNetMatchesOneRankOnTheWholeBatch) {
  const int world = GetParam();
  const int64_t per_rank = 4;
  auto one = spawn(
      [&](Context& ctx) { return Train<LinearNet>(ctx, {10}, 1, per_rank * world, 5); }, 1, "cpu",
      options_);
  auto many = spawn([&](Context& ctx) { return Train<LinearNet>(ctx, {10}, 1, per_rank, 5); },
                    world, "cpu", options_);
  ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
  for (int r = 0; r < world; ++r) ExpectClose((*many)[r], (*one)[0], "LinearNet");
}

TEST_P(EquivalenceTest, ConvNetMatchesOneRankOnTheWholeBatch) {
  const int world = GetParam();
  const int64_t per_rank = 2;
  auto one = spawn(
      [&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, per_rank * world, 4); }, 1,
      "cpu", options_);
  auto many = spawn([&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, per_rank, 4); },
                    world, "cpu", options_);
  ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
  for (int r = 0; r < world; ++r) ExpectClose((*many)[r], (*one)[0], "ConvNet");
}

// Under bfloat16 autocast each rank rounds its own weight gradient (a sum over its
// B rows) to bfloat16 before the float32 all-reduce, where one rank rounds the sum
// over N*B rows once: the results agree to a few bfloat16 ulps (2^-8 relative)
// times the learning rate, not to float32 rounding.
TEST_P(EquivalenceTest, Bf16AutocastConvNetMatchesOneRankWithinBf16Rounding) {
  const int world = GetParam();
  const int64_t per_rank = 2;
  auto run = [&](int ranks, int64_t batch, bool bf16) {
    return spawn([&](Context& ctx) { return Train<ConvNet>(ctx, {1, 6, 6}, 2, batch, 4, bf16); },
                 ranks, "cpu", options_);
  };
  auto one = run(1, per_rank * world, true);
  auto many = run(world, per_rank, true);
  auto float32 = run(1, per_rank * world, false);
  ASSERT_TRUE(one.ok() && many.ok() && float32.ok())
      << one.status() << many.status() << float32.status();
  EXPECT_NE((*one)[0], (*float32)[0]) << "autocast changed nothing: bf16 did not run";
  ExpectClose((*one)[0], (*float32)[0], "bf16 vs float32", 2e-2);
  for (int r = 0; r < world; ++r) ExpectClose((*many)[r], (*one)[0], "bf16 ConvNet", 5e-3);
}

// l1 applied twice (a parameter used twice in forward, as tied weights are):
// each of its gradients is the sum of two contributions, and its bucket may be
// reduced only once both are in (autograd fires the grad-ready hook once, after
// every contribution). x: (N, 10) -> (N, 1).
struct TwiceNet : nn::Module {
  TwiceNet()
      : l1(register_module("l1", nn::Linear(10, 10))), l2(register_module("l2", nn::Linear(10, 1))) {}
  Tensor forward(const Tensor& x) override { return l2(nn::relu(l1(nn::relu(l1(x))))); }
  nn::Linear l1, l2;
};

TEST_P(EquivalenceTest, ParameterUsedTwiceMatchesOneRankOnTheWholeBatch) {
  const int world = GetParam();
  const int64_t per_rank = 4;
  auto one = spawn(
      [&](Context& ctx) { return Train<TwiceNet>(ctx, {10}, 1, per_rank * world, 5); }, 1, "cpu",
      options_);
  auto many = spawn([&](Context& ctx) { return Train<TwiceNet>(ctx, {10}, 1, per_rank, 5); },
                    world, "cpu", options_);
  ASSERT_TRUE(one.ok() && many.ok()) << one.status() << many.status();
  for (int r = 0; r < world; ++r) ExpectClose((*many)[r], (*one)[0], "TwiceNet");
}

INSTANTIATE_TEST_SUITE_P(Ranks, EquivalenceTest, ::testing::Values(1, 2, 3, 4));

class DataParallelTest : public ::testing::Test {
 protected:
  SpawnOptions options_{.console = &console_};
  std::ostringstream console_;
};

TEST_F(DataParallelTest, BroadcastsRankZerosWeightsAndBucketsInReverseOrder) {
  auto result = spawn(
      [](Context& ctx) {
        LinearNet net;  // different init per rank (generator stream = rank)
        DataParallel dp(net, ctx, {.bucket_bytes = 1 << 20, .first_bucket_bytes = 8});
        EXPECT_EQ(dp.num_buckets(), 2);
        EXPECT_EQ(dp.bucket_parameter_names(0), (std::vector<std::string>{"l2.bias"}));
        EXPECT_EQ(dp.bucket_parameter_names(1),
                  (std::vector<std::string>{"l2.weight", "l1.bias", "l1.weight"}));
        return FlatParams(net);
      },
      3, "cpu", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ((*result)[1], (*result)[0]);
  EXPECT_EQ((*result)[2], (*result)[0]);
}

// The first bucket (l2's gradients) must be launched while l1's gradients are
// not yet produced.
TEST_F(DataParallelTest, FirstBucketLaunchesBeforeBackwardEnds) {
  absl::Status s = spawn(
      [](Context& ctx) {
        LinearNet net;
        std::vector<std::string> events;
        DataParallel dp(net, ctx,
                        {.bucket_bytes = 64,
                         .first_bucket_bytes = 64,
                         .on_bucket_launch = [&](int b, int) {
                           events.push_back("launch " + std::to_string(b));
                         }});
        for (const auto& [name, p] : net.named_parameters()) {
          p.register_grad_ready_hook([&, name = name](Tensor&) { events.push_back("grad " + name); });
        }
        Tensor loss = nn::mse_loss(dp(nn::randn({4, 10})), nn::randn({4, 1}));
        loss.backward();
        const auto first_launch = std::find(events.begin(), events.end(), "launch 0");
        const auto l1_weight = std::find(events.begin(), events.end(), "grad l1.weight");
        ASSERT_NE(first_launch, events.end());
        ASSERT_NE(l1_weight, events.end());
        EXPECT_LT(first_launch - events.begin(), l1_weight - events.begin())
            << "bucket 0 was not launched before backward produced l1.weight's gradient";
        EXPECT_GT(dp.num_buckets(), 1);
      },
      2, "cpu", options_);
  EXPECT_TRUE(s.ok()) << s;
}

TEST_F(DataParallelTest, NoSyncAccumulatesThenReducesTheSum) {
  auto result = spawn(
      [](Context& ctx) {
        nn::manual_seed(3);
        LinearNet net;
        DataParallel dp(net, ctx);
        nn::manual_seed(50 + ctx.rank());
        Tensor x1 = nn::randn({2, 10}), x2 = nn::randn({2, 10}), y = nn::randn({2, 1});
        {
          auto guard = dp.no_sync();
          nn::mse_loss(dp(x1), y).backward();
        }
        nn::mse_loss(dp(x2), y).backward();
        std::vector<float> grads;
        for (const Tensor& p : dp.parameters()) {
          for (float v : p.grad().to_vector<float>()) grads.push_back(v);
        }
        return grads;
      },
      2, "cpu", options_);
  // Reference: each rank's two local gradients summed, averaged over ranks.
  auto reference = spawn(
      [](Context& ctx) {
        nn::manual_seed(3);
        LinearNet net;
        std::vector<float> total;
        for (int r = 0; r < 2; ++r) {
          nn::manual_seed(50 + r);
          Tensor x1 = nn::randn({2, 10}), x2 = nn::randn({2, 10}), y = nn::randn({2, 1});
          nn::mse_loss(net(x1), y).backward();
          nn::mse_loss(net(x2), y).backward();
        }
        for (const Tensor& p : net.parameters()) {
          for (float v : p.grad().to_vector<float>()) total.push_back(v / 2);
        }
        return total;
      },
      1, "cpu", options_);
  ASSERT_TRUE(result.ok() && reference.ok()) << result.status() << reference.status();
  ExpectClose((*result)[0], (*reference)[0], "no_sync");
  ExpectClose((*result)[1], (*reference)[0], "no_sync");
}

// Gradients reduced by hand (reduce_in_backward off): backward leaves each
// rank's own gradient of loss / world_size, apply_collective_grads sums them
// over the ranks, so every rank ends with the mean of the ranks' gradients.
// Against one rank that computes each rank's gradient in turn and averages
// them; three ranks, so that a sum without the division, one rank's gradient
// (a broadcast) or a mean over fewer ranks all differ from it.
TEST_F(DataParallelTest, ScaleLossAndApplyCollectiveGradsAverageTheRanksGradients) {
  const int world = 3;
  auto flat_grads = [](const std::vector<Tensor>& params, double scale) {
    std::vector<float> grads;
    for (const Tensor& p : params) {
      for (float v : p.grad().to_vector<float>()) grads.push_back(static_cast<float>(v * scale));
    }
    return grads;
  };
  auto result = spawn(
      [&](Context& ctx) {
        nn::manual_seed(3);
        LinearNet net;
        DataParallel dp(net, ctx, {.reduce_in_backward = false});
        nn::manual_seed(9 + ctx.rank());
        Tensor x = nn::randn({3, 10}), y = nn::randn({3, 1});
        dp.scale_loss(nn::mse_loss(dp(x), y)).backward();
        dp.apply_collective_grads();
        return flat_grads(dp.parameters(), 1.0);
      },
      world, "cpu", options_);
  auto reference = spawn(
      [&](Context&) {
        nn::manual_seed(3);
        LinearNet net;
        for (int r = 0; r < world; ++r) {
          nn::manual_seed(9 + r);
          Tensor x = nn::randn({3, 10}), y = nn::randn({3, 1});
          nn::mse_loss(net(x), y).backward();  // accumulates: the sum over the ranks
        }
        return flat_grads(net.parameters(), 1.0 / world);
      },
      1, "cpu", options_);
  ASSERT_TRUE(result.ok() && reference.ok()) << result.status() << reference.status();
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ExpectClose((*result)[r], (*reference)[0], "mean gradient");
  }
}

struct MaybeWider : nn::Module {
  explicit MaybeWider(int64_t out) : l(register_module("l", nn::Linear(4, out))) {}
  Tensor forward(const Tensor& x) override { return l(x); }
  nn::Linear l;
};

TEST_F(DataParallelTest, ParameterShapesDifferIsAnErrorNotAHang) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = spawn(
      [](Context& ctx) {
        MaybeWider net(ctx.rank() == 2 ? 3 : 2);
        DataParallel dp(net, ctx);
      },
      3, "cpu", options_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("the model differs across ranks"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("rank 0 has parameter 'l.weight' (2, 4) float32, rank 2 has "
                             "parameter 'l.weight' (3, 4) float32"),
            absl::string_view::npos)
      << s;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10);
}

struct WithUnused : nn::Module {
  WithUnused()
      : used(register_module("used", nn::Linear(4, 1))),
        spare(register_module("spare", nn::Linear(4, 1))) {}
  Tensor forward(const Tensor& x) override { return used(x); }
  nn::Linear used, spare;
};

TEST_F(DataParallelTest, UnusedParameterIsAnErrorNamingIt) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = spawn(
      [](Context& ctx) {
        WithUnused net;
        DataParallel dp(net, ctx);
        nn::mse_loss(dp(nn::randn({2, 4})), nn::randn({2, 1})).backward();
      },
      2, "cpu", options_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("'spare.weight', 'spare.bias' got no gradient"),
            absl::string_view::npos)
      << s;
  EXPECT_NE(s.message().find("find_unused_parameters"), absl::string_view::npos) << s;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10);
}

// A second live DataParallel over one module, or over a module inside (or
// around) a wrapped one, would reduce gradients again (on NCCL reading the
// first's bucket while it is reduced): refused on every rank before any
// collective; once the first is gone the module can be wrapped again.
TEST_F(DataParallelTest, ASecondLiveWrapperOfOneModuleIsRefused) {
  auto result = spawn(
      [](Context& ctx) {
        LinearNet net;
        std::string refusal;
        {
          DataParallel first(net, ctx);
          try {
            DataParallel second(net, ctx);
          } catch (const Error& e) {
            refusal = e.what();
          }
        }
        std::string nested;
        {
          DataParallel whole(net, ctx);
          try {
            DataParallel part(*net.l1.get(), ctx);  // a child of the wrapped module
          } catch (const Error& e) {
            nested = e.what();
          }
        }
        {
          DataParallel part(*net.l2.get(), ctx);
          try {
            DataParallel whole(net, ctx);  // the parent of a wrapped module
          } catch (const Error& e) {
            nested += e.what();
          }
        }
        DataParallel again(net, ctx);  // the others are gone
        nn::mse_loss(again(nn::randn({2, 10})), nn::randn({2, 1})).backward();
        return refusal + "|" + nested;
      },
      2, "cpu", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE((*result)[r].find("is already wrapped by a live DataParallel on rank " +
                                std::to_string(r)),
              std::string::npos)
        << (*result)[r];
    EXPECT_NE((*result)[r].find("LinearImpl wrapped by a live DataParallel on rank " +
                                std::to_string(r) + " contain one another"),
              std::string::npos)
        << (*result)[r];
    EXPECT_NE((*result)[r].find("LinearNet wrapped by a live DataParallel on rank " +
                                std::to_string(r) + " contain one another"),
              std::string::npos)
        << (*result)[r];
  }
}

TEST_F(DataParallelTest, FindUnusedParametersTreatsThemAsZero) {
  auto result = spawn(
      [](Context& ctx) {
        WithUnused net;
        DataParallel dp(net, ctx, {.find_unused_parameters = true});
        nn::mse_loss(dp(nn::randn({2, 4})), nn::randn({2, 1})).backward();
        return net.spare->weight.grad().to_vector<float>();
      },
      2, "cpu", options_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ((*result)[0], std::vector<float>(4, 0.0f));
}

}  // namespace
}  // namespace tandem::dist
