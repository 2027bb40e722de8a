// In-process restarts (SpawnOptions::restart) on one GPU, with the training
// function of the CPU tests (tests/spawn/restart_fixture.h): a 1-rank NCCL
// world and two ranks sharing the GPU (the in-process communicator on device
// memory) restart after a fault, rebuild their communicators and end with
// the parameters of the run without the fault, bit for bit (the same kernels
// on the same inputs; TF32 off); a world shrink from two ranks sharing the GPU
// to one continues there. A kernel's report of bad input that a failed
// attempt left unread is that attempt's, not the next one's. Skipped, with the
// reason, without a GPU.
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nn/tensor.h"
#include "spawn/spawn.h"
#include "tests/gpu_test_util.h"
#include "tests/spawn/restart_fixture.h"

namespace tandem::testing {
namespace {

RunOptions OnGpu(int ranks, std::vector<Fault> faults) {
  RunOptions options = Options(ranks, std::move(faults));
  options.gpus = ranks == 1 ? "0" : "0,0";
  options.spawn.share_devices = ranks > 1;
  return options;
}

class RestartGpuTest : public GpuTest {};

void ExpectRestartGivesTheBitsOfTheRunWithoutTheFault(int ranks) {
  RunReport reference;
  absl::Status s = RunRanks(Restartable({}), OnGpu(ranks, {}), &reference);
  ASSERT_TRUE(s.ok()) << s << "\n" << reference.log;
  RunReport report;
  s = RunRanks(Restartable({}),
               OnGpu(ranks, {{.action = FaultAction::kThrow, .rank = ranks - 1, .step = 4}}),
               &report);
  ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
  EXPECT_EQ(report.attempts, 2) << report.log;
  EXPECT_TRUE(Contains(report.log, "attempt 1 resumes from the snapshot of step 5")) << report.log;
  ExpectSameBits(reference, report);
}

TEST_F(RestartGpuTest, NcclOneRankRestartGivesTheBitsOfTheRunWithoutTheFault) {
  ExpectRestartGivesTheBitsOfTheRunWithoutTheFault(1);
}

TEST_F(RestartGpuTest, RanksSharingOneGpuRestartGiveTheBitsOfTheRunWithoutTheFault) {
  ExpectRestartGivesTheBitsOfTheRunWithoutTheFault(2);
}

// Two ranks sharing the GPU, rank 1 fails: the next attempt runs one rank on
// the GPU (its communicator built again for one rank) and finishes every step.
TEST_F(RestartGpuTest, WorldShrinkFromTwoRanksSharingTheGpuToOne) {
  RunOptions options = OnGpu(2, {{.action = FaultAction::kThrow, .rank = 1, .step = 4}});
  options.spawn.restart.leave_out_failed_rank = true;
  RunReport report;
  absl::Status s = RunRanks(Restartable({}), options, &report);
  ASSERT_TRUE(s.ok()) << s << "\n" << report.log;
  EXPECT_EQ(report.attempts, 2) << report.log;
  EXPECT_TRUE(Contains(report.log, "on 1 rank")) << report.log;
  ASSERT_FALSE(report.ranks.empty());
  EXPECT_EQ(report.ranks[0].losses.size(), 12u) << report.log;
}

// Attempt 0 runs cross_entropy with a bad target (the kernel reports it in the
// device's error word, read at the next host wait) and throws before any host
// wait. Left in the word, the report surfaced at attempt 1's first host wait
// and failed it, with restarts to spare. The failed attempt's report is its
// own (the restart's log line names it, with the failure) and attempt 1
// starts with a clean word; `restarts` 0: the run's failure names it, and the
// caller's next host wait raises nothing.
std::string RunWithAnUnreadReport(int restarts, absl::Status* status, double* loss) {
  std::ostringstream console;
  dist::SpawnOptions options{.console = &console};
  options.restart = {.max_restarts = restarts};
  *status = dist::spawn(
      [&](dist::Context& ctx) {
        const nn::Device gpu = ctx.device();
        nn::Tensor logits = nn::ones({4, 5}, {.device = gpu});
        if (ctx.attempt() == 0) {
          nn::Tensor bad = nn::from_vector(std::vector<int64_t>{0, 7, 2, 4}, {4}, {.device = gpu});
          (void)nn::cross_entropy(logits, bad);  // reported on the device, not read yet
          throw std::runtime_error("attempt 0 fails before any host wait");
        }
        nn::Tensor good = nn::from_vector(std::vector<int64_t>{0, 1, 2, 3}, {4}, {.device = gpu});
        *loss = nn::cross_entropy(logits, good).item();  // raises a pending report
        nn::Synchronize(gpu);
      },
      1, "0", options);
  return console.str();
}

constexpr char kUnreadReport[] =
    "a kernel had also reported, unread before the stop: cross_entropy: target 7 of sample 1 is "
    "out of range [0, 5) on cuda:0";

TEST_F(RestartGpuTest, AReportTheFailedAttemptLeftUnreadIsItsAndTheNextStartsClean) {
  absl::Status s;
  double loss = 0;
  const std::string log = RunWithAnUnreadReport(1, &s, &loss);
  ASSERT_TRUE(s.ok()) << s << "\n" << log;
  EXPECT_TRUE(Contains(log, "restart 1 of 1 after: ")) << log;
  EXPECT_TRUE(Contains(log, "attempt 0 fails before any host wait")) << log;
  EXPECT_TRUE(Contains(log, kUnreadReport)) << log;
  EXPECT_NEAR(loss, std::log(5.0), 1e-5);  // equal logits
  EXPECT_NO_THROW(nn::Synchronize(nn::Device::CUDA(0)));
}

TEST_F(RestartGpuTest, AFailedRunsUnreadReportIsInItsStatusNotInTheCallersNextHostWait) {
  absl::Status s;
  double loss = 0;
  const std::string log = RunWithAnUnreadReport(0, &s, &loss);
  ASSERT_FALSE(s.ok()) << log;
  EXPECT_TRUE(Contains(s.message(), "attempt 0 fails before any host wait")) << s;
  EXPECT_TRUE(Contains(s.message(), kUnreadReport)) << s;
  EXPECT_NO_THROW(nn::Synchronize(nn::Device::CUDA(0)));
}

}  // namespace
}  // namespace tandem::testing
