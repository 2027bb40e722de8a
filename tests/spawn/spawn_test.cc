// dist::spawn on CPU ranks: launch forms, Context, values, seeds, and faults
// (each must end within 10 s with every thread joined and the right rank named).
#include "spawn/spawn.h"

#include <dirent.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nn/random.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

int ThreadCount() {
  int n = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

class SpawnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    threads_before_ = ThreadCount();
    start_ = std::chrono::steady_clock::now();
    options_.console = &console_;
  }
  // pthread_join returns once the kernel clears the thread's tid, which is before
  // the task leaves /proc/self/task; give a joined thread a moment to be reaped (a
  // thread that really outlives spawn stays listed).
  void TearDown() override {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (ThreadCount() != threads_before_ && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(ThreadCount(), threads_before_) << "a thread outlived spawn";
  }
  // Faults must be over quickly.
  void ExpectFast() {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    EXPECT_LT(s, 10.0);
  }
  bool Logged(const std::string& text) const {
    return console_.str().find(text) != std::string::npos;
  }

  std::ostringstream console_;
  SpawnOptions options_{.log_all_ranks = true};
  int threads_before_ = 0;
  std::chrono::steady_clock::time_point start_;
};

void Expect(const absl::Status& s, absl::StatusCode code, std::initializer_list<const char*> parts) {
  EXPECT_EQ(s.code(), code) << s;
  for (const char* part : parts) {
    EXPECT_NE(s.message().find(part), absl::string_view::npos) << s << " lacks \"" << part << "\"";
  }
}

TEST_F(SpawnTest, RunsFnOnEveryRankWithItsOwnArgsAndContext) {
  std::mutex mutex;
  std::vector<int> seen_ranks;
  auto fn = [&](Context& ctx, std::vector<int> scratch, const std::string& tag) {
    scratch.push_back(ctx.rank());  // each rank owns its copy
    EXPECT_EQ(scratch.size(), 2u);
    EXPECT_EQ(tag, "hello");
    EXPECT_EQ(ctx.world_size(), 3);
    EXPECT_EQ(ctx.device(), nn::Device::CPU());
    EXPECT_EQ(&current(), &ctx);
    EXPECT_EQ(nn::thread_generator().stream, static_cast<uint64_t>(ctx.rank()));
    ctx.log().Info("rank {} here", ctx.rank());
    std::lock_guard<std::mutex> lock(mutex);
    seen_ranks.push_back(ctx.rank());
  };
  absl::Status s =
      spawn(fn, std::make_tuple(std::vector<int>{7}, std::string("hello")), 3, "cpu", options_);
  ASSERT_TRUE(s.ok()) << s;
  std::sort(seen_ranks.begin(), seen_ranks.end());
  EXPECT_EQ(seen_ranks, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(Logged("distributed environment"));
  EXPECT_TRUE(Logged("rank 2 cpu] rank 2 here"));
  EXPECT_EQ(current_or_null(), nullptr);
}

TEST_F(SpawnTest, AllVisibleDevicesMeansCpuWithoutGpus) {
  if (nn::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible; this checks the CPU fallback";
  std::atomic<int> calls{0};
  absl::Status s = spawn([&](Context& ctx) { ++calls; EXPECT_TRUE(ctx.device().is_cpu()); },
                         -1, "", options_);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(Logged("no GPU is visible: running on CPU ranks"));
}

// spawn's start is one line by default (world size, processes, devices,
// communicator); SpawnOptions::verbose, and a failed run, print the whole table.
TEST_F(SpawnTest, BannerIsOneLineUnlessVerboseOrFailed) {
  auto spawn_lines = [&] {
    int count = 0;
    std::istringstream in(console_.str());
    for (std::string line; std::getline(in, line);) count += line.find(" spawn] ") != std::string::npos;
    return count;
  };
  ASSERT_TRUE(spawn([](Context&) {}, 3, "cpu", options_).ok());
  EXPECT_TRUE(Logged("spawn] distributed environment: world_size 3, 1 process, ranks here on "
                     "cpu x3, in-process (CPU ranks)\n"))
      << console_.str();
  EXPECT_EQ(spawn_lines(), 2) << console_.str();  // the banner and "all ranks finished"
  EXPECT_FALSE(Logged("rank 2           cpu")) << console_.str();

  console_.str("");
  SpawnOptions verbose = options_;
  verbose.verbose = true;
  ASSERT_TRUE(spawn([](Context&) {}, 3, "cpu", verbose).ok());
  EXPECT_TRUE(Logged("spawn]   rank 2           cpu\n")) << console_.str();
  EXPECT_TRUE(Logged("spawn]   timeout_s        ")) << console_.str();

  console_.str("");
  absl::Status failed = spawn(
      [](Context& ctx) {
        if (ctx.rank() == 1) throw tandem::Error("boom");
      },
      2, "cpu", options_);
  EXPECT_FALSE(failed.ok());
  EXPECT_TRUE(Logged("spawn]   rank 1           cpu\n")) << console_.str();
}

TEST_F(SpawnTest, ReturnsEachRanksValue) {
  auto values = spawn(
      [](Context& ctx) {
        Tensor x = nn::full({1}, ctx.rank() + 1.0);
        ctx.communicator().all_reduce(x);
        return x.item() * 10 + ctx.rank();
      },
      4, "cpu", options_);
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<double>{100, 101, 102, 103}));

  auto or_values = spawn(
      [](Context& ctx) -> absl::StatusOr<int> { return ctx.rank() * 2; }, 2, "cpu", options_);
  ASSERT_TRUE(or_values.ok()) << or_values.status();
  EXPECT_EQ(*or_values, (std::vector<int>{0, 2}));
}

TEST_F(SpawnTest, SeedsDifferPerRankAndRepeat) {
  options_.seed = 42;
  auto draw = [](Context&) { return nn::randn({4}).to_vector<float>(); };
  auto a = spawn(draw, 2, "cpu", options_);
  auto b = spawn(draw, 2, "cpu", options_);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_NE((*a)[0], (*a)[1]);
}

// rank 1 reports rank 0's failure (as a checkpoint save does:
// "rank 0 could not write it") before rank 0 reports its own; spawn returns the
// cause, not the consequence.
TEST_F(SpawnTest, APeersOwnFailureReplacesAPeerFailureThatCameFirst) {
  absl::Status s = spawn(
      [](Context& ctx) {
        if (ctx.rank() == 1) {
          ThrowIfError(MarkPeerFailure(absl::ResourceExhaustedError(
                           "checkpoint c: rank 0 could not write it")),
                       "saving: ");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        throw std::runtime_error("writing c: No space left on device");
      },
      2, "cpu", options_);
  Expect(s, absl::StatusCode::kInternal, {"rank 0", "No space left on device"});
  EXPECT_TRUE(Logged("the cause: ")) << console_.str();
  ExpectFast();
}

TEST(ThrowIfErrorTest, PeerFailuresThrowPeerFailedError) {
  EXPECT_NO_THROW(ThrowIfError(absl::OkStatus(), "x: "));
  EXPECT_THROW(ThrowIfError(MarkPeerFailure(absl::InternalError("a")), "x: "), PeerFailedError);
  try {
    ThrowIfError(absl::InternalError("b"), "x: ");
    FAIL() << "no throw";
  } catch (const PeerFailedError&) {
    FAIL() << "a plain error is not a peer failure";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x: INTERNAL: b"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(IsPeerFailure(MarkPeerFailure(absl::OkStatus())));
}

TEST_F(SpawnTest, BadGpusIsAnErrorBeforeAnyRankRuns) {
  std::atomic<int> calls{0};
  absl::Status s = spawn([&](Context&) { ++calls; }, -1, "0,,1", options_);
  Expect(s, absl::StatusCode::kInvalidArgument, {"token \"\"", "empty"});
  EXPECT_EQ(calls.load(), 0);
}

TEST_F(SpawnTest, LogDirGetsOneWorkerlogPerRank) {
  options_.log_dir = ::testing::TempDir() + "/tandem_spawn_logs";
  ASSERT_TRUE(spawn([](Context& ctx) { ctx.log().Info("hi from {}", ctx.rank()); }, 2, "cpu",
                    options_)
                  .ok());
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(options_.log_dir + "/workerlog." + std::to_string(r));
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_NE(text.str().find("hi from " + std::to_string(r)), std::string::npos) << r;
    EXPECT_NE(text.str().find("communicator"), std::string::npos);
  }
}

TEST_F(SpawnTest, NestedSpawnAndBadTimeoutAreErrors) {
  absl::Status inner;
  ASSERT_TRUE(spawn([&](Context&) { inner = spawn([](Context&) {}, 1, "cpu"); }, 1, "cpu",
                    options_)
                  .ok());
  Expect(inner, absl::StatusCode::kFailedPrecondition, {"do not nest"});
  options_.timeout_s = 0;
  Expect(spawn([](Context&) {}, 1, "cpu", options_), absl::StatusCode::kInvalidArgument,
         {"timeout_s"});
}

// The watchdog counts in int64 nanoseconds: +inf, NaN and values past ~9.2e9 s
// would overflow its conversion, and are refused naming the value.
TEST_F(SpawnTest, InfiniteOrHugeTimeoutIsAnError) {
  for (double bad : {std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN(), 1e10, 9.3e9}) {
    options_.timeout_s = bad;
    bool ran = false;
    const absl::Status status = spawn([&](Context&) { ran = true; }, 1, "cpu", options_);
    Expect(status, absl::StatusCode::kInvalidArgument,
           {"SpawnOptions::timeout_s must be positive and at most 1e+09 s", "not "});
    EXPECT_NE(status.message().find(absl::StrCat(bad)), absl::string_view::npos) << status;
    EXPECT_FALSE(ran);
  }
  options_.timeout_s = 1e9;  // the largest accepted
  EXPECT_TRUE(spawn([](Context&) {}, 1, "cpu", options_).ok());
}

// --- Faults --------------------------------------------------------------------------

// Every rank all-reduces each step; rank `bad` throws at step `k`.
TEST_F(SpawnTest, RankThrowsAtStepK) {
  absl::Status s = spawn(
      [](Context& ctx) {
        for (int step = 0; step < 100; ++step) {
          if (ctx.rank() == 2 && step == 5) throw Error("loss is NaN at step 5");
          Tensor x = nn::ones({8});
          ctx.communicator().all_reduce(x);
        }
      },
      4, "cpu", options_);
  Expect(s, absl::StatusCode::kInternal, {"rank 2 (cpu)", "loss is NaN at step 5"});
  EXPECT_TRUE(Logged("stopped as a consequence"));
  ExpectFast();
}

TEST_F(SpawnTest, RankReturnsNonOkStatus) {
  absl::Status s = spawn(
      [](Context& ctx) -> absl::Status {
        if (ctx.rank() == 1) return absl::NotFoundError("no file data/train.bin");
        ctx.communicator().barrier();
        return absl::OkStatus();
      },
      3, "cpu", options_);
  Expect(s, absl::StatusCode::kNotFound, {"rank 1 (cpu)", "no file data/train.bin"});
  ExpectFast();
}

TEST_F(SpawnTest, RankThrowsBeforeItsFirstCollective) {
  absl::Status s = spawn(
      [](Context& ctx) {
        if (ctx.rank() == 0) throw std::runtime_error("bad config");
        Tensor x = nn::ones({3});
        ctx.communicator().all_reduce(x);
      },
      2, "cpu", options_);
  Expect(s, absl::StatusCode::kInternal, {"rank 0 (cpu)", "bad config"});
  ExpectFast();
}

TEST_F(SpawnTest, SkippedCollectiveEndsInWatchdogReport) {
  options_.timeout_s = 0.3;
  absl::Status s = spawn(
      [](Context& ctx) {
        ctx.communicator().barrier();
        if (ctx.rank() != 1) {
          ctx.communicator().barrier();
        } else {
          // Rank 1 skips it and goes on (returning would be reported at once: below).
          while (!ctx.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      },
      3, "cpu", options_);
  Expect(s, absl::StatusCode::kDeadlineExceeded,
         {"watchdog", "0.3 s", "rank 0 (cpu): waiting in barrier #2",
          "rank 1 (cpu): last completed barrier #1 (running)",
          "rank 2 (cpu): waiting in barrier #2"});
  ExpectFast();
}

TEST_F(SpawnTest, RankThatReturnedBeforeACollectiveEndsTheRunAtOnce) {
  options_.timeout_s = 30;
  absl::Status s = spawn(
      [](Context& ctx) {
        ctx.communicator().barrier();
        if (ctx.rank() != 1) ctx.communicator().barrier();  // rank 1 returns instead
      },
      3, "cpu", options_);
  Expect(s, absl::StatusCode::kFailedPrecondition,
         {"watchdog: rank 1 (cpu) returned from its function after entering 1 collective(s), "
          "while rank ", " (cpu) waits in barrier #2, which it will never enter",
          "DataParallel::join()"});
  ExpectFast();
}

TEST_F(SpawnTest, TwoRanksFailAtOnce) {
  absl::Status s = spawn(
      [](Context& ctx) {
        ctx.communicator().barrier();
        if (ctx.rank() == 1 || ctx.rank() == 3) throw Error("rank-local failure");
        ctx.communicator().barrier();
      },
      4, "cpu", options_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  const bool names_one = s.message().find("rank 1 (cpu)") != absl::string_view::npos;
  const bool names_three = s.message().find("rank 3 (cpu)") != absl::string_view::npos;
  EXPECT_NE(names_one, names_three) << s;
  EXPECT_TRUE(Logged(names_one ? "rank 3 cpu] ERROR" : "rank 1 cpu] ERROR")) << console_.str();
  ExpectFast();
}

TEST_F(SpawnTest, CollectiveMismatchIsAnErrorNotAHang) {
  absl::Status s = spawn(
      [](Context& ctx) {
        Tensor x = nn::ones({ctx.rank() == 0 ? 4 : 6});
        ctx.communicator().all_reduce(x);
      },
      2, "cpu", options_);
  Expect(s, absl::StatusCode::kInternal, {"collective mismatch", "all_reduce #1"});
  ExpectFast();
}

TEST_F(SpawnTest, SigintStopsEveryRankAndReturnsCancelled) {
  std::atomic<int> steps{0};
  struct sigaction before {};
  sigaction(SIGINT, nullptr, &before);
  absl::Status s = spawn(
      [&](Context& ctx) {
        for (int step = 0;; ++step) {
          ctx.check_stop();
          if (ctx.rank() == 0 && step == 3) std::raise(SIGINT);
          ctx.communicator().barrier();
          ++steps;
        }
      },
      2, "cpu", options_);
  Expect(s, absl::StatusCode::kCancelled, {"SIGINT"});
  struct sigaction after {};
  sigaction(SIGINT, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler) << "the SIGINT handler was not restored";
  ExpectFast();
}

}  // namespace
}  // namespace tandem::dist
