// hapi::Model::fit under in-process restarts (FitOptions::snapshot_every_steps,
// SpawnOptions::restart) on CPU ranks: a fault injected by tandem::testing's
// fault plan (a throw, an error returned) in a fit inside a rank's function,
// and a callback's throw in a fit from main (ZeRO included), against the
// fault-free fit, bit for bit, with a snapshot every step and every 3 steps;
// the history and step counts; nothing stored without a restart policy; a
// world shrink keeping the global batch; the refused combinations.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/layers.h"
#include "nn/nn.h"
#include "optim/adam.h"
#include "optim/lr_scheduler.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"

namespace tandem::hapi {
namespace {

// Dropout: the steps redone after a restart draw the same masks only when the
// generator comes back with the snapshot.
struct Net : nn::Module {
  explicit Net(double dropout = 0.25)
      : l1(register_module("l1", nn::Linear(4, 8))),
        drop(register_module("drop", nn::Dropout(dropout))),
        l2(register_module("l2", nn::Linear(8, 3))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return l2(drop(nn::relu(l1(x)))); }
  nn::Linear l1;
  nn::Dropout drop;
  nn::Linear l2;
};

using ::tandem::testing::Classification;

OptimizerFactory AdamFactory() {
  return [](std::vector<nn::Tensor> params) {
    return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = 1e-2});
  };
}

bool Contains(const absl::Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

// 32 training examples, 2 ranks of batch 4: 4 steps an epoch, 3 epochs.
constexpr int64_t kStepsPerEpoch = 4;
constexpr int kEpochs = 3;

const std::shared_ptr<const data::Dataset>& TrainData() {
  static const auto* d = new std::shared_ptr<const data::Dataset>(Classification(32, 21));
  return *d;
}
const std::shared_ptr<const data::Dataset>& TestData() {
  static const auto* d = new std::shared_ptr<const data::Dataset>(Classification(12, 22));
  return *d;
}

// What each rank's fit returned (the last attempt's).
struct Histories {
  std::mutex mu;
  std::map<int, History> by_rank;
};

// Reports every step to the StepLog (loss and parameters); a planned fault
// fires there. kReturnError's status is kept for the function to return.
struct Report : Callback {
  Report(testing::StepLog* log, absl::Status* returned) : log(log), returned(returned) {}
  std::string name() const override { return "Report"; }
  void on_train_batch_end(RunState& s) override {
    absl::Status st = log->EndStep(s.batch_loss.item(), *s.network);
    if (!st.ok()) {
      *returned = st;
      throw Error(std::string(st.message()));
    }
  }
  // Its own entry in every snapshot, checked when a restart brings it back.
  void on_checkpoint_save(RunState& s, CheckpointExtra& extra) override {
    if (!s.saving_snapshot) throw Error("on_checkpoint_save outside a snapshot");
    extra["report.step"] = s.step;
  }
  void on_checkpoint_load(RunState& s, const ResumeInfo& info) override {
    auto it = info.extra.find("report.step");
    if (!info.snapshot || it == info.extra.end() || std::get<int64_t>(it->second) != info.step ||
        s.step != info.step)
      throw Error("on_checkpoint_load: not this callback's snapshot of step " +
                  std::to_string(info.step));
  }
  testing::StepLog* log;
  absl::Status* returned;
};

// A fit inside a rank's function, as a program written with hapi would run
// it: a fresh Model on every attempt, the fit restoring its own snapshot.
testing::TrainingFunction FitWithSnapshots(int64_t every, Histories* out) {
  return [every, out](dist::Context& ctx, testing::StepLog& log) -> absl::Status {
    Model model([] { return std::make_shared<Net>(); });
    model.prepare(AdamFactory(), CrossEntropy(), {MakeMetric<Accuracy>()});
    absl::Status returned;
    testing::StepLog* log_ptr = &log;
    absl::Status* returned_ptr = &returned;
    FitOptions options{.epochs = kEpochs,
                       .batch_size = 8 / ctx.attempt_info().first_world_size,
                       .seed = 3,
                       .eval_data = TestData(),
                       .snapshot_every_steps = every,
                       .callbacks = {[=] { return std::make_unique<Report>(log_ptr, returned_ptr); }}};
    absl::StatusOr<History> h;
    try {
      h = model.fit(TrainData(), options);
    } catch (const std::exception&) {
      if (!returned.ok()) return returned;  // kReturnError: the function returns it
      throw;
    }
    if (!h.ok()) return h.status();
    std::lock_guard<std::mutex> lock(out->mu);
    out->by_rank[ctx.rank()] = *h;
    return absl::OkStatus();
  };
}

testing::RunOptions WithRestarts(int ranks) {
  testing::RunOptions options{.ranks = ranks};
  options.spawn.restart = {.max_restarts = 1};
  return options;
}

void ExpectSameRecords(const testing::RunReport& got, const testing::RunReport& want) {
  ASSERT_EQ(got.ranks.size(), want.ranks.size());
  for (size_t r = 0; r < got.ranks.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_EQ(got.ranks[r].losses.size(), want.ranks[r].losses.size());
    for (size_t i = 0; i < got.ranks[r].losses.size(); ++i)
      EXPECT_EQ(got.ranks[r].losses[i], want.ranks[r].losses[i]) << "step " << i;
    ASSERT_EQ(got.ranks[r].parameters.size(), want.ranks[r].parameters.size());
    for (size_t i = 0; i < got.ranks[r].parameters.size(); ++i) {
      for (size_t p = 0; p < got.ranks[r].parameters[i].size(); ++p) {
        EXPECT_EQ(got.ranks[r].parameters[i][p].values, want.ranks[r].parameters[i][p].values)
            << "step " << i << ", " << got.ranks[r].parameters[i][p].name;
      }
    }
  }
}

void ExpectSameEpochs(const History& got, const History& want) {
  ASSERT_EQ(got.epochs.size(), want.epochs.size());
  for (size_t e = 0; e < got.epochs.size(); ++e) EXPECT_EQ(got.epochs[e], want.epochs[e]) << e;
  EXPECT_EQ(got.steps, want.steps);
}

struct FaultCase {
  testing::FaultAction action;
  int rank;
  int64_t step;           // the StepLog's step (0: the first) at which it fires
  int64_t every;          // FitOptions::snapshot_every_steps
  int64_t restored_step;  // the snapshot's step the restart resumes from
};

class FitRestartTest : public ::testing::TestWithParam<FaultCase> {};

// With a snapshot every step, or every 3, the fit restarted after the fault
// ends with every loss, every parameter at every step and every epoch's logs
// of the fault-free fit, bit for bit; at most `every` steps ran again.
TEST_P(FitRestartTest, RestartedFitEqualsTheFaultFreeFit) {
  const FaultCase c = GetParam();
  TrainData(), TestData();  // made here: Classification seeds the calling thread's generator
  Histories straight_h;
  testing::RunReport straight;
  absl::Status s = testing::RunRanks(FitWithSnapshots(c.every, &straight_h), WithRestarts(2),
                                     &straight);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(straight.attempts, 1);
  ASSERT_EQ(straight_h.by_rank[0].steps, kEpochs * kStepsPerEpoch);
  EXPECT_EQ(straight_h.by_rank[0].snapshots, kEpochs * kStepsPerEpoch / c.every);
  EXPECT_EQ(straight_h.by_rank[0].restored_snapshot_step, -1);

  Histories faulted_h;
  testing::RunReport faulted;
  testing::RunOptions options = WithRestarts(2);
  options.faults = {{.action = c.action, .rank = c.rank, .step = c.step,
                     .error = absl::InternalError("injected")}};
  s = testing::RunRanks(FitWithSnapshots(c.every, &faulted_h), options, &faulted);
  ASSERT_TRUE(s.ok()) << s << "\n" << faulted.log;
  ASSERT_EQ(faulted.faults.size(), 1u);
  EXPECT_EQ(faulted.attempts, 2);
  // The restart resumed from the newest snapshot both ranks stored: the fault
  // at step c.step (0-based) ran c.step + 1 - restored_step steps again.
  EXPECT_LE(c.step + 1 - c.restored_step, c.every);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const History& h = faulted_h.by_rank[r];
    EXPECT_EQ(h.restored_snapshot_step, c.restored_step);
    EXPECT_EQ(h.snapshots, straight_h.by_rank[r].snapshots);
    ExpectSameEpochs(h, straight_h.by_rank[r]);
  }
  EXPECT_NE(faulted.log.find("fit: attempt 1 resumes from the snapshot of step " +
                             std::to_string(c.restored_step)),
            std::string::npos)
      << faulted.log;
  ExpectSameRecords(faulted, straight);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FitRestartTest,
    ::testing::Values(
        // Every step: the snapshot of the step before the fault's.
        FaultCase{testing::FaultAction::kThrow, 1, 5, 1, 5},
        FaultCase{testing::FaultAction::kReturnError, 0, 6, 1, 6},
        // Every 3 steps: steps 7-8 (the fault at step index 7, step 8) run again
        // after the snapshot of step 6; at index 4 (epoch 2's first step) steps
        // 4-5 after the snapshot of step 3, the end of epoch 1 (its evaluation,
        // its logs) among them.
        FaultCase{testing::FaultAction::kThrow, 0, 7, 3, 6},
        FaultCase{testing::FaultAction::kReturnError, 1, 7, 3, 6},
        FaultCase{testing::FaultAction::kThrow, 1, 4, 3, 3},
        FaultCase{testing::FaultAction::kReturnError, 0, 10, 3, 9}),
    [](const ::testing::TestParamInfo<FaultCase>& info) {
      const FaultCase& c = info.param;
      return std::string(c.action == testing::FaultAction::kThrow ? "Throw" : "ReturnError") +
             "AtStep" + std::to_string(c.step) + "Every" + std::to_string(c.every);
    });

// A fault before the first snapshot: the fit starts again from the beginning.
TEST(FitRestartTest, AFaultBeforeTheFirstSnapshotStartsTheFitAgain) {
  TrainData(), TestData();
  Histories straight_h, faulted_h;
  testing::RunReport straight, faulted;
  ASSERT_TRUE(testing::RunRanks(FitWithSnapshots(3, &straight_h), WithRestarts(2), &straight).ok());
  testing::RunOptions options = WithRestarts(2);
  options.faults = {{.action = testing::FaultAction::kThrow, .rank = 1, .step = 1}};
  absl::Status s = testing::RunRanks(FitWithSnapshots(3, &faulted_h), options, &faulted);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(faulted.attempts, 2);
  EXPECT_EQ(faulted_h.by_rank[0].restored_snapshot_step, -1);
  ExpectSameEpochs(faulted_h.by_rank[0], straight_h.by_rank[0]);
  ExpectSameRecords(faulted, straight);
}

// Without a restart policy the run keeps no snapshots: fit stores none (and a
// fault ends the run).
TEST(FitRestartTest, WithoutARestartPolicyNothingIsStored) {
  TrainData(), TestData();
  Histories h;
  testing::RunReport report;
  absl::Status s = testing::RunRanks(FitWithSnapshots(1, &h), {.ranks = 2}, &report);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(h.by_rank[0].snapshots, 0);
  EXPECT_EQ(h.by_rank[0].steps, kEpochs * kStepsPerEpoch);
  testing::RunOptions options{.ranks = 2};
  options.faults = {{.action = testing::FaultAction::kThrow, .rank = 1, .step = 5,
                     .error = absl::InternalError("injected")}};
  s = testing::RunRanks(FitWithSnapshots(1, &h), options, &report);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "injected")) << s;
  EXPECT_EQ(report.attempts, 1);
}

// A fit from main with LaunchOptions::spawn.restart: rank 1's callback throws
// once (attempt 0, after step 6); the model after fit, and the history, are
// those of the fault-free fit, bit for bit, with and without ZeRO (whose
// snapshots hold the gathered, unsharded optimizer state).
struct ThrowOnce : Callback {
  std::string name() const override { return "ThrowOnce"; }
  void on_train_batch_end(RunState& s) override {
    if (s.ctx->attempt() == 0 && s.ctx->rank() == 1 && s.step == 6) throw Error("injected");
  }
};

TEST(FitRestartTest, AFitFromMainRestartsFromItsSnapshot) {
  TrainData(), TestData();
  for (bool zero : {false, true}) {
    SCOPED_TRACE(zero ? "zero" : "unsharded");
    auto make = [] {
      LaunchOptions launch{.gpus = "cpu", .nprocs = 2,
                           .spawn = testing::DefaultTestSpawnOptions()};
      launch.spawn.restart = {.max_restarts = 1};
      auto m = std::make_unique<Model>([] { return std::make_shared<Net>(); }, launch);
      m->prepare(AdamFactory(), CrossEntropy(), {MakeMetric<Accuracy>()});
      return m;
    };
    FitOptions options{.epochs = kEpochs, .batch_size = 4, .seed = 3, .eval_data = TestData(),
                       .zero = zero, .snapshot_every_steps = 2};
    auto straight = make();
    absl::StatusOr<History> a = straight->fit(TrainData(), options);
    ASSERT_TRUE(a.ok()) << a.status();
    auto faulted = make();
    options.callbacks = {MakeCallback<ThrowOnce>()};
    absl::StatusOr<History> b = faulted->fit(TrainData(), options);
    ASSERT_TRUE(b.ok()) << b.status();
    // Step 6's snapshot: rank 0's only (rank 1 threw before its own).
    EXPECT_EQ(b->restored_snapshot_step, 4);
    EXPECT_EQ(b->snapshots, a->snapshots);
    ExpectSameEpochs(*b, *a);
    absl::StatusOr<nn::StateDict> wa = straight->state_dict(), wb = faulted->state_dict();
    ASSERT_TRUE(wa.ok() && wb.ok());
    ASSERT_EQ(wa->size(), wb->size());
    for (size_t i = 0; i < wa->size(); ++i)
      EXPECT_EQ((*wb)[i].second.to_vector<float>(), (*wa)[i].second.to_vector<float>())
          << (*wa)[i].first;
  }
}

// The built-in callbacks with state carry it through the snapshot: the
// learning-rate schedule's position (StepLR by step) and EarlyStopping's best
// value and wait. EarlyStopping (patience 2, an improvement of 10 never made)
// stops after epoch 3; the fault after step 10 resumes from step 8, before
// epoch 2's end, whose EarlyStopping had seen epoch 1 only.
TEST(FitRestartTest, CallbackStateComesBackWithTheSnapshot) {
  TrainData(), TestData();
  auto make = [] {
    LaunchOptions launch{.gpus = "cpu", .nprocs = 2, .spawn = testing::DefaultTestSpawnOptions()};
    launch.spawn.restart = {.max_restarts = 1};
    auto m = std::make_unique<Model>([] { return std::make_shared<Net>(); }, launch);
    m->prepare(AdamFactory(), CrossEntropy());
    return m;
  };
  struct ThrowAt10 : Callback {
    std::string name() const override { return "ThrowAt10"; }
    void on_train_batch_end(RunState& s) override {
      if (s.ctx->attempt() == 0 && s.ctx->rank() == 0 && s.step == 10) throw Error("injected");
    }
  };
  FitOptions options{.epochs = 6, .batch_size = 4, .seed = 3, .snapshot_every_steps = 4};
  options.callbacks = {
      MakeCallback<LRSchedulerCallback>(LRSchedulerCallback::Factory(
          [](optim::Optimizer& o) { return std::make_unique<optim::StepLR>(o, 3, 0.5); })),
      MakeCallback<EarlyStopping>(std::string("loss"), 2, std::string("min"), 10.0)};
  // MetricsLogger: the faulted fit wrote epoch 2's line (step 8) before the
  // fault; resumed inside epoch 2, it drops that line and writes it again,
  // keeping the lines of another run earlier in the file.
  const std::string straight_log = ::testing::TempDir() + "fit_restart_metrics_straight.jsonl";
  const std::string faulted_log = ::testing::TempDir() + "fit_restart_metrics_faulted.jsonl";
  // Both files begin with another run's lines, which stay.
  for (const std::string& path : {straight_log, faulted_log}) {
    std::ofstream other(path, std::ios::trunc);
    for (int e = 0; e < 5; ++e) other << "{\"epoch\": " << e << ", \"step\": " << 10 * (e + 1) << "}\n";
  }
  const std::vector<CallbackFactory> callbacks = options.callbacks;
  auto straight = make();
  options.callbacks.push_back(MakeCallback<MetricsLogger>(straight_log));
  absl::StatusOr<History> a = straight->fit(TrainData(), options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->epochs.size(), 3u);
  auto faulted = make();
  options.callbacks = callbacks;
  options.callbacks.push_back(MakeCallback<MetricsLogger>(faulted_log));
  options.callbacks.push_back(MakeCallback<ThrowAt10>());
  absl::StatusOr<History> b = faulted->fit(TrainData(), options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->restored_snapshot_step, 8);
  ExpectSameEpochs(*b, *a);
  auto lines = [](const std::string& path) {
    std::ifstream in(path);
    std::vector<std::string> out;
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  EXPECT_EQ(lines(straight_log).size(), 5u + 3u);
  EXPECT_EQ(lines(faulted_log), lines(straight_log));
  absl::StatusOr<nn::StateDict> wa = straight->state_dict(), wb = faulted->state_dict();
  ASSERT_TRUE(wa.ok() && wb.ok());
  for (size_t i = 0; i < wa->size(); ++i)
    EXPECT_EQ((*wb)[i].second.to_vector<float>(), (*wa)[i].second.to_vector<float>())
        << (*wa)[i].first;
}

// RestartPolicy::leave_out_failed_rank: 3 ranks of batch B, rank 2 fails
// after step `fail_step` of the first epoch; the 2 ranks left share the global
// batch of 3 B (B = 2: 3 rows each; B = 3: 5 and 4, weighed by their rows) and
// finish the fit on the same samples per step: the step count and the last
// epoch's loss are the fault-free run's, the weights within 1e-5 (the same
// gradients summed over 2 ranks instead of 3). No dropout: a shrunk world's
// ranks keep spawn's generators, not the snapshot's.
void ExpectAWorldShrinkKeepsTheGlobalBatch(int64_t batch_size, int64_t fail_step) {
  SCOPED_TRACE(absl::StrCat("batch_size ", batch_size));
  auto make = [](bool leave_out) {
    LaunchOptions launch{.gpus = "cpu", .nprocs = 3, .spawn = testing::DefaultTestSpawnOptions()};
    launch.spawn.restart = {.max_restarts = 1, .leave_out_failed_rank = leave_out};
    auto m = std::make_unique<Model>([] { return std::make_shared<Net>(0.0); }, launch);
    m->prepare(AdamFactory(), CrossEntropy(), {MakeMetric<Accuracy>()});
    return m;
  };
  struct ThrowOnRank2 : Callback {
    explicit ThrowOnRank2(int64_t step) : step_(step) {}
    std::string name() const override { return "ThrowOnRank2"; }
    void on_train_batch_end(RunState& s) override {
      if (s.ctx->attempt() == 0 && s.ctx->rank() == 2 && s.step == step_) throw Error("injected");
    }
    int64_t step_;
  };
  auto train = Classification(36, 31);
  const int64_t steps = 2 * (36 / (3 * batch_size));
  FitOptions options{.epochs = 2, .batch_size = batch_size, .seed = 3, .snapshot_every_steps = 1};
  auto straight = make(true);
  absl::StatusOr<History> a = straight->fit(train, options);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->steps, steps);
  auto shrunk = make(true);
  options.callbacks = {MakeCallback<ThrowOnRank2>(fail_step)};
  absl::StatusOr<History> b = shrunk->fit(train, options);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->restored_snapshot_step, fail_step - 1);
  EXPECT_EQ(b->steps, steps);
  ASSERT_EQ(b->epochs.size(), 2u);
  // Epoch 2 ran on 2 ranks throughout: its mean loss is over the same samples.
  // Epoch 1's leaves out the failed rank's steps before the snapshot.
  EXPECT_NEAR(b->epochs[1].at("loss"), a->epochs[1].at("loss"), 1e-5);
  EXPECT_NE(b->epochs[0].at("loss"), a->epochs[0].at("loss"));
  absl::StatusOr<nn::StateDict> wa = straight->state_dict(), wb = shrunk->state_dict();
  ASSERT_TRUE(wa.ok() && wb.ok());
  double largest = 0;
  for (size_t i = 0; i < wa->size(); ++i) {
    std::vector<float> x = (*wb)[i].second.to_vector<float>(), y = (*wa)[i].second.to_vector<float>();
    for (size_t j = 0; j < x.size(); ++j) {
      EXPECT_NEAR(x[j], y[j], 1e-5 * (1 + std::abs(y[j]))) << (*wa)[i].first << "[" << j << "]";
      largest = std::max(largest, std::abs(static_cast<double>(x[j]) - y[j]) / (1 + std::abs(y[j])));
    }
  }
  std::printf("batch_size %lld on 3 ranks, then 2: weights within %.3g of the fault-free fit\n",
              static_cast<long long>(batch_size), largest);
}

TEST(FitRestartTest, AWorldShrinkKeepsTheGlobalBatch) { ExpectAWorldShrinkKeepsTheGlobalBatch(2, 5); }

TEST(FitRestartTest, AWorldShrinkKeepsAGlobalBatchTheRanksLeftDoNotDivide) {
  ExpectAWorldShrinkKeepsTheGlobalBatch(3, 2);
}

// uneven = true (join(), which weighs each rank by its rows itself) without
// snapshots: after rank 2's failure the fit starts again on 2 ranks sharing the
// global batch of 9 unevenly (5 and 4) and runs every step.
TEST(FitRestartTest, UnevenDataWithAShrinkToUnevenSharesStartsAgain) {
  LaunchOptions launch{.gpus = "cpu", .nprocs = 3, .spawn = testing::DefaultTestSpawnOptions()};
  launch.spawn.restart = {.max_restarts = 1, .leave_out_failed_rank = true};
  Model m([] { return std::make_shared<Net>(0.0); }, launch);
  m.prepare(AdamFactory(), CrossEntropy(), {MakeMetric<Accuracy>()});
  struct ThrowOnRank2 : Callback {
    std::string name() const override { return "ThrowOnRank2"; }
    void on_train_batch_end(RunState& s) override {
      if (s.ctx->attempt() == 0 && s.ctx->rank() == 2 && s.step == 2) throw Error("injected");
    }
  };
  FitOptions options{.epochs = 1, .batch_size = 3, .seed = 3, .uneven = true};
  options.callbacks = {MakeCallback<ThrowOnRank2>()};
  absl::StatusOr<History> h = m.fit(Classification(36, 31), options);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->steps, 4);  // 36 rows, 9 a step
  EXPECT_EQ(h->restored_snapshot_step, -1);  // no snapshots: from the start
  ASSERT_EQ(h->epochs.size(), 1u);
  EXPECT_TRUE(std::isfinite(h->epochs[0].at("loss")));
}

// What snapshots cannot hold is refused at the first call, naming both.
TEST(FitRestartTest, CombinationsThatCannotWorkAreRefused) {
  TrainData(), TestData();
  LaunchOptions launch{.gpus = "cpu", .nprocs = 3, .spawn = testing::DefaultTestSpawnOptions()};
  launch.spawn.restart = {.max_restarts = 2, .leave_out_failed_rank = true};
  Model model([] { return std::make_shared<Net>(); }, launch);
  model.prepare(AdamFactory(), CrossEntropy());
  absl::Status s =
      model.fit(TrainData(), {.batch_size = 4, .uneven = true, .snapshot_every_steps = 1}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "uneven = true with snapshot_every_steps = 1")) << s;
  EXPECT_TRUE(Contains(s, "max_restarts = 2")) << s;
  // 3 ranks of 3 with accumulation: a world of 2 would share the global batch
  // of 9 unevenly, which is weighed for one micro-batch a step only.
  s = model.fit(TrainData(), {.batch_size = 3, .grad_accum_steps = 2, .snapshot_every_steps = 1})
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(s, "batch_size = 3 on 3 ranks with RestartPolicy::leave_out_failed_rank "
                          "and grad_accum_steps = 2: a world of 2 ranks would share the global "
                          "batch of 9 rows unevenly")) << s;
  s = model.fit(TrainData(), {.snapshot_every_steps = -2}).status();
  EXPECT_TRUE(Contains(s, "snapshot_every_steps = -2: must be >= 0")) << s;
  // Without snapshots uneven data restarts from the start: allowed.
  Model plain([] { return std::make_shared<Net>(); }, launch);
  plain.prepare(AdamFactory(), CrossEntropy());
  s = plain.fit(TrainData(), {.batch_size = 4, .uneven = true}).status();
  EXPECT_TRUE(s.ok()) << s;

  // Inside a rank's function: the same refusal on every rank at the first call.
  testing::RunOptions options = WithRestarts(2);
  options.spawn.restart.max_restarts = 0;  // a restart policy of none keeps no snapshots
  auto uneven_fit = [](dist::Context&, testing::StepLog&) -> absl::Status {
    Model m([] { return std::make_shared<Net>(); });
    m.prepare(AdamFactory(), CrossEntropy());
    return m.fit(TrainData(), {.batch_size = 4, .uneven = true, .snapshot_every_steps = 2}).status();
  };
  EXPECT_TRUE(testing::RunRanks(uneven_fit, options).ok());
  options.spawn.restart.max_restarts = 1;
  s = testing::RunRanks(uneven_fit, options);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "uneven = true with snapshot_every_steps = 2 under a restart policy"))
      << s;
}

}  // namespace
}  // namespace tandem::hapi
