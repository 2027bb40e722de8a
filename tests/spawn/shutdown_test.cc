// spawn's shutdown and the Work lifetime rules, on CPU ranks, driven by the
// asynchronous fake communicator (testing/fake_communicator.h): the abort from the
// watchdog, stop-aware host waits, the teardown order, the guard between abort
// and use, the second Ctrl-C, and what an unwaited handle keeps alive.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <future>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "gtest/gtest.h"
#include "nn/autograd.h"
#include "nn/interrupt.h"
#include "nn/layers.h"
#include "nn/ops/loss.h"
#include "spawn/spawn.h"
#include "testing/fake_communicator.h"

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;
using nn::Tensor;
using testing::FakeAsyncCommunicator;
using testing::FakeGroup;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Runs spawn on `world` CPU ranks over fake communicators. A run still going
// after `limit` is a hang: the fakes are aborted by hand so the test ends (and
// fails) instead of hanging.
class ShutdownTest : public ::testing::Test {
 protected:
  absl::Status Run(int world, const std::function<absl::Status(Context&)>& body,
                   std::chrono::seconds limit = std::chrono::seconds(20)) {
    group_ = std::make_shared<FakeGroup>(world);
    SpawnHooks hooks = hooks_;
    hooks.make_communicators = testing::MakeFakeCommunicators(group_, &comms_);
    options_.console = &console_;
    const Clock::time_point start = Clock::now();
    auto result = std::async(std::launch::async, [&] {
      return RunSpawnWithHooks("cpu", world, options_, hooks, [](int) {}, body);
    });
    if (result.wait_for(limit) != std::future_status::ready) {
      ADD_FAILURE() << "spawn did not return within " << limit.count() << " s: a hang";
      for (FakeAsyncCommunicator* c : comms_) {
        c->ReleaseStall();
        (void)c->Abort(std::chrono::seconds(5));
      }
      group_->Release();
    }
    absl::Status status = result.get();
    seconds_ = SecondsSince(start);
    return status;
  }
  bool Logged(const std::string& text) const {
    return console_.str().find(text) != std::string::npos;
  }

  SpawnOptions options_{.log_all_ranks = true, .timeout_s = 60};
  SpawnHooks hooks_;
  std::ostringstream console_;
  std::shared_ptr<FakeGroup> group_;
  std::vector<FakeAsyncCommunicator*> comms_;
  double seconds_ = 0;
};

FakeAsyncCommunicator& Fake(Context& ctx) {
  return static_cast<FakeAsyncCommunicator&>(ctx.communicator());
}

// Rank 1 throws before the all-reduce that rank 0 waits on (on the host, as
// item() would): spawn returns at once with rank 1's error, and every
// communicator was aborted.
TEST_F(ShutdownTest, PeerFailingBeforeACollectiveEndsAHostWaitOnIt) {
  std::atomic<bool> entered{false};
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 1) {
      while (!entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      throw std::runtime_error("data file truncated");
    }
    Tensor x = nn::ones({4});
    std::shared_ptr<Work> work = ctx.communicator().all_reduce_async(x);
    entered.store(true);
    work->wait();  // never completes: rank 1 never joins
    ADD_FAILURE() << "the wait returned without the peer";
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 (cpu) threw: data file truncated"), absl::string_view::npos)
      << s;
  EXPECT_LT(seconds_, 10.0);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(group_->abort_calls(r), 1) << "rank " << r;
  EXPECT_TRUE(Logged("stopped as a consequence of the first failure")) << console_.str();
}

// SpawnHooks::wrap_communicators: a wrapper must stand for the rank it
// replaces; communicators in the wrong order are refused before any rank runs.
TEST_F(ShutdownTest, WrappedCommunicatorsMustKeepTheirRanks) {
  hooks_.wrap_communicators = [](std::vector<std::unique_ptr<Communicator>> comms)
      -> absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> {
    std::reverse(comms.begin(), comms.end());
    return comms;
  };
  std::atomic<int> ran{0};
  absl::Status s = Run(2, [&](Context&) -> absl::Status {
    ran.fetch_add(1);
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("the communicator at index 0 is rank 1 of 2 on cpu; it replaces "
                             "rank 0 of 2 on cpu"),
            absl::string_view::npos)
      << s;
  EXPECT_EQ(ran.load(), 0);
}

// The stop-aware wait is the installed interrupt check: a plain host wait
// (nn::internal::WaitUntil, what item() uses) on a rank thread ends with the stop.
TEST_F(ShutdownTest, HostWaitsOnRankThreadsEndWithTheStop) {
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 1) return absl::DataLossError("checkpoint unreadable");
    nn::internal::WaitUntil([] { return false; });  // a stream that never drains
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("rank 1 (cpu) returned"), absl::string_view::npos) << s;
  EXPECT_TRUE(Logged("host wait on the device abandoned: the run is stopping")) << console_.str();
  EXPECT_LT(seconds_, 10.0);
}

// The watchdog aborts before the joins, and a rank thread's teardown at exit
// (cudnnDestroy's implicit device sync, modelled by a thread-local whose
// destructor blocks, not stop-aware, on the rank's collectives) runs after the
// abort: with the abort after the joins this would never return.
struct TeardownProbe {
  FakeAsyncCommunicator* comm = nullptr;
  std::atomic<int>* aborted_at_start = nullptr;
  std::atomic<int>* synced = nullptr;
  ~TeardownProbe() {
    if (comm == nullptr) return;
    aborted_at_start->store(comm->aborted() ? 1 : 0);
    synced->store(comm->BlockingDeviceSync() ? 1 : 0);
  }
};

// Rank 0's last step in the tests below: an all_reduce_async of `x` that rank 1
// never joins, its handle kept in a thread-local destroyed after a
// TeardownProbe's (thread-locals go in reverse order): the handle is dropped
// unwaited at thread exit, with no host wait in the function, and the probe
// reports the teardown's abort state and device sync.
void LeaveACollectiveUnjoined(Context& ctx, Tensor& x, std::atomic<int>& aborted_at_start,
                              std::atomic<int>& synced) {
  thread_local std::shared_ptr<Work> extra;
  thread_local TeardownProbe probe;
  probe.comm = &Fake(ctx);
  probe.aborted_at_start = &aborted_at_start;
  probe.synced = &synced;
  extra = ctx.communicator().all_reduce_async(x);
}

// Set when the thread that made it exits: after its rank's function returned
// and spawn recorded that return (thread-locals go after both), before the
// thread-locals made earlier (a TeardownProbe, the kept handle).
struct ExitSignal {
  std::atomic<bool>* exited = nullptr;
  ~ExitSignal() {
    if (exited != nullptr) exited->store(true);
  }
};

// The tests below are about the timeout once EVERY rank returned: rank 1
// returns only after rank 0's thread exits (or the run stops). Were rank 1 seen
// returned while rank 0 still ran with collective #2 entered, the watchdog would
// rightly fail the run at once as uneven steps (FailedPrecondition), which on a
// loaded machine it did.
void MarkExit(std::atomic<bool>& exited) {
  thread_local ExitSignal signal;
  signal.exited = &exited;
}
void AwaitExit(Context& ctx, const std::atomic<bool>& exited) {
  while (!exited.load() && !ctx.stop_requested()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST_F(ShutdownTest, AbortComesBeforeTheJoinsAndBeforeThreadTeardown) {
  std::atomic<bool> entered{false};
  std::atomic<int> aborted_at_start{-1}, synced{-1};
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 1) {
      while (!entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      throw std::runtime_error("out of memory");
    }
    thread_local TeardownProbe probe;
    probe.comm = &Fake(ctx);
    probe.aborted_at_start = &aborted_at_start;
    probe.synced = &synced;
    Tensor x = nn::ones({4});
    std::shared_ptr<Work> work = ctx.communicator().all_reduce_async(x);
    entered.store(true);
    while (!ctx.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    // Returns with its collective stuck (the handle's destructor, CPU rule,
    // waits for it: only the abort ends that wait too).
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 (cpu) threw: out of memory"), absl::string_view::npos) << s;
  EXPECT_EQ(aborted_at_start.load(), 1) << "the thread's teardown ran before the abort";
  EXPECT_EQ(synced.load(), 1) << "the teardown's device sync did not end";
  EXPECT_LT(seconds_, 10.0);
}

// Abort (watchdog thread) and collectives (rank threads) never overlap: ranks
// issue collectives in a loop while one fails; the abort frees the fake's
// handle, which TSan would report if a use were not serialised with it.
TEST_F(ShutdownTest, AbortAndUseDoNotRace) {
  for (int round = 0; round < 20; ++round) {
    const int fail_at = 1 + round % 7;
    absl::Status s = Run(3, [&](Context& ctx) -> absl::Status {
      Tensor x = nn::ones({8});
      for (int step = 0;; ++step) {
        if (ctx.rank() == round % 3 && step == fail_at) throw std::runtime_error("bad batch");
        ctx.communicator().all_reduce(x);
        std::shared_ptr<Work> w = ctx.communicator().all_reduce_async(x);
        w->wait();
      }
    });
    ASSERT_EQ(s.code(), absl::StatusCode::kInternal) << "round " << round << ": " << s;
    EXPECT_NE(s.message().find("threw: bad batch"), absl::string_view::npos) << s;
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(group_->abort_calls(r), 1);
      EXPECT_EQ(group_->overlapping_uses(r), 0)
          << "a collective ran while its communicator was aborted";
    }
  }
}

// A clean run aborts nothing.
TEST_F(ShutdownTest, CleanRunIsNotAborted) {
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    Tensor x = nn::full({3}, static_cast<double>(ctx.rank() + 1));
    ctx.communicator().all_reduce(x);
    EXPECT_EQ(x.to_vector<float>(), std::vector<float>({3, 3, 3}));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(group_->abort_calls(r), 0);
}

// Ranks that return after issuing different numbers of collectives (uneven
// batches per rank, say): rank 0's last all-reduce never completes, and once
// every rank has returned its thread's teardown (a device sync, as
// cudnnDestroy's) would wait for it for good. The watchdog keeps watching while
// a collective is in flight: its timeout names it and the abort ends the sync.
TEST_F(ShutdownTest, CollectiveInFlightAfterEveryRankReturnedIsTimedOut) {
  options_.timeout_s = 1;
  std::atomic<int> aborted_at_start{-1}, synced{-1};
  std::atomic<bool> rank0_exited{false};
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    Tensor x = nn::ones({4});
    ctx.communicator().all_reduce(x);
    if (ctx.rank() == 0) {
      LeaveACollectiveUnjoined(ctx, x, aborted_at_start, synced);
      MarkExit(rank0_exited);
    } else {
      AwaitExit(ctx, rank0_exited);
    }
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 0 (cpu): waiting in all_reduce_async #2"),
            absl::string_view::npos)
      << s;
  EXPECT_EQ(synced.load(), 1) << "the teardown's device sync did not end";
  EXPECT_EQ(group_->abort_calls(0), 1);
  EXPECT_LT(seconds_, 15.0);
}

// The same uneven collectives under a restart policy: every rank returned, but
// rank 0 entered a collective rank 1 never did. That timeout is a program error
// (the ranks ran different steps), not a hang to restart: a new attempt would
// run the same steps and time out again.
TEST_F(ShutdownTest, CollectiveInFlightAfterEveryRankReturnedIsNotRestarted) {
  options_.timeout_s = 0.5;
  options_.restart.max_restarts = 2;
  std::atomic<int> calls{0};
  std::atomic<bool> rank0_exited{false};
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 0) calls.fetch_add(1);
    Tensor x = nn::ones({4});
    ctx.communicator().all_reduce(x);
    if (ctx.rank() == 0) {
      static std::atomic<int> aborted_at_start{-1}, synced{-1};
      LeaveACollectiveUnjoined(ctx, x, aborted_at_start, synced);
      MarkExit(rank0_exited);
    } else {
      AwaitExit(ctx, rank0_exited);
    }
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(calls.load(), 1) << console_.str();
  EXPECT_TRUE(Logged("spawn: not restarting: a collective timed out after every rank's "
                     "function had returned"))
      << console_.str();
  EXPECT_FALSE(Logged("spawn: restart 1")) << console_.str();
}

// Device work the trace does not show (a graph replayed once more on one rank,
// untracked) keeps rank 0's thread in its teardown after every rank returned.
// The watchdog lives until the joins: timeout_s after the last return it fails
// the run, and the abort lets the teardown end.
TEST_F(ShutdownTest, ThreadsThatDoNotExitAfterReturningAreTimedOut) {
  options_.timeout_s = 0.5;
  std::atomic<int> aborted_at_start{-1}, synced{-1};
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    Tensor x = nn::ones({4});
    ctx.communicator().all_reduce(x);
    if (ctx.rank() == 0) {
      thread_local TeardownProbe probe;
      probe.comm = &Fake(ctx);
      probe.aborted_at_start = &aborted_at_start;
      probe.synced = &synced;
      Fake(ctx).EnqueueUntraced();
    }
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("every rank returned, but their threads had not exited"),
            absl::string_view::npos)
      << s;
  EXPECT_EQ(synced.load(), 1) << "the teardown's device sync did not end";
  EXPECT_EQ(group_->abort_calls(0), 1);
  EXPECT_LT(seconds_, 10.0);
}

// A library call that never returns (an NCCL enqueue spinning without an abort
// check) holds rank 0's guard when rank 1 fails: the abort gives up after its
// deadline and spawn ends the process naming the call, after the first error,
// instead of waiting for good. The injected exit releases the call, so the
// test's run can finish.
std::atomic<FakeAsyncCommunicator*> g_stalled{nullptr};
std::atomic<int> g_abort_exit_status{-1};
void ExitAndReleaseTheStall(int status) {
  g_abort_exit_status.store(status);
  if (FakeAsyncCommunicator* c = g_stalled.load()) c->ReleaseStall();
}

TEST_F(ShutdownTest, AbortThatCannotRunEndsTheProcessNamingTheCall) {
  options_.timeout_s = 0.5;
  g_abort_exit_status.store(-1);
  hooks_.exit_process = &ExitAndReleaseTheStall;
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    Tensor x = nn::ones({4});
    if (ctx.rank() == 0) {
      g_stalled.store(&Fake(ctx));
      Fake(ctx).StallNextCall();
      ctx.communicator().all_reduce(x);  // stalls inside the library call
      return absl::OkStatus();
    }
    while (!comms_[0]->stalled()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    throw std::runtime_error("rank 1 out of memory");
  });
  g_stalled.store(nullptr);
  EXPECT_EQ(g_abort_exit_status.load(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 out of memory"), absl::string_view::npos) << s;
  EXPECT_TRUE(Logged("spawn: ending the process (exit status 1) after the run stopped"))
      << console_.str();
  EXPECT_TRUE(Logged("still inside the fake all_reduce")) << console_.str();
  EXPECT_LT(seconds_, 10.0);
}

// An asynchronous library error (NCCL's ncclCommGetAsyncError after a network
// failure) fails the run with the library's message and the rank, long before
// the watchdog's timeout would.
TEST_F(ShutdownTest, AsynchronousLibraryErrorFailsTheRunWithItsMessage) {
  options_.timeout_s = 60;
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 1) {
      Fake(ctx).FailAsynchronouslyAfter(3, "remote proxy error: connection reset by peer");
    }
    Tensor x = nn::ones({4});
    while (true) {
      ctx.communicator().all_reduce(x);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 (cpu): remote proxy error: connection reset by peer"),
            absl::string_view::npos)
      << s;
  EXPECT_LT(seconds_, 10.0);
}

// Rank 0 writes a checkpoint for longer than timeout_s while rank 1 waits in a
// collective: the watchdog's timeout ends the run instead of a hang, and rank
// 1's wait ends with the stop.
TEST_F(ShutdownTest, LongRankZeroCheckpointWriteIsBoundedByTheWatchdog) {
  options_.timeout_s = 0.5;
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    Tensor x = nn::ones({4});
    if (ctx.rank() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the write
      ctx.check_stop();
    }
    ctx.communicator().all_reduce(x);
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("rank 1 (cpu): waiting in all_reduce #1"), absl::string_view::npos)
      << s;
  EXPECT_LT(seconds_, 10.0);
}

// The same write shorter than timeout_s: the others wait for it, and the run
// finishes normally (the stop-aware waits do not end early).
TEST_F(ShutdownTest, ShortRankZeroCheckpointWriteIsWaitedFor) {
  options_.timeout_s = 30;
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    Tensor x = nn::ones({4});
    if (ctx.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ctx.communicator().all_reduce(x);
    EXPECT_EQ(x.to_vector<float>(), std::vector<float>({2, 2, 2, 2}));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

// After a stop, the watchdog keeps checking: a rank that has not returned
// timeout_s after the stop (in code that reaches no stop-aware point) is named.
TEST_F(ShutdownTest, RankNotReturningAfterTheStopIsReported) {
  options_.timeout_s = 0.2;
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 1) throw std::runtime_error("nan loss");
    while (!ctx.stop_requested()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // ignores the stop
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(Logged("after the run stopped, spawn still waits for rank 0 (cpu)"))
      << console_.str();
}

// A second Ctrl-C exits at once with status 130, even while a rank cannot be
// stopped. The exit function is injected (a real _exit would end the test).
std::atomic<int> g_exit_status{-1};
void RecordExit(int status) { g_exit_status.store(status); }

TEST_F(ShutdownTest, SecondSigintExitsAtOnce) {
  g_exit_status.store(-1);
  hooks_.exit_process = &RecordExit;
  std::atomic<bool> running{false};
  std::thread user([&] {  // presses Ctrl-C twice
    while (!running.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::raise(SIGINT);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(g_exit_status.load(), -1) << "the first Ctrl-C must only stop the run";
    std::raise(SIGINT);
  });
  absl::Status s = Run(2, [&](Context& ctx) -> absl::Status {
    if (ctx.rank() == 1) {
      while (true) {
        ctx.check_stop();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    running.store(true);
    // Stuck where no stop reaches it, until the process "exits".
    while (g_exit_status.load() < 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return absl::OkStatus();
  });
  user.join();
  EXPECT_EQ(g_exit_status.load(), 128 + SIGINT);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_NE(s.message().find("SIGINT"), absl::string_view::npos) << s;
}

// --- Work lifetime -------------------------------------------

// The handle keeps the tensor's storage alive until the collective is done, even
// when the caller dropped the tensor: the device never writes freed memory.
TEST(WorkLifetimeTest, HandleKeepsTheTensorAliveUntilWaited) {
  auto group = std::make_shared<FakeGroup>(1);
  group->Hold();
  FakeAsyncCommunicator comm(0, nn::Device::CPU(), group);
  Tensor x = nn::ones({16});
  std::weak_ptr<nn::Storage> storage = x.storage();
  std::shared_ptr<Work> work = comm.all_reduce_async(x);
  x = Tensor();
  EXPECT_FALSE(storage.expired()) << "the storage went with the tensor, not with the work";
  group->Release();
  work->wait();
  EXPECT_TRUE(storage.expired()) << "wait() should release the tensor";
  EXPECT_EQ(group->completions_on_freed_storage(), 0);
}

// Destroyed unwaited (CPU rule): the handle waits for the collective, and only
// then releases the tensor.
TEST(WorkLifetimeTest, UnwaitedHandleReleasesTheTensorOnlyAfterTheCollective) {
  auto group = std::make_shared<FakeGroup>(1);
  group->Hold();
  FakeAsyncCommunicator comm(0, nn::Device::CPU(), group);
  Tensor x = nn::ones({16});
  std::weak_ptr<nn::Storage> storage = x.storage();
  std::shared_ptr<Work> work = comm.all_reduce_async(x);
  x = Tensor();
  std::thread device([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    group->Release();
  });
  work.reset();
  EXPECT_EQ(group->completed(), 1) << "the handle went before its collective completed";
  EXPECT_TRUE(storage.expired());
  EXPECT_EQ(group->completions_on_freed_storage(), 0);
  device.join();
}

struct OneLayer : nn::Module {
  OneLayer() : l(register_module("l", nn::Linear(4, 3))) {}
  Tensor forward(const Tensor& x) override { return l(x); }
  nn::Linear l;
};

// A backward pass that throws after launching a bucket's all-reduce leaves its
// handle unwaited; the next forward must not zero that bucket while the
// collective still runs (it would then write over the zeros).
TEST_F(ShutdownTest, DataParallelDoesNotZeroABucketStillBeingReduced) {
  absl::Status s = Run(1, [&](Context& ctx) -> absl::Status {
    OneLayer net;
    bool fail_second_bucket = true;
    DataParallel dp(net, ctx,
                    {.bucket_bytes = 1,
                     .first_bucket_bytes = 1,
                     .on_bucket_launch = [&](int bucket, int) {
                       if (bucket == 1 && fail_second_bucket) {
                         throw std::runtime_error("hook failed");
                       }
                     }});
    EXPECT_EQ(dp.num_buckets(), 2);
    group_->Hold();
    group_->SetCompletionValue(42);
    Tensor loss = nn::mse_loss(dp(nn::ones({2, 4})), nn::zeros({2, 3}));
    std::thread device([&] {  // bucket 0's all-reduce completes 200 ms from now
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      group_->Release();
    });
    EXPECT_THROW(loss.backward(), std::runtime_error);
    // What a training loop does next: zero the gradients (as
    // Optimizer::zero_grad), then the next forward.
    for (Tensor p : net.parameters()) {
      nn::NoGradGuard no_grad;
      if (p.grad().defined()) p.grad().zero_();
    }
    fail_second_bucket = false;
    dp(nn::ones({2, 4}));
    device.join();
    while (group_->completed() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    for (const auto& [name, p] : net.named_parameters()) {
      for (float v : p.grad().to_vector<float>()) {
        EXPECT_EQ(v, 0.0f) << name << ": its bucket was zeroed before its collective ended";
      }
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace tandem::dist
