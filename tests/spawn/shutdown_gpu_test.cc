// spawn's shutdown, Work lifetimes and NCCL overhead on GPUs, and the
// watchdog's device use. Each test is the smallest program that showed the
// defect; skipped with a reason where too few GPUs are visible. The same logic is
// tested on the CPU with a fake communicator in shutdown_test.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nn/graph.h"
#include "nn/layers.h"
#include "nn/ops/reduce.h"
#include "spawn/spawn.h"
#include "tests/gpu_test_util.h"
#if TANDEM_WITH_CUDA
#include <cuda.h>  // driver types only
#include <cuda_runtime_api.h>
#endif

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;
using nn::Tensor;

// Runs spawn; a run not back within `limit` is reported as a hang (the test
// process is then ended by ctest's timeout, which is the failure).
absl::Status SpawnWithin(double limit_s, int nprocs, const std::string& gpus,
                         const std::function<void(Context&)>& fn, double* seconds) {
  const Clock::time_point start = Clock::now();
  auto result = std::async(std::launch::async, [&] {
    return spawn([&](Context& ctx) { fn(ctx); }, nprocs, gpus, SpawnOptions{.timeout_s = 60});
  });
  if (result.wait_for(std::chrono::duration<double>(limit_s)) != std::future_status::ready) {
    ADD_FAILURE() << "spawn did not return within " << limit_s << " s: it hangs";
    std::fflush(nullptr);
    std::_Exit(1);  // the rank threads cannot be ended any other way
  }
  absl::Status status = result.get();
  *seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return status;
}

// Point 1: rank 1 throws before an all-reduce while rank 0 waits for its result
// on the host (item()). Before the fix, rank 0's item() never returned (its
// stream waits on an NCCL kernel waiting for rank 1) and spawn hung.
void PeerThrowsWhileOtherCallsItem(bool with_conv) {
  TANDEM_REQUIRE_GPUS(2);
  std::atomic<bool> entered{false};
  double seconds = 0;
  absl::Status s = SpawnWithin(60, 2, "0,1", [&](Context& ctx) {
    if (ctx.rank() == 1) {
      while (!entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      throw std::runtime_error("injected failure before the all-reduce");
    }
    Tensor x = nn::ones({1024}, {.device = ctx.device()});
    if (with_conv) {  // a cuDNN handle: cudnnDestroy syncs the device at thread exit
      nn::Conv2d conv(3, 4, 3);
      conv->to(ctx.device());
      x = nn::sum(conv(nn::ones({2, 3, 8, 8}, {.device = ctx.device()}))).reshape({1});
    }
    ctx.communicator().all_reduce(x);
    entered.store(true);
    nn::sum(x).item<float>();  // waits for the all-reduce rank 1 never joins
  }, &seconds);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 (cuda:1) threw: injected failure"), absl::string_view::npos)
      << s;
  EXPECT_LT(seconds, 10.0);
}

TEST(ShutdownGpuTest, PeerThrowingBeforeAllReduceDoesNotHangItem) {
  PeerThrowsWhileOtherCallsItem(false);
}

TEST(ShutdownGpuTest, PeerThrowingBeforeAllReduceDoesNotHangItemWithConv) {
  PeerThrowsWhileOtherCallsItem(true);
}

// Point 4: the async handle keeps its tensor alive until the work is done.
// Before the fix the storage went (cudaFreeAsync on the compute stream, not
// ordered after the communication stream) as soon as the tensor did.
TEST(ShutdownGpuTest, AsyncAllReduceHandleKeepsItsTensorAlive) {
  TANDEM_REQUIRE_GPUS(1);
  double seconds = 0;
  absl::Status s = SpawnWithin(60, 1, "0", [&](Context& ctx) {
    Tensor x = nn::ones({1 << 20}, {.device = ctx.device()});
    std::weak_ptr<nn::Storage> storage = x.storage();
    std::shared_ptr<Work> work = ctx.communicator().all_reduce_async(x);
    x = Tensor();
    EXPECT_FALSE(storage.expired()) << "the tensor's storage went before the all-reduce";
    work->wait();
    work.reset();
    EXPECT_TRUE(storage.expired());
    // Dropped unwaited: still nothing lost, and the stream stays usable.
    Tensor y = nn::ones({1 << 20}, {.device = ctx.device()});
    work = ctx.communicator().all_reduce_async(y);
    work.reset();
    EXPECT_FLOAT_EQ(nn::sum(y).item<float>(), static_cast<float>(1 << 20));
  }, &seconds);
  EXPECT_TRUE(s.ok()) << s;
}

// Host time of a small all-reduce: what the calling thread spends per call,
// not the device's throughput. The estimate (docs/gpu.md) is 10-20 us: NCCL
// 2.28's blocking enqueue (group job, device get/set, algorithm selection, two
// event record/wait pairs inside NCCL) plus tandem's own five CUDA calls (event
// record + stream wait in, NCCL on the communication stream, event record
// twice out, compute stream wait). The queue is drained every 100 calls, below
// the 128 collectives a rank may have in flight, so no call waits for the
// device. The bound is looser than the estimate for a loaded machine.
TEST(ShutdownGpuTest, SmallAllReduceHostTime) {
  const int gpus = nn::cuda_device_count();
  TANDEM_REQUIRE_GPUS(1);
  const int world = std::min(gpus, 2);
  std::vector<double> median_us(world, 0);
  double seconds = 0;
  absl::Status s = SpawnWithin(120, world, world == 2 ? "0,1" : "0", [&](Context& ctx) {
    Tensor x = nn::ones({256}, {.device = ctx.device()});
    for (int i = 0; i < 100; ++i) ctx.communicator().all_reduce(x);
    nn::Synchronize(ctx.device());
    std::vector<double> us;
    for (int i = 0; i < 2000; ++i) {
      const Clock::time_point t0 = Clock::now();
      ctx.communicator().all_reduce(x);
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (i % 100 == 99) nn::Synchronize(ctx.device());  // below the in-flight cap (128)
    }
    std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
    median_us[ctx.rank()] = us[us.size() / 2];
  }, &seconds);
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < world; ++r) {
    std::printf("rank %d: median host time per 1 KiB all_reduce: %.1f us\n", r, median_us[r]);
    EXPECT_LT(median_us[r], 40.0) << "rank " << r;
  }
}

// Two GPUs, a CUDA graph holding the gradient all-reduce: rank 0 replays it
// once more than rank 1 and both return. The extra replay's collective waits
// for good on rank 0's device; untracked, the thread's teardown (and NCCL's
// destroy) would hang spawn. Replays are traced: the watchdog names the stuck
// "graph replay" after timeout_s and the abort ends it.
TEST(ShutdownGpuTest, OneRankReplayingOnceMoreIsTimedOutNotHung) {
  TANDEM_REQUIRE_GPUS(2);
  const Clock::time_point start = Clock::now();
  absl::Status s = spawn(
      [](Context& ctx) {
        Tensor x = nn::ones({1024}, {.device = ctx.device()});
        ctx.communicator().all_reduce(x);
        nn::CudaGraph graph(ctx.device());
        graph.Capture([&] { ctx.communicator().all_reduce(x); });
        const int replays = ctx.rank() == 0 ? 4 : 3;
        for (int i = 0; i < replays; ++i) graph.Replay();
        nn::Synchronize(ctx.device());  // rank 0: waits on its fourth replay
      },
      2, "0,1", SpawnOptions{.timeout_s = 2});
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("graph replay"), absl::string_view::npos) << s;
  EXPECT_LT(seconds, 15.0);
}

// Rank 1 fails before its capture while rank 0 captures and replays a graph
// holding the all-reduce: rank 0's replay never completes; the abort must
// still run (a rank never waits on the guard behind it, and NCCL's last abort
// gets its graph back as rank 0 unwinds), and spawn returns rank 1's error.
TEST(ShutdownGpuTest, PeerFailingBeforeCaptureDoesNotHangTheRun) {
  TANDEM_REQUIRE_GPUS(2);
  double seconds = 0;
  absl::Status s = SpawnWithin(60, 2, "0,1", [](Context& ctx) {
    Tensor x = nn::ones({1024}, {.device = ctx.device()});
    ctx.communicator().all_reduce(x);
    if (ctx.rank() == 1) throw std::runtime_error("injected failure before the capture");
    nn::CudaGraph graph(ctx.device());
    graph.Capture([&] { ctx.communicator().all_reduce(x); });
    for (int i = 0; i < 3; ++i) graph.Replay();
    nn::sum(x).item<float>();
  }, &seconds);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("rank 1 (cuda:1) threw: injected failure before the capture"),
            absl::string_view::npos)
      << s;
  EXPECT_LT(seconds, 15.0);
}

// A rank whose thread is inside a device guard for another GPU still runs its
// collectives: the communicator records its events on its own device (once
// "invalid resource handle").
TEST(ShutdownGpuTest, CollectiveFromInsideAnotherDevicesGuardWorks) {
  TANDEM_REQUIRE_GPUS(2);
  double seconds = 0;
  absl::Status s = SpawnWithin(60, 2, "0,1", [](Context& ctx) {
    Tensor x = nn::ones({16}, {.device = ctx.device()});
    {
      nn::DeviceGuard other(nn::Device::CUDA(1 - ctx.device().index));
      ctx.communicator().all_reduce(x);
      std::shared_ptr<Work> work = ctx.communicator().all_reduce_async(x);
      work->wait();
    }
    TANDEM_CHECK(x.to_vector<float>()[0] == 4.0f, "all_reduce result ", x.to_vector<float>()[0]);
  }, &seconds);
  EXPECT_TRUE(s.ok()) << s;
}

#if TANDEM_WITH_CUDA
// A driver function through the runtime (null if the driver lacks it): the test
// does not link libcuda, so its binary loads, and ctest lists its tests, on a
// machine without a GPU driver.
template <typename Fn>
Fn DriverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

// Point 6 (the watchdog): a run on GPU 1 must not create a context on GPU 0.
// The watchdog polls the communicators' events and aborts them; before the fix
// it did so with the thread's default device, GPU 0.
TEST(ShutdownGpuTest, RunOnGpuOneCreatesNoContextOnGpuZero) {
  TANDEM_REQUIRE_GPUS(2);
  const auto device_get = DriverEntry<CUresult (*)(CUdevice*, int)>("cuDeviceGet");
  const auto primary_state =
      DriverEntry<CUresult (*)(CUdevice, unsigned*, int*)>("cuDevicePrimaryCtxGetState");
  ASSERT_NE(device_get, nullptr);
  ASSERT_NE(primary_state, nullptr);
  CUdevice zero;
  ASSERT_EQ(device_get(&zero, 0), CUDA_SUCCESS);
  unsigned flags = 0;
  int active = 0;
  ASSERT_EQ(primary_state(zero, &flags, &active), CUDA_SUCCESS);
  if (active) GTEST_SKIP() << "GPU 0 already has a context in this process (run alone, as ctest does)";
  // A run that stops: the watchdog polls and aborts on GPU 1 only.
  SpawnOptions options{.timeout_s = 0.5};
  absl::Status s = spawn([&](Context& ctx) {
    Tensor x = nn::ones({16}, {.device = ctx.device()});
    for (int i = 0; i < 20; ++i) ctx.communicator().all_reduce(x);
    nn::Synchronize(ctx.device());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the watchdog polls
    throw std::runtime_error("stop the run: the watchdog aborts");
  }, 1, "1", options);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  ASSERT_EQ(primary_state(zero, &flags, &active), CUDA_SUCCESS);
  EXPECT_EQ(active, 0) << "something in the run created a context on GPU 0";
}
#endif

}  // namespace
}  // namespace tandem::dist
