// CudaGraph on a GPU (label gpu; skipped with a reason where no GPU is visible):
// a captured forward + backward + update replayed with static inputs gives the
// bits of the eager steps; nothing runs at capture; host reads inside the step
// are a clear error that leaves the thread usable; dropout under capture draws
// the masks of the eager steps; pre-replay hooks run in order.
//
// Why bitwise: a replay launches the very kernels (same grids, same arguments,
// same cuBLASLt algorithm and workspace) that the eager step launched, on the
// same stream, in the same order; tandem's kernels use no atomics, so the only
// difference is where the step's temporaries live (the graph's arena), which
// does not enter any result.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "nn/autocast.h"
#include "nn/graph.h"
#include "nn/layers.h"
#include "nn/ops/dropout.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace tandem::nn {
using ::tandem::testing::ErrorOf;
using ::tandem::testing::ExpectSameBits;
namespace {

class CudaGraphGpuTest : public ::tandem::testing::GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    guard_.emplace(Device::CUDA(0));
  }
  std::optional<DeviceGuard> guard_;
};

struct Mlp : Module {
  Mlp() : l1(register_module("l1", Linear(16, 32))), l2(register_module("l2", Linear(32, 1))) {}
  Tensor forward(const Tensor& x) override { return l2(relu(l1(x))); }
  Linear l1, l2;
};

using ::tandem::testing::FlatParams;

constexpr int kSteps = 6;

// Batch k of the run: the same on every call.
std::pair<Tensor, Tensor> Batch(int k) {
  manual_seed(100 + k);
  Tensor x = randn({8, 16}), y = randn({8, 1});
  return {x.to(Device::CUDA(0)), y.to(Device::CUDA(0))};
}

// One training step of `net` on (x, y): forward, backward, SGD update, zero_grad.
// bf16: forward and loss under AutocastGuard(kBFloat16) (the weight casts and the
// bf16 GEMMs are then part of the captured step).
Tensor TrainStep(Mlp& net, const Tensor& x, const Tensor& y, bool bf16 = false) {
  Tensor loss;
  {
    AutocastGuard autocast(bf16 ? kBFloat16 : kFloat32);
    loss = mse_loss(net(x), y);
  }
  loss.backward();
  NoGradGuard no_grad;
  for (Tensor p : net.parameters()) {
    p.add_(p.grad(), -0.05);
    p.grad().zero_();
  }
  return loss;
}

void ExpectReplayMatchesEager(bool bf16) {
  manual_seed(1);
  Mlp eager_net;
  std::vector<float> eager_losses;
  for (int k = 0; k < kSteps; ++k) {
    auto [x, y] = Batch(k);
    eager_losses.push_back(static_cast<float>(TrainStep(eager_net, x, y, bf16).item()));
  }

  manual_seed(1);
  Mlp net;
  Tensor x = empty({8, 16}), y = empty({8, 1});  // the static inputs
  std::vector<float> losses;
  {
    auto [x0, y0] = Batch(0);
    x.copy_(x0);
    y.copy_(y0);
    losses.push_back(static_cast<float>(TrainStep(net, x, y, bf16).item()));  // warm-up, eager
  }
  CudaGraph graph;
  Tensor loss;
  const std::vector<float> before = FlatParams(net);
  graph.Capture([&] { loss = TrainStep(net, x, y, bf16); });
  ASSERT_TRUE(graph.captured());
  EXPECT_GT(graph.num_nodes(), 5);
  ExpectSameBits(FlatParams(net), before, "weights after capture (nothing may run)");
  for (int k = 1; k < kSteps; ++k) {
    auto [xk, yk] = Batch(k);
    x.copy_(xk);
    y.copy_(yk);
    graph.Replay();
    losses.push_back(static_cast<float>(loss.item()));
  }
  ExpectSameBits(losses, eager_losses, "losses");
  ExpectSameBits(FlatParams(net), FlatParams(eager_net), "weights");
}

// Replays `graph` on a new thread (on cuda:0) and joins it: the replay's error
// message, "" when it ran.
std::string ReplayOnAnotherThread(CudaGraph& graph) {
  std::string error;
  std::thread b([&] {
    DeviceGuard device(Device::CUDA(0));
    try {
      graph.Replay();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  b.join();
  return error;
}

TEST_F(CudaGraphGpuTest, ReplayedTrainingStepMatchesEagerSteps) { ExpectReplayMatchesEager(false); }

TEST_F(CudaGraphGpuTest, ReplayedBf16AutocastStepMatchesEagerSteps) {
  ExpectReplayMatchesEager(true);
}

// Two threads on one GPU (ranks sharing it): thread B destroys a captured
// graph, whose memory release synchronises the device, while thread A is in
// the middle of a capture. The release must wait for A's capture to end: a
// device synchronisation during it fails with cudaErrorStreamCaptureUnsupported
// and invalidates A's capture (the first GPU run saw exactly that, as a later
// "FillKernel failed" on the other thread).
TEST_F(CudaGraphGpuTest, ReleasingAGraphOnAnotherThreadDoesNotBreakACapture) {
  std::atomic<bool> capturing{false}, released{false};
  std::string a_error, b_error;
  std::vector<float> a_value, b_value;
  std::thread a([&] {
    DeviceGuard device(Device::CUDA(0));
    try {
      Tensor x = zeros({1024});
      CudaGraph graph;
      graph.Capture([&] {
        capturing.store(true);
        while (!released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        x.add_(full({1024}, 1.0));
      });
      graph.Replay();
      a_value = x.to_vector<float>();
    } catch (const std::exception& e) {
      a_error = e.what();
    }
  });
  std::thread b([&] {
    DeviceGuard device(Device::CUDA(0));
    try {
      {
        Tensor y = zeros({1024});
        CudaGraph graph;
        graph.Capture([&] { y.add_(full({1024}, 2.0)); });
        while (!capturing.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }  // the graph and its memory go while thread a captures
      released.store(true);
      b_value = full({4}, 3.0).to_vector<float>();  // the next kernel on this thread
    } catch (const std::exception& e) {
      released.store(true);
      b_error = e.what();
    }
  });
  a.join();
  b.join();
  EXPECT_EQ(a_error, "");
  EXPECT_EQ(b_error, "");
  EXPECT_EQ(a_value, std::vector<float>(1024, 1.0f));
  EXPECT_EQ(b_value, std::vector<float>(4, 3.0f));
}

// Thread b replays a graph that this thread captured, right after this thread
// queued long work writing the graph's input (not waited for), and this
// thread writes the input again once b has returned. The capturing stream owns
// the input and the output: b's replay must run after the queued adds and
// before the later fill, and this thread's read of the output after the
// replay. Unordered, b's copy ran during the adds (or after the fill) and
// this thread could read the output before it.
TEST_F(CudaGraphGpuTest, ReplayOnAnotherThreadIsOrderedAgainstTheCapturingStream) {
  constexpr int64_t kNumel = int64_t{1} << 24;  // 64 MiB of float32: each add takes tens of us
  constexpr int kAdds = 400;
  Tensor x = zeros({kNumel}), y = zeros({kNumel}), one = full({kNumel}, 1.0);
  CudaGraph graph;
  graph.Capture([&] { y.copy_(x); });
  for (int k = 0; k < kAdds; ++k) x.add_(one);
  const std::string error = ReplayOnAnotherThread(graph);
  x.fill_(-1.0);
  EXPECT_EQ(error, "");
  const std::vector<float> got = y.to_vector<float>();
  int64_t wrong = 0;
  for (float v : got) wrong += v != static_cast<float>(kAdds);
  EXPECT_EQ(wrong, 0) << "of " << kNumel << " elements; first " << got.front() << ", last "
                      << got.back();
}

// A replay on thread b refused by a hook (as an NCCL graph's is) after a
// dropout's hook has already written, on b's stream, the offset the graph
// reads: this thread's next replay must read its own offset. b's stream is
// kept busy before that write (a hook queues adds there), and the graph's
// adds before its dropout outlast them: unordered, b's write landed between
// this thread's write and the dropout's read (the mask of offset 0, the
// warm-up's, instead of the next one).
TEST_F(CudaGraphGpuTest, WritesOfARefusedReplayOnAnotherThreadComeBeforeTheNextReplay) {
  constexpr int64_t kNumel = int64_t{1} << 24;  // 64 MiB of float32: each add takes tens of us
  const std::thread::id self = std::this_thread::get_id();
  Tensor x = full({1000}, 1.0);
  manual_seed(9);
  const std::vector<float> eager0 = dropout(x, 0.5, true).to_vector<float>();
  const std::vector<float> eager1 = dropout(x, 0.5, true).to_vector<float>();
  manual_seed(9);
  (void)dropout(x, 0.5, true);  // warm-up: offset 0, as eager0
  Tensor z = zeros({kNumel}), w = zeros({kNumel}), one = full({kNumel}, 1.0);
  Tensor y;
  CudaGraph graph;
  graph.Capture([&] {
    ASSERT_TRUE(CudaGraph::AddPreReplayHook([&] {  // b's stream busy before the offset's write
      if (std::this_thread::get_id() != self) {
        for (int k = 0; k < 50; ++k) z.add_(one);
      }
    }));
    for (int k = 0; k < 100; ++k) w.add_(one);
    y = dropout(x, 0.5, true);
    ASSERT_TRUE(CudaGraph::AddPreReplayHook([&] {
      if (std::this_thread::get_id() != self) throw std::runtime_error("refused on thread b");
    }));
  });
  const std::string error = ReplayOnAnotherThread(graph);
  EXPECT_EQ(error, "refused on thread b");
  graph.Replay();
  const std::vector<float> got = y.to_vector<float>();
  EXPECT_NE(eager0, eager1);
  ExpectSameBits(got, eager1, "the mask of the replay after the refused one");
  EXPECT_EQ(w.to_vector<float>()[0], 100.0f);
  EXPECT_EQ(z.to_vector<float>()[0], 50.0f);
}

// Waits (up to 20 s) until `flag` is set; whether it was.
bool AwaitFlag(const std::atomic<bool>& flag) {
  for (int i = 0; i < 20000 && !flag.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return flag.load();
}

// While this thread captures, thread b frees a tensor this thread's stream
// owns (b held the last reference and had used it: the free waits for b's
// stream) and reads, for the first time, another one. Done at that moment on
// the capturing stream, b's work would be recorded in the capture instead of
// run: the event recorded for b's first read joins b's stream to the capture
// (b's copy is captured, its host wait fails, and cudaStreamEndCapture fails,
// unjoined); the owner's wait for b's stream before the free, and the free of
// memory the graph did not allocate, invalidate the capture. Instead b's read
// waits for the work queued here before the capture, and the free is done
// after it ends, the memory kept by the graph, which reads it at every replay
// (new tensors filled with other values must not get it).
TEST_F(CudaGraphGpuTest, AnotherThreadsFreeAndFirstReadDuringACaptureDoNotBreakIt) {
  constexpr int64_t kNumel = 1 << 16;
  Tensor read_by_b = full({kNumel}, 7.0);
  Tensor freed_by_b = full({kNumel}, 3.0);
  Tensor x = zeros({kNumel});
  std::atomic<bool> b_used{false}, b_may_go{false}, b_done{false};
  std::string b_error;
  std::vector<float> b_read;
  std::thread b([&, held = freed_by_b]() mutable {
    DeviceGuard device(Device::CUDA(0));
    try {
      (void)held.to_vector<float>();  // b's stream becomes a user of the storage
      b_used.store(true);
      if (!AwaitFlag(b_may_go)) throw std::runtime_error("the capture never began");
      held = Tensor();  // the last reference: the storage goes during the capture
      b_read = read_by_b.to_vector<float>();  // b's first use of this storage
    } catch (const std::exception& e) {
      b_error = e.what();
    }
    b_done.store(true);
  });
  ASSERT_TRUE(AwaitFlag(b_used));
  CudaGraph graph;
  const std::string capture_error = ErrorOf([&] {
    graph.Capture([&] {
      x.add_(freed_by_b);
      freed_by_b = Tensor();  // b holds the last reference now
      b_may_go.store(true);
      EXPECT_TRUE(AwaitFlag(b_done)) << "thread b did not finish during the capture";
      x.add_(full({kNumel}, 1.0));
    });
  });
  b.join();
  EXPECT_EQ(capture_error, "");
  EXPECT_EQ(b_error, "");
  EXPECT_EQ(b_read, std::vector<float>(kNumel, 7.0f));
  ASSERT_TRUE(graph.captured());
  std::vector<Tensor> others;
  for (int k = 0; k < 8; ++k) others.push_back(full({kNumel}, -100.0));
  graph.Replay();
  graph.Replay();
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>(kNumel, 8.0f));
}

// Thread b uses, on its stream of `user_device`, a tensor of 3s that this
// thread's stream (cuda:0) owns (`use`: what b keeps of it, a copy when
// `keeps_copy`, else nothing), then captures a step on `user_device`; during
// that capture this thread drops the tensor (the last reference: the owner
// waits for b's use, then frees) and queues more work on its stream. b's
// capture and replay, this thread's next work and b's copy must all come out
// as if no capture ran.
void ExpectAFreeDuringAUsersCaptureNotToJoinIt(Device user_device, bool keeps_copy,
                                               const std::function<Tensor(const Tensor&)>& use) {
  DeviceGuard device(Device::CUDA(0));
  constexpr int64_t kNumel = 1 << 16;
  std::optional<Tensor> shared = full({kNumel}, 3.0);
  std::atomic<bool> b_used{false}, capturing{false}, freed{false};
  std::string b_error;
  std::vector<float> b_copy, b_value;
  std::thread b([&, seen = *shared]() mutable {
    DeviceGuard on_user_device(user_device);
    try {
      Tensor copy = use(seen);  // b's stream of user_device becomes a user
      seen = Tensor();
      b_used.store(true);
      Tensor y = zeros({kNumel});
      CudaGraph graph(user_device);
      graph.Capture([&] {
        capturing.store(true);
        EXPECT_TRUE(AwaitFlag(freed)) << "this thread did not free the tensor during the capture";
        y.add_(full({kNumel}, 2.0));
      });
      graph.Replay();
      b_value = y.to_vector<float>();
      if (copy.defined()) b_copy = copy.to_vector<float>();
    } catch (const std::exception& e) {
      capturing.store(true);
      b_error = e.what();
    }
  });
  ASSERT_TRUE(AwaitFlag(b_used));
  ASSERT_TRUE(AwaitFlag(capturing));
  shared.reset();  // the last reference: the owner waits for b's use, then frees
  const std::vector<float> after = full({4}, 5.0).to_vector<float>();  // this stream's next work
  freed.store(true);
  b.join();
  EXPECT_EQ(b_error, "");
  EXPECT_EQ(after, std::vector<float>(4, 5.0f));
  EXPECT_EQ(b_value, std::vector<float>(kNumel, 2.0f));
  EXPECT_EQ(b_copy, keeps_copy ? std::vector<float>(kNumel, 3.0f) : std::vector<float>{});
}

// The mirror case: this thread frees a tensor its stream owns while thread b,
// whose stream read it, captures. The owner's wait for b's stream used to
// record an event on b's capturing stream: this thread's stream then joined
// b's capture (its free and its next kernels recorded there, b's capture
// ending unjoined). It now waits for the event b's capture recorded before it
// began (b's eager read).
TEST_F(CudaGraphGpuTest, FreeingATensorWhoseUserStreamCapturesDoesNotJoinTheCapture) {
  ExpectAFreeDuringAUsersCaptureNotToJoinIt(Device::CUDA(0), false, [](const Tensor& seen) {
    (void)seen.to_vector<float>();
    return Tensor();
  });
}

// Two GPUs: thread b replays, on cuda:0, a graph this thread captured there;
// while b's replay runs its pre-replay hook (under cuda:0's capture lock),
// thread c captures a step on cuda:1. A lock over every GPU held c's capture
// until b's replay was done; the hook waits for c's capture to end.
TEST(CudaGraphTwoGpuTest, AReplayOnAnotherThreadDoesNotHoldUpACaptureOnAnotherGpu) {
  TANDEM_REQUIRE_GPUS(2);
  DeviceGuard device(Device::CUDA(0));
  const std::thread::id self = std::this_thread::get_id();
  std::atomic<bool> in_hook{false}, c_captured{false};
  bool c_captured_during_replay = false;
  Tensor x = zeros({16});
  CudaGraph graph;
  graph.Capture([&] {
    ASSERT_TRUE(CudaGraph::AddPreReplayHook([&] {
      if (std::this_thread::get_id() == self) return;
      in_hook.store(true);
      c_captured_during_replay = AwaitFlag(c_captured);
    }));
    x.add_(full({16}, 1.0));
  });
  std::string b_error;
  std::thread b([&] {
    DeviceGuard on_zero(Device::CUDA(0));
    try {
      graph.Replay();
    } catch (const std::exception& e) {
      b_error = e.what();
    }
  });
  std::string c_error;
  std::thread c([&] {
    DeviceGuard on_one(Device::CUDA(1));
    try {
      if (!AwaitFlag(in_hook)) throw std::runtime_error("b's replay never reached its hook");
      Tensor y = zeros({16});
      CudaGraph other;
      other.Capture([&] { y.add_(full({16}, 2.0)); });
      c_captured.store(true);
      other.Replay();
      EXPECT_EQ(y.to_vector<float>(), std::vector<float>(16, 2.0f));
    } catch (const std::exception& e) {
      c_captured.store(true);
      c_error = e.what();
    }
  });
  b.join();
  c.join();
  EXPECT_EQ(b_error, "");
  EXPECT_EQ(c_error, "");
  EXPECT_TRUE(c_captured_during_replay);
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>(16, 1.0f));
}

// Two GPUs: thread b copies a tensor of this thread (cuda:0) to cuda:1 (b's
// cuda:1 stream becomes a user of it) and then captures a step on cuda:1;
// during that capture this thread drops the tensor. The owner's wait for a
// user stream of another GPU used to record an event there without that
// GPU's lock and without looking for a capture: this thread's stream joined
// b's capture (its free and next kernels recorded there, b's capture ending
// unjoined). It now waits, under both GPUs' locks, for the event b's capture
// recorded before it began (b's eager copy).
TEST(CudaGraphTwoGpuTest, FreeingATensorWhosePeerCopyStreamCapturesDoesNotJoinTheCapture) {
  TANDEM_REQUIRE_GPUS(2);
  ExpectAFreeDuringAUsersCaptureNotToJoinIt(
      Device::CUDA(1), true, [](const Tensor& seen) { return seen.to(Device::CUDA(1)); });
}

// A graph reads memory of the thread that captured it at every replay (its
// cuBLASLt workspace, used by the matmul here), freed when that thread exits:
// a replay from another thread while it runs works; after its exit the replay
// is a clear error naming the exited thread, not a read of freed memory.
TEST_F(CudaGraphGpuTest, AReplayAfterTheCapturingThreadExitedIsAnErrorNamingIt) {
  Tensor a = full({8, 8}, 1.0);
  Tensor b = full({8, 8}, 2.0);
  Tensor y = zeros({8, 8});
  CudaGraph graph;
  std::atomic<bool> captured{false}, replayed{false};
  std::string capturing_thread;
  std::string a_error;
  std::thread capturer([&] {
    DeviceGuard device(Device::CUDA(0));
    try {
      y.copy_(matmul(a, b));  // eager: the thread's cuBLASLt handle and workspace
      graph.Capture([&] { y.add_(matmul(a, b)); });
      std::ostringstream id;
      id << std::this_thread::get_id();
      capturing_thread = id.str();
    } catch (const std::exception& e) {
      a_error = e.what();
    }
    captured.store(true);
    if (!AwaitFlag(replayed)) a_error += "; the test thread never replayed";
  });
  ASSERT_TRUE(AwaitFlag(captured));
  const std::string while_running = ErrorOf([&] { graph.Replay(); });
  replayed.store(true);
  capturer.join();
  ASSERT_EQ(a_error, "");
  EXPECT_EQ(while_running, "");
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(64, 32.0f));  // 16 eager + 16 replayed
  const std::string after_exit = ErrorOf([&] { graph.Replay(); });
  EXPECT_NE(after_exit.find("was released"), std::string::npos) << after_exit;
  EXPECT_NE(after_exit.find("captured on thread " + capturing_thread + ", which has exited"),
            std::string::npos)
      << after_exit;
  EXPECT_FALSE(graph.captured());
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(64, 32.0f));  // nothing ran
  // Released for good: capturing it again is refused as for any captured graph
  // (not a capture whose every replay then throws "was released").
  const std::string recapture = ErrorOf([&] { graph.Capture([&] { y.add_(y); }); });
  EXPECT_NE(recapture.find("was already captured"), std::string::npos) << recapture;
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(64, 32.0f));
}

TEST_F(CudaGraphGpuTest, CaptureRunsNothingAndEachReplayRunsOnce) {
  Tensor counter = zeros({4});
  CudaGraph graph;
  EXPECT_EQ(graph.device(), Device::CUDA(0));
  EXPECT_FALSE(graph.captured());
  EXPECT_EQ(graph.num_nodes(), 0);
  graph.Capture([&] { counter.add_(full({4}, 1.0)); });
  EXPECT_EQ(counter.to_vector<float>(), std::vector<float>(4, 0.0f));
  graph.Replay();
  graph.Replay();
  EXPECT_EQ(counter.to_vector<float>(), std::vector<float>(4, 2.0f));
}

TEST_F(CudaGraphGpuTest, ItemInsideTheStepIsAClearErrorAndTheThreadStillWorks) {
  Tensor x = full({3}, 2.0);
  const auto allocator_before = empty({1}).storage()->allocator();
  CudaGraph graph;
  const std::string what = ErrorOf([&] { graph.Capture([&] { (void)sum(x * 3.0).item(); }); });
  EXPECT_NE(what.find("CudaGraph::Capture: the step synchronised with the host"),
            std::string::npos) << what;
  EXPECT_NE(what.find("must not read values on the host"), std::string::npos) << what;
  EXPECT_FALSE(graph.captured());
  EXPECT_FALSE(CudaGraph::IsCapturing());
  // The thread's allocator is restored and eager work runs.
  EXPECT_EQ(empty({1}).storage()->allocator(), allocator_before);
  EXPECT_DOUBLE_EQ(sum(x * 3.0).item(), 18.0);
  // A new capture on the same thread works.
  CudaGraph again;
  again.Capture([&] { x.add_(full({3}, 1.0)); });
  again.Replay();
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>(3, 3.0f));
}

TEST_F(CudaGraphGpuTest, AnExceptionFromTheStepIsRethrownAndTheThreadStillWorks) {
  const auto allocator_before = empty({1}).storage()->allocator();
  CudaGraph graph;
  Tensor x = full({3}, 1.0);
  const std::string what = ErrorOf([&] {
    graph.Capture([&] {
      x.add_(full({3}, 1.0));
      throw std::runtime_error("boom from the step");
    });
  });
  EXPECT_EQ(what, "boom from the step");
  EXPECT_FALSE(graph.captured());
  EXPECT_FALSE(CudaGraph::IsCapturing());
  EXPECT_EQ(empty({1}).storage()->allocator(), allocator_before);
  EXPECT_EQ(x.to_vector<float>(), std::vector<float>(3, 1.0f));  // nothing ran
}

TEST_F(CudaGraphGpuTest, MisuseIsAnError) {
  CudaGraph graph;
  EXPECT_NE(ErrorOf([&] { graph.Replay(); }).find("has not been captured"), std::string::npos);
  graph.Capture([] { (void)zeros({2}); });
  EXPECT_NE(ErrorOf([&] { graph.Capture([] {}); }).find("already captured"), std::string::npos);
  CudaGraph outer;
  const std::string nested = ErrorOf([&] {
    outer.Capture([] {
      CudaGraph inner;
      inner.Capture([] {});
    });
  });
  EXPECT_NE(nested.find("nested capture"), std::string::npos) << nested;
  {
    DeviceGuard cpu(Device::CPU());
    CudaGraph other(Device::CUDA(0));
    const std::string what = ErrorOf([&] { other.Capture([] {}); });
    EXPECT_NE(what.find("current device is cpu but the graph is for cuda:0"), std::string::npos)
        << what;
  }
}

TEST_F(CudaGraphGpuTest, PreReplayHooksRunInOrderBeforeEveryReplay) {
  std::vector<int> order;
  CudaGraph graph;
  graph.Capture([&] {
    EXPECT_TRUE(CudaGraph::IsCapturing());
    EXPECT_TRUE(CudaGraph::AddPreReplayHook([&] { order.push_back(1); }));
    EXPECT_TRUE(CudaGraph::AddPreReplayHook([&] { order.push_back(2); }));
  });
  EXPECT_TRUE(order.empty());
  graph.Replay();
  graph.Replay();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 1, 2}));
}

// CaptureId tells a capture from a later one on the same thread (an
// asynchronous collective's handle keeps it): 0 outside, set and distinct
// inside each.
TEST_F(CudaGraphGpuTest, EachCaptureHasItsOwnIdAndNoneRunsOutside) {
  EXPECT_EQ(CudaGraph::CaptureId(), 0u);
  uint64_t first = 0, second = 0;
  CudaGraph a, b;
  a.Capture([&] { first = CudaGraph::CaptureId(); });
  EXPECT_EQ(CudaGraph::CaptureId(), 0u);
  b.Capture([&] { second = CudaGraph::CaptureId(); });
  EXPECT_NE(first, 0u);
  EXPECT_NE(second, 0u);
  EXPECT_NE(first, second);
}

TEST_F(CudaGraphGpuTest, TensorsOfTheStepOutliveTheGraph) {
  Tensor x = full({5}, 2.0);
  Tensor y;
  {
    CudaGraph graph;
    graph.Capture([&] { y = x * 4.0; });
    graph.Replay();
  }
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>(5, 8.0f));
}

TEST_F(CudaGraphGpuTest, CapturedDropoutDrawsTheMasksOfEagerSteps) {
  Tensor x = full({1000}, 1.0);
  manual_seed(9);
  std::vector<std::vector<float>> eager;
  for (int k = 0; k < 4; ++k) eager.push_back(dropout(x, 0.5, true).to_vector<float>());
  const uint64_t eager_offset = thread_generator().offset;

  manual_seed(9);
  std::vector<std::vector<float>> replayed;
  replayed.push_back(dropout(x, 0.5, true).to_vector<float>());  // warm-up
  Tensor y;
  CudaGraph graph;
  graph.Capture([&] { y = dropout(x, 0.5, true); });
  for (int k = 1; k < 4; ++k) {
    graph.Replay();
    replayed.push_back(y.to_vector<float>());
  }
  for (int k = 0; k < 4; ++k) ExpectSameBits(replayed[k], eager[k], "dropout output");
  EXPECT_NE(eager[1], eager[2]);  // a fresh mask each step
  EXPECT_EQ(thread_generator().offset, eager_offset);
}

}  // namespace
}  // namespace tandem::nn
