// The NCCL communicator in a world of one rank on cuda:0 (spawn with gpus "0"):
// collectives read what another thread's kernels wrote, a tensor on the wrong
// device leaves no collective in flight, and training steps make no allocation
// that could wait for other GPUs' NCCL kernels (counted with
// nn/cuda/internal/call_counter.h). Label gpu; skipped with a reason where no
// GPU is visible.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nn/cuda/internal/call_counter.h"
#include "nn/graph.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "spawn/train/data_parallel.h"
#include "tests/gpu_test_util.h"
#include "tests/spawn/comm/late_writers.h"

namespace tandem::dist {
namespace {

using nn::Device;
using nn::Tensor;
using nn::internal::CudaCall;
using nn::internal::CudaCallCounts;

using testing_support::LateWriters;
constexpr int64_t kElements = testing_support::kLateElements;

class NcclGpuTest : public ::tandem::testing::GpuTest {
 protected:
  std::ostringstream console_;
  SpawnOptions options_{.seed = 7, .console = &console_};
};

int64_t Mismatches(const Tensor& t, float want) {
  int64_t bad = 0;
  for (float v : t.to_vector<float>()) bad += v != want;
  return bad;
}

// Before: Launch recorded the ready event (which NCCL's stream waits for)
// before data_ptr() ordered this thread's stream after the tensor's owner, so
// NCCL copied the input while the other thread's burn still held its fill
// back. all_gather and reduce_scatter are out of place and show it. An
// all_reduce over one rank is in place and the identity (NCCL writes what it
// read, and the late fill then overwrites it), so it cannot show it here: it
// is checked for its value only; the two-process suite
// (nccl_two_process_gpu_test.cc) shows it for all_reduce.
TEST_F(NcclGpuTest, CollectivesReadWhatAnotherThreadsKernelsWrote) {
  auto got = spawn(
      [](Context& ctx) {
        Communicator& comm = ctx.communicator();
        TANDEM_CHECK(comm.kind() == "nccl", "communicator ", comm.kind());
        std::vector<int64_t> bad;
        LateWriters writers;
        Tensor a = writers.Write(ctx.device(), 3.0f);
        bad.push_back(Mismatches(comm.all_gather(a), 3.0f));
        Tensor b = writers.Write(ctx.device(), 4.0f);
        bad.push_back(Mismatches(comm.reduce_scatter(b, ReduceOp::kAvg), 4.0f));
        Tensor c = writers.Write(ctx.device(), 5.0f);
        Tensor out = nn::empty({kElements});
        comm.reduce_scatter_async(c, out)->wait();
        bad.push_back(Mismatches(out, 5.0f));
        Tensor d = writers.Write(ctx.device(), 6.0f);
        comm.all_reduce(d, ReduceOp::kAvg);
        bad.push_back(Mismatches(d, 6.0f));
        return bad;
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<int64_t>& bad = (*got)[0];
  EXPECT_EQ(bad[0], 0) << "all_gather read stale elements";
  EXPECT_EQ(bad[1], 0) << "reduce_scatter read stale elements";
  EXPECT_EQ(bad[2], 0) << "reduce_scatter_async read stale elements";
  EXPECT_EQ(bad[3], 0) << "all_reduce";
}

// Before: Enter ran before the device check, so the caught error left a
// collective entered and never completed; the watchdog then ended the run
// (DeadlineExceeded) timeout_s after the rank returned.
TEST_F(NcclGpuTest, TensorOnTheWrongDeviceLeavesNothingInFlight) {
  options_.timeout_s = 2;
  auto got = spawn(
      [](Context& ctx) {
        Tensor host = nn::ones({4}, {.device = Device::CPU()});
        const uint64_t entered = ctx.communicator().collectives_entered();
        std::string error;
        try {
          ctx.communicator().all_reduce(host);
        } catch (const Error& e) {
          error = e.what();
        }
        TANDEM_CHECK(ctx.communicator().collectives_entered() == entered, "entered ",
                     ctx.communicator().collectives_entered() - entered, " collective(s)");
        std::this_thread::sleep_for(std::chrono::seconds(4));  // past timeout_s
        Tensor x = nn::ones({4}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);
        TANDEM_CHECK(x.to_vector<float>()[0] == 1.0f, "all_reduce after the refusal");
        return error;
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NE((*got)[0].find("is not on rank 0's device cuda:0"), std::string::npos) << (*got)[0];
}

// What ReplayOnAnotherThreadIsRefusedBeforeTheLaunch saw on the rank.
struct ForeignReplay {
  std::string error;         // of the replay from another thread
  float after_refusal = -1;  // x after it
  float after_replay = -1;   // x after a replay on the rank thread
};

// A graph holding the rank's collectives, replayed on another thread, is
// refused before anything is launched: the step does not run (its collectives
// would wait, untraced, for peers that never join), and the rank thread's own
// replay still works. Before, the refusal came from the post-replay hook,
// after the launch: x had been incremented by then.
TEST_F(NcclGpuTest, ReplayOnAnotherThreadIsRefusedBeforeTheLaunch) {
  auto got = spawn(
      [](Context& ctx) {
        Tensor x = nn::zeros({4}, {.device = ctx.device()});
        Tensor one = nn::ones({4}, {.device = ctx.device()});
        auto step = [&] {
          x.add_(one);
          ctx.communicator().all_reduce(x);
        };
        step();  // eager warm-up: x = 1
        ForeignReplay seen;
        nn::CudaGraph graph(ctx.device());
        graph.Capture(step);
        std::thread other([&] {
          nn::DeviceGuard device(ctx.device());
          try {
            graph.Replay();
          } catch (const Error& e) {
            seen.error = e.what();
          }
        });
        other.join();
        seen.after_refusal = x.to_vector<float>()[0];
        graph.Replay();
        seen.after_replay = x.to_vector<float>()[0];
        return seen;
      },
      1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  const ForeignReplay& seen = (*got)[0];
  EXPECT_NE(seen.error.find("replay it on the rank thread that captured it"), std::string::npos)
      << seen.error;
  EXPECT_EQ(seen.after_refusal, 1.0f);
  EXPECT_EQ(seen.after_replay, 2.0f);
}

struct SmallNet : nn::Module {
  SmallNet()
      : l1(register_module("l1", nn::Linear(32, 64))),
        l2(register_module("l2", nn::Linear(64, 4))) {}
  Tensor forward(const Tensor& x) override { return l2(nn::relu(l1(x))); }
  nn::Linear l1, l2;
};

// What one phase of TrainCounting made, every thread of the process.
struct Phases {
  CudaCallCounts eager;     // kEagerSteps steps after the warm-up
  CudaCallCounts replays;   // kReplays replays of the captured step
  CudaCallCounts released;  // the graph and the step's tensors going
};

constexpr int kEagerSteps = 20;
constexpr int kReplays = 20;

// The steps of TrainCounting; `before` is left at the start of the release.
void RunCounted(Context& ctx, Phases& phases, CudaCallCounts& before) {
  SmallNet net;
  DataParallel dp(net, ctx);
  optim::Adam adam(dp.parameters(), {.lr = 1e-3});
  Tensor x = nn::empty({16, 32}), y = nn::empty({16, 4});
  Tensor loss;
  auto step = [&] {
    loss = nn::mse_loss(dp(x), y);
    loss.backward();
    adam.step();
    adam.zero_grad();
  };
  auto fill = [&](int k) {
    nn::manual_seed(100 + k, 0);
    x.copy_(nn::randn({16, 32}, {.device = Device::CPU()}));
    y.copy_(nn::randn({16, 4}, {.device = Device::CPU()}));
  };
  for (int k = 0; k < 3; ++k) {
    fill(k);
    step();
    (void)loss.item();
  }
  before = nn::internal::ProcessCudaCalls();
  for (int k = 0; k < kEagerSteps; ++k) {
    fill(k);
    step();
    (void)loss.item();
  }
  phases.eager = nn::internal::ProcessCudaCalls() - before;
  {
    std::optional<nn::CudaGraph> graph;
    graph.emplace(ctx.device());
    graph->Capture(step);
    graph->Replay();
    (void)loss.item();
    before = nn::internal::ProcessCudaCalls();
    for (int k = 0; k < kReplays; ++k) {
      fill(k);
      graph->Replay();
      (void)loss.item();
    }
    phases.replays = nn::internal::ProcessCudaCalls() - before;
    before = nn::internal::ProcessCudaCalls();  // released: from here to the caller's end
    loss = Tensor();
    graph.reset();
  }
}

// DataParallel over NCCL, Adam (fused CUDA update), inputs in static tensors:
// 3 eager warm-up steps, kEagerSteps counted eager steps, a capture, kReplays
// counted replays, then the release of the graph and of everything else the
// run made, counted too.
Phases TrainCounting(Context& ctx) {
  Phases phases;
  CudaCallCounts before;
  RunCounted(ctx, phases, before);  // everything it made is gone when it returns
  phases.released = nn::internal::ProcessCudaCalls() - before;
  return phases;
}

// Mid-run, with peer access on, cudaMalloc / cudaFree / cudaHostAlloc /
// cudaFreeHost and cudaDeviceSynchronize can wait behind other GPUs' NCCL
// kernels. After a warm-up, neither eager steps, replays of a captured step
// nor the release of the graph make any (stream-ordered pool calls are
// allowed); the counts per step are printed for reference.
TEST_F(NcclGpuTest, StepsMakeNoAllocationAfterWarmUp) {
  auto got = spawn([](Context& ctx) { return TrainCounting(ctx); }, 1, "0", options_);
  ASSERT_TRUE(got.ok()) << got.status();
  const Phases& p = (*got)[0];
  std::printf("%d eager steps: %s\n%d replays: %s\ngraph release: %s\n", kEagerSteps,
              p.eager.ToString().c_str(), kReplays, p.replays.ToString().c_str(),
              p.released.ToString().c_str());
  for (const auto& [name, counts] :
       {std::pair<const char*, CudaCallCounts>{"eager steps", p.eager},
        {"replays", p.replays},
        {"graph release", p.released}}) {
    EXPECT_EQ(counts.Allocations(), 0) << name << ": " << counts.ToString();
    EXPECT_EQ(counts[CudaCall::kDeviceSynchronize], 0) << name << ": " << counts.ToString();
  }
  // Events are pooled: none made per step.
  EXPECT_EQ(p.eager[CudaCall::kEventCreate], 0) << p.eager.ToString();
  EXPECT_EQ(p.replays[CudaCall::kEventCreate], 0) << p.replays.ToString();
  EXPECT_GT(p.eager[CudaCall::kKernelLaunch], 0) << p.eager.ToString();
}

}  // namespace
}  // namespace tandem::dist
