// A least-recently-used map of one thread's cached kernel state by key (the
// oneDNN primitives of conv_dnnl.cc, pool_dnnl.cc and matmul_dnnl.cc, one per
// shape): bounded, so that a program with ever new shapes (variable batch
// tails, many image sizes, a sweep) does not grow without bound.
// Internal to nn.
//
// Threads: none of its own and no lock; one thread's object (a thread_local),
// not to be shared between threads.
// Lifetime: a value is held by shared_ptr, so one taken out with a copy of
// Get's pointer (a call that runs several cached primitives, a later Get of
// which may evict an earlier one) lives on after eviction until that copy goes.
#ifndef TANDEM_NN_OPS_INTERNAL_LRU_CACHE_H_
#define TANDEM_NN_OPS_INTERNAL_LRU_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <utility>

#include "nn/error.h"

namespace tandem::nn::ops::internal {

// Key: ordered by operator<. Value: anything; made by Get's `make` on a miss.
template <typename Key, typename Value>
class LruCache {
 public:
  LruCache() = default;
  LruCache(const LruCache&) = delete;
  LruCache& operator=(const LruCache&) = delete;

  // The value for `key`, now the most recently used. On a miss, keeps
  // `make()`'s Value, dropping least recently used values first so that at
  // most `capacity()` remain (>= 1; called on misses only, so the hit path
  // reads no setting). The reference is valid until the next Get on this
  // cache; copy the pointer to keep the value past it. A `make` that throws
  // leaves the cache as it was.
  template <typename Capacity, typename Make>
  const std::shared_ptr<Value>& Get(const Key& key, Capacity&& capacity, Make&& make) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      // The list node moves to the front; no allocation, no copy.
      if (it->second.position != order_.begin()) {
        order_.splice(order_.begin(), order_, it->second.position);
      }
      return it->second.value;
    }
    auto value = std::make_shared<Value>(make());
    const int64_t keep = capacity();
    TANDEM_CHECK(keep >= 1, "LruCache: capacity ", keep, "; need at least 1");
    while (static_cast<int64_t>(index_.size()) >= keep) {
      index_.erase(*order_.back());
      order_.pop_back();
    }
    it = index_.emplace(key, Node{std::move(value), {}}).first;
    try {
      order_.push_front(&it->first);
    } catch (...) {
      index_.erase(it);
      throw;
    }
    it->second.position = order_.begin();
    return it->second.value;
  }

  // How many values it holds.
  size_t size() const { return index_.size(); }

 private:
  // Most recently used first: the keys of index_'s nodes (which do not move).
  using Order = std::list<const Key*>;
  struct Node {
    std::shared_ptr<Value> value;
    typename Order::iterator position;
  };

  std::map<Key, Node> index_;
  Order order_;
};

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_LRU_CACHE_H_
