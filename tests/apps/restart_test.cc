// train_mnist and train_cifar10 with --max_restarts: a rank made to fail once
// (the test-only --test_fail_at=R:S, apps/test_hooks.cc) restarts in the
// process from its snapshot and ends with the summary of the run without the
// fault (accuracies, loss, epochs, steps); without --max_restarts the same
// fault ends the run with exit status 1 and one line naming the rank; the
// flags' bad values exit 2.
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/apps/run_program.h"

namespace {

constexpr char kFashion[] = "/usr/share/datasets/fashion-mnist";

using ::tandem::testing::RunProgram;
using ::tandem::testing::RunResult;

// The summary line up to its timing: "summary: <data>, N rank(s), E epoch(s)
// run (S steps in all): best test accuracy A%, final F%, final train loss L".
std::string SummaryWithoutTiming(const std::string& output) {
  const size_t at = output.find("summary: ");
  if (at == std::string::npos) return "";
  const size_t end = output.find(", time ", at);
  return end == std::string::npos ? "" : output.substr(at, end - at);
}

// A --metrics CSV file's rows without their timing columns (samples_per_s,
// wall_s): dataset, epoch, step, loss, accuracy, lr.
std::vector<std::string> MetricsRowsWithoutTiming(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> rows;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ',');
    if (f.size() == 8) f.erase(f.begin() + 5, f.begin() + 7);
    rows.push_back(absl::StrJoin(f, ","));
  }
  return rows;
}

// restart: --max_restarts and --snapshot_every. resumed_step -1: no snapshot
// (the run starts again). Both runs write --metrics: the restarted run's file
// holds the same rows (no row of the failed attempt twice).
void ExpectRestartEndsAsTheUninterruptedRun(const std::string& program, const std::string& common,
                                            const std::string& restart, const std::string& fail_at,
                                            int64_t resumed_step) {
  // Named after the test: ctest -j runs the tests of this file in parallel processes.
  const std::string dir = ::testing::TempDir() + "app_restart_" +
                          ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const std::string straight_csv = dir + "_straight.csv";
  const std::string restarted_csv = dir + "_restarted.csv";
  std::filesystem::remove(straight_csv);
  std::filesystem::remove(restarted_csv);
  RunResult straight = RunProgram(program, common + " " + restart + " --metrics=" + straight_csv);
  ASSERT_EQ(straight.status, 0) << straight.output;
  const std::string want = SummaryWithoutTiming(straight.output);
  ASSERT_FALSE(want.empty()) << straight.output;
  EXPECT_EQ(straight.output.find("spawn: restart"), std::string::npos) << straight.output;

  RunResult restarted = RunProgram(program, common + " " + restart + " --test_fail_at=" + fail_at +
                                                " --metrics=" + restarted_csv);
  ASSERT_EQ(restarted.status, 0) << restarted.output;
  EXPECT_EQ(SummaryWithoutTiming(restarted.output), want) << restarted.output;
  EXPECT_NE(restarted.output.find(absl::StrCat("spawn: restart 1 of ")), std::string::npos)
      << restarted.output;
  EXPECT_NE(restarted.output.find(absl::StrCat(
                "after: rank ", fail_at.substr(0, fail_at.find(':')), " (cpu) threw: callback ",
                "ClassifierOutputs failed in on_train_batch_end: --test_fail_at")),
            std::string::npos)
      << restarted.output;
  EXPECT_NE(restarted.output.find(
                resumed_step >= 0 ? absl::StrCat("resumes from the snapshot of step ", resumed_step)
                                  : std::string("resumes from the start")),
            std::string::npos)
      << restarted.output;
  const std::vector<std::string> want_rows = MetricsRowsWithoutTiming(straight_csv);
  EXPECT_GT(want_rows.size(), 1u);
  EXPECT_EQ(MetricsRowsWithoutTiming(restarted_csv), want_rows)
      << "--metrics after the restart (" << restarted_csv << ") differs from " << straight_csv;

  // Without restarts the same fault ends the run: status 1, the last line names the rank.
  RunResult failed = RunProgram(program, common + " --test_fail_at=" + fail_at);
  EXPECT_EQ(failed.status, 1) << failed.output;
  EXPECT_NE(failed.output.find("--test_fail_at: rank"), std::string::npos) << failed.output;
}

// A snapshot every step: the fault after step 5 resumes from step 4's (rank 1
// threw before its own snapshot of step 5); every 3 steps, after step 7 from
// step 6's, across the first epoch's end (4 steps an epoch).
TEST(AppRestart, Cifar10SyntheticRestartEndsWithTheUninterruptedSummary) {
  const std::string common =
      "--gpus=cpu --nprocs=2 --epochs=3 --max_steps_per_epoch=4 --batch_size=8 "
      "--synthetic_train_size=64 --synthetic_test_size=32 --log_every=1";
  ExpectRestartEndsAsTheUninterruptedRun(TRAIN_CIFAR10, common, "--max_restarts=1", "1:5", 4);
  ExpectRestartEndsAsTheUninterruptedRun(TRAIN_CIFAR10, common,
                                         "--max_restarts=1 --snapshot_every=3", "0:8", 6);
  // From step 3's snapshot after a fault at step 5: the first epoch's end
  // (step 4) and its metrics row come again.
  ExpectRestartEndsAsTheUninterruptedRun(TRAIN_CIFAR10, common,
                                         "--max_restarts=1 --snapshot_every=3", "0:5", 3);
  // No snapshots: the run starts again and writes every row again.
  ExpectRestartEndsAsTheUninterruptedRun(TRAIN_CIFAR10, common,
                                         "--max_restarts=1 --snapshot_every=0", "1:6", -1);
}

TEST(AppRestart, MnistRestartEndsWithTheUninterruptedSummary) {
  if (!std::filesystem::exists(std::filesystem::path(kFashion) / "train-images-idx3-ubyte.gz") &&
      !std::filesystem::exists(std::filesystem::path(kFashion) / "train-images-idx3-ubyte")) {
    GTEST_SKIP() << "no Fashion-MNIST at " << kFashion;
  }
  const std::string common =
      absl::StrCat("--data_dir=", kFashion, " --gpus=cpu --nprocs=2 --epochs=2 --batch_size=16 ",
                   "--train_limit=320 --test_limit=200 --log_every=5 --optimizer=momentum");
  ExpectRestartEndsAsTheUninterruptedRun(TRAIN_MNIST, common,
                                         "--max_restarts=2 --snapshot_every=4", "1:14", 12);
}

// Bad values exit 2 with one line naming the flag.
TEST(AppRestart, BadRestartFlagsExitTwo) {
  const std::string common = "--gpus=cpu --nprocs=2 --epochs=1 --max_steps_per_epoch=1 "
                             "--synthetic_train_size=16 --synthetic_test_size=8";
  struct Case {
    std::string program, args, message;
  };
  for (const Case& c : {
           Case{TRAIN_CIFAR10, "--max_restarts=-1", "--max_restarts -1: must be >= 0"},
           Case{TRAIN_CIFAR10, "--max_restarts=1 --snapshot_every=-2",
                "--snapshot_every -2: must be >= 0"},
           Case{TRAIN_CIFAR10, "--snapshot_every=5",
                "--snapshot_every 5: only with --max_restarts > 0"},
           Case{TRAIN_CIFAR10, "--max_restarts=1 --test_fail_at=1", "--test_fail_at \"1\""},
           Case{TRAIN_LINEAR, "--max_restarts=1", "--max_restarts 1: only the classifier programs"},
       }) {
    const std::string args =
        c.program == TRAIN_LINEAR ? "--gpus=cpu " + c.args : common + " " + c.args;
    RunResult r = RunProgram(c.program, args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << args << "\n" << r.output;
  }
}

}  // namespace
