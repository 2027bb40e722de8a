// dist::ZeroRedundancyOptimizer on CPU ranks: every optimizer ends where the
// unsharded one ends (1 to 4 ranks, with a schedule, with global-norm
// clipping), the state is 1/N per rank, state_dict() is the unsharded dict and
// a checkpoint of 2 ranks resumes on 3; bad input is an error on every rank.
#include "spawn/train/zero_redundancy_optimizer.h"

#include <memory>
#include <sstream>
#include <string>
#include <tuple>

#include "gtest/gtest.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/lr_scheduler.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "tests/spawn/train/dp_models.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

std::unique_ptr<optim::Optimizer> MakeOptimizer(const std::string& name, std::vector<Tensor> p) {
  if (name == "sgd") return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{.lr = 0.1});
  if (name == "nesterov") {
    return std::make_unique<optim::SGD>(
        std::move(p), optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3,
                                        .nesterov = true});
  }
  if (name == "adam") return std::make_unique<optim::Adam>(std::move(p), optim::AdamOptions{.lr = 1e-2});
  if (name == "adamw") {
    return std::make_unique<optim::AdamW>(std::move(p), optim::AdamWOptions{.lr = 1e-2});
  }
  return std::make_unique<optim::Adagrad>(std::move(p), optim::AdagradOptions{.lr = 0.1});
}

struct RunSetup {
  std::string optimizer = "adam";
  bool zero = true;
  double clip = 0;     // > 0: clip the global gradient norm to this
  bool schedule = false;
  int64_t global_batch = 12;
};

double MaxRelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return err / scale;
}

// Steps [first, first + steps) of ConvNet on batches of setup.global_batch rows
// split over the ranks; sharded or not. `before` runs after construction (to
// load a checkpoint). Returns the parameters and the optimizer's state dict.
struct Outcome {
  std::vector<float> params;
  optim::StateDict state;
  int64_t state_bytes = 0;
};

Outcome Train(Context& ctx, const RunSetup& setup, int first, int steps,
              const std::function<void(ConvNet&, ZeroRedundancyOptimizer*, optim::Optimizer*)>&
                  before = nullptr) {
  ConvNet net;
  DataParallel dp(net, ctx, {.bucket_bytes = 400, .first_bucket_bytes = 100});
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> plain;
  if (setup.zero) {
    zero = std::make_unique<ZeroRedundancyOptimizer>(
        dp, [&](std::vector<Tensor> p) { return MakeOptimizer(setup.optimizer, std::move(p)); });
  } else {
    plain = MakeOptimizer(setup.optimizer, net.parameters());
  }
  optim::Optimizer& inner = zero ? zero->optimizer() : *plain;
  if (before) before(net, zero.get(), plain.get());
  std::unique_ptr<optim::CosineAnnealingLR> schedule;
  if (setup.schedule) schedule = std::make_unique<optim::CosineAnnealingLR>(inner, 8);
  const int64_t per_rank = setup.global_batch / ctx.world_size();
  for (int step = first; step < first + steps; ++step) {
    nn::manual_seed(3000 + step);
    Tensor x = nn::randn({setup.global_batch, 1, 6, 6}), y = nn::randn({setup.global_batch, 2});
    const int64_t lo = ctx.rank() * per_rank;
    if (zero) zero->zero_grad(); else plain->zero_grad();
    nn::mse_loss(dp(x.slice(lo, lo + per_rank)), y.slice(lo, lo + per_rank)).backward();
    if (setup.clip > 0) {
      if (zero) zero->clip_grad_norm_(setup.clip); else optim::clip_grad_norm_(net.parameters(), setup.clip);
    }
    if (zero) zero->step(); else plain->step();
    if (schedule) schedule->step();
  }
  Outcome out{.params = testing::FlatParams(net)};
  out.state = zero ? zero->state_dict() : plain->state_dict();
  out.state_bytes = zero ? zero->state_bytes() : 0;
  return out;
}

class ZeroTest : public ::testing::TestWithParam<std::tuple<int, std::string>> {
 protected:
  std::ostringstream console_;
  SpawnOptions options_{.seed = 7, .console = &console_};
};

// The same parameters as the unsharded optimizer; recorded: bit for bit.
TEST_P(ZeroTest, MatchesTheUnshardedOptimizer) {
  const auto [ranks, name] = GetParam();
  for (const bool schedule : {false, true}) {
    RunSetup sharded{.optimizer = name, .schedule = schedule};
    RunSetup plain = sharded;
    plain.zero = false;
    auto a = spawn([&](Context& ctx) { return Train(ctx, sharded, 0, 4); }, ranks, "cpu", options_);
    auto b = spawn([&](Context& ctx) { return Train(ctx, plain, 0, 4); }, ranks, "cpu", options_);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    for (int r = 0; r < ranks; ++r) {
      testing::ExpectSameBits((*a)[r].params, (*b)[0].params, "sharded vs unsharded parameters");
    }
    // The gathered state is the unsharded optimizer's dict, entry for entry.
    const optim::StateDict& got = (*a)[0].state;
    const optim::StateDict& want = (*b)[0].state;
    EXPECT_EQ(got.scalars, want.scalars);
    ASSERT_EQ(got.tensors.size(), want.tensors.size());
    for (const auto& [key, tensor] : want.tensors) {
      bool found = false;
      for (const auto& [k, t] : got.tensors) {
        if (k != key) continue;
        found = true;
        testing::ExpectSameBits(t.to_vector<float>(), tensor.to_vector<float>(), key.c_str());
      }
      EXPECT_TRUE(found) << key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksOptimizers, ZeroTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values("sgd", "nesterov", "adam", "adamw",
                                                              "adagrad")));

std::ostringstream g_console;
SpawnOptions Options() { return {.seed = 7, .console = &g_console}; }

TEST(ZeroClipTest, GlobalNormAcrossShardsMatchesUnshardedClipping) {
  for (const int ranks : {2, 3}) {
    RunSetup sharded{.optimizer = "nesterov", .clip = 0.05};
    RunSetup plain = sharded;
    plain.zero = false;
    auto a = spawn([&](Context& ctx) { return Train(ctx, sharded, 0, 4); }, ranks, "cpu", Options());
    auto b = spawn([&](Context& ctx) { return Train(ctx, plain, 0, 4); }, ranks, "cpu", Options());
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    const double error = MaxRelativeError((*a)[0].params, (*b)[0].params);
    EXPECT_LE(error, 1e-6) << ranks << " ranks";
    std::ostringstream text;
    text << error;
    RecordProperty(("max_relative_error_" + std::to_string(ranks) + "_ranks").c_str(), text.str());
    // Clipping changed the run: without it the parameters differ.
    RunSetup unclipped = plain;
    unclipped.clip = 0;
    auto c = spawn([&](Context& ctx) { return Train(ctx, unclipped, 0, 4); }, ranks, "cpu", Options());
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_GT(MaxRelativeError((*c)[0].params, (*b)[0].params), 1e-3);
  }
}

// Adam's two moments per element: the ranks' state adds up to the unsharded
// state plus the padding, and no rank holds more than its share.
TEST(ZeroStateTest, EachRankHoldsItsShareOfTheState) {
  for (const int ranks : {2, 4}) {
    RunSetup sharded{.optimizer = "adam"};
    auto a = spawn([&](Context& ctx) { return Train(ctx, sharded, 0, 1); }, ranks, "cpu", Options());
    ASSERT_TRUE(a.ok()) << a.status();
    ConvNet net;
    int64_t numel = 0;
    for (const Tensor& p : net.parameters()) numel += p.numel();
    int64_t total = 0;
    for (const Outcome& o : *a) {
      total += o.state_bytes;
      // Each bucket pads fewer than `ranks` elements.
      EXPECT_LE(o.state_bytes, 2 * 4 * (numel / ranks + 8 * ranks)) << ranks;
    }
    EXPECT_GE(total, 2 * 4 * numel);
    EXPECT_LT(total, 2 * 4 * (numel + 8 * ranks));
  }
}

// A checkpoint of 2 sharded ranks, gathered, resumes on 3 sharded ranks (and
// the same dict on 3 unsharded ones): both end where 3 unsharded ranks that
// ran every step end.
TEST(ZeroCheckpointTest, StateOfTwoRanksResumesOnThree) {
  RunSetup sharded{.optimizer = "adam"};
  RunSetup plain = sharded;
  plain.zero = false;
  auto first = spawn([&](Context& ctx) { return Train(ctx, sharded, 0, 2); }, 2, "cpu", Options());
  ASSERT_TRUE(first.ok()) << first.status();
  const Outcome& saved = (*first)[0];
  auto load = [&](ConvNet& net, ZeroRedundancyOptimizer* zero, optim::Optimizer* unsharded) {
    nn::NoGradGuard no_grad;
    size_t k = 0;
    for (Tensor p : net.parameters()) {
      std::vector<float> v(saved.params.begin() + k, saved.params.begin() + k + p.numel());
      p.copy_(nn::from_vector<float>(v, p.shape()));
      k += p.numel();
    }
    if (zero != nullptr) {
      std::unique_ptr<optim::Optimizer> holder = zero->MakeUnsharded();
      ThrowIfError(holder->load_state_dict(saved.state), "");
      ThrowIfError(zero->LoadFrom(*holder), "");
    } else {
      ThrowIfError(unsharded->load_state_dict(saved.state), "");
    }
  };
  auto resumed = spawn([&](Context& ctx) { return Train(ctx, sharded, 2, 2, load); }, 3, "cpu",
                       Options());
  auto resumed_plain = spawn([&](Context& ctx) { return Train(ctx, plain, 2, 2, load); }, 3, "cpu",
                             Options());
  auto whole = spawn([&](Context& ctx) { return Train(ctx, plain, 0, 4); }, 3, "cpu", Options());
  ASSERT_TRUE(resumed.ok() && resumed_plain.ok() && whole.ok())
      << resumed.status() << resumed_plain.status() << whole.status();
  testing::ExpectSameBits((*resumed)[0].params, (*resumed_plain)[0].params, "resumed sharded");
  const double error = MaxRelativeError((*resumed)[0].params, (*whole)[0].params);
  EXPECT_LE(error, 1e-6);
  std::ostringstream text;
  text << error;
  RecordProperty("max_relative_error", text.str());
}

std::string ErrorOfRun(const std::function<void(Context&)>& fn) {
  absl::Status s = spawn(fn, 2, "cpu", Options());
  return s.ok() ? "" : std::string(s.message());
}

TEST(ZeroErrorTest, BucketsThatDifferBetweenRanksAreAnErrorNamingThem) {
  const std::string e = ErrorOfRun([](Context& ctx) {
    ConvNet net;
    DataParallel dp(net, ctx, {.bucket_bytes = ctx.rank() == 0 ? 400 : 100000,
                               .first_bucket_bytes = 100});
    ZeroRedundancyOptimizer zero(dp, [](std::vector<Tensor> p) { return MakeOptimizer("sgd", p); });
  });
  EXPECT_NE(e.find("ZeroRedundancyOptimizer: rank 0 has"), std::string::npos) << e;
  EXPECT_NE(e.find("gradient buckets, rank 1 has"), std::string::npos) << e;
}

TEST(ZeroErrorTest, FactoryWithoutOptimizerOrOverOtherTensors) {
  std::string e = ErrorOfRun([](Context& ctx) {
    ConvNet net;
    DataParallel dp(net, ctx);
    ZeroRedundancyOptimizer zero(dp, [](std::vector<Tensor>) { return nullptr; });
  });
  EXPECT_NE(e.find("the factory returned no optimizer"), std::string::npos) << e;
  e = ErrorOfRun([](Context& ctx) {
    ConvNet net;
    DataParallel dp(net, ctx);
    ZeroRedundancyOptimizer zero(dp, [&](std::vector<Tensor>) {
      return MakeOptimizer("sgd", net.parameters());
    });
  });
  EXPECT_NE(e.find("holding exactly the"), std::string::npos) << e;
}

// A hook of the user's own reduces whole buckets: refused. (The built-in ones
// compose: compose_test.cc.)
TEST(ZeroErrorTest, DataParallelWithAHookOfItsOwn) {
  const std::string e = ErrorOfRun([](Context& ctx) {
    ConvNet net;
    const CommHook mine = [](GradBucket& bucket) {
      return BucketReduction{.work = bucket.comm->all_reduce_async(bucket.buffer, ReduceOp::kSum)};
    };
    DataParallel dp(net, ctx, {.comm_hook = mine});
    ZeroRedundancyOptimizer zero(dp, [](std::vector<Tensor> p) { return MakeOptimizer("sgd", p); });
  });
  EXPECT_NE(e.find("ZeroRedundancyOptimizer: the DataParallel's comm hook is neither "
                   "AllReduceHook, Bf16CompressHook nor Fp16CompressHook"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace tandem::dist
