// Stream bookkeeping of a CUDA storage (Storage in nn/tensor.h): the stream that
// owns its memory (allocated it: the allocating thread's stream) and the other
// streams that have used it, as PyTorch's recordStream keeps them. Plain
// pointers and no CUDA header, so the rules are tested on the CPU with fake
// streams (tests/nn/stream_uses_test.cc). Internal to nn; installed with the
// public headers only because nn/tensor.h holds one by value.
//
// The rules (carried out by nn/tensor.cc with nn/cuda/runtime.cc):
//  - a use from a stream that is neither the owner nor already a user first
//    makes that stream wait for the work enqueued on the owner so far (the
//    kernels that produced the data), then joins the users: NeedsWait / AddUser;
//  - the free runs on the owner after it has waited for every user: TakeUsers.
#ifndef TANDEM_NN_INTERNAL_STREAM_USES_H_
#define TANDEM_NN_INTERNAL_STREAM_USES_H_

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace tandem::nn::internal {

// A stream and the CUDA ordinal it belongs to.
struct StreamRef {
  CUstream_st* stream = nullptr;
  int device = 0;
  friend bool operator==(const StreamRef&, const StreamRef&) = default;
};

// Thread-safe: NeedsWait and AddUser may be called from several threads at once
// (each with its own stream); owner() is fixed at construction.
class StreamUses {
 public:
  explicit StreamUses(StreamRef owner = {}) : owner_(owner) {}
  StreamUses(const StreamUses&) = delete;
  StreamUses& operator=(const StreamUses&) = delete;

  const StreamRef& owner() const { return owner_; }
  bool has_owner() const { return owner_.stream != nullptr; }

  // True when a use on `stream` must first wait for the owner: it is not the
  // owner and has not been added as a user. Only the thread whose stream it is
  // asks for it, so a stream is never added twice by a race.
  bool NeedsWait(CUstream_st* stream) const {
    if (stream == owner_.stream) return false;
    std::lock_guard<std::mutex> lock(mu_);
    return std::find_if(users_.begin(), users_.end(),
                        [&](const StreamRef& u) { return u.stream == stream; }) == users_.end();
  }

  // Records `user` (not the owner) as a stream the free must wait for. Adding
  // one twice keeps one entry.
  void AddUser(StreamRef user) {
    if (user.stream == owner_.stream || user.stream == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(users_.begin(), users_.end(), user) == users_.end()) users_.push_back(user);
    any_users_.store(true, std::memory_order_release);
  }

  // The users so far, in the order they were added; the list is left empty.
  // Takes no lock when there has never been one (the free of a storage used
  // only by its owner, the common case).
  std::vector<StreamRef> TakeUsers() {
    std::vector<StreamRef> users;
    if (!any_users_.load(std::memory_order_acquire)) return users;
    std::lock_guard<std::mutex> lock(mu_);
    users.swap(users_);
    return users;
  }

 private:
  const StreamRef owner_;
  mutable std::mutex mu_;
  std::vector<StreamRef> users_;  // guarded by mu_
  std::atomic<bool> any_users_{false};  // set once users_ has had an entry
};

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_STREAM_USES_H_
