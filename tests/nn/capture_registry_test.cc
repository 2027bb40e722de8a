// The per-device capture registry of CUDA graphs (nn/internal/capture_registry.h),
// driven with fake streams and events so that its rules are checked without a
// GPU, and under ThreadSanitizer (label tsan_ok): work under one device's lock
// (a replay from another thread) holds up a capture's start on that device and
// not on another; work on a stream being captured is queued for the end of the
// capture, or redirected to the event recorded before it (a storage's free
// with users on several GPUs under all their locks, in one order); releases
// wait for every capture on their devices; the locks are recursive.
#include "nn/internal/capture_registry.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/nn/fake_cuda_handles.h"

namespace tandem::nn::internal {
namespace {

using namespace std::chrono_literals;

using ::tandem::testing::FakeEvent;
using ::tandem::testing::FakeStream;

// `hold(block)` runs on another thread and calls `block` from inside work
// done under some device locks (it blocks until released); meanwhile a capture
// of `captured` begins on `capture_device` on a third thread. Returns whether
// that Begin returned while the work still held its locks.
bool BeginReturnsWhileHeld(CaptureRegistry& registry,
                           const std::function<void(const std::function<void()>&)>& hold,
                           int capture_device, CUstream_st* captured) {
  std::promise<void> holding;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::thread worker([&] {
    hold([&] {
      holding.set_value();
      released.wait();
    });
  });
  holding.get_future().wait();
  std::atomic<bool> begun{false};
  std::thread capture([&] {
    registry.Begin(capture_device, captured, FakeEvent(1));
    begun = true;
  });
  // Long enough for an unblocked Begin to return many times over.
  for (int i = 0; i < 200 && !begun; ++i) std::this_thread::sleep_for(5ms);
  const bool returned_while_held = begun;
  release.set_value();
  worker.join();
  capture.join();
  EXPECT_EQ(registry.captures(capture_device), 1);
  return returned_while_held;
}

// Work under device 0's lock (a replay from another thread) while a capture
// begins on `capture_device`.
bool BeginReturnsWhileDeviceZeroIsHeld(int capture_device) {
  CaptureRegistry registry;
  return BeginReturnsWhileHeld(
      registry,
      [&](const std::function<void()>& block) {
        EXPECT_TRUE(registry.RunUnlessCapturing(0, block));
      },
      capture_device, FakeStream(1));
}

TEST(CaptureRegistryTest, WorkUnderOneDevicesLockDoesNotHoldUpACaptureOnAnother) {
  EXPECT_TRUE(BeginReturnsWhileDeviceZeroIsHeld(1));
}

TEST(CaptureRegistryTest, WorkUnderADevicesLockHoldsUpACaptureOnThatDevice) {
  EXPECT_FALSE(BeginReturnsWhileDeviceZeroIsHeld(0));
}

// The mark is recorded under the device's lock: work another thread queues on
// the stream under that lock (a replay's wait on the capturing stream) comes
// before the mark, which first uses from other streams wait for.
TEST(CaptureRegistryTest, TheMarkIsRecordedAfterWorkUnderTheDevicesLock) {
  CaptureRegistry registry;
  std::promise<void> holding;
  std::promise<void> calling;
  std::atomic<bool> replay_done{false};
  std::thread replay([&] {
    EXPECT_TRUE(registry.RunUnlessCapturing(0, [&] {
      holding.set_value();
      calling.get_future().wait();
      // Long enough for a record made outside the lock to run many times over.
      std::this_thread::sleep_for(100ms);
      replay_done = true;
    }));
  });
  holding.get_future().wait();
  bool recorded_after_replay = false;
  std::thread capture([&] {
    calling.set_value();
    EXPECT_TRUE(registry.Begin(0, FakeStream(0), FakeEvent(0), [&] {
      recorded_after_replay = replay_done.load();
      return true;
    }));
  });
  replay.join();
  capture.join();
  EXPECT_TRUE(recorded_after_replay);
  EXPECT_EQ(registry.captures(0), 1);
  // A record that fails registers nothing.
  EXPECT_FALSE(registry.Begin(1, FakeStream(1), FakeEvent(1), [] { return false; }));
  EXPECT_EQ(registry.captures(1), 0);
}

TEST(CaptureRegistryTest, NothingRunsUnderADevicesLockWhileItCaptures) {
  CaptureRegistry registry;
  registry.Begin(2, FakeStream(0), FakeEvent(0));
  bool ran = false;
  EXPECT_FALSE(registry.RunUnlessCapturing(2, [&] { ran = true; }));
  EXPECT_FALSE(ran);
  EXPECT_TRUE(registry.RunUnlessCapturing(3, [&] { ran = true; }));  // another device
  EXPECT_TRUE(ran);
  EXPECT_TRUE(registry.End(2, FakeStream(0)).empty());
  ran = false;
  EXPECT_TRUE(registry.RunUnlessCapturing(2, [&] { ran = true; }));
  EXPECT_TRUE(ran);
}

// A free on a stream being captured (no users to wait for) is queued for the
// capturing thread, in order; a free on another stream runs at once.
TEST(CaptureRegistryTest, AFreeOnACapturedStreamIsQueuedForTheEndOfItsCaptureInOrder) {
  CaptureRegistry registry;
  registry.Begin(0, FakeStream(0), FakeEvent(0));
  std::vector<int> order;
  bool now_ran = false;
  auto free_on = [&](CUstream_st* owner, auto later) {
    return registry.RunAfterUsersOrQueue(
        0, owner, {}, [](const StreamRef&) { ADD_FAILURE() << "no users"; },
        [](const StreamRef&, CUevent_st*) { ADD_FAILURE() << "no users"; },
        [&] { now_ran = true; }, std::move(later));
  };
  // Another stream of the same device is not captured: at once.
  EXPECT_TRUE(free_on(FakeStream(1), [&] { order.push_back(-1); }));
  EXPECT_TRUE(now_ran);
  now_ran = false;
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(free_on(FakeStream(0), [&order, i] { order.push_back(i); }));
  }
  EXPECT_FALSE(now_ran);
  EXPECT_TRUE(order.empty());
  std::vector<std::function<void()>> after = registry.End(0, FakeStream(0));
  ASSERT_EQ(after.size(), 3u);
  for (auto& fn : after) fn();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  // The capture has ended: at once again, nothing queued.
  EXPECT_TRUE(free_on(FakeStream(0), [] {}));
  EXPECT_TRUE(now_ran);
  EXPECT_TRUE(registry.End(0, FakeStream(0)).empty());
}

TEST(CaptureRegistryTest, AFirstUseOfACapturedStreamsTensorGetsTheEventRecordedBeforeTheCapture) {
  CaptureRegistry registry;
  registry.Begin(0, FakeStream(0), FakeEvent(7));
  registry.Begin(0, FakeStream(1), FakeEvent(8));  // two ranks sharing the GPU capture at once
  CUevent_st* got = nullptr;
  bool now_ran = false;
  registry.RunOrMark(0, FakeStream(1), [&] { now_ran = true; }, [&](CUevent_st* e) { got = e; });
  EXPECT_FALSE(now_ran);
  EXPECT_EQ(got, FakeEvent(8));
  registry.End(0, FakeStream(1));
  got = nullptr;
  registry.RunOrMark(0, FakeStream(1), [&] { now_ran = true; }, [&](CUevent_st* e) { got = e; });
  EXPECT_TRUE(now_ran);
  EXPECT_EQ(got, nullptr);
  EXPECT_EQ(registry.captures(0), 1);
}

TEST(CaptureRegistryTest, AReleaseWaitsForTheLastCaptureOnAnyOfItsDevices) {
  CaptureRegistry registry;
  registry.Begin(0, FakeStream(0), FakeEvent(0));
  registry.Begin(1, FakeStream(1), FakeEvent(1));
  int released = 0;
  EXPECT_FALSE(registry.ReleaseOrDefer({1, 0, 1}, [&] { ++released; }));
  EXPECT_TRUE(registry.ReleaseOrDefer({2}, [&] { released += 10; }));  // no capture on 2
  EXPECT_EQ(released, 10);
  // The capture on 0 ends: device 1 still captures, the release waits again.
  registry.End(0, FakeStream(0));
  std::vector<CaptureRegistry::Release> ready = registry.TakeDeferred();
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].first, (std::vector<int>{0, 1}));
  EXPECT_FALSE(registry.ReleaseOrDefer(ready[0].first, ready[0].second));
  EXPECT_EQ(released, 10);
  registry.End(1, FakeStream(1));
  for (CaptureRegistry::Release& r : registry.TakeDeferred()) {
    EXPECT_TRUE(registry.ReleaseOrDefer(std::move(r.first), std::move(r.second)));
  }
  EXPECT_EQ(released, 11);
  EXPECT_TRUE(registry.TakeDeferred().empty());
}

// A storage's free on its owner after waits for its users
// (RunAfterUsersOrQueue), users of the owner's GPU and of another one (a peer
// copy's destination stream): a user stream being captured, on either GPU, is
// waited for through its capture's mark, never recorded on; the others are
// waited for as they are; then the free.
TEST(CaptureRegistryTest, AFreeWaitsForUsersThatCaptureOnAnyGpuThroughTheirMarks) {
  CaptureRegistry registry;
  registry.Begin(1, FakeStream(5), FakeEvent(5));  // another thread captures on GPU 1
  registry.Begin(0, FakeStream(3), FakeEvent(3));  // and another on the owner's GPU
  std::vector<std::string> order;
  const std::vector<StreamRef> users = {
      {FakeStream(2), 0}, {FakeStream(3), 0}, {FakeStream(5), 1}, {FakeStream(6), 1}};
  auto name = [](const StreamRef& u) {
    for (int i = 0; i < 8; ++i) {
      if (u.stream == FakeStream(i)) return std::to_string(i);
    }
    return std::string("?");
  };
  EXPECT_TRUE(registry.RunAfterUsersOrQueue(
      0, FakeStream(0), users, [&](const StreamRef& u) { order.push_back("wait " + name(u)); },
      [&](const StreamRef& u, CUevent_st* mark) {
        order.push_back("mark " + name(u) + (mark == FakeEvent(u.device == 1 ? 5 : 3) ? "" : "?"));
      },
      [&] { order.push_back("free"); }, [] { ADD_FAILURE() << "the owner does not capture"; }));
  EXPECT_EQ(order, (std::vector<std::string>{"wait 2", "mark 3", "mark 5", "wait 6", "free"}));
  // Users of the owner's GPU only (one lock): the same rules.
  order.clear();
  EXPECT_TRUE(registry.RunAfterUsersOrQueue(
      0, FakeStream(0), {{FakeStream(3), 0}, {FakeStream(2), 0}},
      [&](const StreamRef& u) { order.push_back("wait " + name(u)); },
      [&](const StreamRef& u, CUevent_st* mark) {
        order.push_back("mark " + name(u) + (mark == FakeEvent(3) ? "" : "?"));
      },
      [&] { order.push_back("free"); }, [] { ADD_FAILURE() << "the owner does not capture"; }));
  EXPECT_EQ(order, (std::vector<std::string>{"mark 3", "wait 2", "free"}));
}

// While the owner itself is being captured the whole free (waits included) is
// queued for the capturing thread, which runs it after the capture has ended.
TEST(CaptureRegistryTest, AFreeWhoseOwnerCapturesIsQueuedWithItsWaits) {
  CaptureRegistry registry;
  registry.Begin(0, FakeStream(0), FakeEvent(0));
  int ran = 0;
  bool later = false;
  EXPECT_FALSE(registry.RunAfterUsersOrQueue(
      0, FakeStream(0), {{FakeStream(4), 1}}, [&](const StreamRef&) { ++ran; },
      [&](const StreamRef&, CUevent_st*) { ++ran; }, [&] { ++ran; }, [&] { later = true; }));
  EXPECT_EQ(ran, 0);
  std::vector<std::function<void()>> after = registry.End(0, FakeStream(0));
  ASSERT_EQ(after.size(), 1u);
  after[0]();
  EXPECT_TRUE(later);
}

// The caller's queued free may hold the users the registry reads (nothing is
// copied unless the free is queued): queued, it keeps them whole; run at once,
// every one is waited for.
TEST(CaptureRegistryTest, TheUsersMayLiveInTheQueuedFree) {
  struct Queued {
    std::vector<StreamRef> users;
    std::vector<StreamRef>* seen;
    void operator()() const { *seen = users; }
  };
  CaptureRegistry registry;
  registry.Begin(0, FakeStream(0), FakeEvent(0));
  const std::vector<StreamRef> users = {{FakeStream(1), 0}, {FakeStream(2), 1}};
  std::vector<StreamRef> seen;
  Queued queued{users, &seen};
  const std::vector<StreamRef>& held = queued.users;
  EXPECT_FALSE(registry.RunAfterUsersOrQueue(
      0, FakeStream(0), held, [](const StreamRef&) { ADD_FAILURE() << "the owner captures"; },
      [](const StreamRef&, CUevent_st*) { ADD_FAILURE() << "the owner captures"; },
      [] { ADD_FAILURE() << "the owner captures"; }, std::move(queued)));
  std::vector<std::function<void()>> after = registry.End(0, FakeStream(0));
  ASSERT_EQ(after.size(), 1u);
  after[0]();
  EXPECT_EQ(seen, users);
  // The capture has ended: the same free runs at once and waits for each user.
  Queued again{users, &seen};
  std::vector<StreamRef> waited;
  EXPECT_TRUE(registry.RunAfterUsersOrQueue(
      0, FakeStream(0), again.users, [&](const StreamRef& u) { waited.push_back(u); },
      [](const StreamRef&, CUevent_st*) { ADD_FAILURE() << "no user captures"; }, [] {},
      std::move(again)));
  EXPECT_EQ(waited, users);
}

// Whether a capture of `captured` (a stream of `capture_device`) began while
// a free on `owner` (of `device`) with the one user `user` was waiting for
// that user (after the free's checks, before its record and its free).
bool CaptureBeganDuringTheFreesWait(int device, CUstream_st* owner, StreamRef user,
                                    int capture_device, CUstream_st* captured) {
  CaptureRegistry registry;
  return BeginReturnsWhileHeld(
      registry,
      [&](const std::function<void()>& block) {
        EXPECT_TRUE(registry.RunAfterUsersOrQueue(
            device, owner, {user}, [&](const StreamRef&) { block(); },
            [](const StreamRef&, CUevent_st*) { ADD_FAILURE() << "no capture yet"; }, [] {},
            [] { ADD_FAILURE() << "the owner does not capture"; }));
      },
      capture_device, captured);
}

// The wait recorded on a user stream of another GPU is made under that GPU's
// lock: a capture cannot begin there between the check and the record (the
// record would join the owner to it).
TEST(CaptureRegistryTest, AFreeHoldsTheLockOfItsUsersGpuWhileWaitingForIt) {
  EXPECT_FALSE(CaptureBeganDuringTheFreesWait(0, FakeStream(0), {FakeStream(1), 1}, 1,
                                              FakeStream(1)))
      << "a capture began on the user's GPU while its wait was recorded";
}

// With users of other GPUs only, the owner's GPU is locked too: a capture of
// the owner cannot begin between the check that found none and the free on it
// (which would then be recorded in that capture).
TEST(CaptureRegistryTest, AFreeWithUsersOnlyOnAnotherGpuHoldsTheOwnersLockToo) {
  EXPECT_FALSE(CaptureBeganDuringTheFreesWait(1, FakeStream(0), {FakeStream(1), 0}, 1,
                                              FakeStream(0)))
      << "a capture of the owner began while its free was under way";
}

// Frees on two GPUs, each with a user on the other, racing with captures of
// those users: the locks are taken in one order (no deadlock; ThreadSanitizer
// reports an inversion), and a captured user is only ever waited for through
// its mark.
TEST(CaptureRegistryTest, FreesWithUsersOnEachOthersGpuRacingWithCapturesTakeLocksInOrder) {
  CaptureRegistry registry;
  std::atomic<int> capturing[2] = {0, 0};
  std::atomic<int> recorded_on_capture{0};
  std::atomic<int> frees{0};
  std::vector<std::thread> threads;
  for (int d = 0; d < 2; ++d) {
    threads.emplace_back([&, d] {  // captures of the user streams FakeStream(10 + d)
      for (int i = 0; i < 200; ++i) {
        registry.Begin(d, FakeStream(10 + d), FakeEvent(d));
        capturing[d].fetch_add(1);
        std::this_thread::yield();
        capturing[d].fetch_sub(1);
        for (auto& fn : registry.End(d, FakeStream(10 + d))) fn();
      }
    });
    threads.emplace_back([&, d] {  // frees owned by GPU d, used on the other GPU
      const int other = 1 - d;
      for (int i = 0; i < 400; ++i) {
        registry.RunAfterUsersOrQueue(
            d, FakeStream(d), {{FakeStream(10 + other), other}},
            [&](const StreamRef& u) {
              if (capturing[u.device].load() > 0) recorded_on_capture.fetch_add(1);
            },
            [](const StreamRef&, CUevent_st*) {}, [&] { frees.fetch_add(1); },
            [] { ADD_FAILURE() << "the owners never capture"; });
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(frees.load(), 800);
  EXPECT_EQ(recorded_on_capture.load(), 0);
}

// A replay's pre-replay hook, under the device's lock, may reach a tensor's
// first use on that device (its lock again): no deadlock.
TEST(CaptureRegistryTest, TheLocksAreRecursive) {
  CaptureRegistry registry;
  bool inner = false;
  EXPECT_TRUE(registry.RunUnlessCapturing(0, [&] {
    registry.RunOrMark(0, FakeStream(3), [&] {
      EXPECT_TRUE(registry.ReleaseOrDefer({0}, [&] { inner = true; }));
    }, [](CUevent_st*) { ADD_FAILURE() << "no capture runs"; });
  }));
  EXPECT_TRUE(inner);
}

// Releases racing with captures on two devices: every release runs exactly
// once, never while one of its devices captures (under ThreadSanitizer too).
TEST(CaptureRegistryTest, ReleasesRacingWithCapturesRunOnceAndNeverDuringACapture) {
  CaptureRegistry registry;
  std::atomic<int> capturing[2] = {0, 0};
  std::atomic<int> released{0};
  std::atomic<int> during_capture{0};
  constexpr int kReleases = 400;
  std::vector<std::thread> threads;
  for (int d = 0; d < 2; ++d) {
    threads.emplace_back([&, d] {
      for (int i = 0; i < 200; ++i) {
        registry.Begin(d, FakeStream(d), FakeEvent(d));
        capturing[d].fetch_add(1);
        std::this_thread::yield();
        capturing[d].fetch_sub(1);
        for (auto& fn : registry.End(d, FakeStream(d))) fn();
        for (CaptureRegistry::Release& r : registry.TakeDeferred()) {
          registry.ReleaseOrDefer(std::move(r.first), std::move(r.second));
        }
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < kReleases; ++i) {
      const int a = i % 2, b = (i / 2) % 2;
      registry.ReleaseOrDefer({a, b}, [&, a, b] {
        if (capturing[a].load() + capturing[b].load() > 0) during_capture.fetch_add(1);
        released.fetch_add(1);
      });
    }
  });
  for (std::thread& t : threads) t.join();
  for (CaptureRegistry::Release& r : registry.TakeDeferred()) {
    EXPECT_TRUE(registry.ReleaseOrDefer(std::move(r.first), std::move(r.second)));
  }
  EXPECT_EQ(released.load(), kReleases);
  EXPECT_EQ(during_capture.load(), 0);
}

}  // namespace
}  // namespace tandem::nn::internal
