// hapi::Model's callbacks and options as a user combines them: EarlyStopping
// and ModelCheckpoint monitoring an evaluation value that only every
// eval_freq-th epoch has, a fit whose epochs would hold no step, evaluate
// before prepare, random augmentations across fit's epochs, a resume inside
// an epoch with another global batch or grad_accum_steps, ReduceLROnPlateau,
// clip_grad_norm, the progress lines after a resume on another world,
// ModelCheckpoint's files in place when every rank's fit returns, and a bad
// mode naming its callback.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "data/dataset.h"
#include "data/transforms.h"
#include "hapi/model.h"
#include "nn/error.h"
#include "nn/nn.h"
#include "optim/sgd.h"
#include "spawn/observe/summary_writer.h"
#include "spawn/spawn.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;

using ::tandem::testing::Classification;

std::unique_ptr<Model> Prepared(int ranks, double lr) {
  auto model = std::make_unique<Model>(
      [] { return std::make_shared<Net>(); },
      LaunchOptions{.gpus = "cpu", .nprocs = ranks, .spawn = testing::DefaultTestSpawnOptions()});
  model->prepare(
      [lr](std::vector<nn::Tensor> params) {
        return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = lr});
      },
      CrossEntropy(), {MakeMetric<Accuracy>()});
  return model;
}

bool Contains(const absl::Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

// Rank 0 takes its time in on_train_end (before ModelCheckpoint writes).
struct SlowTrainEndOnRankZero : Callback {
  std::string name() const override { return "SlowTrainEndOnRankZero"; }
  void on_train_end(RunState& s, const Logs&) override {
    if (s.ctx->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
};

// Inside a rank's function (each rank with its own Model) ModelCheckpoint's
// files are written once, by rank 0, and every rank's fit returns with them in
// place, final.safetensors included, though rank 0 writes it last of all.
TEST(CallbacksTest, ModelCheckpointsFilesAreThereWhenEveryRanksFitReturns) {
  auto train = Classification(16, 73);
  const std::string dir = ::testing::TempDir() + "/hapi_checkpoint_inside_ranks";
  std::filesystem::remove_all(dir);
  std::atomic<int> missing{0};
  absl::Status run = dist::spawn(
      [&](dist::Context&) -> absl::Status {
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(
            [](std::vector<nn::Tensor> params) {
              return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.1});
            },
            CrossEntropy());
        absl::StatusOr<History> h = model.fit(
            train, {.epochs = 2, .batch_size = 4,
                    .callbacks = {MakeCallback<SlowTrainEndOnRankZero>(),
                                  MakeCallback<ModelCheckpoint>(dir, 1)}});
        if (!h.ok()) return h.status();
        for (const char* file : {"epoch_1", "epoch_2", "final"}) {
          if (!std::filesystem::exists(absl::StrCat(dir, "/", file, ".safetensors"))) ++missing;
        }
        return absl::OkStatus();
      },
      2, "cpu", testing::DefaultTestSpawnOptions());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_EQ(missing.load(), 0);
}

// ModelCheckpoint on rank 0 alone (rank 0 writes its files, so a script may
// give it to rank 0 only): its barrier at train end fails the run within
// seconds naming ModelCheckpoint, whether rank 1 returns or goes on to a
// collective.
TEST(CallbacksTest, ModelCheckpointOnOneRankAloneFailsNamingIt) {
  auto train = Classification(16, 74);
  const std::string dir = ::testing::TempDir() + "/hapi_checkpoint_one_rank";
  for (bool rank_one_returns : {true, false}) {
    SCOPED_TRACE(rank_one_returns ? "rank 1 returns" : "rank 1 goes on to a barrier");
    std::filesystem::remove_all(dir);
    const auto start = std::chrono::steady_clock::now();
    absl::Status run = dist::spawn(
        [&](dist::Context& ctx) -> absl::Status {
          Model model([] { return std::make_shared<Net>(); });
          model.prepare(
              [](std::vector<nn::Tensor> params) {
                return std::make_unique<optim::SGD>(std::move(params),
                                                    optim::SGDOptions{.lr = 0.1});
              },
              CrossEntropy());
          FitOptions options{.epochs = 1, .batch_size = 4};
          if (ctx.rank() == 0) options.callbacks = {MakeCallback<ModelCheckpoint>(dir, 1)};
          absl::StatusOr<History> h = model.fit(train, options);
          if (!h.ok()) return h.status();
          if (ctx.rank() == 1 && !rank_one_returns) {
            nn::Tensor x = nn::zeros({3});
            ctx.communicator().all_reduce(x);
          }
          return absl::OkStatus();
        },
        2, "cpu", testing::DefaultTestSpawnOptions());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(run.ok());
    EXPECT_TRUE(Contains(run, "from hapi::ModelCheckpoint::on_train_end (a barrier: every "
                              "rank's fit has the callback)"))
        << run;
    EXPECT_LT(seconds, 10.0) << run;  // the watchdog's timeout_s is 60
  }
}

// With eval_freq 2 only epochs 2, 4, ... carry "eval_*" values: the callbacks
// act on those epochs and wait through the others (as Paddle's act on each
// evaluation). lr 0: eval_loss never improves, so EarlyStopping with patience
// 2 stops at the second evaluation after the first (epoch 6 of 10).
TEST(CallbacksTest, EvalMonitorsActOnTheEpochsThatEvaluate) {
  auto train = Classification(16, 71), test = Classification(9, 72);
  const std::string dir = ::testing::TempDir() + "/hapi_eval_freq_mc";
  std::filesystem::remove_all(dir);
  auto model = Prepared(2, 0.0);
  auto h = model->fit(train, {.epochs = 10, .batch_size = 4, .eval_data = test, .eval_freq = 2,
                              .callbacks = {MakeCallback<EarlyStopping>("eval_loss", 2),
                                            MakeCallback<ModelCheckpoint>(dir, 0, "eval_acc")}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->epochs.size(), 6u);
  for (size_t e = 0; e < h->epochs.size(); ++e)
    EXPECT_EQ(h->epochs[e].count("eval_loss"), e % 2 == 1 ? 1u : 0u) << e;
  EXPECT_TRUE(std::filesystem::exists(dir + "/best.safetensors"));

  // A monitor that an evaluating epoch lacks (a misspelt name) is still an
  // error, at the first evaluation.
  auto typo = Prepared(2, 0.1)->fit(
      train, {.epochs = 4, .batch_size = 4, .eval_data = test, .eval_freq = 2,
              .callbacks = {MakeCallback<EarlyStopping>("eval_accuracy", 1)}});
  ASSERT_FALSE(typo.ok());
  EXPECT_TRUE(Contains(typo.status(), "monitor 'eval_accuracy' is not among this epoch's logs "
                                      "(eval_acc, eval_loss, loss)"))
      << typo.status();
  // And an evaluation value without eval data, at the first epoch.
  auto no_eval = Prepared(2, 0.1)->fit(
      train, {.epochs = 4, .batch_size = 4,
              .callbacks = {MakeCallback<ModelCheckpoint>(dir, 0, "eval_acc")}});
  ASSERT_FALSE(no_eval.ok());
  EXPECT_TRUE(Contains(no_eval.status(), "ModelCheckpoint: monitor 'eval_acc' is not among this "
                                         "epoch's logs (loss); evaluation values need eval data"))
      << no_eval.status();
}

// drop_last with fewer examples than one global batch leaves no step in an
// epoch: refused on every rank naming the sizes, not a fit that trains nothing.
TEST(CallbacksTest, AFitWithoutAStepPerEpochIsRefusedNamingTheSizes) {
  auto train = Classification(12, 73);
  auto h = Prepared(2, 0.1)->fit(train, {.epochs = 2, .batch_size = 8, .drop_last = true});
  ASSERT_FALSE(h.ok());
  EXPECT_TRUE(Contains(h.status(), "fit: no step per epoch: drop_last with 12 examples and a "
                                   "global batch of 16 rows over 2 ranks"))
      << h.status();
  // Enough examples for one global batch: one step an epoch.
  auto one = Prepared(2, 0.1)->fit(Classification(16, 74),
                                   {.epochs = 2, .batch_size = 8, .drop_last = true});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->steps, 2);
}

// evaluate() needs the loss and metrics of prepare(); unprepared it returned
// empty logs.
TEST(CallbacksTest, EvaluateBeforePrepareIsAFailedPrecondition) {
  Model model([] { return std::make_shared<Net>(); },
              LaunchOptions{.gpus = "cpu", .nprocs = 1, .spawn = testing::DefaultTestSpawnOptions()});
  auto logs = model.evaluate(Classification(8, 75));
  EXPECT_EQ(logs.status().code(), absl::StatusCode::kFailedPrecondition) << logs.status();
  EXPECT_TRUE(Contains(logs.status(), "hapi::Model::evaluate: call prepare(optimizer, loss, "
                                      "metrics) first"))
      << logs.status();
  // predict needs no loss.
  auto out = model.predict(Classification(8, 75));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->size(0), 8);
}

// Records the epoch each example's draw is for (the generator's offset), as a
// random augmentation would use it.
class RecordEpochs : public data::Transform {
 public:
  explicit RecordEpochs(std::shared_ptr<std::set<uint64_t>> epochs) : epochs_(std::move(epochs)) {}
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override {
    std::lock_guard<std::mutex> lock(mu_);
    epochs_->insert(generator.offset >> 32);
    return x;
  }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<std::set<uint64_t>> epochs_;
};

// fit's loader passes each epoch to the dataset: a TransformDataset's random
// augmentations differ from epoch to epoch (fit cannot call its set_epoch: the
// dataset is const and shared by the ranks).
TEST(CallbacksTest, FitDrawsNewAugmentationsEachEpoch) {
  auto epochs = std::make_shared<std::set<uint64_t>>();
  auto train = std::make_shared<data::TransformDataset>(
      Classification(16, 76), std::make_shared<RecordEpochs>(epochs), 1);
  auto h = Prepared(2, 0.1)->fit(train, {.epochs = 3, .batch_size = 4, .num_workers = 1});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*epochs, (std::set<uint64_t>{0, 1, 2}));
}

struct EndFitAt : Callback {
  explicit EndFitAt(int64_t step) : step(step) {}
  std::string name() const override { return "EndFitAt"; }
  void on_train_batch_end(RunState& s) override { s.end_fit = s.step == step; }
  int64_t step;
};

// Records each draw's (example, epoch): the generator's stream and offset.
class RecordDraws : public data::Transform {
 public:
  using Draws = std::multiset<std::pair<uint64_t, uint64_t>>;
  explicit RecordDraws(std::shared_ptr<Draws> draws) : draws_(std::move(draws)) {}
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override {
    std::lock_guard<std::mutex> lock(mu_);
    draws_->insert({generator.stream, generator.offset >> 32});
    return x;
  }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<Draws> draws_;
};

// A fit resumed inside an epoch reads the rest of that epoch with that
// epoch's draws and the next epochs with theirs: the stopped and the resumed
// fit together draw exactly what the uninterrupted one does (shuffled, on two
// ranks; no workers, which would read ahead of the stop).
TEST(CallbacksTest, AResumedFitDrawsTheAugmentationsOfEachEpoch) {
  const std::string dir = ::testing::TempDir() + "/hapi_resume_draws";
  std::filesystem::remove_all(dir);
  auto fit = [&](std::shared_ptr<RecordDraws::Draws> draws, FitOptions options) {
    auto train = std::make_shared<data::TransformDataset>(
        Classification(24, 83), std::make_shared<RecordDraws>(draws), 2);
    return Prepared(2, 0.1)->fit(train, options);
  };
  FitOptions options{.epochs = 3, .batch_size = 4, .seed = 5};
  auto straight = std::make_shared<RecordDraws::Draws>();
  ASSERT_TRUE(fit(straight, options).ok());
  ASSERT_EQ(straight->size(), 72u);
  options.checkpoint = {.dir = dir, .every_steps = 2};
  FitOptions first = options;
  first.callbacks = {MakeCallback<EndFitAt>(int64_t{4})};  // epoch 2, after its first step
  auto interrupted = std::make_shared<RecordDraws::Draws>();
  ASSERT_TRUE(fit(interrupted, first).ok());
  options.resume = true;
  auto resumed = std::make_shared<RecordDraws::Draws>();
  ASSERT_TRUE(fit(resumed, options).ok());
  // The checkpoint of step 4 (the last) was taken: nothing is read twice.
  RecordDraws::Draws both = *interrupted;
  both.insert(resumed->begin(), resumed->end());
  EXPECT_EQ(both, *straight);
  EXPECT_EQ(resumed->count({0, 0}), 0u);
}

// A fit resumed at step 4 (its checkpoint) with a TensorBoard callback: the
// resumed fit's event file holds a SessionLog START at step 4, the first
// file none, so that TensorBoard drops the first file's steps from 4 on.
TEST(CallbacksTest, AResumedFitsTensorBoardFileStartsASessionAtTheResumedStep) {
  const std::string dir = ::testing::TempDir() + "/hapi_resume_tensorboard";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 3, .batch_size = 4, .seed = 5};
  options.checkpoint = {.dir = dir + "/ck", .every_steps = 2};
  FitOptions first = options;
  first.callbacks = {MakeCallback<EndFitAt>(int64_t{4}), MakeCallback<TensorBoard>(dir + "/tb")};
  ASSERT_TRUE(Prepared(2, 0.1)->fit(Classification(24, 84), first).ok());
  options.resume = true;
  options.callbacks = {MakeCallback<TensorBoard>(dir + "/tb")};
  ASSERT_TRUE(Prepared(2, 0.1)->fit(Classification(24, 84), options).ok());
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/tb")) {
    files.push_back(e.path().string());
  }
  ASSERT_EQ(files.size(), 2u);
  // The event without its wall time (field 1: a tag byte and 8 bytes).
  const std::string start_at_4 = dist::internal::SessionStartEvent(4, 0).substr(9);
  const std::string start_at_0 = dist::internal::SessionStartEvent(0, 0).substr(9);
  int with_start = 0;
  for (const std::string& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (bytes.find(start_at_4) != std::string::npos) ++with_start;
    EXPECT_EQ(bytes.find(start_at_0), std::string::npos) << f;
  }
  EXPECT_EQ(with_start, 1);
  std::filesystem::remove_all(dir);
}

// A checkpoint inside an epoch counts the loader's position in global
// batches: resumed on a world with another global batch it would train the
// wrong samples (2 ranks of 4 rows stopped after samples 0-15; 1 rank of 4
// rows went on from sample 8). Refused naming both global batches; the same
// global batch on another world size (1 rank of 8 rows), and a checkpoint
// at an epoch's end, resume.
TEST(CallbacksTest, AMidEpochResumeWithAnotherGlobalBatchIsRefused) {
  auto train = Classification(24, 77);
  const std::string dir = ::testing::TempDir() + "/hapi_resume_world";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 2, .batch_size = 4, .checkpoint = {.dir = dir, .every_steps = 2}};
  FitOptions first = options;
  first.callbacks = {MakeCallback<EndFitAt>(int64_t{2})};
  ASSERT_TRUE(Prepared(2, 0.1)->fit(train, first).ok());
  FitOptions resumed = options;
  resumed.resume = true;
  auto refused = Prepared(1, 0.1)->fit(train, resumed);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused.status(), "stopped after 2 steps of epoch 1 with a global batch "
                                         "of 8 rows; this fit's global batch is 4 rows "
                                         "(batch_size 4 on 1 rank)"))
      << refused.status();
  resumed.batch_size = 8;
  auto same_global = Prepared(1, 0.1)->fit(train, resumed);
  ASSERT_TRUE(same_global.ok()) << same_global.status();
  EXPECT_EQ(same_global->steps, 6);  // 3 steps an epoch of 8 rows over 24 examples
  // The end of that fit (an epoch boundary) resumes with any global batch.
  resumed.epochs = 3;
  resumed.batch_size = 4;
  auto at_end = Prepared(1, 0.1)->fit(train, resumed);
  ASSERT_TRUE(at_end.ok()) << at_end.status();
  EXPECT_EQ(at_end->steps, 12);
}

// The steps a checkpoint inside an epoch counts are grad_accum_steps loader
// batches each: resumed with another grad_accum_steps, the rest of the epoch
// would start elsewhere than where the loader stopped (2 steps of 1 batch
// stopped at batch 2; with 2 batches a step the loop went on from batch 4,
// reading batches 2 and 3 as 4 and 5 and leaving 4 and 5 untrained; the other
// way round it ran out of batches). Refused naming both; the same
// grad_accum_steps resumes.
TEST(CallbacksTest, AMidEpochResumeWithAnotherGradAccumIsRefused) {
  auto train = Classification(24, 82);
  const std::string dir = ::testing::TempDir() + "/hapi_resume_accum";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 2, .batch_size = 4, .checkpoint = {.dir = dir, .every_steps = 2}};
  FitOptions first = options;
  first.callbacks = {MakeCallback<EndFitAt>(int64_t{2})};
  ASSERT_TRUE(Prepared(1, 0.1)->fit(train, first).ok());
  FitOptions resumed = options;
  resumed.resume = true;
  resumed.grad_accum_steps = 2;
  auto refused = Prepared(1, 0.1)->fit(train, resumed);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(Contains(refused.status(), "stopped after 2 steps of epoch 1 with the loader at "
                                         "batch 2 of 6; with grad_accum_steps = 2 those steps "
                                         "end at batch 4"))
      << refused.status();
  resumed.grad_accum_steps = 1;
  auto same = Prepared(1, 0.1)->fit(train, resumed);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->steps, 12);

  // Written with 2 batches a step (1 step: batch 2 of 6), resumed with 1.
  std::filesystem::remove_all(dir);
  first.grad_accum_steps = 2;
  first.checkpoint.every_steps = 1;
  first.callbacks = {MakeCallback<EndFitAt>(int64_t{1})};
  ASSERT_TRUE(Prepared(1, 0.1)->fit(train, first).ok());
  auto fewer = Prepared(1, 0.1)->fit(train, resumed);
  ASSERT_FALSE(fewer.ok());
  EXPECT_TRUE(Contains(fewer.status(), "stopped after 1 steps of epoch 1 with the loader at "
                                       "batch 2 of 6; with grad_accum_steps = 1 those steps "
                                       "end at batch 1"))
      << fewer.status();
}

// Rank 0's lr at each epoch's end (after the callbacks before it).
struct RecordLr : Callback {
  explicit RecordLr(std::shared_ptr<std::vector<double>> lrs) : lrs(std::move(lrs)) {}
  std::string name() const override { return "RecordLr"; }
  void on_epoch_end(RunState& s, const Logs&) override {
    if (s.ctx->rank() == 0) lrs->push_back(s.optimizer->lr());
  }
  std::shared_ptr<std::vector<double>> lrs;
};

// Keras' rule (Paddle's callback restates it) on a loss that never improves by
// min_delta 10: patience 2, factor 0.5, cooldown 1 halve the lr after epochs
// 3, 5, 7 and 9 (the cooldown epoch resets the wait, the next one counts), not
// below min_lr 0.01. A fit resumed from epoch 3's checkpoint continues the counts and
// the lr, to the same sequence.
TEST(CallbacksTest, ReduceLROnPlateauFollowsKerasRuleAndResumes) {
  auto train = Classification(16, 78);
  auto plateau = [](std::shared_ptr<std::vector<double>> lrs) {
    return std::vector<CallbackFactory>{
        MakeCallback<ReduceLROnPlateau>("loss", 0.5, 2, "min", 10.0, 1, 0.01),
        MakeCallback<RecordLr>(std::move(lrs))};
  };
  auto straight = std::make_shared<std::vector<double>>();
  auto h = Prepared(2, 0.1)->fit(train, {.epochs = 10, .batch_size = 4, .callbacks = plateau(straight)});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(*straight, (std::vector<double>{0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.0125, 0.0125,
                                            0.01, 0.01}));

  // With the sharded optimizer too: its lr goes through the gathered one.
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "zero" : "unsharded");
    const std::string dir = ::testing::TempDir() + "/hapi_plateau";
    std::filesystem::remove_all(dir);
    auto first = std::make_shared<std::vector<double>>(), second = first;
    FitOptions options{.epochs = 3, .batch_size = 4, .zero = zero, .checkpoint = {.dir = dir},
                       .checkpoint_each_epoch = true, .callbacks = plateau(first)};
    ASSERT_TRUE(Prepared(2, 0.1)->fit(train, options).ok());
    options.epochs = 10;
    options.resume = true;
    ASSERT_TRUE(Prepared(2, 0.1)->fit(train, options).ok());
    EXPECT_EQ(*second, *straight);
  }

  EXPECT_THROW(ReduceLROnPlateau("loss", 1.5), Error);
  std::string what;
  try {
    ReduceLROnPlateau("loss", 0.1, -1);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_EQ(what, "ReduceLROnPlateau: patience must be >= 0, got -1");
}

// Keras' and Paddle's rule: training stops at the patience-th evaluation in
// a row without an improvement (patience 0: the first). lr 0: eval_loss never
// improves after the first epoch, so patience p runs 1 + max(p, 1) epochs.
TEST(CallbacksTest, EarlyStoppingStopsAfterPatienceEvaluationsWithoutImprovement) {
  auto train = Classification(16, 81), test = Classification(9, 82);
  for (int patience : {0, 1, 2, 3}) {
    auto h = Prepared(2, 0.0)->fit(
        train, {.epochs = 10, .batch_size = 4, .eval_data = test,
                .callbacks = {MakeCallback<EarlyStopping>("eval_loss", patience)}});
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->epochs.size(), static_cast<size_t>(1 + std::max(patience, 1)))
        << "patience " << patience;
  }
}

// Paddle's datasets give each label as shape (1), so a batch's labels are
// (N, 1), which Paddle's cross entropy and hapi's Accuracy take: CrossEntropy()
// trains on them as on (N) labels.
TEST(CallbacksTest, CrossEntropyTakesPaddlesLabelsOfShapeNBy1) {
  auto flat = std::static_pointer_cast<const data::TensorDataset>(Classification(24, 91));
  auto column = std::make_shared<data::TensorDataset>(flat->data(),
                                                      flat->targets().reshape({24, 1}));
  FitOptions options{.epochs = 2, .batch_size = 4, .eval_data = column};
  auto a = Prepared(2, 0.1);
  auto b = Prepared(2, 0.1);
  auto ha = a->fit(flat, {.epochs = 2, .batch_size = 4, .eval_data = flat});
  auto hb = b->fit(column, options);
  ASSERT_TRUE(ha.ok()) << ha.status();
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->epochs, ha->epochs);
  // Other shapes are still named.
  auto wrong = std::make_shared<data::TensorDataset>(
      flat->data(), nn::zeros({24, 2}, {.dtype = nn::kInt64}));
  absl::StatusOr<History> h = Prepared(1, 0.1)->fit(wrong, {.batch_size = 4});
  ASSERT_FALSE(h.ok());
  EXPECT_TRUE(Contains(h.status(), "labels of shape (4, 2)")) << h.status();
  // (N, 1) labels of another N, or not int64, are named as they came.
  auto message = [](const nn::Tensor& logits, const nn::Tensor& labels) {
    try {
      CrossEntropy()(logits, labels);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const nn::Tensor logits = nn::zeros({4, 3});
  EXPECT_NE(message(logits, nn::zeros({3, 1}, {.dtype = nn::kInt64})).find("labels of shape (3, 1)"),
            std::string::npos)
      << message(logits, nn::zeros({3, 1}, {.dtype = nn::kInt64}));
  EXPECT_NE(message(logits, nn::zeros({4, 1})).find("labels must be int64, got float32(4, 1)"),
            std::string::npos)
      << message(logits, nn::zeros({4, 1}));
  // The gradient is that of the (N) labels.
  auto grad_of = [&](const nn::Tensor& labels) {
    nn::Tensor x = nn::arange(12, {.dtype = nn::kFloat32}).reshape({4, 3}).detach();
    x.set_requires_grad(true);
    CrossEntropy()(x, labels).backward();
    return x.grad().to_vector<float>();
  };
  const nn::Tensor labels =
      nn::from_vector(std::vector<int64_t>{2, 0, 1, 2}, {4}, {.dtype = nn::kInt64});
  EXPECT_EQ(grad_of(labels.reshape({4, 1})), grad_of(labels));
}

// CrossEntropy(options) is nn::cross_entropy with those options, on (N) and
// Paddle's (N, 1) labels; fit trains with it on two ranks; a per-sample reduction
// or a bad label_smoothing is refused when the LossFunction is made.
TEST(CallbacksTest, CrossEntropyTakesTheLossOptions) {
  const nn::CrossEntropyOptions options{
      .weight = nn::from_vector(std::vector<float>{0.5f, 2.0f, 1.0f}, {3}),
      .ignore_index = 1,
      .label_smoothing = 0.2};
  const nn::Tensor logits = nn::arange(12, {.dtype = nn::kFloat32}).reshape({4, 3}) * 0.25;
  const nn::Tensor labels = nn::from_vector(std::vector<int64_t>{2, 1, 0, 2}, {4});
  const float want = nn::cross_entropy(logits, labels, options).item<float>();
  EXPECT_EQ(CrossEntropy(options)(logits, labels).item<float>(), want);
  EXPECT_EQ(CrossEntropy(options)(logits, labels.reshape({4, 1})).item<float>(), want);
  EXPECT_NE(CrossEntropy()(logits, labels).item<float>(), want);
  auto error_of = [](const nn::CrossEntropyOptions& bad) {
    try {
      CrossEntropy(bad);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of({.reduction = nn::Reduction::kNone}).find("reduction none"),
            std::string::npos);
  EXPECT_NE(error_of({.label_smoothing = -0.5}).find("label_smoothing -0.5 is outside [0, 1]"),
            std::string::npos);
  // A weight that cannot serve is refused here too, not at each rank's first step: a
  // GPU rank's copy of a weight that requires grad would not require it, so the
  // call there would take what the CPU refuses.
  EXPECT_NE(error_of({.weight = nn::ones({3}).set_requires_grad(true)})
                .find("hapi::CrossEntropy: weight requires grad"),
            std::string::npos);
  EXPECT_NE(error_of({.weight = nn::ones({3, 1})})
                .find("hapi::CrossEntropy: weight of shape (3, 1) must be 1-D"),
            std::string::npos);
  EXPECT_NE(error_of({.weight = nn::Tensor()}).find("hapi::CrossEntropy: weight is undefined"),
            std::string::npos);
  auto model = std::make_unique<Model>(
      [] { return std::make_shared<Net>(); },
      LaunchOptions{.gpus = "cpu", .nprocs = 2, .spawn = testing::DefaultTestSpawnOptions()});
  model->prepare(
      [](std::vector<nn::Tensor> params) {
        return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.1});
      },
      CrossEntropy({.weight = nn::ones({3}), .label_smoothing = 0.1}));
  absl::StatusOr<History> h = model->fit(Classification(16, 76), {.epochs = 1, .batch_size = 4});
  ASSERT_TRUE(h.ok()) << h.status();
}

// A bad mode names the callback it was given to, as the callbacks' other
// argument errors do: fit makes the callbacks on the ranks, where the message
// alone says which one failed.
TEST(CallbacksTest, ABadModeNamesTheCallback) {
  auto what = [](const std::function<void()>& make) {
    try {
      make();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(what([] { EarlyStopping("eval_acc", 1, "maximum"); }),
            "EarlyStopping: mode must be \"min\", \"max\" or \"auto\", got 'maximum'");
  EXPECT_EQ(what([] { ReduceLROnPlateau("loss", 0.1, 10, "lowest"); }),
            "ReduceLROnPlateau: mode must be \"min\", \"max\" or \"auto\", got 'lowest'");
  EXPECT_EQ(what([] { ModelCheckpoint("/tmp/unused", 1, "eval_acc", "Max"); }),
            "ModelCheckpoint: mode must be \"min\", \"max\" or \"auto\", got 'Max'");
}

// The rule against Keras' (tf.keras ReduceLROnPlateau.on_epoch_end, run in
// Python on the same values): improvements by more than min_delta reset the
// wait, in and out of the cooldown; mode max; patience 0; min_lr. With eval
// data the epochs that did not evaluate are skipped (every other one here).
TEST(CallbacksTest, ReduceLROnPlateauMatchesKerasOnImprovingValues) {
  const std::vector<double> values = {0.5,  0.52, 0.6,  0.6,  0.61, 0.58, 0.7,  0.69, 0.68,
                                      0.67, 0.66, 0.8,  0.79, 0.78, 0.77, 0.76, 0.75, 0.74};
  auto run = [&](ReduceLROnPlateau plateau, double sign) {
    nn::Tensor w = nn::zeros({2});
    w.set_requires_grad(true);
    optim::SGD sgd({w}, optim::SGDOptions{.lr = 0.1});
    RunState s;
    s.optimizer = &sgd;
    s.has_eval_data = true;
    plateau.on_train_begin(s);
    std::vector<double> lrs;
    for (double v : values) {
      s.evaluated = false;  // an epoch between evaluations: not counted
      plateau.on_epoch_end(s, {{"loss", 1.0}});
      s.evaluated = true;
      plateau.on_epoch_end(s, {{"loss", 1.0}, {"eval_acc", sign * v}});
      lrs.push_back(sgd.lr());
    }
    return lrs;
  };
  auto near = [](const std::vector<double>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << i;
  };
  near(run(ReduceLROnPlateau("eval_acc", 0.5, 2, "auto", 0.05, 2, 0.02), 1.0),
       {0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025, 0.025, 0.02,
        0.02, 0.02, 0.02, 0.02});
  near(run(ReduceLROnPlateau("eval_acc", 0.5, 0, "min", 0.05, 1, 0.02), -1.0),
       {0.1, 0.05, 0.05, 0.025, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02,
        0.02, 0.02, 0.02, 0.02});

  // A first value of NaN counts as no improvement (Keras compares it with an
  // infinite best); the finite values after it improve again.
  nn::Tensor w = nn::zeros({2});
  w.set_requires_grad(true);
  optim::SGD sgd({w}, optim::SGDOptions{.lr = 0.1});
  RunState s;
  s.optimizer = &sgd;
  ReduceLROnPlateau plateau("loss", 0.5, 2);
  plateau.on_train_begin(s);
  std::vector<double> lrs;
  for (double v : {std::nan(""), 1.0, 0.5, 0.4, 0.6, 0.6}) {
    plateau.on_epoch_end(s, {{"loss", v}});
    lrs.push_back(sgd.lr());
  }
  near(lrs, {0.1, 0.1, 0.1, 0.1, 0.1, 0.05});
}

// EarlyStopping and ModelCheckpoint: a NaN first value is no best (as Keras',
// whose best starts infinite); before, it became the best, no finite value
// improved on it, and EarlyStopping stopped after patience epochs of progress
// while ModelCheckpoint never saved a better model.
TEST(CallbacksTest, ANanFirstValueIsNoBestForEarlyStoppingAndModelCheckpoint) {
  RunState s;
  EarlyStopping stopping("loss", 2);  // the NaN is one evaluation without an improvement
  stopping.on_train_begin(s);
  for (double v : {std::nan(""), 1.0, 0.9, 0.8, 0.7}) {
    stopping.on_epoch_end(s, {{"loss", v}});
    EXPECT_FALSE(s.stop_training) << "after " << v;
  }
  const std::string dir = ::testing::TempDir() + "/hapi_nan_best";
  ModelCheckpoint checkpoint(dir, 0, "loss");
  checkpoint.on_train_begin(s);
  CheckpointExtra extra;
  checkpoint.on_epoch_end(s, {{"loss", std::nan("")}});
  checkpoint.on_checkpoint_save(s, extra);
  EXPECT_EQ(std::get<int64_t>(extra.at("hapi.ModelCheckpoint.loss.have_best")), 0);
  checkpoint.on_epoch_end(s, {{"loss", 2.0}});
  checkpoint.on_epoch_end(s, {{"loss", 1.5}});
  checkpoint.on_checkpoint_save(s, extra);
  EXPECT_EQ(std::get<int64_t>(extra.at("hapi.ModelCheckpoint.loss.have_best")), 1);
  EXPECT_EQ(std::get<double>(extra.at("hapi.ModelCheckpoint.loss.best")), 1.5);
}

// The monitoring callbacks' entries round-trip: a callback loaded from another's
// entries goes on counting where that one stopped (EarlyStopping: patience 2,
// two epochs without improvement saved, the third stops); entries of the wrong
// type are an error naming the file; missing entries load nothing.
TEST(CallbacksTest, MonitorStateRoundTripsAndWrongTypesAreNamed) {
  RunState s;
  EarlyStopping first("loss", 2);
  first.on_train_begin(s);
  for (double v : {1.0, 1.5, 1.2}) first.on_epoch_end(s, {{"loss", v}});
  ResumeInfo info{.path = "ckpt-7"};
  first.on_checkpoint_save(s, info.extra);
  EarlyStopping resumed("loss", 2);
  resumed.on_checkpoint_load(s, info);
  resumed.on_train_begin(s);
  resumed.on_epoch_end(s, {{"loss", 1.1}});
  EXPECT_TRUE(s.stop_training);
  EarlyStopping fresh("loss", 2);
  fresh.on_checkpoint_load(s, ResumeInfo{.path = "empty"});
  s.stop_training = false;
  fresh.on_train_begin(s);
  fresh.on_epoch_end(s, {{"loss", 1.1}});
  EXPECT_FALSE(s.stop_training);

  info.extra["hapi.EarlyStopping.loss.wait"] = 2.0;
  EarlyStopping wrong("loss", 2);
  try {
    wrong.on_checkpoint_load(s, info);
    ADD_FAILURE() << "a double under hapi.EarlyStopping.loss.wait was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EarlyStopping: ckpt-7: the entries "
                                         "hapi.EarlyStopping.loss.* have the wrong types"),
              std::string::npos)
        << e.what();
  }
}

// The 2-norm of the change of every parameter between two state dicts.
double ChangeNorm(const nn::StateDict& before, const nn::StateDict& after) {
  double sum = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    std::vector<double> a = before[i].second.to_vector<double>();
    std::vector<double> b = after[i].second.to_vector<double>();
    for (size_t j = 0; j < a.size(); ++j) sum += (b[j] - a[j]) * (b[j] - a[j]);
  }
  return std::sqrt(sum);
}

// FitOptions::clip_grad_norm: one SGD step of lr 1 on gradients whose global
// norm is far above max_norm moves the parameters by max_norm (the closed
// form of clip_grad_norm_: scale max_norm / (norm + 1e-6)), on one rank, on
// two and with the sharded optimizer alike; without it the step is larger.
TEST(CallbacksTest, ClipGradNormBoundsEachStep) {
  auto train = Classification(16, 79);
  auto one_step = [&](int ranks, double clip, bool zero) {
    nn::manual_seed(80);  // the same initial weights (state_dict builds them here)
    auto model = Prepared(ranks, 1.0);
    nn::StateDict before = *model->state_dict();
    auto h = model->fit(train, {.epochs = 1, .batch_size = 16 / ranks, .shuffle = false,
                                .clip_grad_norm = clip, .zero = zero});
    EXPECT_TRUE(h.ok()) << h.status();
    return ChangeNorm(before, *model->state_dict());
  };
  EXPECT_GT(one_step(1, 0.0, false), 0.05);
  EXPECT_NEAR(one_step(1, 0.01, false), 0.01, 1e-6);
  EXPECT_NEAR(one_step(2, 0.01, false), 0.01, 1e-6);
  EXPECT_NEAR(one_step(2, 0.01, true), 0.01, 1e-6);
  auto refused = Prepared(1, 0.1)->fit(train, {.clip_grad_norm = -1});
  EXPECT_TRUE(Contains(refused.status(), "fit: clip_grad_norm = -1: must be >= 0 (0: no clipping)"))
      << refused.status();
  auto graphed = Prepared(1, 0.1)->fit(train, {.clip_grad_norm = 1, .cuda_graph = true});
  EXPECT_TRUE(Contains(graphed.status(), "fit: cuda_graph with clip_grad_norm = 1"))
      << graphed.status();
}

// clip_grad_norm under uneven data (DataParallel::join()): 62 samples on 3
// ranks with batch 4 (rank 2 joins a step early each epoch) train as one rank
// with batch 12, clipped alike: the unsharded optimizer clips the join's
// reduced gradients on the active ranks; the sharded one's norm over the
// shards is answered by the joined rank's replay (no hang, the same norm).
TEST(CallbacksTest, ClipGradNormUnderJoinEqualsOneRank) {
  auto train = Classification(62, 84);
  auto weights = [&](int ranks, bool zero) {
    nn::manual_seed(85);
    auto model = Prepared(ranks, 0.5);
    auto h = model->fit(train, {.epochs = 2, .batch_size = 12 / ranks, .seed = 3,
                                .clip_grad_norm = 0.05, .zero = zero, .uneven = true});
    EXPECT_TRUE(h.ok()) << ranks << " ranks, zero " << zero << ": " << h.status();
    return *model->state_dict();
  };
  const nn::StateDict one = weights(1, false);
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "zero" : "unsharded");
    EXPECT_LT(ChangeNorm(one, weights(3, zero)), 1e-5);
  }
  // Not clipped: other weights.
  nn::manual_seed(85);
  auto unclipped = Prepared(1, 0.5);
  ASSERT_TRUE(unclipped->fit(train, {.epochs = 2, .batch_size = 12, .seed = 3}).ok());
  EXPECT_GT(ChangeNorm(one, *unclipped->state_dict()), 1e-3);
}

// ProgressLogger counts the steps of the epoch it is in: after a resume at an
// epoch's end on a world with more steps per epoch (2 ranks of 2 steps an
// epoch, then 1 rank of 4) it read "epoch 2/2 step -1/4".
TEST(CallbacksTest, ProgressAfterAResumeOnAnotherWorldCountsTheEpochsSteps) {
  const std::string dir = ::testing::TempDir() + "/hapi_progress_resume";
  std::filesystem::remove_all(dir);
  auto fit = [&](int epochs, bool resume) {
    return [=](dist::Context&, testing::StepLog&) -> absl::Status {
      Model model([] { return std::make_shared<Net>(); });
      model.prepare(
          [](std::vector<nn::Tensor> params) {
            return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.1});
          },
          CrossEntropy());
      return model.fit(Classification(16, 81), {.epochs = epochs, .batch_size = 4,
                                                .checkpoint = {.dir = dir}, .resume = resume,
                                                .log_freq = 1})
          .status();
    };
  };
  ASSERT_TRUE(testing::RunRanks(fit(1, false), {.ranks = 2}).ok());
  testing::RunReport report;
  absl::Status s = testing::RunRanks(fit(2, true), {.ranks = 1}, &report);
  ASSERT_TRUE(s.ok()) << s;
  for (int step = 1; step <= 4; ++step)
    EXPECT_NE(report.log.find("epoch 2/2 step " + std::to_string(step) + "/4 loss"),
              std::string::npos)
        << step << "\n" << report.log;
  EXPECT_EQ(report.log.find("step -"), std::string::npos) << report.log;
}

// EarlyStopping's and ReduceLROnPlateau's lines say what they count: an
// evaluation value's checks are evaluations (eval_freq 2: every other epoch),
// which the line called epochs; a training value's are epochs. lr 0: nothing
// improves (min_delta keeps rounding in the epoch's loss from counting; the
// plateau's lr of 1e-12 moves nothing either).
TEST(CallbacksTest, MonitorLinesCountEvaluationsOrEpochs) {
  auto run = [](std::string monitor, bool plateau) {
    return [=](dist::Context&, testing::StepLog&) -> absl::Status {
      Model model([] { return std::make_shared<Net>(); });
      model.prepare(
          [plateau](std::vector<nn::Tensor> params) {
            // ReduceLROnPlateau leaves an lr of 0 (its min_lr) alone.
            return std::make_unique<optim::SGD>(std::move(params),
                                                optim::SGDOptions{.lr = plateau ? 1e-12 : 0.0});
          },
          CrossEntropy());
      CallbackFactory callback =
          plateau ? MakeCallback<ReduceLROnPlateau>(monitor, 0.5, 2, "min", 1e-3)
                  : MakeCallback<EarlyStopping>(monitor, 2, "min", 1e-3);
      return model.fit(Classification(16, 91), {.epochs = 8, .batch_size = 4,
                                                .eval_data = Classification(8, 92),
                                                .eval_freq = 2, .callbacks = {callback}})
          .status();
    };
  };
  auto log_of = [&](std::string monitor, bool plateau) {
    testing::RunReport report;
    absl::Status s = testing::RunRanks(run(monitor, plateau), {.ranks = 2}, &report);
    EXPECT_TRUE(s.ok()) << s;
    return report.log;
  };
  const std::string eval = log_of("eval_loss", false);
  EXPECT_NE(eval.find("for 2 evaluations; stopping"), std::string::npos) << eval;
  EXPECT_EQ(eval.find("epochs; stopping"), std::string::npos) << eval;
  const std::string train = log_of("loss", false);
  EXPECT_NE(train.find("for 2 epochs; stopping"), std::string::npos) << train;
  const std::string plateau = log_of("eval_loss", true);
  EXPECT_NE(plateau.find("ReduceLROnPlateau: eval_loss has not improved on "), std::string::npos)
      << plateau;
  EXPECT_NE(plateau.find(" for 2 evaluations; lr now 5e-13"), std::string::npos) << plateau;
}

}  // namespace
}  // namespace tandem::hapi
