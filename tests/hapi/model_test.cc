// hapi::Model on CPU ranks: N ranks against one, evaluation and prediction
// over uneven shards, callbacks' order and failures, early stopping, bad
// inputs, save/load, the sharded optimizer, comm hooks, uneven training data
// under join(), max_steps_per_epoch, and a fit() inside a rank's function
// under tandem::testing (equivalence, an injected fault).
#include "hapi/model.h"

#include <pthread.h>

#include <csignal>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/nn.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "spawn/signals.h"
#include "spawn/train/comm_hooks.h"
#include "testing/equivalence.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"
#include "tests/hapi/step_log_callback.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;

using ::tandem::testing::Classification;

LaunchOptions Cpu(int ranks) {
  return {.gpus = "cpu", .nprocs = ranks, .spawn = testing::DefaultTestSpawnOptions()};
}

OptimizerFactory AdamFactory(double lr) {
  return [lr](std::vector<nn::Tensor> params) {
    return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = lr});
  };
}

bool Contains(const absl::Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

std::unique_ptr<Model> Prepared(int ranks) {
  auto model = std::make_unique<Model>([] { return std::make_shared<Net>(); }, Cpu(ranks));
  model->prepare(AdamFactory(1e-2), CrossEntropy(),
                 {MakeMetric<Accuracy>(), MakeMetric<Accuracy>(2)});
  return model;
}

void ExpectCloseWeights(const nn::StateDict& a, const nn::StateDict& b, double rtol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    std::vector<double> x = a[i].second.to_vector<double>(), y = b[i].second.to_vector<double>();
    ASSERT_EQ(x.size(), y.size());
    for (size_t j = 0; j < x.size(); ++j)
      EXPECT_NEAR(x[j], y[j], rtol * (1 + std::abs(y[j]))) << a[i].first << "[" << j << "]";
  }
}

// 2 and 4 ranks with batch 16/N train as 1 rank with batch 16 (the same
// samples per step, in the same order); the evaluation over 37 samples (not
// a multiple of the ranks) counts each sample once: its accuracies are equal.
TEST(ModelTest, FitOnTwoAndFourRanksEqualsOneRankOnTheSameGlobalBatch) {
  constexpr int kEpochs = 10;
  auto train = Classification(64, 1), test = Classification(37, 2);
  std::map<int, nn::StateDict> weights;
  std::map<int, History> histories;
  for (int ranks : {1, 2, 4}) {
    auto model = Prepared(ranks);
    auto h = model->fit(train, {.epochs = kEpochs, .batch_size = 16 / ranks, .seed = 7,
                                .eval_data = test, .eval_batch_size = 5});
    ASSERT_TRUE(h.ok()) << ranks << " ranks: " << h.status();
    ASSERT_EQ(h->epochs.size(), static_cast<size_t>(kEpochs));
    EXPECT_EQ(h->steps, 4 * kEpochs);
    histories[ranks] = *h;
    auto w = model->state_dict();
    ASSERT_TRUE(w.ok());
    weights[ranks] = *w;
  }
  for (int ranks : {2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    ExpectCloseWeights(weights[ranks], weights[1], 1e-6);
    for (size_t e = 0; e < kEpochs; ++e) {
      const Logs& n = histories[ranks].epochs[e];
      const Logs& one = histories[1].epochs[e];
      EXPECT_EQ(n.at("eval_acc"), one.at("eval_acc")) << "epoch " << e;
      EXPECT_EQ(n.at("eval_acc_top2"), one.at("eval_acc_top2")) << "epoch " << e;
      EXPECT_NEAR(n.at("loss"), one.at("loss"), 1e-6) << "epoch " << e;
      EXPECT_NEAR(n.at("eval_loss"), one.at("eval_loss"), 1e-6) << "epoch " << e;
    }
  }
  // The metric is a real one: a trained model beats chance on this rule.
  EXPECT_GT(histories[1].epochs.back().at("eval_acc"), 0.5);
}

// evaluate() on 3 ranks (37 = 13 + 12 + 12 samples, batches of 4) equals one
// rank's exactly for the counts, and both equal a count made by hand.
TEST(ModelTest, EvaluateOnUnevenShardsEqualsOneRankExactly) {
  auto test = Classification(37, 3);
  auto one = Prepared(1);
  auto three = Prepared(3);
  auto w = one->state_dict();
  ASSERT_TRUE(w.ok());
  const std::string path = ::testing::TempDir() + "/hapi_eval.safetensors";
  ASSERT_TRUE(one->save(path).ok());
  ASSERT_TRUE(three->load(path).ok());
  auto a = one->evaluate(test, {.batch_size = 4});
  auto b = three->evaluate(test, {.batch_size = 4});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->at("eval_acc"), b->at("eval_acc"));
  EXPECT_EQ(a->at("eval_acc_top2"), b->at("eval_acc_top2"));
  EXPECT_NEAR(a->at("eval_loss"), b->at("eval_loss"), 1e-6);
  // By hand: the network on the whole set at once.
  Net net;
  ASSERT_TRUE(net.load_state_dict(*w).ok());
  auto* ds = dynamic_cast<const data::TensorDataset*>(test.get());
  std::vector<int64_t> predicted = nn::argmax(net(ds->data()), 1).to_vector<int64_t>();
  std::vector<int64_t> labels = ds->targets().to_vector<int64_t>();
  int correct = 0;
  for (size_t i = 0; i < labels.size(); ++i) correct += predicted[i] == labels[i];
  EXPECT_EQ(a->at("eval_acc"), correct / 37.0);
}

struct Identity : nn::Module {
  nn::Tensor forward(const nn::Tensor& x) override { return x * 1.0; }
};

// predict() returns every example's output in dataset order on any number of
// ranks: with an identity network, the dataset's own data.
TEST(ModelTest, PredictReturnsOutputsInDatasetOrderAcrossRanks) {
  const int64_t n = 23;
  nn::Tensor x = nn::arange(n * 2, {.dtype = nn::kFloat32}).reshape({n, 2});
  auto ds = std::make_shared<data::TensorDataset>(x, nn::zeros({n}, {.dtype = nn::kInt64}));
  for (int ranks : {1, 2, 4}) {
    Model model([] { return std::make_shared<Identity>(); }, Cpu(ranks));
    auto out = model.predict(ds, {.batch_size = 3});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->shape(), (nn::Shape{n, 2}));
    EXPECT_EQ(out->to_vector<float>(), x.to_vector<float>()) << ranks << " ranks";
  }
}

// Records every hook it sees, per rank.
struct Recorder : Callback {
  static std::mutex mu;
  static std::map<int, std::vector<std::string>> seen;
  std::string name() const override { return "Recorder"; }
  void Add(RunState& s, std::string what) {
    std::lock_guard<std::mutex> lock(mu);
    seen[s.ctx->rank()].push_back(std::move(what));
  }
  void on_train_begin(RunState& s) override { Add(s, "train_begin"); }
  void on_epoch_begin(RunState& s) override { Add(s, "epoch_begin " + std::to_string(s.epoch)); }
  void on_train_batch_begin(RunState& s) override { Add(s, "batch_begin " + std::to_string(s.step)); }
  void on_train_batch_end(RunState& s) override { Add(s, "batch_end " + std::to_string(s.step)); }
  void on_eval_begin(RunState& s) override { Add(s, "eval_begin"); }
  void on_eval_end(RunState& s, const Logs& l) override {
    Add(s, "eval_end " + std::to_string(l.count("eval_acc")));
  }
  void on_epoch_end(RunState& s, const Logs& l) override {
    Add(s, "epoch_end " + std::to_string(l.count("loss")));
  }
  void on_train_end(RunState& s, const Logs&) override { Add(s, "train_end"); }
};
std::mutex Recorder::mu;
std::map<int, std::vector<std::string>> Recorder::seen;

TEST(ModelTest, CallbacksFireInTheDocumentedOrderOnEveryRank) {
  Recorder::seen.clear();
  auto model = Prepared(2);
  // 16 samples, batch 4 per rank: 2 steps per epoch; eval every 2nd epoch and after the last.
  auto h = model->fit(Classification(16, 4), {.epochs = 3, .batch_size = 4,
                                              .eval_data = Classification(6, 5), .eval_freq = 2,
                                              .callbacks = {MakeCallback<Recorder>()}});
  ASSERT_TRUE(h.ok()) << h.status();
  const std::vector<std::string> expected = {
      "train_begin",
      "epoch_begin 0", "batch_begin 0", "batch_end 1", "batch_begin 1", "batch_end 2",
      "epoch_end 1",
      "epoch_begin 1", "batch_begin 2", "batch_end 3", "batch_begin 3", "batch_end 4",
      "eval_begin", "eval_end 1", "epoch_end 1",
      "epoch_begin 2", "batch_begin 4", "batch_end 5", "batch_begin 5", "batch_end 6",
      "eval_begin", "eval_end 1", "epoch_end 1",
      "train_end"};
  ASSERT_EQ(Recorder::seen.size(), 2u);
  EXPECT_EQ(Recorder::seen[0], expected);
  EXPECT_EQ(Recorder::seen[1], expected);
}

// Throws on one rank at one step.
struct Thrower : Callback {
  std::string name() const override { return "Thrower"; }
  void on_train_batch_end(RunState& s) override {
    if (s.ctx->rank() == 1 && s.step == 2) throw std::runtime_error("disk full");
  }
};

TEST(ModelTest, AThrowingCallbackEndsEveryRankNamingTheCallback) {
  auto model = Prepared(2);
  auto h = model->fit(Classification(64, 6),
                      {.epochs = 2, .batch_size = 4, .callbacks = {MakeCallback<Thrower>()}});
  ASSERT_FALSE(h.ok());
  EXPECT_TRUE(Contains(h.status(), "rank 1")) << h.status();
  EXPECT_TRUE(Contains(h.status(), "callback Thrower failed in on_train_batch_end: disk full"))
      << h.status();
}

// Rank 1 alone asks to stop after the first epoch: every rank stops there.
struct StopOnRankOne : Callback {
  std::string name() const override { return "StopOnRankOne"; }
  void on_epoch_end(RunState& s, const Logs&) override {
    if (s.ctx->rank() == 1) s.stop_training = true;
  }
};

TEST(ModelTest, OneRanksStopEndsEveryRankAtTheSameEpoch) {
  auto model = Prepared(2);
  auto h = model->fit(Classification(16, 7),
                      {.epochs = 5, .batch_size = 4, .callbacks = {MakeCallback<StopOnRankOne>()}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->epochs.size(), 1u);
  EXPECT_EQ(h->steps, 2);
}

TEST(ModelTest, EarlyStoppingStopsWhenTheMonitorStallsAndNamesAMissingOne) {
  // lr 0: the loss never improves, so patience 1 stops after epoch 2.
  Model model([] { return std::make_shared<Net>(); }, Cpu(1));
  model.prepare(AdamFactory(0.0), CrossEntropy());
  auto h = model.fit(Classification(16, 8),
                     {.epochs = 6, .batch_size = 8, .shuffle = false,
                      .callbacks = {MakeCallback<EarlyStopping>("loss", 1)}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->epochs.size(), 2u);
  auto missing = model.fit(Classification(16, 8),
                           {.epochs = 1, .batch_size = 8,
                            .callbacks = {MakeCallback<EarlyStopping>("eval_acc", 1)}});
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(Contains(missing.status(), "monitor 'eval_acc' is not among this epoch's logs (loss)"))
      << missing.status();
}


// Raises SIGUSR1 on rank 0 after `step` (on the rank thread: see
// tests/spawn/preempt_test.cc for why not kill(getpid())).
struct PreemptAt : Callback {
  explicit PreemptAt(int64_t step) : step(step) {}
  std::string name() const override { return "PreemptAt"; }
  void on_train_batch_end(RunState& s) override {
    if (s.ctx->rank() == 0 && s.step == step) ::pthread_kill(::pthread_self(), SIGUSR1);
  }
  int64_t step;
};

// A stop signal in the middle of an epoch saves at one agreed step; fit with
// resume then ends exactly where the uninterrupted fit ends (bit for bit: the
// checkpoint holds the optimizer, the sampler's position and the generators).
TEST(ModelTest, APreemptedFitResumesToTheUninterruptedResult) {
  auto train = Classification(32, 11), test = Classification(9, 12);
  const std::string dir = ::testing::TempDir() + "/hapi_preempt";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 3, .batch_size = 4, .seed = 5, .eval_data = test};
  auto straight = Prepared(2);
  auto a = straight->fit(train, options);
  ASSERT_TRUE(a.ok()) << a.status();

  options.checkpoint = {.dir = dir, .keep = 2, .every_steps = 3};
  LaunchOptions launch = Cpu(2);
  launch.spawn.stop_signals = {SIGUSR1};
  auto make = [&] {
    auto m = std::make_unique<Model>([] { return std::make_shared<Net>(); }, launch);
    m->prepare(AdamFactory(1e-2), CrossEntropy(),
               {MakeMetric<Accuracy>(), MakeMetric<Accuracy>(2)});
    return m;
  };
  auto first = make();
  FitOptions preempted = options;
  preempted.callbacks = {MakeCallback<PreemptAt>(6)};  // epoch 2 of 3, step 2 of 4
  auto stopped = first->fit(train, preempted);
  ASSERT_FALSE(stopped.ok());
  EXPECT_TRUE(dist::IsStopped(stopped.status())) << stopped.status();

  auto second = make();
  options.resume = true;
  auto b = second->fit(train, options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->steps, 12);
  ASSERT_EQ(b->epochs.size(), 2u);  // the interrupted epoch, then the last
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(b->epochs[e].at("loss"), a->epochs[e + 1].at("loss"), 1e-12) << e;
    EXPECT_EQ(b->epochs[e].at("eval_acc"), a->epochs[e + 1].at("eval_acc")) << e;
  }
  ExpectCloseWeights(*second->state_dict(), *straight->state_dict(), 0.0);
  // The fit's final checkpoint: a resume after it has nothing left to do.
  auto third = make();
  auto c = third->fit(train, options);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->epochs.size(), 0u);
  ExpectCloseWeights(*third->state_dict(), *straight->state_dict(), 0.0);
}

// FitOptions::zero: 2 ranks with the sharded optimizer end with the weights
// and losses of 2 ranks with the unsharded one, with and without the bf16 comm
// hook; the hook's rounding moves the result a little from the uncompressed
// run's, and not at all from the sharded run's with the same hook.
TEST(ModelTest, ZeroAndCommHooksOnTwoRanksEqualTheUnshardedRun) {
  auto train = Classification(64, 21), test = Classification(17, 22);
  std::map<std::pair<bool, bool>, nn::StateDict> weights;  // (zero, bf16 hook)
  std::map<std::pair<bool, bool>, History> histories;
  for (bool zero : {false, true}) {
    for (bool bf16 : {false, true}) {
      auto model = Prepared(2);
      FitOptions o{.epochs = 4, .batch_size = 8, .seed = 3, .eval_data = test, .zero = zero};
      if (bf16) o.data_parallel.comm_hook = dist::Bf16CompressHook();
      auto h = model->fit(train, o);
      ASSERT_TRUE(h.ok()) << "zero " << zero << " bf16 " << bf16 << ": " << h.status();
      histories[std::pair(zero, bf16)] = *h;
      weights[std::pair(zero, bf16)] = *model->state_dict();
      // The kept (gathered) optimizer state continues in a second fit, sharded or not.
      auto again = model->fit(train, {.epochs = 1, .batch_size = 8, .zero = !zero});
      ASSERT_TRUE(again.ok()) << again.status();
    }
  }
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 hook" : "no hook");
    ExpectCloseWeights(weights[std::pair(true, bf16)], weights[std::pair(false, bf16)], 1e-6);
    for (size_t e = 0; e < 4; ++e) {
      EXPECT_NEAR(histories[std::pair(true, bf16)].epochs[e].at("loss"),
                  histories[std::pair(false, bf16)].epochs[e].at("loss"), 1e-6);
    }
  }
  // The hook did round: close to the uncompressed run, not equal to it.
  ExpectCloseWeights(weights[std::pair(false, true)], weights[std::pair(false, false)], 5e-2);
  double largest = 0;
  for (size_t i = 0; i < weights[std::pair(false, true)].size(); ++i) {
    auto x = weights[std::pair(false, true)][i].second.to_vector<double>();
    auto y = weights[std::pair(false, false)][i].second.to_vector<double>();
    for (size_t j = 0; j < x.size(); ++j) largest = std::max(largest, std::abs(x[j] - y[j]));
  }
  EXPECT_GT(largest, 0.0);
}

// A fit with zero preempted mid-epoch resumes (sharded again) to the unsharded
// uninterrupted result: the checkpoint holds the gathered, unsharded state.
TEST(ModelTest, APreemptedZeroFitResumesToTheUnshardedResult) {
  auto train = Classification(32, 31);
  const std::string dir = ::testing::TempDir() + "/hapi_preempt_zero";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 3, .batch_size = 4, .seed = 5};
  auto straight = Prepared(2);
  ASSERT_TRUE(straight->fit(train, options).ok());

  options.zero = true;
  options.checkpoint = {.dir = dir, .keep = 2, .every_steps = 3};
  LaunchOptions launch = Cpu(2);
  launch.spawn.stop_signals = {SIGUSR1};
  auto make = [&] {
    auto m = std::make_unique<Model>([] { return std::make_shared<Net>(); }, launch);
    m->prepare(AdamFactory(1e-2), CrossEntropy());
    return m;
  };
  auto first = make();
  FitOptions preempted = options;
  preempted.callbacks = {MakeCallback<PreemptAt>(6)};
  auto stopped = first->fit(train, preempted);
  ASSERT_FALSE(stopped.ok());
  EXPECT_TRUE(dist::IsStopped(stopped.status())) << stopped.status();
  auto second = make();
  options.resume = true;
  auto b = second->fit(train, options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->steps, 12);
  ExpectCloseWeights(*second->state_dict(), *straight->state_dict(), 1e-6);
}

// FitOptions::uneven: 62 samples on 3 ranks with batch 4 (the last global
// batch's 2 samples go to ranks 0 and 1: rank 2 runs one step fewer each
// epoch) train as one rank with batch 12 on the same order, sharded optimizer
// or not; every sample counts once.
TEST(ModelTest, UnevenDataUnderJoinOnThreeRanksEqualsOneRank) {
  auto train = Classification(62, 41), test = Classification(13, 42);
  std::map<std::pair<int, bool>, nn::StateDict> weights;
  std::map<std::pair<int, bool>, History> histories;
  for (auto [ranks, zero] : {std::pair{1, false}, std::pair{3, false}, std::pair{3, true}}) {
    auto model = Prepared(ranks);
    auto h = model->fit(train, {.epochs = 3, .batch_size = 12 / ranks, .seed = 9,
                                .eval_data = test, .zero = zero, .uneven = true});
    ASSERT_TRUE(h.ok()) << ranks << " ranks, zero " << zero << ": " << h.status();
    EXPECT_EQ(h->steps, 3 * 6) << ranks;
    histories[std::pair(ranks, zero)] = *h;
    weights[std::pair(ranks, zero)] = *model->state_dict();
  }
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "zero" : "unsharded");
    ExpectCloseWeights(weights[std::pair(3, zero)], weights[std::pair(1, false)], 1e-5);
    for (size_t e = 0; e < 3; ++e) {
      EXPECT_EQ(histories[std::pair(3, zero)].epochs[e].at("eval_acc"),
                histories[std::pair(1, false)].epochs[e].at("eval_acc"));
      // Each rank's batch losses weighed by their rows: the one-rank epoch loss.
      EXPECT_NEAR(histories[std::pair(3, zero)].epochs[e].at("loss"),
                  histories[std::pair(1, false)].epochs[e].at("loss"), 1e-5)
          << "epoch " << e;
    }
  }
  // Without uneven the last global batch wraps around: other samples, other weights.
  auto wrapped = Prepared(3);
  ASSERT_TRUE(wrapped->fit(train, {.epochs = 3, .batch_size = 4, .seed = 9}).ok());
  auto w = wrapped->state_dict();
  double largest = 0;
  for (size_t i = 0; i < w->size(); ++i) {
    auto x = (*w)[i].second.to_vector<double>();
    auto y = weights[std::pair(1, false)][i].second.to_vector<double>();
    for (size_t j = 0; j < x.size(); ++j) largest = std::max(largest, std::abs(x[j] - y[j]));
  }
  EXPECT_GT(largest, 1e-4);
}

// The epoch loss under uneven data with accumulation: 62 samples on 3 ranks,
// batch 4, two micro-batches a step (rank 2's last step has one, the others'
// two, the second holding one sample each) against one rank with batch 12,
// also with max_steps_per_epoch cutting the epoch before its tail. The first
// epoch's losses are taken before any step the tail could make differ.
TEST(ModelTest, UnevenDataEpochLossWithAccumulationEqualsOneRank) {
  auto train = Classification(62, 43);
  for (int64_t max_steps : {0, 2}) {
    std::map<int, double> loss;
    for (int ranks : {1, 3}) {
      auto model = Prepared(ranks);
      auto h = model->fit(train, {.epochs = 1, .batch_size = 12 / ranks, .seed = 5,
                                  .grad_accum_steps = 2, .uneven = true,
                                  .max_steps_per_epoch = max_steps});
      ASSERT_TRUE(h.ok()) << ranks << " ranks: " << h.status();
      loss[ranks] = h->epochs.at(0).at("loss");
    }
    EXPECT_NEAR(loss[3], loss[1], 1e-6) << "max_steps_per_epoch " << max_steps;
  }
}

// max_steps_per_epoch cuts every epoch; the next epoch starts at its beginning.
TEST(ModelTest, MaxStepsPerEpochCutsEachEpoch) {
  auto train = Classification(64, 51);
  std::vector<int64_t> seen;
  struct Count : Callback {
    explicit Count(std::vector<int64_t>* seen) : seen(seen) {}
    std::string name() const override { return "Count"; }
    void on_train_batch_end(RunState& s) override {
      if (s.ctx->rank() == 0) seen->push_back(s.step);
    }
    std::vector<int64_t>* seen;
  };
  auto model = Prepared(2);
  auto h = model->fit(train, {.epochs = 3, .batch_size = 4, .max_steps_per_epoch = 3,
                              .callbacks = {MakeCallback<Count>(&seen)}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->steps, 9);
  EXPECT_EQ(seen, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

// A callback's checkpoint entries: saved at every save, handed back on
// resume; end_fit stops after a step with no epoch end and no final save, and
// checkpoint_each_epoch's file lets the next fit resume at the epoch's start.
struct Bookkeeper : Callback {
  explicit Bookkeeper(int64_t end_at, std::vector<std::string>* events)
      : end_at(end_at), events(events) {}
  std::string name() const override { return "Bookkeeper"; }
  void on_train_batch_end(RunState& s) override {
    if (s.step == end_at) s.end_fit = true;
  }
  void on_epoch_end(RunState& s, const Logs&) override { epochs_seen = s.epoch + 1; }
  void on_checkpoint_save(RunState& s, CheckpointExtra& extra) override {
    extra["app.epochs_seen"] = int64_t{epochs_seen};
    if (s.ctx->rank() == 0) events->push_back("save " + std::to_string(s.step));
  }
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override {
    epochs_seen = static_cast<int>(std::get<int64_t>(info.extra.at("app.epochs_seen")));
    if (s.ctx->rank() == 0)
      events->push_back("load " + std::to_string(info.step) + " epoch " +
                        std::to_string(info.epoch) + "+" + std::to_string(info.epoch_steps) +
                        " seen " + std::to_string(epochs_seen));
  }
  int64_t end_at;
  std::vector<std::string>* events;
  int epochs_seen = 0;
};

TEST(ModelTest, EpochCheckpointsCallbackEntriesAndEndFit) {
  auto train = Classification(32, 61), test = Classification(9, 62);
  const std::string dir = ::testing::TempDir() + "/hapi_epoch_ck";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 3, .batch_size = 4, .seed = 5, .eval_data = test,
                     .checkpoint = {.dir = dir}, .checkpoint_each_epoch = true};
  auto straight = Prepared(2);
  FitOptions plain = options;
  plain.checkpoint = {};
  auto a = straight->fit(train, plain);
  ASSERT_TRUE(a.ok()) << a.status();

  std::vector<std::string> events;
  auto first = Prepared(2);
  FitOptions ending = options;
  ending.callbacks = {MakeCallback<Bookkeeper>(int64_t{6}, &events)};  // epoch 2, step 2 of 4
  auto stopped = first->fit(train, ending);
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_EQ(stopped->ended_at_step, 6);
  EXPECT_EQ(stopped->epochs.size(), 1u);  // no epoch end for the partial epoch
  EXPECT_EQ(events, (std::vector<std::string>{"save 4"}));  // epoch 1's; no final save
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-4.ckpt"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-6.ckpt"));

  auto second = Prepared(2);
  FitOptions resumed = options;
  resumed.resume = true;
  resumed.callbacks = {MakeCallback<Bookkeeper>(int64_t{0}, &events)};
  auto b = second->fit(train, resumed);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->steps, 12);
  EXPECT_EQ(events, (std::vector<std::string>{"save 4", "load 4 epoch 1+0 seen 1", "save 8",
                                              "save 12"}));
  ASSERT_EQ(b->epochs.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(b->epochs[e].at("loss"), a->epochs[e + 1].at("loss"), 1e-12) << e;
    EXPECT_EQ(b->epochs[e].at("eval_acc"), a->epochs[e + 1].at("eval_acc")) << e;
  }
  ExpectCloseWeights(*second->state_dict(), *straight->state_dict(), 0.0);
}

// A checkpoint without fit's entries (another loop's, here made by renaming
// them) resumes through FitOptions::resume_position, to the uninterrupted
// result; without it the missing entry is named.
TEST(ModelTest, AnotherLoopsCheckpointResumesThroughResumePosition) {
  auto train = Classification(32, 71);
  const std::string dir = ::testing::TempDir() + "/hapi_other_loop";
  std::filesystem::remove_all(dir);
  FitOptions options{.epochs = 3, .batch_size = 4, .seed = 5};
  auto straight = Prepared(2);
  ASSERT_TRUE(straight->fit(train, options).ok());

  options.checkpoint = {.dir = dir, .every_steps = 3};
  std::vector<std::string> events;
  FitOptions ending = options;
  ending.callbacks = {MakeCallback<Bookkeeper>(int64_t{6}, &events)};  // epoch 2, step 2 of 4
  ASSERT_TRUE(Prepared(2)->fit(train, ending).ok());
  const std::string path = dir + "/step-6.ckpt";
  absl::StatusOr<nn::Checkpoint> ck = nn::LoadCheckpoint(path);
  ASSERT_TRUE(ck.ok()) << ck.status();
  nn::Checkpoint renamed = *ck;
  for (const char* key : {"hapi.epoch", "hapi.epoch_steps", "hapi.epoch_loss_sum"}) {
    ASSERT_TRUE(renamed.metadata.contains(key)) << key;
    renamed.metadata[std::string("loop.") + (key + 5)] = renamed.metadata.at(key);
    renamed.metadata.erase(key);
  }
  ASSERT_TRUE(nn::SaveCheckpoint(path, renamed).ok());

  options.resume = true;
  auto refused = Prepared(2)->fit(train, options);
  EXPECT_TRUE(Contains(refused.status(), "missing entry \"hapi.epoch\"")) << refused.status();
  options.resume_position = [](const CheckpointExtra& extra, const std::string&) {
    return absl::StatusOr<ResumePosition>(ResumePosition{
        .epoch = static_cast<int>(std::get<int64_t>(extra.at("loop.epoch"))),
        .epoch_steps = std::get<int64_t>(extra.at("loop.epoch_steps")),
        .epoch_loss_sum = std::get<double>(extra.at("loop.epoch_loss_sum"))});
  };
  auto resumed = Prepared(2);
  auto b = resumed->fit(train, options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->steps, 12);
  ExpectCloseWeights(*resumed->state_dict(), *straight->state_dict(), 0.0);
}

struct BnNet : nn::Module {
  BnNet()
      : conv(register_module("conv", nn::Conv2d(1, 4, 3, {.padding = {1, 1}}, /*bias=*/false))),
        bn(register_module("bn", nn::BatchNorm2d(4))),
        fc(register_module("fc", nn::Linear(4 * 4 * 4, 3))) {}
  nn::Tensor forward(const nn::Tensor& x) override {
    return fc(nn::relu(bn(conv(x.reshape({x.size(0), 1, 4, 4})))).flatten(1));
  }
  nn::Conv2d conv;
  nn::BatchNorm2d bn;
  nn::Linear fc;
};

// With sync_batch_norm, 2 ranks' BatchNorm statistics are those of the global
// batch: the fit equals one rank's with the global batch, running statistics too.
TEST(ModelTest, SyncBatchNormFitOnTwoRanksEqualsOneRank) {
  nn::manual_seed(13);
  nn::Tensor x = nn::randn({32, 16});
  auto labels = nn::from_vector(std::vector<int64_t>(32, 1), {32}, {.dtype = nn::kInt64});
  for (int64_t i = 0; i < 32; i += 3) labels.host_data<int64_t>()[i] = 2;
  auto train = std::make_shared<data::TensorDataset>(x, labels);
  std::map<int, nn::StateDict> weights;
  for (int ranks : {1, 2}) {
    Model model([] { return std::make_shared<BnNet>(); }, Cpu(ranks));
    model.prepare(AdamFactory(1e-2), CrossEntropy());
    auto h = model.fit(train, {.epochs = 2, .batch_size = 8 / ranks, .sync_batch_norm = true});
    ASSERT_TRUE(h.ok()) << h.status();
    weights[ranks] = *model.state_dict();
  }
  ExpectCloseWeights(weights[2], weights[1], 1e-5);
}


// Precision, Recall and Mean against counts made by hand.
TEST(MetricsTest, PrecisionRecallAndMeanCountByHand) {
  // outputs > 0.5 predict 1: predictions 1 1 0 1 0 against labels 1 0 1 1 0:
  // tp 2, fp 1, fn 1.
  nn::Tensor out = nn::from_vector(std::vector<float>{0.9f, 0.6f, 0.2f, 0.7f, 0.1f}, {5, 1});
  nn::Tensor labels = nn::from_vector(std::vector<int64_t>{1, 0, 1, 1, 0}, {5},
                                      {.dtype = nn::kInt64});
  Precision precision;
  Recall recall;
  Mean mean("out");
  precision.update(out, labels);
  recall.update(out, labels);
  mean.update(out, labels);
  EXPECT_EQ(precision.name(), "precision");
  EXPECT_EQ(recall.name(), "recall");
  EXPECT_DOUBLE_EQ(precision.value(), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(recall.value(), 2.0 / 3.0);
  recall.update(nn::from_vector(std::vector<float>{0.1f}, {1}),
                nn::from_vector(std::vector<int64_t>{1}, {1}, {.dtype = nn::kInt64}));
  EXPECT_DOUBLE_EQ(recall.value(), 2.0 / 4.0);  // one more false negative
  EXPECT_NEAR(mean.value(), (0.9 + 0.6 + 0.2 + 0.7 + 0.1) / 5, 1e-7);
  EXPECT_THROW(precision.update(out, nn::full({5}, 2.0)), Error);  // not a binary label
}

// A diverged model's NaN scores are wrong answers: every comparison with NaN
// is false, so counted as numbers a row of NaN had nothing above its label and
// scored 100% (train_mnist --lr=inf once reported "best test accuracy 100.00%").
TEST(MetricsTest, AccuracyCountsNanScoresAsWrong) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const nn::Tensor labels =
      nn::from_vector(std::vector<int64_t>{0, 1, 2, 2}, {4}, {.dtype = nn::kInt64});
  // Rows: all NaN; NaN at the label only; NaN above a finite label score; all
  // numbers, the label's the largest.
  const nn::Tensor out = nn::from_vector(
      std::vector<float>{nan, nan, nan, 0.1f, nan, 0.2f, 0.1f, nan, 0.9f, 0.1f, 0.2f, 0.7f},
      {4, 3});
  Accuracy top1;
  Accuracy top2(2);
  top1.update(out, labels);
  top2.update(out, labels);
  EXPECT_DOUBLE_EQ(top1.value(), 1.0 / 4.0);  // only the last row
  EXPECT_DOUBLE_EQ(top2.value(), 2.0 / 4.0);  // and row 2: only the NaN beats its 0.9
}

TEST(ModelTest, BadInputsGetOneClearErrorEach) {
  auto train = Classification(16, 9);
  {
    Model model([] { return std::make_shared<Net>(); }, Cpu(1));
    auto h = model.fit(train);
    EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition) << h.status();
    EXPECT_TRUE(Contains(h.status(), "call prepare(optimizer, loss, metrics) first"));
  }
  auto model = Prepared(2);
  auto empty = std::make_shared<data::TensorDataset>(nn::zeros({0, 4}),
                                                     nn::zeros({0}, {.dtype = nn::kInt64}));
  EXPECT_TRUE(Contains(model->fit(empty).status(), "the training data is empty (0 examples)"));
  EXPECT_TRUE(Contains(model->fit(train, {.eval_data = empty}).status(),
                       "fit: eval_data is empty (0 examples)"));
  EXPECT_TRUE(Contains(model->evaluate(empty).status(), "evaluate: the data is empty"));
  EXPECT_TRUE(Contains(model->fit(train, {.batch_size = 0}).status(), "fit: batch_size = 0"));
  EXPECT_TRUE(Contains(model->fit(train, {.resume = true}).status(),
                       "fit: resume needs checkpoint.dir"));
  EXPECT_TRUE(Contains(model->fit(train, {.drop_last = true, .uneven = true}).status(),
                       "fit: uneven = true with drop_last = true"));
  EXPECT_TRUE(Contains(model->fit(train, {.uneven = true, .checkpoint = {.dir = "/tmp/x"}}).status(),
                       "fit: uneven = true with checkpoint.dir"));
  EXPECT_TRUE(Contains(model->fit(train, {.max_steps_per_epoch = -1}).status(),
                       "fit: max_steps_per_epoch = -1"));
  EXPECT_TRUE(Contains(model->fit(train, {.zero = true, .cuda_graph = true}).status(),
                       "fit: cuda_graph with grad_accum_steps > 1, zero or uneven"));
  EXPECT_TRUE(Contains(model->fit(train, {.cuda_graph = true}).status(),
                       "fit: cuda_graph needs a CUDA rank; this rank runs on cpu"));
  // Labels of the wrong dtype and out of range: the loss names them, on the rank.
  auto float_labels = std::make_shared<data::TensorDataset>(nn::randn({8, 4}), nn::zeros({8}));
  auto s = model->fit(float_labels, {.batch_size = 4}).status();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "rank")) << s;
  EXPECT_TRUE(Contains(s, "float32")) << s;
  auto out_of_range = std::make_shared<data::TensorDataset>(
      nn::randn({8, 4}), nn::full({8}, 7, {.dtype = nn::kInt64}));
  s = model->fit(out_of_range, {.batch_size = 4}).status();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "7")) << s;
  // A metric that does not match the output: top-5 of 3 classes.
  Model top5([] { return std::make_shared<Net>(); }, Cpu(2));
  top5.prepare(AdamFactory(1e-2), CrossEntropy(), {MakeMetric<Accuracy>(5)});
  s = top5.evaluate(train).status();
  EXPECT_TRUE(Contains(s, "metric acc_top5: top-5 of 3 classes")) << s;
}

// The same fit() inside a rank's function, tested with tandem::testing: a
// callback reports each step to the StepLog, so CheckEquivalence compares 2
// ranks with 1 step by step, and an injected fault ends the run naming the rank.
absl::Status FitInsideSpawn(dist::Context& ctx, testing::StepLog& log) {
  Model model([] { return std::make_shared<Net>(); });
  model.prepare(AdamFactory(1e-2), CrossEntropy());
  auto h = model.fit(Classification(32, 10),
                     {.epochs = 2, .batch_size = 8 / ctx.world_size(), .seed = 3,
                      .callbacks = {testing::StepLogReport(&log)}});
  return h.status();
}

TEST(ModelTest, FitInsideARanksFunctionIsEquivalentAndFailsCleanly) {
  testing::EquivalenceReport report;
  absl::Status s = testing::CheckEquivalence(FitInsideSpawn, {.ranks = 2}, &report);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(report.steps_compared, 8);

  testing::RunOptions options{.ranks = 2};
  options.faults = {{.action = testing::FaultAction::kThrow, .rank = 1, .step = 3,
                     .error = absl::InternalError("injected")}};
  s = testing::RunRanks(FitInsideSpawn, options);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "rank 1")) << s;
  EXPECT_TRUE(Contains(s, "injected")) << s;
}

}  // namespace
}  // namespace tandem::hapi
