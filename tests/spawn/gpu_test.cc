// spawn on GPUs: NCCL with one rank, and two ranks sharing one GPU through the
// in-process communicator (share_devices). Skipped where no GPU is visible.
#include <cmath>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "gtest/gtest.h"
#include "nn/cuda/internal/call_counter.h"
#include "nn/graph.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "spawn/train/data_parallel.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

struct LinearNet : nn::Module {
  LinearNet()
      : l1(register_module("l1", nn::Linear(10, 10))), l2(register_module("l2", nn::Linear(10, 1))) {}
  Tensor forward(const Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

using ::tandem::testing::FlatParams;

// K SGD steps; rank r trains on rows [r*B, (r+1)*B) of each step's batch.
std::vector<float> Train(Context& ctx, int64_t per_rank, bool wrap) {
  LinearNet net;
  std::unique_ptr<DataParallel> dp;
  if (wrap) dp = std::make_unique<DataParallel>(net, ctx);
  const int64_t batch = per_rank * ctx.world_size();
  for (int step = 0; step < 5; ++step) {
    nn::manual_seed(1000 + step);
    Tensor x = nn::randn({batch, 10}), y = nn::randn({batch, 1});
    const int64_t lo = ctx.rank() * per_rank;
    Tensor xs = x.slice(lo, lo + per_rank), ys = y.slice(lo, lo + per_rank);
    Tensor loss = nn::mse_loss(wrap ? (*dp)(xs) : net(xs), ys);
    loss.backward();
    nn::NoGradGuard no_grad;
    for (Tensor p : net.parameters()) {
      p.add_(p.grad(), -0.1);
      p.set_grad(Tensor());
    }
  }
  return FlatParams(net);
}

void ExpectClose(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-5 * std::max(1.0f, std::fabs(b[i]))) << "element " << i;
  }
}

class GpuSpawnTest : public ::tandem::testing::GpuTest {
 protected:
  std::ostringstream console_;
  SpawnOptions options_{.seed = 7, .console = &console_};
};

TEST_F(GpuSpawnTest, NcclOneRankDataParallelMatchesTheUnwrappedModel) {
  auto wrapped = spawn([](Context& ctx) { return Train(ctx, 8, true); }, 1, "0", options_);
  auto plain = spawn([](Context& ctx) { return Train(ctx, 8, false); }, 1, "0", options_);
  ASSERT_TRUE(wrapped.ok() && plain.ok()) << wrapped.status() << plain.status();
  EXPECT_NE(console_.str().find("NCCL"), std::string::npos);
  ExpectClose((*wrapped)[0], (*plain)[0]);
}

TEST_F(GpuSpawnTest, TwoRanksSharingOneGpuMatchOneRankOnTheDoubledBatch) {
  options_.share_devices = true;
  auto two = spawn([](Context& ctx) { return Train(ctx, 4, true); }, 2, "0,0", options_);
  auto one = spawn([](Context& ctx) { return Train(ctx, 8, true); }, 1, "0", options_);
  ASSERT_TRUE(two.ok() && one.ok()) << two.status() << one.status();
  ExpectClose((*two)[0], (*one)[0]);
  ExpectClose((*two)[1], (*one)[0]);
}

TEST_F(GpuSpawnTest, SharedGpuCollectives) {
  options_.share_devices = true;
  auto got = spawn(
      [](Context& ctx) {
        Tensor x = nn::full({1000}, ctx.rank() + 1.0);
        ctx.communicator().all_reduce(x, ReduceOp::kSum);
        Tensor g = ctx.communicator().all_gather(nn::full({2}, ctx.rank() * 1.0));
        std::vector<float> out = x.to_vector<float>();
        for (float v : g.to_vector<float>()) out.push_back(v);
        return out;
      },
      3, "0,0,0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  for (const std::vector<float>& v : *got) {
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(v[i], 6.0f);
    EXPECT_EQ(std::vector<float>(v.begin() + 1000, v.end()),
              (std::vector<float>{0, 0, 1, 1, 2, 2}));
  }
}

// --- CUDA graph capture of a DataParallel step (nn/graph.h) -------------------

// K Adam steps of a DataParallel LinearNet, each on batch k copied into static
// inputs; `captured`: step 0 eager, then one capture and K-1 replays. Returns
// the losses followed by the weights.
std::vector<float> TrainDataParallel(Context& ctx, bool captured) {
  constexpr int kSteps = 5;
  LinearNet net;
  DataParallel dp(net, ctx);
  optim::Adam adam(dp.parameters(), {.lr = 1e-2});
  Tensor x = nn::empty({8, 10}), y = nn::empty({8, 1});
  Tensor loss;
  auto step = [&] {
    loss = nn::mse_loss(dp(x), y);
    loss.backward();
    adam.step();
    adam.zero_grad();
  };
  std::vector<float> out;
  std::optional<nn::CudaGraph> graph;
  for (int k = 0; k < kSteps; ++k) {
    nn::manual_seed(500 + k, 0);
    x.copy_(nn::randn({8, 10}, {.device = nn::Device::CPU()}));
    y.copy_(nn::randn({8, 1}, {.device = nn::Device::CPU()}));
    if (!captured || k == 0) {
      step();
    } else {
      if (!graph) {
        graph.emplace(ctx.device());
        graph->Capture(step);
      }
      graph->Replay();
    }
    out.push_back(static_cast<float>(loss.item()));
  }
  TANDEM_CHECK(adam.step_count(0, 0) == kSteps, "step count ", adam.step_count(0, 0));
  for (float v : FlatParams(net)) out.push_back(v);
  return out;
}

// Why bitwise: a replay launches the eager step's kernels and NCCL all-reduce
// (one rank: a copy) with the same arguments; Adam's scalars are the same doubles.
TEST_F(GpuSpawnTest, NcclOneRankCapturedDataParallelStepMatchesEager) {
  auto eager = spawn([](Context& ctx) { return TrainDataParallel(ctx, false); }, 1, "0", options_);
  auto replayed = spawn(
      [](Context& ctx) {
        TANDEM_CHECK(ctx.communicator().kind() == "nccl", "communicator ",
                     ctx.communicator().kind());
        return TrainDataParallel(ctx, true);
      },
      1, "0", options_);
  ASSERT_TRUE(eager.ok() && replayed.ok()) << eager.status() << replayed.status();
  const std::vector<float>& a = (*eager)[0];
  const std::vector<float>& b = (*replayed)[0];
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t u, v;
    std::memcpy(&u, &a[i], 4);
    std::memcpy(&v, &b[i], 4);
    ASSERT_EQ(u, v) << "element " << i << " (the first 5 are losses): " << a[i] << " vs " << b[i];
  }
}

// Replays of a graph that holds an NCCL all-reduce are followed by the
// watchdog (one "graph replay" each, complete when the graph has run) and
// bounded like eager collectives: 300 replays, more than the 128 a rank may
// have in flight, end with the right sum and a clean run (the communicator's
// finalize would wait on an untracked replay).
TEST_F(GpuSpawnTest, NcclGraphReplaysAreTracked) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        nn::CudaGraph graph(ctx.device());
        graph.Capture([&] {
          x.fill_(1.0);
          ctx.communicator().all_reduce(x);
        });
        for (int i = 0; i < 300; ++i) graph.Replay();
        return x.to_vector<float>()[0];
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0], 1.0f);
}

// The handle of an asynchronous collective made inside a capture: its event
// was recorded in the capture, and CUDA refuses to query such an event
// (cudaErrorCapturedEvent, which a query left as the thread's last error: the
// next kernel's launch check blamed that kernel, inside the capture or after
// it). is_completed() answers true without a query, inside the capture and
// after; the kernels launched right after it run, and the replays reduce as
// captured.
TEST_F(GpuSpawnTest, NcclWorkOfACapturedCollectiveIsCompletedWithoutQueryingItsEvent) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        Tensor y = nn::zeros({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        std::shared_ptr<Work> work;
        bool inside = false;
        nn::CudaGraph graph(ctx.device());
        graph.Capture([&] {
          x.fill_(1.0);
          work = ctx.communicator().all_reduce_async(x);
          inside = work->is_completed();
          y.fill_(2.0);  // a launch check right after the query
          work->wait();
          x.add_(y, 1.0);
        });
        const bool after = work->is_completed();
        Tensor z = nn::zeros({4}, {.device = ctx.device()});
        z.fill_(5.0);  // an eager launch check right after the query
        work.reset();  // destroyed outside its capture (waited inside it): nothing to wait for
        graph.Replay();
        graph.Replay();
        return std::vector<float>{inside ? 1.0f : 0.0f, after ? 1.0f : 0.0f,
                                  x.to_vector<float>()[0], z.to_vector<float>()[0]};
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << console_.str();
  EXPECT_EQ((*got)[0], (std::vector<float>{1.0f, 1.0f, 3.0f, 5.0f}));
}

// The handle of a collective made in one capture, unwaited there (a later
// synchronous collective joined the communication stream back), then waited
// for and destroyed inside a later capture on the same thread. Its end event
// belongs to the first capture: the destructor's wait on it from the second
// merged the two captures, which invalidated the second ("the step
// synchronised with the host"). Now wait() there is a clear error and the
// destructor waits for nothing; both graphs replay as captured.
TEST_F(GpuSpawnTest, NcclWorkOfOneCaptureIsNotWaitedForInALaterCapture) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        Tensor y = nn::ones({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        std::shared_ptr<Work> work;
        nn::CudaGraph first(ctx.device());
        first.Capture([&] {
          x.fill_(1.0);
          work = ctx.communicator().all_reduce_async(x);
          ctx.communicator().all_reduce(y);  // joins the communication stream back
        });
        std::string wait_error;
        nn::CudaGraph second(ctx.device());
        second.Capture([&] {
          try {
            work->wait();
          } catch (const Error& e) {
            wait_error = e.what();
          }
          work.reset();  // destroyed inside the later capture
          y.fill_(4.0);
        });
        first.Replay();
        second.Replay();
        const bool refused = wait_error.find("capture that has ended") != std::string::npos;
        return std::vector<float>{refused ? 1.0f : 0.0f, x.to_vector<float>()[0],
                                  y.to_vector<float>()[0]};
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << console_.str();
  EXPECT_EQ((*got)[0], (std::vector<float>{1.0f, 1.0f, 4.0f}));
}

// Handles of collectives made outside any capture (a warm-up step's), waited
// for and dropped inside a capture on the thread's stream: the capturing
// stream's wait on their end events, recorded outside the capture, is refused
// by CUDA and invalidated the capture (Capture() failed with "the step
// synchronised with the host"). The host now waits for such a collective (it
// ran eagerly) in relaxed capture mode: the capture succeeds, and its replay
// computes as captured.
TEST_F(GpuSpawnTest, NcclWorkMadeBeforeACaptureIsWaitedForAndDroppedInsideIt) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        Tensor z = nn::full({1024}, 2.0, {.device = ctx.device()});
        Tensor y = nn::zeros({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        std::shared_ptr<Work> waited = ctx.communicator().all_reduce_async(x);
        std::shared_ptr<Work> dropped = ctx.communicator().all_reduce_async(z);
        const auto before = nn::internal::ProcessCudaCalls();
        std::string error;
        nn::CudaGraph graph(ctx.device());
        try {
          graph.Capture([&] {
            waited->wait();
            dropped.reset();  // destroyed unwaited inside the capture
            y.copy_(x);
            y.add_(z, 1.0);
          });
        } catch (const Error& e) {
          error = e.what();
        }
        const auto host_waits =
            (nn::internal::ProcessCudaCalls() - before)[nn::internal::CudaCall::kHostWait];
        waited.reset();  // waited for inside the capture: nothing left to wait for
        if (!error.empty()) return std::make_pair(error, std::vector<float>{});
        graph.Replay();
        return std::make_pair(std::to_string(host_waits), y.to_vector<float>());
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << console_.str();
  const auto& [text, y] = (*got)[0];
  ASSERT_FALSE(y.empty()) << "the capture failed: " << text;
  EXPECT_EQ(text, "2") << "host waits inside the capture (one per handle)";
  EXPECT_EQ(y[0], 3.0f);
  EXPECT_EQ(y[1023], 3.0f);
}

// An eager collective's handle asked whether it has completed inside a
// capture (a warm-up step's handle, in the captured step): its event query is
// a call CUDA refuses to a thread that captures in thread-local mode, and the
// refusal invalidates the capture. It runs in relaxed capture mode: the
// capture succeeds, and the handle, waited for first, is complete.
TEST_F(GpuSpawnTest, NcclWorkMadeBeforeACaptureIsAskedWhetherCompletedInsideIt) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        Tensor y = nn::zeros({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        std::shared_ptr<Work> work = ctx.communicator().all_reduce_async(x);
        bool after_wait = false;
        std::string error;
        nn::CudaGraph graph(ctx.device());
        try {
          graph.Capture([&] {
            (void)work->is_completed();  // either answer: the collective may still run
            work->wait();
            after_wait = work->is_completed();
            y.copy_(x);
          });
        } catch (const Error& e) {
          error = e.what();
        }
        work.reset();
        if (error.empty()) graph.Replay();
        return std::make_tuple(error, after_wait, y.to_vector<float>());
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << console_.str();
  const auto& [error, after_wait, y] = (*got)[0];
  EXPECT_EQ(error, "") << "the capture failed";
  EXPECT_TRUE(after_wait) << "a handle waited for on the host is not complete";
  ASSERT_EQ(y.size(), 1024u);
  EXPECT_EQ(y[0], 1.0f);
}

// An eager collective still running when it is waited for inside a capture: it
// is queued behind tens of milliseconds of matmuls, so the host wait's first
// queries find its end event not ready. The wait returned that "not ready" as
// its result once the event completed, and wait() raised it as a CUDA error
// (the capture failed with "cudaErrorNotReady"). Now the wait ends with the
// collective, the capture succeeds and its replay computes as captured.
TEST_F(GpuSpawnTest, NcclWorkStillRunningWhenWaitedForInsideACaptureIsWaitedForToItsEnd) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        Tensor y = nn::zeros({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        Tensor a = nn::full({4096, 4096}, 1.0 / 4096, {.device = ctx.device()});
        Tensor b = a;
        for (int i = 0; i < 32; ++i) b = nn::matmul(b, a);  // the collective waits for these
        std::shared_ptr<Work> work = ctx.communicator().all_reduce_async(x);
        const bool running = !work->is_completed();
        std::string error;
        nn::CudaGraph graph(ctx.device());
        try {
          graph.Capture([&] {
            work->wait();
            y.copy_(x);
          });
        } catch (const Error& e) {
          error = e.what();
        }
        work.reset();
        if (error.empty()) graph.Replay();
        return std::make_tuple(error, running, y.to_vector<float>());
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << console_.str();
  const auto& [error, running, y] = (*got)[0];
  EXPECT_TRUE(running) << "the collective had ended before the capture: queue more work before it";
  EXPECT_EQ(error, "") << "the capture failed";
  ASSERT_EQ(y.size(), 1024u);
  EXPECT_EQ(y[0], 1.0f);
}

// A thread_local made before the thread's first stream is destroyed after the
// thread's streams at its exit. An asynchronous collective's handle it held
// could not reach the thread's compute stream there (ThreadStream threw) and
// skipped its wait, so the output it kept alive was freed unordered after the
// collective. The host now waits for the collective at that point: the
// thread's exit makes a host wait (counted), and nothing is left to report.
TEST_F(GpuSpawnTest, NcclWorkHeldByAThreadLocalIsWaitedForAtTheThreadsExit) {
  auto got = spawn(
      [&](Context& ctx) {
        Tensor warm = nn::ones({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(warm);  // eager warm-up (NCCL's first call)
        constexpr int64_t kElements = int64_t{1} << 22;
        int64_t exit_waits = -1;
        std::string thread_error;
        const auto before = nn::internal::ProcessCudaCalls();
        std::thread([&] {
          thread_local std::shared_ptr<Work> held;  // before this thread's first stream
          try {
            nn::DeviceGuard guard(ctx.device());
            Tensor input = nn::full({kElements}, 3.0, {.device = ctx.device()});
            Tensor output = nn::empty({kElements}, {.device = ctx.device()});
            held = ctx.communicator().reduce_scatter_async(input, output);
          } catch (const std::exception& e) {
            thread_error = e.what();
          }
        }).join();  // `held` dies after the thread's streams
        exit_waits = (nn::internal::ProcessCudaCalls() - before)[nn::internal::CudaCall::kHostWait];
        nn::Synchronize(ctx.device());
        return std::make_pair(thread_error, exit_waits);
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status() << "\n" << console_.str();
  const auto& [thread_error, exit_waits] = (*got)[0];
  EXPECT_EQ(thread_error, "");
  EXPECT_GE(exit_waits, 1) << "the handle's destructor at the thread's exit did not wait";
}

// A graph holding NCCL collectives that outlives the training function would
// make NCCL's destroy wait for good (spawn would hang at its end): spawn
// releases it, fails the run naming it, and a later replay is a clear error.
TEST_F(GpuSpawnTest, NcclGraphOutlivingTheRunIsReleasedAndNamed) {
  std::shared_ptr<nn::CudaGraph> kept;
  auto got = spawn(
      [&](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);  // eager warm-up (NCCL's first call)
        auto graph = std::make_shared<nn::CudaGraph>(ctx.device());
        graph->Capture([&] {
          x.fill_(1.0);
          ctx.communicator().all_reduce(x);
        });
        for (int i = 0; i < 300; ++i) graph->Replay();
        const float v = x.to_vector<float>()[0];
        kept = graph;
        return v;
      },
      1, "0", options_);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_NE(got.status().message().find("CUDA graph of cuda:0"), absl::string_view::npos)
      << got.status();
  ASSERT_NE(kept, nullptr);
  try {
    kept->Replay();
    ADD_FAILURE() << "a replay after the run ended did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was released"), std::string::npos) << e.what();
  }
  kept.reset();
}

// Host code cannot read device memory by mistake: the host accessors name the
// tensor (multi-process checkpoint restore once memcpy'd into a GPU tensor).
TEST_F(GpuSpawnTest, HostAccessToDeviceMemoryIsAClearError) {
  Tensor x = nn::ones({3}, {.device = nn::Device::CUDA(0)});
  try {
    (void)x.host_data<float>();
    ADD_FAILURE() << "host_data on a CUDA tensor did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float32(3) on cuda:0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("device memory"), std::string::npos) << e.what();
  }
  EXPECT_NE(x.data_ptr(), nullptr);  // the raw pointer for kernels stays
  EXPECT_EQ(x.to(nn::Device::CPU()).host_data<float>()[2], 1.0f);
}

TEST_F(GpuSpawnTest, InProcessCommunicatorCaptureIsAClearError) {
  options_.share_devices = true;
  auto got = spawn(
      [](Context& ctx) {
        LinearNet net;
        DataParallel dp(net, ctx);
        Tensor x = nn::randn({4, 10}), y = nn::randn({4, 1});
        nn::mse_loss(dp(x), y).backward();  // eager warm-up
        std::string what;
        nn::CudaGraph graph(ctx.device());
        try {
          graph.Capture([&] { nn::mse_loss(dp(x), y).backward(); });
        } catch (const Error& e) {
          what = e.what();
        }
        TANDEM_CHECK(!graph.captured() && !nn::CudaGraph::IsCapturing(), "capture state");
        // The communicator still works eagerly afterwards.
        Tensor t = nn::full({3}, ctx.rank() + 1.0);
        ctx.communicator().all_reduce(t, ReduceOp::kSum);
        TANDEM_CHECK(t.to_vector<float>() == std::vector<float>(3, 3.0f), "all_reduce after");
        return what;
      },
      2, "0,0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  for (const std::string& what : *got) {
    EXPECT_NE(what.find("in-process communicator cannot be captured in a CUDA graph"),
              std::string::npos) << what;
    EXPECT_NE(what.find("use NCCL"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tandem::dist
