// The process's spare CUDA streams, per device: the streams that ended threads
// gave back (nn/cuda/runtime.cc, ThreadStream), which the next thread that
// needs a stream on that device takes. Plain pointers and no CUDA header, so
// the rules are tested on the CPU with fake streams
// (tests/nn/spare_streams_test.cc). Internal to nn.
//
// Borrow: spawn, before a restart, waits (up to seconds) for the work that a
// failed attempt's ended threads left on their streams
// (TakeDeviceErrorOfEndedThreads). No thread may take one of those streams
// meanwhile (it could begin a capture on it, and a query of a capturing stream
// is refused and invalidates the capture), but the wait must not hold the
// pool's lock either: every thread that starts or ends (Take, Give) would
// block behind it. Borrow takes a device's spares out of the pool under the
// lock and gives them back when the Borrowed is destroyed; meanwhile Take
// does not see them (a thread then makes a new stream) and Give adds to the
// pool as usual.
//
// Thread-safe.
#ifndef TANDEM_NN_INTERNAL_SPARE_STREAMS_H_
#define TANDEM_NN_INTERNAL_SPARE_STREAMS_H_

#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace tandem::nn::internal {

class SpareStreams {
 public:
  // A device's spare streams, out of the pool until this is destroyed.
  class Borrowed {
   public:
    Borrowed(SpareStreams* pool, int device, std::vector<CUstream_st*> streams)
        : pool_(pool), device_(device), streams_(std::move(streams)) {}
    ~Borrowed() {
      if (pool_ == nullptr || streams_.empty()) return;
      try {
        pool_->GiveAll(device_, std::move(streams_));
      } catch (...) {  // out of host memory: the streams are leaked, never reused
      }
    }
    Borrowed(Borrowed&& other) noexcept
        : pool_(std::exchange(other.pool_, nullptr)),
          device_(other.device_),
          streams_(std::move(other.streams_)) {}
    Borrowed(const Borrowed&) = delete;
    Borrowed& operator=(const Borrowed&) = delete;
    Borrowed& operator=(Borrowed&&) = delete;

    const std::vector<CUstream_st*>& streams() const { return streams_; }

   private:
    SpareStreams* pool_;
    int device_;
    std::vector<CUstream_st*> streams_;
  };

  // A spare stream of `device` (the one given back last), or null when none is
  // in the pool.
  CUstream_st* Take(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = spare_.find(device);
    if (it == spare_.end() || it->second.empty()) return nullptr;
    CUstream_st* stream = it->second.back();
    it->second.pop_back();
    return stream;
  }

  // `stream` of `device` is spare again (its thread ended).
  void Give(int device, CUstream_st* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    spare_[device].push_back(stream);
  }

  // Every spare stream of `device`, out of the pool until the result is
  // destroyed; then back in it, where Take reaches them after the streams given
  // meanwhile.
  Borrowed Borrow(int device) {
    std::vector<CUstream_st*> streams;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = spare_.find(device);
      if (it != spare_.end()) streams.swap(it->second);
    }
    return Borrowed(this, device, std::move(streams));
  }

  // Spare streams of `device` in the pool now (tests).
  size_t Count(int device) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = spare_.find(device);
    return it == spare_.end() ? 0 : it->second.size();
  }

 private:
  void GiveAll(int device, std::vector<CUstream_st*> streams) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<CUstream_st*>& spare = spare_[device];
    spare.insert(spare.begin(), streams.begin(), streams.end());
  }

  mutable std::mutex mu_;
  std::unordered_map<int, std::vector<CUstream_st*>> spare_;  // by ordinal; guarded by mu_
};

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_SPARE_STREAMS_H_
