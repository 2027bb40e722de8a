// The pool of spare CUDA streams (nn/internal/spare_streams.h), with fake
// streams, also under ThreadSanitizer (label tsan_ok): a borrow takes every
// spare stream of its device out of the pool without holding the pool's lock
// while it is held (threads that start or end meanwhile take and give streams
// at once, and never get a borrowed one), and gives them back when it ends.
#include "nn/internal/spare_streams.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <utility>
#include <vector>

#include "tests/nn/fake_cuda_handles.h"

namespace tandem::nn::internal {
namespace {

using namespace std::chrono_literals;

using ::tandem::testing::FakeStream;

TEST(SpareStreamsTest, TakeGivesTheLastStreamGivenBackOfItsDevice) {
  SpareStreams pool;
  EXPECT_EQ(pool.Take(0), nullptr);
  pool.Give(0, FakeStream(1));
  pool.Give(0, FakeStream(2));
  pool.Give(1, FakeStream(3));
  EXPECT_EQ(pool.Take(0), FakeStream(2));
  EXPECT_EQ(pool.Take(0), FakeStream(1));
  EXPECT_EQ(pool.Take(0), nullptr);
  EXPECT_EQ(pool.Take(1), FakeStream(3));
}

// A borrow held across a long wait (spawn's wait for a failed attempt's work,
// up to 5 s) while another thread takes and gives streams of the same device:
// that thread is not held up (it finishes while the borrow is still held),
// never receives a borrowed stream, and the borrowed streams come back after.
TEST(SpareStreamsTest, ABorrowHeldDoesNotBlockOtherThreadsNorLendsItsStreams) {
  SpareStreams pool;
  pool.Give(0, FakeStream(1));
  pool.Give(0, FakeStream(2));
  pool.Give(1, FakeStream(5));
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> borrowed_promise;
  std::future<void> borrowed = borrowed_promise.get_future();
  std::vector<CUstream_st*> lent;
  std::thread waiter([&] {
    SpareStreams::Borrowed ended = pool.Borrow(0);
    lent = ended.streams();
    borrowed_promise.set_value();
    released.wait();  // the long wait, holding the borrow
  });
  borrowed.wait();
  EXPECT_EQ(lent, (std::vector<CUstream_st*>{FakeStream(1), FakeStream(2)}));

  // Another thread starts (takes), ends (gives back) and starts again.
  std::atomic<bool> other_done{false};
  CUstream_st* first_take = FakeStream(0);
  CUstream_st* second_take = nullptr;
  CUstream_st* other_device = nullptr;
  std::thread other([&] {
    first_take = pool.Take(0);  // none spare: the thread would make a new stream
    pool.Give(0, FakeStream(3));
    second_take = pool.Take(0);
    other_device = pool.Take(1);
    other_done = true;
  });
  const auto start = std::chrono::steady_clock::now();
  while (!other_done && std::chrono::steady_clock::now() - start < 10s) {
    std::this_thread::sleep_for(1ms);
  }
  const bool done_while_borrowed = other_done.load();
  EXPECT_TRUE(done_while_borrowed) << "Take / Give waited behind a borrow";
  if (!done_while_borrowed) {
    release.set_value();  // end the borrow so that the test ends
    other.join();
    waiter.join();
    return;
  }
  other.join();
  EXPECT_EQ(first_take, nullptr);
  EXPECT_EQ(second_take, FakeStream(3));
  EXPECT_EQ(other_device, FakeStream(5));
  EXPECT_EQ(pool.Count(0), 0u);

  pool.Give(0, FakeStream(4));  // given while the borrow is held
  release.set_value();
  waiter.join();
  EXPECT_EQ(pool.Count(0), 3u);
  std::vector<CUstream_st*> back;
  while (CUstream_st* s = pool.Take(0)) back.push_back(s);
  // The stream given meanwhile first, then the borrowed ones.
  EXPECT_EQ(back, (std::vector<CUstream_st*>{FakeStream(4), FakeStream(2), FakeStream(1)}));
}

TEST(SpareStreamsTest, BorrowingADeviceWithoutSparesLendsNothing) {
  SpareStreams pool;
  pool.Give(1, FakeStream(1));
  {
    SpareStreams::Borrowed none = pool.Borrow(0);
    EXPECT_TRUE(none.streams().empty());
  }
  EXPECT_EQ(pool.Count(0), 0u);
  EXPECT_EQ(pool.Count(1), 1u);
}

// Moved from, a borrow gives back nothing twice.
TEST(SpareStreamsTest, AMovedBorrowGivesItsStreamsBackOnce) {
  SpareStreams pool;
  pool.Give(0, FakeStream(1));
  {
    SpareStreams::Borrowed first = pool.Borrow(0);
    SpareStreams::Borrowed second(std::move(first));
    EXPECT_EQ(second.streams().size(), 1u);
  }
  EXPECT_EQ(pool.Count(0), 1u);
}

}  // namespace
}  // namespace tandem::nn::internal
