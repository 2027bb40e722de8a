// The stream bookkeeping of CUDA storages (nn/internal/stream_uses.h), driven
// with fake stream pointers so that the rules are checked without a GPU, and
// under ThreadSanitizer (label tsan_ok): a use from a stream other than the
// owner waits once and is recorded; the owner never waits on itself; the free
// takes every recorded stream exactly once.
#include "nn/internal/stream_uses.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "nn/tensor.h"
#include "tests/nn/fake_cuda_handles.h"

namespace tandem::nn::internal {
namespace {

using ::tandem::testing::FakeStream;

TEST(StreamUsesTest, OwnerNeverWaitsAndIsNeverAUser) {
  StreamUses uses({FakeStream(0), 3});
  EXPECT_TRUE(uses.has_owner());
  EXPECT_EQ(uses.owner(), (StreamRef{FakeStream(0), 3}));
  EXPECT_FALSE(uses.NeedsWait(FakeStream(0)));
  uses.AddUser({FakeStream(0), 3});
  EXPECT_TRUE(uses.TakeUsers().empty());
}

TEST(StreamUsesTest, AnotherStreamWaitsOnceThenIsRecordedForTheFree) {
  StreamUses uses({FakeStream(0), 0});
  EXPECT_TRUE(uses.NeedsWait(FakeStream(1)));
  uses.AddUser({FakeStream(1), 0});
  EXPECT_FALSE(uses.NeedsWait(FakeStream(1)));  // waited once already
  EXPECT_TRUE(uses.NeedsWait(FakeStream(2)));   // another stream still must
  uses.AddUser({FakeStream(2), 1});             // a peer copy's stream on GPU 1
  uses.AddUser({FakeStream(1), 0});             // recorded twice, kept once
  EXPECT_EQ(uses.TakeUsers(), (std::vector<StreamRef>{{FakeStream(1), 0}, {FakeStream(2), 1}}));
  EXPECT_TRUE(uses.TakeUsers().empty());  // taken: the list is left empty
}

TEST(StreamUsesTest, HostMemoryHasNoOwner) {
  StreamUses uses;
  EXPECT_FALSE(uses.has_owner());
  uses.AddUser({nullptr, 0});  // no stream: ignored
  EXPECT_TRUE(uses.TakeUsers().empty());
}

// Several threads, each with its own stream, use one storage at once (as ranks
// gathering from one DeviceDataset do): each waits exactly once, and the free
// sees every stream once.
TEST(StreamUsesTest, ConcurrentUsersFromManyThreadsAreEachRecordedOnce) {
  constexpr int kThreads = 8;
  constexpr int kUsesPerThread = 200;
  StreamUses uses({FakeStream(0), 0});
  std::vector<int> waits(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      CUstream_st* mine = FakeStream(t + 1);
      for (int k = 0; k < kUsesPerThread; ++k) {
        if (uses.NeedsWait(mine)) {
          ++waits[t];
          uses.AddUser({mine, 0});
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(waits[t], 1) << "thread " << t;
  std::vector<StreamRef> users = uses.TakeUsers();
  ASSERT_EQ(users.size(), static_cast<size_t>(kThreads));
  for (int t = 1; t <= kThreads; ++t) {
    EXPECT_NE(std::find(users.begin(), users.end(), StreamRef{FakeStream(t), 0}), users.end())
        << "stream " << t << " missing";
  }
}

// Host storages (the CPU build, and pinned or pageable memory in a CUDA build)
// have no owning stream, so data_ptr() never takes the CUDA path.
TEST(StreamUsesTest, HostStoragesHaveNoStream) {
  Tensor t = zeros({4}, {.device = Device::CPU()});
  EXPECT_EQ(t.storage()->stream(), nullptr);
  t.storage()->RecordStream(FakeStream(1), Device::CUDA(0));  // host memory: nothing to order
  EXPECT_NE(t.data_ptr(), nullptr);
  EXPECT_THROW(t.storage()->RecordStream(FakeStream(1), Device::CPU()), Error);
}

}  // namespace
}  // namespace tandem::nn::internal
