// Preemption of the training programs, run as processes: SIGTERM at random
// moments (some while a checkpoint write is in flight) then --resume, SIGKILL
// right after a periodic checkpoint then --resume, a damaged newest checkpoint
// of three then --resume. Each resumed run must end with the model and
// optimizer tensors of an uninterrupted run, bit for bit, and every stopped
// run must exit within 10 s of its signal. CPU ranks; the train_mnist test
// skips without Fashion-MNIST.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nn/checkpoint.h"
#include "tests/test_util.h"

namespace {

using ::tandem::testing::MakeTempDir;
using Clock = std::chrono::steady_clock;
constexpr char kFashion[] = "/usr/share/datasets/fashion-mnist";

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A program started with stdout and stderr to files.
class Child {
 public:
  Child(const std::string& program, const std::string& args, const std::string& out_path,
        const std::string& write_delay_ms = "")
      : out_path_(out_path) {
    std::vector<std::string> argv = {program};
    for (absl::string_view a : absl::StrSplit(args, ' ', absl::SkipEmpty())) argv.emplace_back(a);
    // Test-only flag: the checkpoint writer sleeps this long before each write.
    if (!write_delay_ms.empty()) argv.push_back("--test_checkpoint_write_delay_ms=" + write_delay_ms);
    pid_ = ::fork();
    if (pid_ == 0) {
      // Apart: a log line (stderr, from any thread) must not split a loss line.
      if (std::freopen(out_path.c_str(), "w", stdout) == nullptr ||
          std::freopen((out_path + ".err").c_str(), "w", stderr) == nullptr) {
        ::_exit(127);
      }
      std::vector<char*> raw;
      for (auto& a : argv) raw.push_back(a.data());
      raw.push_back(nullptr);
      ::execv(raw[0], raw.data());
      ::_exit(127);
    }
  }
  // Waits (at most timeout_s) and returns the exit status; -signal when
  // killed by a signal; -1000 on a timeout (the child is then killed).
  int Wait(double timeout_s = 120) {
    const Clock::time_point start = Clock::now();
    for (;;) {
      int raw = 0;
      const pid_t r = ::waitpid(pid_, &raw, WNOHANG);
      if (r == pid_) return WIFEXITED(raw) ? WEXITSTATUS(raw) : -WTERMSIG(raw);
      if (Seconds(Clock::now() - start) > timeout_s) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &raw, 0);
        return -1000;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  void Signal(int sig) const { ::kill(pid_, sig); }
  pid_t pid() const { return pid_; }
  // stdout, then stderr.
  std::string Output() const { return ReadFile(out_path_) + ReadFile(out_path_ + ".err"); }

 private:
  pid_t pid_ = -1;
  std::string out_path_;
};

struct Finished {
  int status;
  std::string output;
  double seconds;
};
Finished RunToEnd(const std::string& program, const std::string& args, const std::string& out_path) {
  const Clock::time_point start = Clock::now();
  Child c(program, args, out_path);
  const int status = c.Wait();
  return {status, c.Output(), Seconds(Clock::now() - start)};
}

// The model and optimizer tensors of a checkpoint, serialised (equal bytes:
// equal tensors, bit for bit); "" when it does not load.
std::string TrainedState(const std::string& path) {
  absl::StatusOr<tandem::nn::Checkpoint> ck = tandem::nn::LoadCheckpoint(path);
  if (!ck.ok()) return "";
  tandem::nn::Checkpoint only;
  for (const auto& [name, t] : ck->tensors) {
    if (name.rfind("model.", 0) == 0 || name.rfind("optim.", 0) == 0) only.tensors[name] = t;
  }
  return tandem::nn::SerializeCheckpoint(only);
}

// "step:K loss:X" lines of train_linear, by K.
std::map<int64_t, std::string> LossLines(const std::string& output) {
  std::map<int64_t, std::string> out;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    if (line.rfind("step:", 0) != 0) continue;
    const size_t space = line.find(' ');
    int64_t k = 0;
    if (space != absl::string_view::npos && absl::SimpleAtoi(line.substr(5, space - 5), &k)) {
      out[k] = std::string(line);
    }
  }
  return out;
}

// Every loss line the resumed run printed is the uninterrupted run's.
void ExpectSameLosses(const std::string& reference, const std::string& resumed) {
  const auto ref = LossLines(reference);
  int compared = 0;
  for (const auto& [k, line] : LossLines(resumed)) {
    ASSERT_TRUE(ref.contains(k)) << line;
    EXPECT_EQ(line, ref.at(k));
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

constexpr int kLinearSteps = 6000;
constexpr int kEvery = 300;
const std::string kLinearArgs =
    absl::StrCat("--gpus=cpu --nprocs=2 --seed=3 --steps=", kLinearSteps,
                 " --checkpoint_every_steps=", kEvery, " --keep_checkpoints=3 --checkpoint_dir=");

std::string FinalCheckpoint(const std::string& dir) {
  return absl::StrCat(dir, "/step-", kLinearSteps, ".ckpt");
}

// Waits (at most timeout_s) until `path` exists; returns whether it does.
bool AwaitFile(const std::string& path, double timeout_s) {
  const Clock::time_point start = Clock::now();
  while (!std::filesystem::exists(path)) {
    if (Seconds(Clock::now() - start) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return true;
}

TEST(TrainLinearPreempt, SigtermAtRandomMomentsThenResumeEndsBitForBit) {
  const std::string base = MakeTempDir("tandem_preempt_apps_t");
  // The reference run, timed from its first periodic checkpoint (training under
  // way: the program's load time, which varies with the build, is left out).
  Clock::time_point first_checkpoint;
  Finished ref;
  {
    const std::string dir = base + "/ref";
    const Clock::time_point start = Clock::now();
    Child c(TRAIN_LINEAR, kLinearArgs + dir, base + "/ref.out");
    ASSERT_TRUE(AwaitFile(absl::StrCat(dir, "/step-", kEvery, ".ckpt"), 60));
    first_checkpoint = Clock::now();
    const int status = c.Wait();
    ref = {status, c.Output(), Seconds(Clock::now() - start)};
  }
  ASSERT_EQ(ref.status, 0) << ref.output;
  const double train_window_s = std::max(0.05, Seconds(Clock::now() - first_checkpoint));
  const std::string expected = TrainedState(FinalCheckpoint(base + "/ref"));
  ASSERT_FALSE(expected.empty());
  std::mt19937 rng(20261124);
  int stopped = 0, in_flight = 0;
  for (int trial = 0; trial < 10; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    const std::string dir = absl::StrCat(base, "/", trial);
    // Odd trials: every write takes 100 ms more, so a stop often finds one in flight.
    const bool slow_writes = trial % 2 == 1;
    // A random moment of the training, measured from its first checkpoint.
    const double delay_s =
        std::uniform_real_distribution<double>(0, 0.7 * train_window_s)(rng);
    Child c(TRAIN_LINEAR, kLinearArgs + dir, dir + ".out", slow_writes ? "100" : "");
    AwaitFile(absl::StrCat(dir, "/step-", kEvery, ".ckpt"), 60);
    std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
    c.Signal(SIGTERM);
    const Clock::time_point signalled = Clock::now();
    const int status = c.Wait(60);
    const double exit_s = Seconds(Clock::now() - signalled);
    const std::string out = c.Output();
    EXPECT_LT(exit_s, 10.0) << out;
    // 0: the run had finished its last step when the signal came. Killed by
    // SIGTERM: it came before the program installed its handler (while the
    // process was being loaded), so nothing was trained yet.
    if (status == -SIGTERM) {
      EXPECT_TRUE(LossLines(out).empty()) << out;
    } else {
      ASSERT_TRUE(status == 75 || status == 0) << status << "\n" << out;
    }
    if (status == 75) {
      ++stopped;
      // At a step, or (a signal before the first step boundary) at once, with
      // nothing trained to lose.
      EXPECT_TRUE(out.find("stopped by SIGTERM at step") != std::string::npos ||
                  out.find("stopped by SIGTERM before any rank reached a step boundary") !=
                      std::string::npos)
          << out;
      in_flight += out.find(" in flight") != std::string::npos;
    }
    std::cerr << "trial " << trial << ": SIGTERM " << delay_s << " s after the first checkpoint, exit " << status
              << " " << exit_s << " s after the signal" << (slow_writes ? " (slow writes)" : "")
              << "\n";
    const Finished resumed = RunToEnd(TRAIN_LINEAR, kLinearArgs + dir + " --resume", dir + ".resumed");
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_EQ(TrainedState(FinalCheckpoint(dir)), expected);
    if (status == 75) ExpectSameLosses(ref.output, resumed.output);
  }
  EXPECT_GE(stopped, 5);  // most signals land while training runs
  EXPECT_GE(in_flight, 1);  // and at least one while a checkpoint write was in flight
}

// Steps of a few ms (batch 2000), so that the kill lands within a step of the
// file's appearance; the write of a checkpoint (ms) ends long before the next.
TEST(TrainLinearPreempt, SigkillRightAfterAPeriodicCheckpointLosesAtMostNSteps) {
  constexpr int kN = 50;
  const std::string args = absl::StrCat("--gpus=cpu --nprocs=2 --seed=3 --steps=400 --batch_size=2000 "
                                        "--checkpoint_every_steps=", kN, " --checkpoint_dir=");
  const std::string base = MakeTempDir("tandem_preempt_apps_k");
  const Finished ref = RunToEnd(TRAIN_LINEAR, args + base + "/ref", base + "/ref.out");
  ASSERT_EQ(ref.status, 0) << ref.output;
  const std::string dir = base + "/killed";
  Child c(TRAIN_LINEAR, args + dir, dir + ".out");
  const std::string target = absl::StrCat(dir, "/step-", 4 * kN, ".ckpt");
  const Clock::time_point start = Clock::now();
  while (!std::filesystem::exists(target) && Seconds(Clock::now() - start) < 60) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  c.Signal(SIGKILL);
  ASSERT_EQ(c.Wait(), -SIGKILL);
  const auto printed = LossLines(c.Output());
  ASSERT_FALSE(printed.empty());
  const int64_t done = printed.rbegin()->first + 1;  // steps finished (at least)
  const Finished resumed = RunToEnd(TRAIN_LINEAR, args + dir + " --resume", dir + ".resumed");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  const size_t at = resumed.output.find("resumed from ");
  ASSERT_NE(at, std::string::npos) << resumed.output;
  const size_t step_at = resumed.output.find(" at step ", at);
  int64_t from = -1;
  ASSERT_TRUE(absl::SimpleAtoi(
      resumed.output.substr(step_at + 9, resumed.output.find('\n', step_at) - step_at - 9), &from))
      << resumed.output;
  std::cerr << "SIGKILL after step " << done << "; resumed from step " << from << "\n";
  EXPECT_GE(from, 4 * kN);
  EXPECT_LE(done - from, kN);
  EXPECT_EQ(TrainedState(dir + "/step-400.ckpt"), TrainedState(base + "/ref/step-400.ckpt"));
  EXPECT_FALSE(TrainedState(base + "/ref/step-400.ckpt").empty());
  ExpectSameLosses(ref.output, resumed.output);
}

// The newest of three checkpoints truncated, or with one byte flipped:
// --resume names it and the reason in one line, uses the one before, and the
// run ends as the uninterrupted one.
TEST(TrainLinearPreempt, DamagedNewestOfThreeFallsBackAndSaysSo) {
  const std::string base = MakeTempDir("tandem_preempt_apps_d");
  const std::string args = absl::StrCat("--gpus=cpu --nprocs=2 --seed=3 --checkpoint_every_steps=",
                                        kEvery, " --keep_checkpoints=3 --checkpoint_dir=");
  const int early = kLinearSteps - 2 * kEvery + 60;  // not a multiple of kEvery
  for (const bool truncate : {true, false}) {
    SCOPED_TRACE(truncate ? "truncated" : "flipped byte");
    const std::string dir = absl::StrCat(base, "/", truncate);
    // An early end: files step-<early - 60 - kEvery>, step-<early - 60>, step-<early>.
    const Finished first = RunToEnd(TRAIN_LINEAR, absl::StrCat(args, dir, " --steps=", early),
                               dir + ".first");
    ASSERT_EQ(first.status, 0) << first.output;
    const std::string newest = absl::StrCat(dir, "/step-", early, ".ckpt");
    ASSERT_EQ(std::filesystem::directory_iterator(dir) == std::filesystem::directory_iterator(),
              false);
    int files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.path().extension() == ".ckpt";
    EXPECT_EQ(files, 3);
    if (truncate) {
      std::filesystem::resize_file(newest, std::filesystem::file_size(newest) - 100);
    } else {
      std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(newest) / 2));
      f.put('\x5a');
    }
    const Finished resumed = RunToEnd(TRAIN_LINEAR, absl::StrCat(args, dir, " --steps=", kLinearSteps,
                                                            " --resume"),
                                 dir + ".resumed");
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    std::vector<std::string> skipped;
    for (absl::string_view line : absl::StrSplit(resumed.output, '\n')) {
      if (line.find("skipping checkpoint") != absl::string_view::npos) skipped.emplace_back(line);
    }
    ASSERT_EQ(skipped.size(), 1u) << resumed.output;
    EXPECT_NE(skipped[0].find("skipping checkpoint " + newest + ": "), std::string::npos)
        << skipped[0];
    EXPECT_NE(skipped[0].find(truncate ? "trunc" : "checksum"), std::string::npos) << skipped[0];
    std::cerr << skipped[0] << "\n";
    EXPECT_NE(resumed.output.find(absl::StrCat("resumed from ", dir, "/step-", early - 60, ".ckpt")),
              std::string::npos)
        << resumed.output;
    const Finished ref = RunToEnd(TRAIN_LINEAR, absl::StrCat(args, dir, "-ref --steps=", kLinearSteps),
                             dir + ".ref");
    ASSERT_EQ(ref.status, 0) << ref.output;
    EXPECT_EQ(TrainedState(FinalCheckpoint(dir)), TrainedState(FinalCheckpoint(dir + "-ref")));
    ASSERT_FALSE(TrainedState(FinalCheckpoint(dir)).empty());
  }
}

// train_mnist, two ranks, periodic checkpoints mid-epoch: SIGTERM once training
// runs (a few ms after a checkpoint appears), while a write is in flight, then
// --resume: the metrics rows (loss, accuracy) and the final state equal an
// uninterrupted run's.
// Ctrl-C in one process is a planned stop, not a failure: exit status 130 with
// the one line that says so, and no line says ERROR (neither the stop itself
// nor the ranks it cancelled mid-collective), periodic writes in flight or not.
TEST(TrainLinearPreempt, CtrlCStopsWithOneLineAndNoErrorLine) {
  const std::string base = MakeTempDir("tandem_preempt_apps_ctrlc");
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    const std::string dir = absl::StrCat(base, "/", trial);
    Child c(TRAIN_LINEAR,
            absl::StrCat("--gpus=cpu --nprocs=2 --steps=100000000 --checkpoint_every_steps=50 "
                         "--checkpoint_dir=", dir),
            dir + ".out", trial == 1 ? "50" : "");
    // A checkpoint: training is under way, spawn's SIGINT handler installed.
    ASSERT_TRUE(AwaitFile(absl::StrCat(dir, "/step-", 100 * (trial + 1), ".ckpt"), 60));
    c.Signal(SIGINT);
    const int status = c.Wait(60);
    const std::string out = c.Output();
    EXPECT_EQ(status, 130) << out;
    EXPECT_EQ(out.find("ERROR"), std::string::npos) << out;
    std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back(),
              "train_linear: stopped: spawn: interrupted (SIGINT); every rank stopped at its next "
              "collective, stop-aware wait or step boundary (a second Ctrl-C exits at once)")
        << out;
  }
}

TEST(TrainMnistPreempt, SigtermMidEpochThenResumeEndsBitForBit) {
  if (!std::filesystem::exists(std::filesystem::path(kFashion) / "train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "no Fashion-MNIST at " << kFashion;
  }
  const std::string base = MakeTempDir("tandem_preempt_apps_m");
  const std::string args =
      "--gpus=cpu --nprocs=2 --epochs=2 --batch_size=32 --train_limit=960 --test_limit=200 "
      "--seed=7 --num_workers=2 --checkpoint_every_steps=4 --keep_checkpoints=3 ";
  const Finished ref = RunToEnd(TRAIN_MNIST,
                           args + "--checkpoint_dir=" + base + "/ref --metrics=" + base + "/ref.csv",
                           base + "/ref.out");
  ASSERT_EQ(ref.status, 0) << ref.output;
  const std::string dir = base + "/stopped";
  const std::string run_args = args + "--checkpoint_dir=" + dir + " --metrics=" + base + "/run.csv";
  // Rank 1 sleeps 40 ms in every step of the stopped run (a test hook that changes
  // no number), so that the signal, sent at most 100 ms after step 8's checkpoint,
  // lands inside epoch 1 (steps 1-15) however fast the machine runs the steps.
  Child c(TRAIN_MNIST, run_args + " --test_slow_rank=1:40", dir + ".out", "150");
  const std::string first = dir + "/step-8.ckpt";
  const Clock::time_point start = Clock::now();
  while (!std::filesystem::exists(first) && Seconds(Clock::now() - start) < 120) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(std::mt19937(7)() % 100));
  c.Signal(SIGTERM);
  const Clock::time_point signalled = Clock::now();
  const int status = c.Wait(60);
  const double exit_s = Seconds(Clock::now() - signalled);
  const std::string out = c.Output();
  std::cerr << "train_mnist: exit " << status << " " << exit_s << " s after SIGTERM\n";
  EXPECT_LT(exit_s, 10.0);
  ASSERT_EQ(status, 75) << out;
  EXPECT_NE(out.find("stopped by SIGTERM at step"), std::string::npos) << out;
  EXPECT_NE(out.find("run again with --resume"), std::string::npos) << out;
  const Finished resumed = RunToEnd(TRAIN_MNIST, run_args + " --resume", dir + ".resumed");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("step(s) of epoch 1"), std::string::npos) << resumed.output;
  // dataset, epoch, step, loss, accuracy of every row.
  auto rows = [](const std::string& path) {
    std::vector<std::string> out;
    for (absl::string_view line : absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> cells = absl::StrSplit(line, ',');
      if (cells.size() >= 5) out.push_back(absl::StrCat(cells[0], cells[1], cells[2], cells[3], cells[4]));
    }
    return out;
  };
  EXPECT_EQ(rows(base + "/run.csv"), rows(base + "/ref.csv"));
  EXPECT_EQ(rows(base + "/ref.csv").size(), 3u);
  EXPECT_EQ(TrainedState(dir + "/step-30.ckpt"), TrainedState(base + "/ref/step-30.ckpt"));
  EXPECT_FALSE(TrainedState(base + "/ref/step-30.ckpt").empty());
}

#ifdef TANDEM_MPIRUN
// The processes whose parent is `parent`, by pid.
std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    // /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces.
    const std::string stat = ReadFile(entry.path().string() + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
    pid_t ppid = 0;
    if (fields.size() > 1 && absl::SimpleAtoi(fields[1], &ppid) && ppid == parent) {
      out.push_back(pid);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// S of every "<program>: stopped by ... at step S" in an output. Searched in the
// whole text, not line by line: mpirun forwards the processes' stderr in chunks
// that can interleave two processes' lines.
std::vector<int64_t> StoppedSteps(const std::string& output, const std::string& program) {
  std::vector<int64_t> steps;
  const std::string prefix = program + ": stopped by ";
  for (size_t at = output.find(prefix); at != std::string::npos;
       at = output.find(prefix, at + 1)) {
    const size_t step_at = output.find(" at step ", at);
    if (step_at == std::string::npos) break;
    size_t end = step_at + 9;
    while (end < output.size() && std::isdigit(static_cast<unsigned char>(output[end]))) ++end;
    int64_t s = 0;
    if (absl::SimpleAtoi(output.substr(step_at + 9, end - step_at - 9), &s)) steps.push_back(s);
  }
  return steps;
}

// Several processes (mpirun -np 2, one CPU rank each): a stop signal sent to ONE
// process (SIGTERM, as a node's own kill would be) or SIGUSR1 sent to mpirun
// (which forwards it to every process) stops every process at one step after the
// save, mpirun exits 75, and --resume ends with the uninterrupted run's state, bit
// for bit. (mpirun's own SIGTERM is not forwarded: OpenMPI 4.1 kills the job, see
// docs/preemption.md.)
TEST(TrainLinearPreemptMpi, StopSignalToOneProcessStopsTheJobThenResumeEndsBitForBit) {
  constexpr int kSteps = 30000, kEveryMpi = 2000;
  const std::string base = MakeTempDir("tandem_preempt_apps_mpi");
  const std::string args =
      absl::StrCat("-np 2 ", TRAIN_LINEAR, " --gpus=cpu --nprocs=1 --seed=3 --steps=", kSteps,
                   " --checkpoint_every_steps=", kEveryMpi, " --keep_checkpoints=3 --checkpoint_dir=");
  auto final_state = [&](const std::string& dir) {
    return TrainedState(absl::StrCat(dir, "/step-", kSteps, ".ckpt"));
  };
  Clock::time_point first_checkpoint;
  Finished ref;
  {
    const Clock::time_point start = Clock::now();
    Child c(TANDEM_MPIRUN, args + base + "/ref", base + "/ref.out");
    ASSERT_TRUE(AwaitFile(absl::StrCat(base, "/ref/step-", kEveryMpi, ".ckpt"), 60));
    first_checkpoint = Clock::now();
    const int status = c.Wait();
    ref = {status, c.Output(), Seconds(Clock::now() - start)};
  }
  ASSERT_EQ(ref.status, 0) << ref.output;
  const double window_s = Seconds(Clock::now() - first_checkpoint);
  const std::string expected = final_state(base + "/ref");
  ASSERT_FALSE(expected.empty());
  std::mt19937 rng(20261125);
  int stopped = 0;
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    const std::string dir = absl::StrCat(base, "/", trial);
    Child c(TANDEM_MPIRUN, args + dir, dir + ".out");
    // The moment: a random checkpoint in the first half of the run, then a random
    // part of a checkpoint interval (timed on the run's own progress, not on the
    // reference run's, whose speed under a loaded machine can differ by far).
    const int64_t at = kEveryMpi * std::uniform_int_distribution<int64_t>(1, 7)(rng);
    AwaitFile(absl::StrCat(dir, "/step-", at, ".ckpt"), 60);
    std::this_thread::sleep_for(std::chrono::duration<double>(
        std::uniform_real_distribution<double>(0, window_s * kEveryMpi / kSteps)(rng)));
    const std::vector<pid_t> processes = ChildrenOf(c.pid());
    if (processes.size() != 2) {  // the run ended before the signal (a loaded machine)
      ASSERT_EQ(c.Wait(60), 0) << c.Output();
      EXPECT_EQ(final_state(dir), expected);
      continue;
    }
    const int signal = trial < 2 ? SIGTERM : SIGUSR1;
    ::kill(trial < 2 ? processes[trial] : c.pid(), signal);
    const Clock::time_point signalled = Clock::now();
    const int status = c.Wait(60);
    const double exit_s = Seconds(Clock::now() - signalled);
    const std::string out = c.Output();
    std::cerr << "mpirun trial " << trial << ": " << (trial < 2 ? "SIGTERM to one process" : "SIGUSR1 to mpirun")
              << ", exit " << status << " " << exit_s << " s after the signal\n";
    EXPECT_LT(exit_s, 10.0) << out;
    ASSERT_TRUE(status == 75 || status == 0) << status << "\n" << out;
    if (status == 75) {
      ++stopped;
      // Both processes stopped, at the same step.
      const std::vector<int64_t> steps = StoppedSteps(out, "train_linear");
      ASSERT_EQ(steps.size(), 2u) << out;
      EXPECT_EQ(steps[0], steps[1]) << out;
      if (signal == SIGTERM) {
        EXPECT_NE(out.find("stopped by SIGTERM on another process at step"), std::string::npos) << out;
      }
    }
    const Finished resumed = RunToEnd(TANDEM_MPIRUN, args + dir + " --resume", dir + ".resumed");
    ASSERT_EQ(resumed.status, 0) << resumed.output;
    EXPECT_EQ(final_state(dir), expected);
    if (status == 75) ExpectSameLosses(ref.output, resumed.output);
  }
  EXPECT_GE(stopped, 2);
}
// Ctrl-C to mpirun (a terminal's SIGINT reaches mpirun only: OpenMPI puts each
// process in a process group of its own): mpirun sends the processes SIGTERM a
// second later, every process stops at one step with its checkpoint written and
// complete, and --resume finishes the run. mpirun itself exits 1 (its own status
// for a job it was told to end), within a few seconds.
TEST(TrainMnistPreemptMpi, CtrlCToMpirunStopsEveryProcessWithItsCheckpoint) {
  if (!std::filesystem::exists(std::filesystem::path(kFashion) / "train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "no Fashion-MNIST at " << kFashion;
  }
  // The run's output files (dir + ".out", ...) inside the removed directory too.
  const std::string dir = MakeTempDir("tandem_preempt_apps_ctrlc") + "/run";
  const std::string args = absl::StrCat(
      "-np 2 ", TRAIN_MNIST, " --gpus=cpu --nprocs=1 --epochs=1 --train_limit=32000 ",
      "--test_limit=200 --seed=7 --checkpoint_every_steps=4 --keep_checkpoints=3 ",
      "--log_every=100000 --checkpoint_dir=", dir);
  Child c(TANDEM_MPIRUN, args, dir + ".out");
  ASSERT_TRUE(AwaitFile(dir + "/step-8.ckpt", 120));
  c.Signal(SIGINT);
  const Clock::time_point signalled = Clock::now();
  const int status = c.Wait(60);
  const double exit_s = Seconds(Clock::now() - signalled);
  const std::string out = c.Output();
  std::cerr << "Ctrl-C to mpirun: exit " << status << " " << exit_s << " s after the signal\n";
  EXPECT_LT(exit_s, 10.0) << out;
  EXPECT_NE(status, 0) << out;
  // Both processes stopped at one step, which has its checkpoint.
  const std::vector<int64_t> steps = StoppedSteps(out, "train_mnist");
  ASSERT_EQ(steps.size(), 2u) << out;
  EXPECT_EQ(steps[0], steps[1]) << out;
  EXPECT_FALSE(TrainedState(absl::StrCat(dir, "/step-", steps[0], ".ckpt")).empty());
  const Finished resumed = RunToEnd(TANDEM_MPIRUN, args + " --resume", dir + ".resumed");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  EXPECT_NE(resumed.output.find(absl::StrCat("step-", steps[0], ".ckpt")), std::string::npos)
      << resumed.output;
}
#endif  // TANDEM_MPIRUN

}  // namespace
