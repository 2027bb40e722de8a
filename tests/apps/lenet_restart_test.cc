// In-process restarts (SpawnOptions::restart, spawn/restart.h) on a real
// model: LeNet (apps::MakeLeNet) on a subset of Fashion-MNIST, 2 CPU ranks
// under DataParallel, SGD with momentum, a shuffled DistributedBatchSampler
// behind a DataLoader with a worker thread, and input dropout (each rank's
// generator). A rank throws at a chosen step; the run restarts from the
// in-memory snapshot taken every K steps and must end, at every step, with the
// same losses and parameters, bit for bit, as the run without the fault:
// K = 1 (nothing redone but the failed step) and K = 5 (the steps since the
// snapshot redone, across an epoch boundary). Skips when the data set is not
// installed (Debian: dataset-fashion-mnist).
#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "apps/models.h"
#include "data/dataloader.h"
#include "data/readers.h"
#include "data/sampler.h"
#include "data/transforms.h"
#include "gtest/gtest.h"
#include "nn/ops/dropout.h"
#include "nn/ops/loss.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint.h"
#include "testing/run.h"

namespace tandem::testing {
namespace {

constexpr char kDataDir[] = "/usr/share/datasets/fashion-mnist";
constexpr int64_t kRows = 256;    // the first 256 training images
constexpr int64_t kPerRank = 16;  // images per rank and step: 8 steps an epoch on 2 ranks
constexpr int kSteps = 14;

bool Contains(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

// The subset, loaded once (null when the data set is missing).
std::shared_ptr<const data::Dataset> TrainSubset() {
  static const std::shared_ptr<const data::Dataset> subset =
      []() -> std::shared_ptr<const data::Dataset> {
    if (!std::filesystem::exists(std::string(kDataDir) + "/train-images-idx3-ubyte.gz")) {
      return nullptr;
    }
    absl::StatusOr<data::TensorDataset> all = data::LoadMnist(kDataDir, /*train=*/true);
    if (!all.ok()) {
      ADD_FAILURE() << all.status();
      return nullptr;
    }
    return std::make_shared<data::TensorDataset>(all->data().slice(0, kRows).clone(),
                                                 all->targets().slice(0, kRows).clone());
  }();
  return subset;
}

struct Knobs {
  int snapshot_every = 1;  // K
  // Steps each rank ran, over every attempt (may be null).
  std::shared_ptr<std::vector<std::atomic<int>>> steps_run;
};

absl::Status TrainLeNet(dist::Context& ctx, StepLog& log, const Knobs& k) {
  const std::shared_ptr<const data::Dataset> train = TrainSubset();
  std::shared_ptr<nn::Module> net = apps::MakeLeNet();
  dist::DataParallel dp(*net, ctx);
  optim::SGD sgd(net->parameters(), {.lr = 0.05, .momentum = 0.9});
  auto sampler = std::make_shared<data::DistributedBatchSampler>(
      train->size(), kPerRank, ctx.world_size(), ctx.rank(), /*shuffle=*/true,
      /*drop_last=*/false, /*seed=*/3);
  data::DataLoader loader(
      train, sampler,
      {.num_workers = 1,
       .prefetch = 2,
       .batch_transform = std::make_shared<data::ToFloatNormalize>(
           1.0 / 255, std::vector<double>{0.2860}, std::vector<double>{0.3530})});
  int64_t step = 0;
  dist::TrainingState state{.model = net.get(), .optimizer = &sgd, .loader = &loader, .step = &step};
  ASSIGN_OR_RETURN(const bool restored, dist::RestoreSnapshot(ctx, state));
  if (restored) ctx.log().Info("attempt {} resumes at step {}", ctx.attempt(), step);
  loader.start_epoch();
  while (step < kSteps) {
    std::optional<data::Batch> batch = loader.next();
    if (!batch.has_value()) {
      loader.start_epoch();
      continue;
    }
    // Input dropout draws from this rank's generator: the snapshot must restore it.
    nn::Tensor x = nn::dropout(batch->data, 0.1, /*training=*/true);
    nn::Tensor loss = nn::cross_entropy(dp(x), batch->target);
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    if (k.steps_run) ++(*k.steps_run)[ctx.rank()];
    if (step % k.snapshot_every == 0) RETURN_IF_ERROR(dist::SaveSnapshot(ctx, state));
    RETURN_IF_ERROR(log.EndStep(loss, *net));
  }
  return absl::OkStatus();
}

RunOptions Options(std::vector<Fault> faults) {
  RunOptions options{.ranks = 2, .faults = std::move(faults)};
  options.spawn.restart = {.max_restarts = 2};
  return options;
}

RunReport RunLeNet(const Knobs& k, std::vector<Fault> faults) {
  RunReport report;
  absl::Status s = RunRanks(
      [k](dist::Context& ctx, StepLog& log) { return TrainLeNet(ctx, log, k); },
      Options(std::move(faults)), &report);
  EXPECT_TRUE(s.ok()) << s << "\n" << report.log;
  return report;
}

// Every rank's losses and parameters at every step, exactly.
void ExpectSameBits(const RunReport& expected, const RunReport& actual) {
  ASSERT_EQ(expected.ranks.size(), actual.ranks.size());
  for (size_t r = 0; r < expected.ranks.size(); ++r) {
    const RankRecord& e = expected.ranks[r];
    const RankRecord& a = actual.ranks[r];
    ASSERT_EQ(e.losses.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    ASSERT_EQ(a.losses.size(), e.losses.size()) << "rank " << r;
    for (size_t s = 0; s < e.losses.size(); ++s) {
      EXPECT_EQ(e.losses[s], a.losses[s]) << "rank " << r << " step " << s;
      ASSERT_EQ(e.parameters[s].size(), a.parameters[s].size());
      for (size_t p = 0; p < e.parameters[s].size(); ++p) {
        EXPECT_EQ(e.parameters[s][p].values, a.parameters[s][p].values)
            << "rank " << r << " step " << s << " " << e.parameters[s][p].name;
      }
    }
  }
}

class LeNetRestartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (TrainSubset() == nullptr) GTEST_SKIP() << kDataDir << " is not installed";
  }
};

// A snapshot every step: rank 1 throws after its 10th step (index 9); the
// attempt after the restart resumes from the newest step both ranks stored
// and the run is the run without the fault.
TEST_F(LeNetRestartTest, SnapshotEveryStepEndsBitForBitAsTheRunWithoutTheFault) {
  const RunReport reference = RunLeNet({.snapshot_every = 1}, {});
  EXPECT_EQ(reference.attempts, 1);
  const RunReport report =
      RunLeNet({.snapshot_every = 1}, {{.action = FaultAction::kThrow, .rank = 1, .step = 9}});
  EXPECT_EQ(report.attempts, 2) << report.log;
  EXPECT_TRUE(Contains(report.log, "spawn: restart 1 of 2 after: rank 1 (cpu) threw: injected "
                                   "fault"))
      << report.log;
  EXPECT_TRUE(Contains(report.log, "; attempt 1 resumes from the snapshot of step ")) << report.log;
  ExpectSameBits(reference, report);
}

// A snapshot every 5 steps: rank 1 throws after its 9th step (index 8, the
// first of the second epoch); the attempt resumes from step 5, runs steps 6-9
// again (the epoch boundary among them) and still ends bit for bit as the run
// without the fault: the snapshot restores the loader's epoch and position and
// each rank's generator along with the model and the momentum.
TEST_F(LeNetRestartTest, SnapshotEveryFiveStepsRedoesTheStepsSinceAndEndsBitForBit) {
  const RunReport reference = RunLeNet({.snapshot_every = 5}, {});
  auto steps_run = std::make_shared<std::vector<std::atomic<int>>>(2);
  const RunReport report = RunLeNet({.snapshot_every = 5, .steps_run = steps_run},
                               {{.action = FaultAction::kThrow, .rank = 1, .step = 8}});
  EXPECT_EQ(report.attempts, 2) << report.log;
  EXPECT_TRUE(Contains(report.log, "attempt 1 resumes from the snapshot of step 5")) << report.log;
  // Rank 1 ran 9 steps on the first attempt and steps 6-14 on the second;
  // rank 0 at most one step more before the stop reached it.
  EXPECT_EQ((*steps_run)[1].load(), 9 + (kSteps - 5));
  EXPECT_LE((*steps_run)[0].load(), 10 + (kSteps - 5));
  ExpectSameBits(reference, report);
}

}  // namespace
}  // namespace tandem::testing
