// GPU checks of pinned host memory (the caching allocator, asynchronous copies,
// item()) and of deferred device errors (a bad cross_entropy target raised at
// the next host synchronisation, the context still usable). Label gpu; skipped
// with a reason when no GPU is visible.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nn/internal/cuda_runtime.h"
#include "nn/internal/device_error.h"
#include "nn/ops/loss.h"
#include "nn/ops/matmul.h"
#include "nn/random.h"
#include "nn/tensor.h"
#include "tests/gpu_test_util.h"
#include "tests/test_util.h"

namespace tandem::nn {
using ::tandem::testing::ErrorOf;
namespace {

const Device kGpu = Device::CUDA(0);

class PinnedGpuTest : public ::tandem::testing::GpuTest {};

std::vector<float> Iota(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i % 1000003);
  return v;
}

// A pinned float32 tensor of `n` elements holding Iota(n, start).
Tensor PinnedIota(int64_t n, float start) {
  return from_vector(Iota(n, start), {n}, {.device = Device::CPU(), .pinned = true});
}

// Enqueues about a second of matmuls on the thread's stream of kGpu (fp32,
// no TF32), so that work queued after it stays pending for a while.
void KeepStreamBusy() {
  NoGradGuard no_grad;
  const bool tf32 = allow_tf32();
  set_allow_tf32(false);
  Tensor m = rand({8192, 8192}, {.device = kGpu});
  Tensor x = m;
  for (int i = 0; i < 40; ++i) x = matmul(x, m);  // ~18 ms each on an H100
  set_allow_tf32(tf32);
}

// 3 MiB of float32: the 4 MiB size class, which the other tests here leave alone.
constexpr int64_t kProbeElements = int64_t{3} << 18;

TEST_F(PinnedGpuTest, PinnedBlockIsReusedOnceItsCopyIsDone) {
  DeviceGuard guard(kGpu);
  Tensor a = PinnedIota(kProbeElements, 1.0f);
  ASSERT_TRUE(a.is_pinned());
  void* first = a.data_ptr();
  Tensor on_gpu = a.to(kGpu);
  Synchronize(kGpu);  // the copy out of `a` is done
  a = Tensor();       // back to the cache, with a completed use
  const internal::PinnedCacheStats before = internal::GetPinnedCacheStats();
  Tensor b = empty({kProbeElements}, {.device = Device::CPU(), .pinned = true});
  EXPECT_EQ(b.data_ptr(), first) << "a freed block whose copy completed was not reused";
  EXPECT_EQ(internal::GetPinnedCacheStats().blocks, before.blocks);
  EXPECT_EQ(on_gpu.to_vector<float>(), Iota(kProbeElements, 1.0f));
}

TEST_F(PinnedGpuTest, PinnedBlockIsNotReusedWhileItsCopyIsPending) {
  DeviceGuard guard(kGpu);
  Tensor a = PinnedIota(kProbeElements, 2.0f);
  void* first = a.data_ptr();
  KeepStreamBusy();
  Tensor on_gpu = a.to(kGpu);  // queued behind the matmuls: not started yet
  a = Tensor();                // freed while its copy is pending
  EXPECT_GE(internal::GetPinnedCacheStats().pending_blocks, 1);
  Tensor b = empty({kProbeElements}, {.device = Device::CPU(), .pinned = true});
  void* second = b.data_ptr();
  EXPECT_NE(second, first) << "a block was handed out while a copy from it was pending";
  Synchronize(kGpu);
  b = Tensor();
  // Both blocks are free and done now: the next two requests reuse them.
  Tensor c = empty({kProbeElements}, {.device = Device::CPU(), .pinned = true});
  Tensor d = empty({kProbeElements}, {.device = Device::CPU(), .pinned = true});
  EXPECT_EQ((std::set<void*>{c.data_ptr(), d.data_ptr()}), (std::set<void*>{first, second}));
  EXPECT_EQ(on_gpu.to_vector<float>(), Iota(kProbeElements, 2.0f));
}

TEST_F(PinnedGpuTest, RoundTripsFromPinnedAndPageableMemory) {
  DeviceGuard guard(kGpu);
  // Small, medium, and larger than the 32 MiB staging chunk (three chunks).
  for (int64_t n : {int64_t{7}, int64_t{1} << 20, (int64_t{80} << 20) / 4 + 3}) {
    const std::vector<float> values = Iota(n, 0.5f);
    Tensor pageable = from_vector(values, {n}, {.device = Device::CPU()});
    Tensor pinned = pageable.pin_memory();
    EXPECT_TRUE(pinned.is_pinned());
    EXPECT_FALSE(pageable.is_pinned());
    Tensor from_pinned = pinned.to(kGpu);
    Tensor from_pageable = pageable.to(kGpu);
    pageable.fill_(-1.0);  // staged: the copy already has its own bytes
    EXPECT_EQ(from_pinned.to_vector<float>(), values) << n;
    EXPECT_EQ(from_pageable.to_vector<float>(), values) << n;
    Tensor back = from_pinned.to(Device::CPU());
    EXPECT_FALSE(back.is_pinned());
    EXPECT_EQ(back.to_vector<float>(), values) << n;
    Tensor into_pinned = empty({n}, {.device = Device::CPU(), .pinned = true});
    into_pinned.copy_(from_pageable);
    EXPECT_EQ(into_pinned.to_vector<float>(), values) << n;
  }
  // A view into a pinned block (interior pointer), and a dtype change on the way.
  Tensor rows = from_vector(std::vector<int64_t>{1, 2, 3, 4, 5, 6}, {3, 2},
                            {.device = Device::CPU(), .pinned = true});
  EXPECT_EQ(rows.slice(1, 3).to(kGpu).to_vector<int64_t>(), (std::vector<int64_t>{3, 4, 5, 6}));
  EXPECT_EQ(rows.to(kGpu).to(kFloat32).to(Device::CPU()).to_vector<float>(),
            (std::vector<float>{1, 2, 3, 4, 5, 6}));
  // pin_memory of a CUDA tensor is an error naming it.
  try {
    rows.to(kGpu).pin_memory();
    FAIL() << "pin_memory on a CUDA tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}

TEST_F(PinnedGpuTest, ItemReadsEveryDType) {
  DeviceGuard guard(kGpu);
  EXPECT_EQ(scalar_tensor(2.5, {.dtype = kFloat32, .device = kGpu}).item(), 2.5);
  EXPECT_EQ(scalar_tensor(-3.25, {.dtype = kFloat64, .device = kGpu}).item(), -3.25);
  EXPECT_EQ(scalar_tensor(123456789.0, {.dtype = kInt64, .device = kGpu}).item<int64_t>(),
            123456789);
  EXPECT_EQ(scalar_tensor(7, {.dtype = kUInt8, .device = kGpu}).item(), 7.0);
  Tensor v = from_vector(std::vector<float>{1, 2, 3}, {3}, {.device = kGpu});
  EXPECT_EQ(v[2].item(), 3.0);  // an element inside a larger block
  EXPECT_THROW(v.item(), Error);
}

TEST_F(PinnedGpuTest, RecordPinnedUseRejectsOtherMemory) {
  DeviceGuard guard(kGpu);
  float local = 0;
  EXPECT_THROW(internal::RecordPinnedUse(&local, kGpu, nullptr), Error);
  Tensor pageable = zeros({4}, {.device = Device::CPU()});
  EXPECT_FALSE(internal::IsPinnedHostPointer(pageable.data_ptr()));
  Tensor pinned = zeros({4}, {.device = Device::CPU(), .pinned = true});
  EXPECT_TRUE(internal::IsPinnedHostPointer(pinned.data<float>() + 3));
}

// Runs `f`, returns the tandem::Error message it throws ("" if none).
TEST_F(PinnedGpuTest, BadCrossEntropyTargetIsRaisedAtTheNextSyncAndTheContextLives) {
  DeviceGuard guard(kGpu);
  manual_seed(5);
  Tensor logits_cpu = randn({4, 5}, {.device = Device::CPU()});
  Tensor logits = logits_cpu.to(kGpu);
  Tensor bad = from_vector(std::vector<int64_t>{0, 7, 2, 4}, {4}, {.device = kGpu});
  Tensor loss;
  ASSERT_NO_THROW(loss = cross_entropy(logits, bad));  // no host sync at the launch
  EXPECT_EQ(ErrorOf([&] { loss.item(); }),
            "cross_entropy: target 7 of sample 1 is out of range [0, 5) on cuda:0");
  // Raised once: the word is clear again, the loss itself is NaN.
  double value = 0;
  ASSERT_NO_THROW(value = loss.item());
  EXPECT_TRUE(std::isnan(value));

  // The context is usable: the same op with good targets matches the CPU.
  Tensor good = from_vector(std::vector<int64_t>{0, 3, 2, 4}, {4}, {.device = Device::CPU()});
  EXPECT_NEAR(cross_entropy(logits, good.to(kGpu)).item(), cross_entropy(logits_cpu, good).item(),
              1e-5);

  // Also raised by Synchronize and by a copy to the host (of an unrelated tensor).
  Tensor negative = from_vector(std::vector<int64_t>{0, 1, 2, -3}, {4}, {.device = kGpu});
  cross_entropy(logits, negative);
  EXPECT_EQ(ErrorOf([] { Synchronize(kGpu); }),
            "cross_entropy: target -3 of sample 3 is out of range [0, 5) on cuda:0");
  EXPECT_NO_THROW(Synchronize(kGpu));
  cross_entropy(logits, negative);
  Tensor other = ones({3}, {.device = kGpu});
  EXPECT_NE(ErrorOf([&] { other.to_vector<float>(); }).find("target -3 of sample 3"),
            std::string::npos);
  EXPECT_EQ(other.to_vector<float>(), (std::vector<float>{1, 1, 1}));

  // Two bad rows: exactly one of them is reported (the first to be seen wins).
  Tensor two = from_vector(std::vector<int64_t>{9, 1, 2, -1}, {4}, {.device = kGpu});
  const std::string message = ErrorOf([&] { cross_entropy(logits, two).item(); });
  EXPECT_TRUE(message == "cross_entropy: target 9 of sample 0 is out of range [0, 5) on cuda:0" ||
              message == "cross_entropy: target -1 of sample 3 is out of range [0, 5) on cuda:0")
      << message;
  EXPECT_NO_THROW(Synchronize(kGpu));

  // Backward through a bad target runs (NaN gradient), and nothing is left pending.
  Tensor x = logits.detach().clone().set_requires_grad(true);
  Tensor l = cross_entropy(x, bad);
  EXPECT_NE(ErrorOf([&] {
              l.backward();
              Synchronize(kGpu);
            }).find("target 7 of sample 1"),
            std::string::npos);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(std::isnan(x.grad().to_vector<float>()[5]));  // row 1, the bad one
  EXPECT_FALSE(std::isnan(x.grad().to_vector<float>()[0]));
}

// A thread reports bad input behind a second of matmuls and ends without a host
// wait (a failed restart attempt's rank). TakeDeviceErrorOfEndedThreads waits
// for the work it left on its stream, returns the report and clears the word:
// the next host wait raises nothing. Without that wait the report, written
// later, would be missed here and raised by the next host wait instead.
// nll_loss reports a bad label as cross_entropy does, with its own message; the
// backward leaves that row zero and the context stays usable.
TEST_F(PinnedGpuTest, BadNllLossTargetIsRaisedAtTheNextSyncAndTheContextLives) {
  DeviceGuard guard(kGpu);
  manual_seed(6);
  Tensor log_probs_cpu = randn({4, 5}, {.device = Device::CPU()});
  Tensor log_probs = log_probs_cpu.to(kGpu);
  Tensor bad = from_vector(std::vector<int64_t>{0, 1, 5, 4}, {4}, {.device = kGpu});
  Tensor loss;
  ASSERT_NO_THROW(loss = nll_loss(log_probs, bad, Reduction::kNone));
  EXPECT_EQ(ErrorOf([&] { loss.to_vector<float>(); }),
            "nll_loss: target 5 of sample 2 is out of range [0, 5) on cuda:0");
  const std::vector<float> per_sample = loss.to_vector<float>();
  EXPECT_TRUE(std::isnan(per_sample[2]));
  EXPECT_EQ(per_sample[0], -log_probs_cpu.to_vector<float>()[0]);
  Tensor good = from_vector(std::vector<int64_t>{0, 3, 2, 4}, {4}, {.device = Device::CPU()});
  EXPECT_NEAR(nll_loss(log_probs, good.to(kGpu)).item(), nll_loss(log_probs_cpu, good).item(),
              1e-6);
}

// With the loss options on CUDA: a label equal to ignore_index is no error (loss
// and gradient 0, out of the mean); any other label out of range, -100 included
// when ignore_index names a class, is the same deferred device error; a weight on
// another device is refused at the call, naming both devices.
TEST_F(PinnedGpuTest, ClassificationLossOptionsOnCudaIgnoreAndReportAsOnTheCpu) {
  DeviceGuard guard(kGpu);
  manual_seed(7);
  Tensor logits_cpu = randn({4, 5}, {.device = Device::CPU()});
  Tensor logits = logits_cpu.to(kGpu);
  Tensor weight_cpu = from_vector(std::vector<float>{1, 2, 3, 4, 5}, {5});
  Tensor y_cpu = from_vector(std::vector<int64_t>{0, -100, 2, 4}, {4});
  const CrossEntropyOptions options{.weight = weight_cpu.to(kGpu), .label_smoothing = 0.1};
  CrossEntropyOptions cpu_options = options;
  cpu_options.weight = weight_cpu;
  EXPECT_NEAR(cross_entropy(logits, y_cpu.to(kGpu), options).item(),
              cross_entropy(logits_cpu, y_cpu, cpu_options).item(), 1e-5);
  EXPECT_NO_THROW(Synchronize(kGpu));
  Tensor loss = cross_entropy(logits, y_cpu.to(kGpu), {.ignore_index = 3});
  EXPECT_EQ(ErrorOf([&] { loss.item(); }),
            "cross_entropy: target -100 of sample 1 is out of range [0, 5) on cuda:0");
  Tensor nll = nll_loss(logits, y_cpu.to(kGpu), {.ignore_index = 3});
  EXPECT_EQ(ErrorOf([&] { nll.item(); }),
            "nll_loss: target -100 of sample 1 is out of range [0, 5) on cuda:0");
  EXPECT_NE(ErrorOf([&] { cross_entropy(logits, y_cpu.to(kGpu), {.weight = weight_cpu}); })
                .find("cross_entropy: weight on cpu but the input on cuda:0"),
            std::string::npos);
}

TEST_F(PinnedGpuTest, ReportLeftByAnEndedThreadIsTakenAfterItsWorkAndCleared) {
  std::string thread_error;
  std::thread rank([&] {
    try {
      DeviceGuard guard(kGpu);
      Tensor logits = ones({4, 5}, {.device = kGpu});
      Tensor bad = from_vector(std::vector<int64_t>{0, 1, 2, 11}, {4}, {.device = kGpu});
      KeepStreamBusy();
      (void)cross_entropy(logits, bad);
    } catch (const std::exception& e) {
      thread_error = e.what();
    }
  });
  rank.join();
  EXPECT_EQ(thread_error, "");
  EXPECT_EQ(internal::TakeDeviceErrorOfEndedThreads(kGpu),
            "cross_entropy: target 11 of sample 3 is out of range [0, 5) on cuda:0");
  EXPECT_EQ(internal::TakeDeviceErrorOfEndedThreads(kGpu), "");
  DeviceGuard guard(kGpu);
  EXPECT_NO_THROW(Synchronize(kGpu));
  EXPECT_EQ(internal::TakeDeviceErrorOfEndedThreads(Device::CPU()), "");
}

// spawn's wait for the work a failed attempt's ended threads left
// (TakeDeviceErrorOfEndedThreads, up to 5 s) held the stream pool's lock, so a
// thread that started on the device (its first stream comes from the pool) or
// ended (its streams go back) meanwhile waited behind it. The ended threads'
// streams are now taken out of the pool for the wait: a thread that starts
// and ends during it is done before the wait is.
TEST_F(PinnedGpuTest, WaitingForEndedThreadsWorkDoesNotHoldUpThreadsThatStartOrEnd) {
  std::thread([] {
    DeviceGuard guard(kGpu);
    KeepStreamBusy();  // left on its stream: about a second of matmuls
  }).join();
  std::atomic<bool> wait_done{false};
  std::thread waiter([&] {
    (void)internal::TakeDeviceErrorOfEndedThreads(kGpu);
    wait_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the waiter is polling
  const bool started_during_wait = !wait_done.load();
  std::thread([] {
    DeviceGuard guard(kGpu);
    Tensor t = zeros({16}, {.device = kGpu});  // the thread's first stream on the device
  }).join();                                     // and its exit, which gives it back
  const bool ended_during_wait = !wait_done.load();
  waiter.join();
  ASSERT_TRUE(started_during_wait) << "the matmuls ended within 100 ms: nothing was waited for";
  EXPECT_TRUE(ended_during_wait) << "a thread that started and ended waited behind the wait";
  DeviceGuard guard(kGpu);
  EXPECT_NO_THROW(Synchronize(kGpu));
}

}  // namespace
}  // namespace tandem::nn
