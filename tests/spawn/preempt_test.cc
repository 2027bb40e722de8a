// Preemption: the step-boundary agreement (stop signals, agreed saves),
// dist::CheckpointManager (periodic saves, rotation, fallback to an older file,
// a stop during a background write, bit-identical resume), on CPU ranks.
// Signals are real (SendStopSignal: a rank thread signals itself while spawn's
// process-wide handlers are installed).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "optim/sgd.h"
#include "spawn/train/checkpoint_manager.h"
#include "spawn/signals.h"
#include "spawn/spawn.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

// Raises `signal` on the calling rank thread (as std::raise does). Not
// kill(getpid()): ThreadSanitizer holds a signal the kernel hands to a thread
// blocked in pthread_join (spawn's caller) until the join returns, and a run
// whose ranks wait for the stop would then never end. spawn's handlers are
// process-wide, so what the tests check does not depend on the thread.
void SendStopSignal(int signal) { ::pthread_kill(::pthread_self(), signal); }

using internal::StepAgreement;

// --- The agreement on its own ----------------------------------------------------

TEST(StepAgreement, StopsEveryRankAtTheFirstStepNoRankHasPassed) {
  // Rank 1 is one step behind when rank 0 sees the stop: both stop at 5.
  StepAgreement a(2, nullptr, 60);
  EXPECT_FALSE(a.AtBoundary(0, 4, false).stop);
  EXPECT_FALSE(a.AtBoundary(1, 4, false).stop);
  a.RequestStop("test");
  EXPECT_TRUE(a.AtBoundary(0, 5, false).stop);
  EXPECT_TRUE(a.AtBoundary(1, 5, false).stop);
}

TEST(StepAgreement, RankAheadMovesTheTargetOn) {
  // Rank 1 already passed 5 when rank 0 (at 5) sees the stop: both stop at 6.
  StepAgreement a(2, nullptr, 60);
  EXPECT_FALSE(a.AtBoundary(1, 5, false).stop);
  a.RequestStop("test");
  EXPECT_FALSE(a.AtBoundary(0, 5, false).stop);
  EXPECT_TRUE(a.AtBoundary(1, 6, false).stop);
  EXPECT_TRUE(a.AtBoundary(0, 6, false).stop);
}

TEST(StepAgreement, ProposedSaveIsDueOnceAtOneStepForEveryRank) {
  StepAgreement a(3, nullptr, 60);
  for (int r = 0; r < 3; ++r) a.AtBoundary(r, 1, false);
  a.AtBoundary(2, 2, false);  // rank 2 ahead
  // Rank 0 proposes at 2 (twice: its clock stays expired until it saved).
  EXPECT_FALSE(a.AtBoundary(0, 2, true).save);
  EXPECT_FALSE(a.AtBoundary(1, 2, false).save);
  EXPECT_TRUE(a.AtBoundary(0, 3, true).save);
  EXPECT_TRUE(a.AtBoundary(1, 3, false).save);
  EXPECT_TRUE(a.AtBoundary(2, 3, false).save);
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(a.AtBoundary(r, 4, false).save) << r;
}

TEST(StepAgreement, StopBeforeAnyBoundaryCancelsAtOnce) {
  StepAgreement a(2, nullptr, 60);
  a.RequestStop("SIGTERM");
  const absl::Status s = a.Poll();
  EXPECT_TRUE(IsStopped(s)) << s;
  EXPECT_EQ(StoppedAtStep(s), std::nullopt);
  EXPECT_NE(s.message().find("before any rank reached a step boundary"), std::string::npos) << s;
  EXPECT_TRUE(a.Poll().ok());  // once
}

TEST(StepAgreement, GracePeriodEndsAStopThatIsNotReached) {
  StepAgreement a(2, nullptr, 0.05);
  a.AtBoundary(0, 3, false);
  a.AtBoundary(1, 3, false);
  a.RequestStop("SIGTERM");
  a.AtBoundary(0, 4, false);  // target 4; rank 1 never arrives
  EXPECT_TRUE(a.Poll().ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const absl::Status s = a.Poll();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("agreed stop step 4"), std::string::npos) << s;
  EXPECT_NE(s.message().find("rank 1: last boundary at step 3"), std::string::npos) << s;
}

// --- Across processes, without MPI: the communication threads' rounds -------------
//
// P agreements in cross-process mode (one per simulated process), L rank threads
// each, coupled by a barrier per step as a data-parallel step's all-reduce
// couples them. One driver thread plays every process's communication thread:
// for each process in turn (random order, random pauses) it applies the last
// round's result and takes the process's contribution to the next round, then
// reduces the contributions with MAX: a process can be a round behind another,
// as with MPI_Iallreduce.
class SimulatedJob {
 public:
  SimulatedJob(int processes, int ranks_per_process, uint32_t seed)
      : processes_(processes), local_(ranks_per_process), rng_(seed) {
    for (int p = 0; p < processes; ++p) {
      agreements_.push_back(std::make_unique<StepAgreement>(local_, nullptr, 60, true));
    }
  }
  StepAgreement& at(int p) { return *agreements_[p]; }
  // Runs rounds until done() (called between rounds) says so.
  void Drive(const std::function<bool()>& done) {
    StepAgreement::Round result;  // the last round's MAX, applied by each process in turn
    bool have_result = false;
    std::vector<int> order(processes_);
    for (int p = 0; p < processes_; ++p) order[p] = p;
    while (!done()) {
      std::shuffle(order.begin(), order.end(), rng_);
      StepAgreement::Round next;
      next.arrived = StepAgreement::kNone;
      for (int p : order) {
        if (have_result) agreements_[p]->ApplyRound(result);
        const StepAgreement::Round mine = agreements_[p]->LocalRound();
        next.stop_code = std::max(next.stop_code, mine.stop_code);
        next.save_wanted = std::max(next.save_wanted, mine.save_wanted);
        next.arrived = std::max(next.arrived, mine.arrived);
        std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 300));
      }
      result = next;
      have_result = true;
    }
  }

 private:
  const int processes_;
  const int local_;
  std::mt19937 rng_;
  std::vector<std::unique_ptr<StepAgreement>> agreements_;
};

TEST(CrossProcessAgreement, EveryRankOfEveryProcessStopsAndSavesAtOneStep) {
  std::mt19937 rng(777);
  for (int trial = 0; trial < 8; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    const int processes = 2 + trial % 2;
    const int local = 1 + trial % 3;
    const int world = processes * local;
    const int stopper = static_cast<int>(rng() % processes);
    const int64_t stop_at = 20 + rng() % 40;
    const int64_t propose_from = 5 + rng() % 10;  // global rank 0 proposes saves from here
    const uint32_t seed = rng();
    SimulatedJob job(processes, local, seed);
    std::barrier step_barrier(world);
    std::vector<int64_t> stopped_at(world, -1);
    std::vector<std::vector<int64_t>> saves(world);
    std::atomic<int> finished{0};
    // The stop is requested at stop_at, or at the first step after it at which
    // global rank 0 has made an agreed save: a stop agreed while a save is still
    // proposed replaces that save (the stop saves), and on a loaded machine the
    // rounds (the driver thread) can lag the ranks by tens of steps. A save that
    // is never agreed still fails the test: the stop then comes kNoSaveSteps
    // steps later, and saves[0] is empty.
    constexpr int64_t kNoSaveSteps = 2000;
    std::atomic<bool> saved{false};
    std::vector<std::thread> ranks;
    for (int g = 0; g < world; ++g) {
      ranks.emplace_back([&, g] {
        const int p = g / local, l = g % local;
        std::mt19937 jitter(seed + g);
        bool stop_sent = false;
        for (int64_t step = 1; step < 100000; ++step) {
          step_barrier.arrive_and_wait();  // the step's all-reduce
          std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 400));
          if (p == stopper && l == 0 && !stop_sent && step >= stop_at &&
              (saved.load() || step >= stop_at + kNoSaveSteps)) {
            job.at(p).RequestStop("SIGTERM");
            stop_sent = true;
          }
          const bool propose = g == 0 && step >= propose_from && saves[0].size() < 3;
          const StepAgreement::Decision d = job.at(p).AtBoundary(l, step, propose);
          if (d.save) saves[g].push_back(step);
          if (d.save && g == 0) saved = true;
          if (d.stop) {
            stopped_at[g] = step;
            break;
          }
        }
        step_barrier.arrive_and_drop();
        finished.fetch_add(1);
      });
    }
    job.Drive([&] { return finished.load() == world; });
    for (std::thread& t : ranks) t.join();
    for (int g = 0; g < world; ++g) {
      EXPECT_EQ(stopped_at[g], stopped_at[0]) << "global rank " << g;
      EXPECT_EQ(saves[g], saves[0]) << "global rank " << g;
    }
    EXPECT_GT(stopped_at[0], stop_at);  // the stop is agreed at a later boundary
    EXPECT_FALSE(saves[0].empty());
    for (int p = 0; p < processes; ++p) {
      for (int l = 0; l < local; ++l) job.at(p).RankStopped(l);
      const absl::Status outcome = job.at(p).Outcome();
      EXPECT_EQ(StoppedAtStep(outcome), stopped_at[0]) << outcome;
      // The other processes name the signal of the one that got it.
      const std::string reason = p == stopper ? "stopped by SIGTERM at step"
                                              : "stopped by a stop request on another process";
      EXPECT_NE(outcome.message().find(reason), std::string::npos) << outcome;
    }
  }
}

TEST(CrossProcessAgreement, StopBeforeAnyBoundaryOfAnyProcessCancelsWithoutAStep) {
  SimulatedJob job(2, 2, 1);
  job.at(1).RequestStop("SIGTERM");
  int rounds = 0;
  job.Drive([&] { return ++rounds > 3; });
  for (int p = 0; p < 2; ++p) {
    const absl::Status s = job.at(p).Poll();
    EXPECT_TRUE(IsStopped(s)) << s;
    EXPECT_EQ(StoppedAtStep(s), std::nullopt) << s;
    EXPECT_TRUE(job.at(p).Poll().ok());  // once
    // A rank arriving now is not told to stop at a step: the run is being cancelled.
    EXPECT_FALSE(job.at(p).AtBoundary(0, 1, false).stop);
  }
}

TEST(CrossProcessAgreement, HeldRankLeavesOnTheRunsStop) {
  SimulatedJob job(2, 1, 2);
  job.at(0).AtBoundary(0, 1, false);
  job.at(0).RequestStop("SIGTERM");
  // One round: process 0 now holds its ranks at their next boundary.
  StepAgreement::Round round = job.at(0).LocalRound();
  round.arrived = std::max(round.arrived, job.at(1).LocalRound().arrived);
  job.at(0).ApplyRound(round);
  std::stop_source stop;
  std::atomic<bool> left{false};
  std::thread rank([&] {
    EXPECT_THROW(job.at(0).AtBoundary(0, 2, false, stop.get_token()), CancelledError);
    left = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(left.load());  // held: no round decided the target yet
  stop.request_stop();
  rank.join();
  EXPECT_TRUE(left.load());
}

// --- Under spawn, with real signals ---------------------------------------------

// Ranks run a loop with an all-reduce per step and random per-rank delays (so
// they are out of phase); rank `sender` sends SIGTERM at step `at`. Every rank
// records the step at which it was told to stop, and the first step at whose
// boundary it saw the signal (a StopSignalScope of the test's own, read just
// before and just after AtStepBoundary). The signal may reach a thread other
// than the sender late on a loaded machine, so the stop step is not bounded by
// `at`; but once a rank sees it at the boundary of step s, no rank has passed
// s + 1 (each step's all-reduce needs every rank) and the next AtStepBoundary
// of any rank notices it, so the agreed stop is at most s + 1, however late the
// signal landed. Every rank sees it at the latest at the boundary it stops at.
TEST(SpawnStopSignal, EveryRankStopsAtTheSameStep) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 6; ++trial) {
    const int world = 2 + trial % 3;
    const int sender = static_cast<int>(rng() % world);
    const int64_t at = 3 + rng() % 10;
    const uint32_t seed = rng();
    std::vector<int64_t> stopped_at(world, -1);
    std::vector<int64_t> first_seen(world, -1);  // per rank, the first step it saw the signal
    std::ostringstream log;
    const StopSignalScope seen({SIGTERM});
    const absl::Status s = spawn(
        [&](Context& ctx) {
          std::mt19937 jitter(seed + ctx.rank());
          for (int64_t step = 1; step < 1000; ++step) {
            nn::Tensor x = nn::ones({4});
            ctx.communicator().all_reduce(x, ReduceOp::kSum);
            std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 2000));
            if (ctx.rank() == sender && step == at) SendStopSignal(SIGTERM);
            auto note = [&] {
              if (first_seen[ctx.rank()] < 0 && seen.Received() != 0) first_seen[ctx.rank()] = step;
            };
            note();
            const bool stop = ctx.AtStepBoundary(step).stop;
            note();
            if (stop) {
              stopped_at[ctx.rank()] = step;
              ctx.communicator().barrier();  // collectives still work: the save's would
              throw StoppedError("stopped", step);
            }
          }
        },
        world, "cpu", {.console = &log});
    ASSERT_TRUE(IsStopped(s)) << s << "\n" << log.str();
    ASSERT_TRUE(StoppedAtStep(s).has_value()) << s;
    for (int r = 0; r < world; ++r) EXPECT_EQ(stopped_at[r], *StoppedAtStep(s)) << "rank " << r;
    EXPECT_GE(*StoppedAtStep(s), at);
    int64_t earliest = -1;
    for (int64_t step : first_seen) {
      if (step >= 0 && (earliest < 0 || step < earliest)) earliest = step;
    }
    ASSERT_GE(earliest, 0) << "no rank saw the signal";
    EXPECT_LE(*StoppedAtStep(s), earliest + 1) << "first seen at step " << earliest;
    EXPECT_NE(s.message().find("stopped by SIGTERM at step"), std::string::npos) << s;
  }
}

TEST(SpawnStopSignal, FunctionWithoutBoundariesIsCancelledAtOnce) {
  std::ostringstream log;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = spawn(
      [&](Context& ctx) {
        if (ctx.rank() == 0) SendStopSignal(SIGUSR1);
        for (;;) {  // never calls AtStepBoundary
          ctx.check_stop();
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      },
      2, "cpu", {.console = &log});
  EXPECT_TRUE(IsStopped(s)) << s;
  EXPECT_NE(s.message().find("SIGUSR1"), std::string::npos) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST(SpawnStopSignal, RankThatNeverStopsEndsTheRunAfterTheGracePeriod) {
  std::ostringstream log;
  const absl::Status s = spawn(
      [&](Context& ctx) {
        for (int64_t step = 1;; ++step) {
          if (ctx.rank() == 0 && step == 3) SendStopSignal(SIGTERM);
          if (ctx.rank() == 1 && step > 1) {  // stops calling the boundary
            ctx.check_stop();
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            continue;
          }
          if (ctx.AtStepBoundary(step).stop) throw StoppedError("stopped", step);
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      },
      2, "cpu", {.console = &log, .stop_grace_s = 0.5});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 0: stopped"), std::string::npos) << s;
}

TEST(SpawnStopSignal, SigintIsNotAGracefulStopSignal) {
  const absl::Status s = spawn([](Context&) {}, 1, "cpu", {.stop_signals = {SIGINT}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("SIGINT"), std::string::npos) << s;
}

// --- CheckpointManager ----------------------------------------------------------

// x: (B, 4) -> (B, 1), SGD with momentum (optimizer state matters), random
// batches from the rank's generator (restored from the file).
struct Trainer {
  explicit Trainer(Context& ctx)
      : net(4, 1),
        dp(net, ctx),
        sgd(net.parameters(), {.lr = 0.05, .momentum = 0.9}),
        state{.model = &net, .optimizer = &sgd, .step = &step} {}
  void Step() {
    nn::Tensor x = nn::randn({3, 4});
    nn::Tensor y = nn::randn({3, 1});
    nn::Tensor loss = nn::MSELoss()(dp(x), y);
    sgd.zero_grad();
    loss.backward();
    sgd.step();
    ++step;
  }
  std::vector<float> Weights() const {
    std::vector<float> out;
    for (const auto& [name, t] : net.state_dict()) {
      for (float v : t.to_vector<float>()) out.push_back(v);
    }
    return out;
  }
  nn::LinearImpl net;
  DataParallel dp;
  optim::SGD sgd;
  int64_t step = 0;
  TrainingState state;
};

std::vector<std::string> Names(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) out.push_back(std::filesystem::path(p).filename().string());
  return out;
}

TEST(CheckpointManager, KeepsTheNewestAndListsByStep) {
  const std::string dir = testing::MakeTempDir("tandem_preempt_keep");
  std::ofstream(dir + "/epoch-7.ckpt") << "an older version's file";
  std::ofstream(dir + "/step-9.ckpt.tmp.999999999.0") << "a write cut short";
  std::ostringstream log;
  const absl::Status s = spawn(
      [&](Context& ctx) {
        Trainer t(ctx);
        CheckpointManager m(ctx, {.dir = dir, .keep = 3, .every_steps = 2});
        for (int i = 0; i < 11; ++i) {
          t.Step();
          absl::Status saved = m.AtStepBoundary(t.state);
          if (!saved.ok()) return saved;
        }
        return m.Finish();
      },
      2, "cpu", {.console = &log});
  ASSERT_TRUE(s.ok()) << s << log.str();
  EXPECT_EQ(Names(CheckpointManager::List(dir)),
            (std::vector<std::string>{"step-10.ckpt", "step-8.ckpt", "step-6.ckpt",
                                      "epoch-7.ckpt"}));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-9.ckpt.tmp.999999999.0"));
  EXPECT_NE(log.str().find("removed " + dir + "/step-9.ckpt.tmp.999999999.0"), std::string::npos)
      << log.str();
}

// Trains `total` steps from the newest checkpoint of dir (or from the start),
// with periodic saves; returns rank 0's final weights. stop_at: SIGTERM then.
struct Outcome {
  absl::Status status;
  std::vector<float> weights;
  std::string restored;
  std::string log;
};
Outcome Train(const std::string& dir, int64_t total, int64_t stop_at, double write_delay_s = 0) {
  Outcome out;
  std::ostringstream log;
  std::mutex mu;
  out.status = spawn(
      [&](Context& ctx) -> absl::Status {
        Trainer t(ctx);
        CheckpointManager m(ctx, {.dir = dir, .keep = 3, .every_steps = 4,
                                  .write_delay_s = write_delay_s});
        absl::StatusOr<std::string> from = m.Restore(t.state);
        if (!from.ok()) return from.status();
        while (t.step < total) {
          t.Step();
          if (ctx.rank() == 0 && t.step == stop_at) SendStopSignal(SIGTERM);
          absl::Status saved = m.AtStepBoundary(t.state);
          if (!saved.ok()) return saved;
        }
        if (ctx.rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          out.weights = t.Weights();
          out.restored = *from;
        }
        return m.Finish();
      },
      2, "cpu", {.seed = 5, .console = &log});
  out.log = log.str();
  return out;
}

TEST(CheckpointManager, StopThenResumeEndsBitForBitWithAnUninterruptedRun) {
  const Outcome straight = Train(testing::MakeTempDir("tandem_preempt_straight"), 30, -1);
  ASSERT_TRUE(straight.status.ok()) << straight.status << straight.log;
  const std::string dir = testing::MakeTempDir("tandem_preempt_stopped");
  const Outcome stopped = Train(dir, 30, 13);
  ASSERT_TRUE(IsStopped(stopped.status)) << stopped.status << stopped.log;
  const int64_t at = *StoppedAtStep(stopped.status);
  // kill() to the own process is delivered to some thread, possibly a step later.
  EXPECT_TRUE(at >= 13 && at < 30) << at;
  EXPECT_TRUE(std::filesystem::exists(CheckpointManager::PathFor(dir, at)));
  const Outcome resumed = Train(dir, 30, -1);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status << resumed.log;
  EXPECT_EQ(resumed.restored, CheckpointManager::PathFor(dir, at));
  EXPECT_EQ(resumed.weights, straight.weights);
  ASSERT_FALSE(straight.weights.empty());
}

TEST(CheckpointManager, StopDuringABackgroundWriteWaitsForItThenSaves) {
  const std::string dir = testing::MakeTempDir("tandem_preempt_inflight");
  // Saves every 4 steps take 0.3 s to write: one is always in flight.
  const Outcome stopped = Train(dir, 30, 5, 0.3);
  ASSERT_TRUE(IsStopped(stopped.status)) << stopped.status << stopped.log;
  // The signal may reach the process a few steps late: some write is in flight then.
  EXPECT_NE(stopped.log.find("after the write of " + dir + "/step-"), std::string::npos)
      << stopped.log;
  const int64_t at = *StoppedAtStep(stopped.status);
  const std::vector<std::string> files = CheckpointManager::List(dir);
  ASSERT_FALSE(files.empty());
  EXPECT_EQ(files.front(), CheckpointManager::PathFor(dir, at));
  for (const std::string& f : files) EXPECT_TRUE(nn::LoadCheckpoint(f).ok()) << f;
}

TEST(CheckpointManager, RestoreFallsBackToAnOlderFileAndSaysSo) {
  const Outcome straight = Train(testing::MakeTempDir("tandem_preempt_straight"), 20, -1);
  ASSERT_TRUE(straight.status.ok()) << straight.status;
  const std::string dir = testing::MakeTempDir("tandem_preempt_fallback");
  const Outcome first = Train(dir, 12, -1);  // step-4, -8, -12
  ASSERT_TRUE(first.status.ok()) << first.status;
  const std::string newest = CheckpointManager::PathFor(dir, 12);
  std::filesystem::resize_file(newest, std::filesystem::file_size(newest) / 2);
  const Outcome resumed = Train(dir, 20, -1);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status << resumed.log;
  EXPECT_EQ(resumed.restored, CheckpointManager::PathFor(dir, 8));
  EXPECT_NE(resumed.log.find("skipping checkpoint " + newest + ": "), std::string::npos)
      << resumed.log;
  EXPECT_EQ(resumed.weights, straight.weights);
}

TEST(CheckpointManager, NoLoadableFileIsAnErrorNamingTheNewest) {
  const std::string dir = testing::MakeTempDir("tandem_preempt_bad");
  std::ofstream(dir + "/step-3.ckpt") << "junk";
  std::ofstream(dir + "/step-1.ckpt") << "junk";
  const Outcome out = Train(dir, 5, -1);
  EXPECT_FALSE(out.status.ok());
  EXPECT_NE(out.status.message().find("no checkpoint of " + dir + " could be loaded (2 tried)"),
            std::string::npos)
      << out.status;
  EXPECT_NE(out.status.message().find(dir + "/step-3.ckpt"), std::string::npos) << out.status;
}

// every_minutes: rank 0's clock proposes, the ranks agree; ranks that saved at
// different steps would pair the snapshot's collectives with a step's and fail.
TEST(CheckpointManager, TimedSavesHappenAtOneStepOnEveryRank) {
  const std::string dir = testing::MakeTempDir("tandem_preempt_timed");
  std::ostringstream log;
  const absl::Status s = spawn(
      [&](Context& ctx) -> absl::Status {
        Trainer t(ctx);
        CheckpointManager m(ctx, {.dir = dir, .every_minutes = 0.02 / 60});  // 20 ms
        std::mt19937 jitter(ctx.rank());
        for (int i = 0; i < 40; ++i) {
          t.Step();
          std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 3000));
          absl::Status saved = m.AtStepBoundary(t.state);
          if (!saved.ok()) return saved;
        }
        return m.Finish();
      },
      3, "cpu", {.timeout_s = 20, .console = &log});
  ASSERT_TRUE(s.ok()) << s << log.str();
  EXPECT_GE(CheckpointManager::List(dir).size(), 2u) << log.str();
}

TEST(CheckpointManager, RejectsBadOptions) {
  EXPECT_FALSE(CheckpointManager::Validate({}).ok());
  EXPECT_FALSE(CheckpointManager::Validate({.dir = "d", .keep = -1}).ok());
  EXPECT_FALSE(CheckpointManager::Validate({.dir = "d", .every_steps = -2}).ok());
  EXPECT_TRUE(CheckpointManager::Validate({.dir = "d", .keep = 2, .every_steps = 5}).ok());
}

}  // namespace
}  // namespace tandem::dist
