// Inside a rank's function (each rank with its own Model), a load() on rank 0
// alone (`if (ctx.rank() == 0) model.load(path)`, as a PyTorch script
// loads) followed by evaluate, predict or fit on every rank: every rank
// enters the same collectives and takes rank 0's loaded weights, on 2 and 3
// ranks, and a save writes them. A load on another rank alone, whose
// weights rank 0's fresh ones would replace (before evaluate, predict, fit
// or save), and an optimizer state that rank 0 alone loaded (before fit),
// are errors on every rank naming them; so after an earlier call on every
// rank. A call on rank 0 alone is named: by the watchdog, or on every rank
// when the other rank makes another call.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/nn.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"
#include "tests/hapi/hapi_test_util.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;
using ::tandem::testing::Classification;
using test::Cpu;
using test::AdamFactory;
using test::Contains;

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/hapi_load_on_one_rank_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

bool SameBits(const nn::StateDict& a, const nn::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.to_vector<float>() != b[i].second.to_vector<float>())
      return false;
  }
  return true;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want,
                const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::abs(want[i]))) << where << " [" << i << "]";
}

// A fitted model saved to `path` (with its optimizer file when `training`),
// and what one rank's evaluate and predict give with its weights.
struct Saved {
  std::string path;
  nn::StateDict weights;
  double eval_loss = 0;
  std::vector<float> predicted;
};

Saved SaveFitted(const std::string& name, bool training,
                 const std::shared_ptr<const data::Dataset>& data) {
  Saved s;
  s.path = Dir(name) + "/model.safetensors";
  Model model([] { return std::make_shared<Net>(); }, Cpu(1));
  model.prepare(AdamFactory(), CrossEntropy());
  nn::manual_seed(3);
  EXPECT_TRUE(model.fit(Classification(32, 61), {.epochs = 2, .batch_size = 8}).ok());
  EXPECT_TRUE(model.save(s.path, {.training = training}).ok());
  Model loaded([] { return std::make_shared<Net>(); }, Cpu(1));
  loaded.prepare(AdamFactory(), CrossEntropy());
  EXPECT_TRUE(loaded.load(s.path).ok());
  s.weights = *loaded.state_dict();
  s.eval_loss = loaded.evaluate(data, {.batch_size = 5})->at("eval_loss");
  s.predicted = loaded.predict(data, {.batch_size = 5})->to_vector<float>();
  return s;
}

// What each rank saw.
struct RankResult {
  double eval_loss = std::nan("");
  std::vector<float> predicted;
  nn::StateDict kept;
};

// evaluate then predict (or predict then evaluate) after a load on rank 0
// alone: every rank's results are the loaded weights' and every rank keeps
// them. Before Build agreed on the broadcasts this failed: rank 0 skipped
// the broadcasts of rank 0's weights that the other ranks entered.
TEST(LoadOnOneRankTest, ALoadOnRankZeroAloneReachesEveryRankInEvaluateAndPredict) {
  auto data = Classification(23, 62);
  const Saved saved = SaveFitted("rank0", /*training=*/false, data);
  for (int ranks : {2, 3}) {
    for (bool evaluate_first : {true, false}) {
      SCOPED_TRACE(absl::StrCat(ranks, " ranks, ", evaluate_first ? "evaluate" : "predict",
                                " first"));
      std::vector<RankResult> results(static_cast<size_t>(ranks));
      absl::Status run = dist::spawn(
          [&](dist::Context& ctx) -> absl::Status {
            RankResult& mine = results[static_cast<size_t>(ctx.rank())];
            Model model([] { return std::make_shared<Net>(); });
            model.prepare(AdamFactory(), CrossEntropy());
            if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
            auto predict = [&]() -> absl::Status {
              ASSIGN_OR_RETURN(nn::Tensor p, model.predict(data, {.batch_size = 5}));
              mine.predicted = p.to_vector<float>();
              return absl::OkStatus();
            };
            if (!evaluate_first) RETURN_IF_ERROR(predict());
            ASSIGN_OR_RETURN(Logs logs, model.evaluate(data, {.batch_size = 5}));
            mine.eval_loss = logs.at("eval_loss");
            if (evaluate_first) RETURN_IF_ERROR(predict());
            ASSIGN_OR_RETURN(mine.kept, model.state_dict());
            return absl::OkStatus();
          },
          ranks, "cpu", testing::DefaultTestSpawnOptions());
      ASSERT_TRUE(run.ok()) << run;
      for (int r = 0; r < ranks; ++r) {
        const RankResult& got = results[static_cast<size_t>(r)];
        const std::string where = absl::StrCat("rank ", r);
        EXPECT_NEAR(got.eval_loss, saved.eval_loss, 1e-6 * saved.eval_loss) << where;
        EXPECT_EQ(got.eval_loss, results[0].eval_loss) << where;
        EXPECT_EQ(got.predicted, results[0].predicted) << where;
        ExpectNear(got.predicted, saved.predicted, where);
        EXPECT_TRUE(SameBits(got.kept, saved.weights)) << where << " kept other weights";
      }
    }
  }
}

// save after a load on rank 0 alone writes the loaded weights, and every
// rank keeps them (the ranks that had none take rank 0's).
TEST(LoadOnOneRankTest, ASaveAfterALoadOnRankZeroAloneWritesAndKeepsTheLoadedWeights) {
  auto data = Classification(23, 65);
  const Saved saved = SaveFitted("save", /*training=*/false, data);
  const std::string copy = Dir("save_copy") + "/copy.safetensors";
  std::vector<nn::StateDict> kept(3);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
        RETURN_IF_ERROR(model.save(copy));
        ASSIGN_OR_RETURN(kept[static_cast<size_t>(ctx.rank())], model.state_dict());
        return absl::OkStatus();
      },
      3, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  Model written([] { return std::make_shared<Net>(); }, Cpu(1));
  ASSERT_TRUE(written.load(copy).ok());
  EXPECT_TRUE(SameBits(*written.state_dict(), saved.weights));
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(SameBits(kept[static_cast<size_t>(r)], saved.weights)) << "rank " << r;
}

// fit after a load (weights only) on rank 0 alone: DataParallel's broadcast
// gives every rank rank 0's loaded weights; the fit ends with the same
// weights on every rank, those of the same fit from main after a load.
TEST(LoadOnOneRankTest, AFitAfterAWeightsOnlyLoadOnRankZeroStartsFromThem) {
  auto data = Classification(23, 63);
  const Saved saved = SaveFitted("fit", /*training=*/false, data);
  const FitOptions options{.epochs = 1, .batch_size = 4, .shuffle = false};
  Model from_main([] { return std::make_shared<Net>(); }, Cpu(3));
  from_main.prepare(AdamFactory(), CrossEntropy());
  ASSERT_TRUE(from_main.load(saved.path).ok());
  ASSERT_TRUE(from_main.fit(data, options).ok());
  const nn::StateDict want = *from_main.state_dict();
  std::vector<nn::StateDict> kept(3);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
        RETURN_IF_ERROR(model.fit(data, options).status());
        ASSIGN_OR_RETURN(kept[static_cast<size_t>(ctx.rank())], model.state_dict());
        return absl::OkStatus();
      },
      3, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(SameBits(kept[static_cast<size_t>(r)], want)) << "rank " << r;
  }
  EXPECT_FALSE(SameBits(want, saved.weights)) << "the fit did not train";
}

// A load on rank 1 alone: rank 0's Model has no weights, so taking rank 0's
// would drop rank 1's; an optimizer state loaded on rank 0 alone would step
// rank 0's optimizer apart from the others'. Both fail on every rank, naming
// the ranks, before any other collective.
TEST(LoadOnOneRankTest, ALoadOnAnotherRankAloneOrOfAnOptimizerStateIsAnError) {
  auto data = Classification(23, 64);
  const Saved saved = SaveFitted("errors", /*training=*/true, data);
  const std::string copy = Dir("errors_save") + "/copy.safetensors";
  for (const std::string call : {"evaluate", "predict", "fit", "save"}) {
    SCOPED_TRACE(call);
    absl::Status run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model([] { return std::make_shared<Net>(); });
          model.prepare(AdamFactory(), CrossEntropy());
          if (ctx.rank() == 1) RETURN_IF_ERROR(model.load(saved.path));
          if (call == "evaluate") return model.evaluate(data).status();
          if (call == "predict") return model.predict(data).status();
          if (call == "save") return model.save(copy);
          return model.fit(data).status();
        },
        3, "cpu", testing::DefaultTestSpawnOptions());
    EXPECT_TRUE(Contains(run, call == "save"
                                  ? "hapi::Model::save: 1 rank(s) other than rank 0 hold weights "
                                    "of their own"
                                  : absl::StrCat("hapi::Model::", call,
                                                 ": rank 1 holds weights of its own")))
        << run;
  }
  EXPECT_FALSE(std::filesystem::exists(copy)) << "save wrote rank 0's fresh weights";
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
        return model.fit(data).status();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(Contains(run, "hapi::Model::fit: rank 0 holds an optimizer state (from load() or "
                            "an earlier fit) that rank 1 lacks"))
      << run;
  // With reset_optimizer the same fit runs.
  run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path, {.reset_optimizer = true}));
        return model.fit(data).status();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(run.ok()) << run;
}

// After an earlier call on every rank (each rank's Model then holds weights
// of its own), a load on rank 0 alone still reaches every rank at the next
// evaluate, predict and save; a load on rank 1 alone is still an error, and so
// is a fit after rank 0 alone loaded an optimizer state over the others' own.
TEST(LoadOnOneRankTest, ALoadOnOneRankAfterAnEarlierCallIsAgreedToo) {
  auto data = Classification(23, 66);
  const Saved saved = SaveFitted("after", /*training=*/true, data);
  const std::string copy = Dir("after_save") + "/copy.safetensors";
  std::vector<RankResult> results(3);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        RankResult& mine = results[static_cast<size_t>(ctx.rank())];
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.evaluate(data, {.batch_size = 5}).status());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
        ASSIGN_OR_RETURN(Logs logs, model.evaluate(data, {.batch_size = 5}));
        mine.eval_loss = logs.at("eval_loss");
        ASSIGN_OR_RETURN(nn::Tensor p, model.predict(data, {.batch_size = 5}));
        mine.predicted = p.to_vector<float>();
        ASSIGN_OR_RETURN(mine.kept, model.state_dict());
        return absl::OkStatus();
      },
      3, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < 3; ++r) {
    const RankResult& got = results[static_cast<size_t>(r)];
    const std::string where = absl::StrCat("rank ", r);
    EXPECT_NEAR(got.eval_loss, saved.eval_loss, 1e-6 * saved.eval_loss) << where;
    ExpectNear(got.predicted, saved.predicted, where);
    EXPECT_TRUE(SameBits(got.kept, saved.weights)) << where << " kept other weights";
  }
  // save straight after the load: every rank keeps the loaded weights.
  std::vector<nn::StateDict> kept(3);
  run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.evaluate(data, {.batch_size = 5}).status());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
        RETURN_IF_ERROR(model.save(copy));
        ASSIGN_OR_RETURN(kept[static_cast<size_t>(ctx.rank())], model.state_dict());
        return absl::OkStatus();
      },
      3, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(SameBits(kept[static_cast<size_t>(r)], saved.weights)) << "save, rank " << r;
  for (const std::string call : {"evaluate", "predict", "fit", "save"}) {
    SCOPED_TRACE(call);
    run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model([] { return std::make_shared<Net>(); });
          model.prepare(AdamFactory(), CrossEntropy());
          RETURN_IF_ERROR(model.evaluate(data, {.batch_size = 5}).status());
          if (ctx.rank() == 1) RETURN_IF_ERROR(model.load(saved.path));
          if (call == "evaluate") return model.evaluate(data).status();
          if (call == "predict") return model.predict(data).status();
          if (call == "save") return model.save(copy);
          return model.fit(data).status();
        },
        3, "cpu", testing::DefaultTestSpawnOptions());
    EXPECT_TRUE(Contains(run, call == "save"
                                  ? "hapi::Model::save: 1 rank(s) other than rank 0 loaded "
                                    "weights (a load() there alone) that rank 0 did not load"
                                  : absl::StrCat("hapi::Model::", call,
                                                 ": rank 1 loaded weights (a load() there alone) "
                                                 "that rank 0 did not load")))
        << run;
  }
  run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.fit(data).status());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(saved.path));
        return model.fit(data).status();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(Contains(run, "hapi::Model::fit: rank 0 loaded an optimizer state (a load() there "
                            "alone) while rank 1 keeps its own"))
      << run;
  // After a fit on every rank, a weights-only load on rank 0 alone leaves rank
  // 0 without an optimizer state that rank 1 keeps: refused, and the message
  // says what helps (a load on every rank), since reset_optimizer on rank 0
  // alone would not.
  const Saved weights_only = SaveFitted("after_weights_only", /*training=*/false, data);
  run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.fit(data).status());
        if (ctx.rank() == 0) RETURN_IF_ERROR(model.load(weights_only.path));
        return model.fit(data).status();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(Contains(run, "hapi::Model::fit: rank 1 holds an optimizer state (from load() or "
                            "an earlier fit) that rank 0 lacks, so their optimizers would step "
                            "apart; call load() on every rank (each then holds the file's "
                            "optimizer state, or none with reset_optimizer)"))
      << run;
  // And a load on every rank (weights only, no optimizer state on any rank) runs.
  run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(AdamFactory(), CrossEntropy());
        RETURN_IF_ERROR(model.fit(data).status());
        RETURN_IF_ERROR(model.load(weights_only.path));
        return model.fit(data).status();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  EXPECT_TRUE(run.ok()) << run;
}

// evaluate, predict or fit called on rank 0 alone: while the other rank
// returns, the watchdog names the call (Build's agreement is labelled); while
// it makes another of these calls, every rank fails naming both calls.
TEST(LoadOnOneRankTest, ACallOnRankZeroAloneIsNamed) {
  auto data = Classification(23, 67);
  for (const std::string call : {"evaluate", "predict", "fit"}) {
    for (bool other_returns : {true, false}) {
      SCOPED_TRACE(absl::StrCat(call, other_returns ? ", rank 1 returns" : ", rank 1 evaluates"));
      if (call == "evaluate" && !other_returns) continue;
      const auto start = std::chrono::steady_clock::now();
      absl::Status run = dist::spawn(
          [&](dist::Context& ctx) -> absl::Status {
            Model model([] { return std::make_shared<Net>(); });
            model.prepare(AdamFactory(), CrossEntropy());
            if (ctx.rank() == 1) {
              if (other_returns) return absl::OkStatus();
              return model.evaluate(data).status();
            }
            if (call == "evaluate") return model.evaluate(data).status();
            if (call == "predict") return model.predict(data).status();
            return model.fit(data).status();
          },
          2, "cpu", testing::DefaultTestSpawnOptions());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ASSERT_FALSE(run.ok());
      EXPECT_TRUE(Contains(run, other_returns
                                    ? absl::StrCat("from hapi::Model::", call,
                                                   " (inside a rank's function a collective: "
                                                   "call it on every rank")
                                    : absl::StrCat("some rank called hapi::Model::", call,
                                                   " while another called "
                                                   "hapi::Model::evaluate")))
          << run;
      EXPECT_LT(seconds, 10.0) << run;  // the watchdog's timeout_s is 60
    }
  }
}

}  // namespace
}  // namespace tandem::hapi
