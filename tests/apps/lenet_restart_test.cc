// In-process restarts (SpawnOptions::restart, spawn/restart.h) on a real
// model: LeNet (apps::MakeLeNet) on a subset of Fashion-MNIST, 2 and 4 CPU
// ranks under DataParallel, SGD with momentum, a shuffled
// DistributedBatchSampler behind a DataLoader with a worker thread, and input
// dropout (each rank's generator). One fault of tandem::testing's fault plan
// (testing/faults.h) at a chosen step: a rank throws, a rank's communicator
// reports an asynchronous error, or a rank hangs until the watchdog's timeout
// ends the collective its peers wait in. The run restarts from the in-memory
// snapshot taken every K steps and must end, at every step, with the same
// losses and parameters, bit for bit, as the run without the fault, each rank
// having run at most K steps again: K = 1 (nothing redone but what the stop
// cut short) and K = 5 (the steps since the snapshot redone, across an epoch
// boundary). Skips when the data set is not installed (Debian:
// dataset-fashion-mnist).
//
// Built with TANDEM_LENET_RESTART_SYNTHETIC (apps_lenet_restart_synthetic_test,
// also in the ThreadSanitizer build, which has no programs): 256 random
// images and labels instead of the data set, the same cases; it never skips.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "apps/models.h"
#include "data/dataloader.h"
#include "data/readers.h"
#include "data/sampler.h"
#include "data/transforms.h"
#include "gtest/gtest.h"
#include "nn/ops/dropout.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint.h"
#include "testing/run.h"
#include "tests/testing/same_bits.h"

namespace tandem::testing {
namespace {

constexpr char kDataDir[] = "/usr/share/datasets/fashion-mnist";
constexpr int64_t kRows = 256;    // the first 256 training images
constexpr int64_t kPerRank = 16;  // images per rank and step: 8 steps an epoch on 2 ranks, 4 on 4
constexpr int kSteps = 14;
// DataParallel's constructor broadcasts LeNet's 6 parameters; each step then
// all-reduces its gradients in one bucket: collective kBroadcasts + s + 1 is
// the all-reduce of step s (0 for the first).
constexpr uint64_t kBroadcasts = 6;

#ifdef TANDEM_LENET_RESTART_SYNTHETIC
constexpr bool kSynthetic = true;
#else
constexpr bool kSynthetic = false;
#endif

bool Contains(absl::string_view text, absl::string_view part) {
  return text.find(part) != absl::string_view::npos;
}

// The subset, loaded once (null when the data set is missing).
std::shared_ptr<const data::Dataset> TrainSubset() {
  static const std::shared_ptr<const data::Dataset> subset =
      []() -> std::shared_ptr<const data::Dataset> {
    if (kSynthetic) {
      std::mt19937 random(7);
      std::vector<uint8_t> pixels(kRows * 28 * 28);
      for (uint8_t& p : pixels) p = static_cast<uint8_t>(random() % 256);
      std::vector<int64_t> labels(kRows);
      for (int64_t& l : labels) l = static_cast<int64_t>(random() % 10);
      return std::make_shared<data::TensorDataset>(
          nn::from_vector<uint8_t>(pixels, {kRows, 1, 28, 28}, {.dtype = nn::kUInt8}),
          nn::from_vector<int64_t>(labels, {kRows}, {.dtype = nn::kInt64}));
    }
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
  // A pause after each step (the communicator error's case: the watchdog,
  // which polls every 100 ms, must see the error before the run ends).
  int step_delay_ms = 0;
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
    if (k.step_delay_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(k.step_delay_ms));
    }
  }
  return absl::OkStatus();
}

enum class Kind { kException, kCommunicatorError, kHang };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kException:
      return "Exception";
    case Kind::kCommunicatorError:
      return "CommunicatorError";
    case Kind::kHang:
      return "Hang";
  }
  return "?";
}

// The hang's case: the watchdog's limit for a collective, which ends the hang
// (the peers of the hung rank wait in the next step's all-reduce). Longer
// under ThreadSanitizer, whose steps are slower (a peer's step must not
// exceed it).
#if defined(__SANITIZE_THREAD__)
constexpr double kHangTimeoutS = 4.0;
#else
constexpr double kHangTimeoutS = 1.0;
#endif

RunOptions Options(int ranks, std::vector<Fault> faults, double timeout_s = 60) {
  RunOptions options{.ranks = ranks, .faults = std::move(faults)};
  options.spawn.timeout_s = timeout_s;
  // Every failure kind restarts (each is on by default; said here for the reader).
  options.spawn.restart = {
      .max_restarts = 2, .on_exception = true, .on_comm_error = true, .on_timeout = true};
  return options;
}

RunReport RunLeNet(int ranks, const Knobs& k, std::vector<Fault> faults, double timeout_s = 60) {
  RunReport report;
  absl::Status s = RunRanks(
      [k](dist::Context& ctx, StepLog& log) { return TrainLeNet(ctx, log, k); },
      Options(ranks, std::move(faults), timeout_s), &report);
  EXPECT_TRUE(s.ok()) << s << "\n" << report.log;
  return report;
}

// The run without a fault, once per rank count and K (the snapshots do not
// change the training: the same bits every K).
const RunReport& Reference(int ranks, int every) {
  static std::map<std::pair<int, int>, RunReport>* const runs =
      new std::map<std::pair<int, int>, RunReport>();
  auto it = runs->find({ranks, every});
  if (it == runs->end()) {
    RunReport report = RunLeNet(ranks, {.snapshot_every = every}, {});
    EXPECT_EQ(report.attempts, 1) << report.log;
    it = runs->emplace(std::make_pair(ranks, every), std::move(report)).first;
  }
  return it->second;
}

// Every rank's losses and parameters at every step, exactly, over all kSteps steps.
void ExpectSameBits(const RunReport& expected, const RunReport& actual) {
  for (size_t r = 0; r < expected.ranks.size(); ++r) {
    ASSERT_EQ(expected.ranks[r].losses.size(), static_cast<size_t>(kSteps)) << "rank " << r;
  }
  ExpectSameLossesAndParameters(expected, actual);
}

// (ranks, fault kind, K: a snapshot every K steps)
using Case = std::tuple<int, Kind, int>;

class LeNetRestartTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    // One OpenBLAS thread per call: the ranks already fill the cores, and
    // OpenBLAS's own threads are not instrumented by ThreadSanitizer (their
    // writes to a convolution's buffer read as races with the rank's thread).
    nn::set_cpu_blas_threads(1);
    if (TrainSubset() == nullptr) GTEST_SKIP() << kDataDir << " is not installed";
  }
};

// The fault comes after step s (0 for the first): s = 9 with K = 1, s = 8
// with K = 5 (the first step of the second epoch on 2 ranks, of the third on 4;
// the attempt resumes from step 5 and runs steps 6-9 again, an epoch boundary
// among them). The exception: the last rank throws after step s. The
// communicator error: rank 0's communicator reports one in step s's
// all-reduce (which itself completes); the watchdog sees it at its next poll,
// some steps later, so the step resumed from is the newest every rank stored
// by then. The hang: rank 1 stops after step s until the run stops; its
// peers' all-reduce of step s + 1 exceeds the watchdog's timeout.
TEST_P(LeNetRestartTest, RestartsFromTheSnapshotAndEndsBitForBitAsTheRunWithoutTheFault) {
  const auto [ranks, kind, every] = GetParam();
  const int64_t s = every == 1 ? 9 : 8;
  Fault fault;
  std::string failure;  // in the restart's log line
  double timeout_s = 60;
  Knobs knobs{.snapshot_every = every,
              .steps_run = std::make_shared<std::vector<std::atomic<int>>>(ranks)};
  switch (kind) {
    case Kind::kException:
      fault = {.action = FaultAction::kThrow, .rank = ranks - 1, .step = s};
      failure = "rank " + std::to_string(ranks - 1) + " (cpu) threw: injected fault";
      break;
    case Kind::kCommunicatorError:
      fault = {.action = FaultAction::kReturnError,
               .rank = 0,
               .collective = kBroadcasts + static_cast<uint64_t>(s) + 1,
               .error = absl::UnavailableError("injected network failure")};
      failure = "rank 0 (cpu): injected network failure";
      knobs.step_delay_ms = 40;
      break;
    case Kind::kHang:
      fault = {.action = FaultAction::kHang, .rank = 1, .step = s};
      failure =
          absl::StrCat("watchdog: a collective did not complete within ", kHangTimeoutS, " s");
      timeout_s = kHangTimeoutS;
      break;
  }
  const RunReport& reference = Reference(ranks, every);
  const RunReport report = RunLeNet(ranks, knobs, {fault}, timeout_s);
  EXPECT_EQ(report.attempts, 2) << report.log;
  ASSERT_EQ(report.faults.size(), 1u) << report.log;
  if (kind == Kind::kCommunicatorError) {
    EXPECT_EQ(report.faults[0].where,
              "rank 0: all_reduce_async #" + std::to_string(kBroadcasts + s + 1));
  }
  EXPECT_TRUE(Contains(report.log, "spawn: restart 1 of 2 after: ")) << report.log;
  EXPECT_TRUE(Contains(report.log, failure)) << report.log;
  if (kind == Kind::kCommunicatorError) {
    EXPECT_TRUE(Contains(report.log, "; attempt 1 resumes from the snapshot of step "))
        << report.log;
  } else {
    // Every rank ran steps 0..s; none could finish step s + 1 without the
    // faulty rank's all-reduce: the newest common snapshot is the newest
    // multiple of K up to s + 1.
    const int64_t resumed = (s + 1) / every * every;
    EXPECT_TRUE(Contains(report.log, "; attempt 1 resumes from the snapshot of step " +
                                         std::to_string(resumed) + ";"))
        << report.log;
  }
  // At most K steps run again by any rank.
  for (int r = 0; r < ranks; ++r) {
    const int redone = (*knobs.steps_run)[r].load() - kSteps;
    EXPECT_GE(redone, 0) << "rank " << r;
    EXPECT_LE(redone, every) << "rank " << r;
  }
  ExpectSameBits(reference, report);
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::to_string(std::get<0>(info.param)) + "Ranks" + KindName(std::get<1>(info.param)) +
         "SnapshotEvery" + std::to_string(std::get<2>(info.param));
}

// The two builds of this file name their cases apart (ctest lists both).
#ifdef TANDEM_LENET_RESTART_SYNTHETIC
INSTANTIATE_TEST_SUITE_P(
    RandomImages, LeNetRestartTest,
    ::testing::Combine(::testing::Values(2, 4),
                       ::testing::Values(Kind::kException, Kind::kCommunicatorError, Kind::kHang),
                       ::testing::Values(1, 5)),
    CaseName);
#else
INSTANTIATE_TEST_SUITE_P(
    FashionMnist, LeNetRestartTest,
    ::testing::Combine(::testing::Values(2, 4),
                       ::testing::Values(Kind::kException, Kind::kCommunicatorError, Kind::kHang),
                       ::testing::Values(1, 5)),
    CaseName);
#endif

}  // namespace
}  // namespace tandem::testing
