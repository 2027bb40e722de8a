// The restartable training function of the in-process restart tests
// (restart_test.cc on CPU ranks, restart_gpu_test.cc on a GPU): a small MLP
// under DataParallel with SGD and momentum, a shuffled DistributedBatchSampler
// and dropout, snapshotting every K steps, and the helpers that run it through
// testing::RunRanks and compare runs bit for bit.
#ifndef TANDEM_TESTS_SPAWN_RESTART_FIXTURE_H_
#define TANDEM_TESTS_SPAWN_RESTART_FIXTURE_H_

#include <atomic>
#include <chrono>
#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/string_view.h"
#include "data/sampler.h"
#include "gtest/gtest.h"
#include "nn/ops/dropout.h"
#include "nn/ops/index.h"
#include "nn/ops/loss.h"
#include "spawn/train/checkpoint.h"
#include "testing/run.h"
#include "tests/testing/same_bits.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

bool Contains(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

constexpr int64_t kRows = 40;    // the dataset
constexpr int64_t kPerRank = 4;  // rows per rank and step

struct Knobs {
  int steps = 12;
  int snapshot_every = 1;  // K
  // Rank 1 returns OK after this many steps (-1: never): a program error.
  int rank1_returns_after = -1;
  // Rank 1 sleeps this long, reaching no stop-aware wait, after this step (-1: never).
  int rank1_sleeps_after = -1;
  int rank1_sleep_ms = 0;
  // Rank 0 raises this signal after this step (-1: never).
  int rank0_raises_after = -1;
  int rank0_signal = 0;
  // A pause after each step, so that the watchdog's poll sees an asynchronous
  // error before the run ends.
  int step_delay_ms = 0;
  // Steps each rank ran, over every attempt (may be null).
  std::shared_ptr<std::vector<std::atomic<int>>> steps_run;
};

// A small MLP under DataParallel with SGD and momentum (optimizer state), a
// shuffled DistributedBatchSampler over a fixed dataset (a sampler position)
// and dropout (each rank's generator): every part of the snapshot matters for
// a bitwise resume.
absl::Status TrainRestartable(dist::Context& ctx, StepLog& log, const Knobs& k) {
  Mlp net;
  dist::DataParallel dp(net, ctx);
  optim::SGD sgd(net.parameters(), {.lr = 0.05, .momentum = 0.9});
  data::DistributedBatchSampler sampler(kRows, kPerRank, ctx.world_size(), ctx.rank(),
                                        /*shuffle=*/true, /*drop_last=*/false, /*seed=*/5);
  nn::Tensor data_x, data_y;
  {
    SameOnEveryRank shared(/*seed=*/11, /*step=*/0);
    data_x = nn::randn({kRows, 6});
    data_y = nn::randn({kRows, 1});
  }
  int64_t step = 0;
  dist::TrainingState state{.model = &net, .optimizer = &sgd, .sampler = &sampler, .step = &step};
  ASSIGN_OR_RETURN(const bool restored, dist::RestoreSnapshot(ctx, state));
  if (ctx.attempt() == 0 && restored) return absl::InternalError("restored on the first attempt");
  sampler.reset();
  while (step < k.steps) {
    if (ctx.rank() == 1 && step == k.rank1_returns_after) return absl::OkStatus();
    std::optional<std::vector<int64_t>> batch = sampler.next();
    if (!batch.has_value()) {
      sampler.reset();
      continue;
    }
    const nn::Tensor rows = nn::from_vector<int64_t>(*batch, {static_cast<int64_t>(batch->size())},
                                                     {.dtype = nn::kInt64});
    nn::Tensor x = nn::dropout(nn::index_select(data_x, rows), 0.25, /*training=*/true);
    nn::Tensor loss = nn::mse_loss(dp(x), nn::index_select(data_y, rows));
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    ++step;
    if (k.steps_run) ++(*k.steps_run)[ctx.rank()];
    if (step % k.snapshot_every == 0) RETURN_IF_ERROR(dist::SaveSnapshot(ctx, state));
    RETURN_IF_ERROR(log.EndStep(loss.item(), net));
    if (k.step_delay_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(k.step_delay_ms));
    if (ctx.rank() == 1 && step == k.rank1_sleeps_after) {
      std::this_thread::sleep_for(std::chrono::milliseconds(k.rank1_sleep_ms));
    }
    if (ctx.rank() == 0 && step == k.rank0_raises_after) std::raise(k.rank0_signal);
  }
  return absl::OkStatus();
}

TrainingFunction Restartable(Knobs k) {
  return [k](dist::Context& ctx, StepLog& log) { return TrainRestartable(ctx, log, k); };
}

RunOptions Options(int ranks, std::vector<Fault> faults, int max_restarts = 2,
                   double timeout_s = 30) {
  RunOptions options{.ranks = ranks, .faults = std::move(faults)};
  options.spawn.timeout_s = timeout_s;
  options.spawn.restart = {.max_restarts = max_restarts};
  return options;
}

// Every rank's losses and parameters at every step, exactly.
void ExpectSameBits(const RunReport& expected, const RunReport& actual) {
  ExpectSameLossesAndParameters(expected, actual);
}

RunReport Reference(int ranks, const Knobs& k) {
  RunReport report;
  absl::Status s = RunRanks(Restartable(k), Options(ranks, {}), &report);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(report.attempts, 1);
  return report;
}

}  // namespace
}  // namespace tandem::testing

#endif  // TANDEM_TESTS_SPAWN_RESTART_FIXTURE_H_
