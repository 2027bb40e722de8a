// The least-recently-used map behind the per-thread oneDNN primitive caches
// (nn/ops/internal/lru_cache.h): what it keeps, what it drops, that a value held
// outside lives on after it is dropped, and a `make` that throws; and the
// process-wide capacity (nn/ops/matmul.h) read by threads while another sets it.
#include "nn/ops/internal/lru_cache.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "nn/error.h"
#include "nn/ops/internal/matmul_kernels.h"  // CpuPrimitiveCacheCapacityFromEnvironment
#include "nn/ops/matmul.h"                   // cpu_primitive_cache_capacity

namespace tandem::nn::ops::internal {
namespace {

// Counts the values made and destroyed.
struct Counted {
  int key = 0;
  int* destroyed = nullptr;
  Counted(int k, int* d) : key(k), destroyed(d) {}
  Counted(Counted&& other) noexcept : key(other.key), destroyed(other.destroyed) {
    other.destroyed = nullptr;
  }
  Counted(const Counted&) = delete;
  Counted& operator=(const Counted&) = delete;
  Counted& operator=(Counted&&) = delete;
  ~Counted() {
    if (destroyed != nullptr) ++*destroyed;
  }
};

class LruCacheTest : public ::testing::Test {
 protected:
  // The value for `key`, made (and counted in made_) on a miss.
  const Counted& Get(int key) {
    return *cache_.Get(key, [this] { return capacity_; }, [&] {
      made_.push_back(key);
      return Counted(key, &destroyed_);
    });
  }

  LruCache<int, Counted> cache_;
  int64_t capacity_ = 2;
  std::vector<int> made_;
  int destroyed_ = 0;
};

TEST_F(LruCacheTest, DropsTheLeastRecentlyUsedPastTheCapacity) {
  EXPECT_EQ(Get(1).key, 1);
  EXPECT_EQ(Get(2).key, 2);
  EXPECT_EQ(Get(1).key, 1);  // a hit: 1 is now the most recently used
  EXPECT_EQ(made_, (std::vector<int>{1, 2}));
  EXPECT_EQ(Get(3).key, 3);  // drops 2, not 1
  EXPECT_EQ(cache_.size(), 2u);
  EXPECT_EQ(destroyed_, 1);
  EXPECT_EQ(Get(1).key, 1);  // still there
  EXPECT_EQ(Get(2).key, 2);  // made again; drops 3
  EXPECT_EQ(made_, (std::vector<int>{1, 2, 3, 2}));
  EXPECT_EQ(Get(1).key, 1);
  EXPECT_EQ(made_.size(), 4u);
  EXPECT_EQ(cache_.size(), 2u);
}

TEST_F(LruCacheTest, ACapacityOfOneKeepsTheLastKey) {
  capacity_ = 1;
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(Get(1).key, 1);
    EXPECT_EQ(Get(1).key, 1);  // a hit
    EXPECT_EQ(Get(2).key, 2);
    EXPECT_EQ(cache_.size(), 1u);
  }
  EXPECT_EQ(made_, (std::vector<int>{1, 2, 1, 2, 1, 2}));
  EXPECT_EQ(destroyed_, 5);
}

TEST_F(LruCacheTest, AValueHeldOutsideOutlivesItsEviction) {
  capacity_ = 1;
  const std::shared_ptr<Counted> held = cache_.Get(1, [] { return 1; }, [&] {
    return Counted(1, &destroyed_);
  });
  Get(2);  // drops 1 from the cache
  EXPECT_EQ(cache_.size(), 1u);
  EXPECT_EQ(destroyed_, 0);
  EXPECT_EQ(held->key, 1);
  EXPECT_EQ(held.use_count(), 1);  // only ours
}

TEST_F(LruCacheTest, ASmallerCapacityShrinksTheCacheAtTheNextMiss) {
  capacity_ = 4;
  for (int key = 0; key < 4; ++key) Get(key);
  capacity_ = 2;
  Get(0);  // a hit reads no capacity
  EXPECT_EQ(cache_.size(), 4u);
  Get(9);  // a miss: keeps 0 (the most recent) and 9
  EXPECT_EQ(cache_.size(), 2u);
  Get(0);
  Get(9);
  EXPECT_EQ(made_, (std::vector<int>{0, 1, 2, 3, 9}));
}

TEST_F(LruCacheTest, AMakeThatThrowsLeavesTheCacheAsItWas) {
  Get(1);
  Get(2);
  EXPECT_THROW(cache_.Get(3, [] { return 2; },
                          []() -> Counted { throw std::runtime_error("no primitive"); }),
               std::runtime_error);
  EXPECT_EQ(cache_.size(), 2u);
  EXPECT_EQ(destroyed_, 0);
  Get(1);
  Get(2);
  EXPECT_EQ(made_, (std::vector<int>{1, 2}));  // both still there
}

TEST_F(LruCacheTest, ACapacityBelowOneIsAnErrorNamingIt) {
  capacity_ = 0;
  try {
    Get(1);
    ADD_FAILURE() << "capacity 0 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache_.size(), 0u);
}

// The process-wide capacity as the oneDNN caches read it: threads missing in
// their own caches (the first of them reading the environment, as nothing in
// this process has read the capacity before) while another thread sets it.
// Under ThreadSanitizer (label tsan_ok) a capacity read or written without
// synchronisation is a reported race; each cache then keeps the last capacity
// set at its next miss.
TEST(LruCacheCapacityTest, ThreadsReadTheCapacityWhileAnotherSetsIt) {
  constexpr int kThreads = 4;
  constexpr int kGets = 2000;
  std::atomic<bool> last_set{false};
  std::vector<size_t> after_last(kThreads, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      LruCache<int, int> cache;
      for (int k = 0; k < kGets; ++k) {
        cache.Get(k % 10, cpu_primitive_cache_capacity, [k] { return k; });
      }
      while (!last_set.load(std::memory_order_acquire)) std::this_thread::yield();
      cache.Get(-1, cpu_primitive_cache_capacity, [] { return -1; });  // a miss
      after_last[i] = cache.size();
    });
  }
  for (int k = 0; k < 200; ++k) set_cpu_primitive_cache_capacity(k % 2 == 0 ? 6 : 2);
  set_cpu_primitive_cache_capacity(3);
  last_set.store(true, std::memory_order_release);
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_GE(after_last[i], 1u) << "thread " << i;
    EXPECT_LE(after_last[i], 3u) << "thread " << i;
  }
  set_cpu_primitive_cache_capacity(CpuPrimitiveCacheCapacityFromEnvironment());
}

}  // namespace
}  // namespace tandem::nn::ops::internal
