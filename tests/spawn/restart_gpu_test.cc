// In-process restarts (SpawnOptions::restart) on one GPU, with the training
// function of the CPU tests (tests/spawn/restart_fixture.h): a 1-rank NCCL
// world and two ranks sharing the GPU (the in-process communicator on device
// memory) restart after a fault, rebuild their communicators and end with
// the parameters of the run without the fault, bit for bit (the same kernels
// on the same inputs; TF32 off); a world shrink from two ranks sharing the GPU
// to one continues there. Skipped, with the reason, without a GPU.
#include <string>
#include <vector>

#include "gtest/gtest.h"
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

}  // namespace
}  // namespace tandem::testing
