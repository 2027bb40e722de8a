// Test-only: a communicator whose all-reduces run asynchronously, the way NCCL's
// do on a GPU, so spawn's shutdown and the Work lifetime rules can be tested on
// the CPU (tests/spawn/shutdown_test.cc).
//
// - all_reduce / all_reduce_async (float32): the rank enqueues the collective and
//   returns; a helper thread (the "device") completes collective n once every
//   rank has entered it, after `delay`, unless the group is held (Hold/Release).
//   A collective that some rank never enters never completes: only Abort ends
//   it, as ncclCommAbort ends a kernel waiting for a peer that never came.
// - The device keeps only the tensor's data pointer, as NCCL does; the Work
//   (Communicator's wrapper) must keep the storage alive. A completion finding
//   its storage freed is counted (completions_on_freed_storage), not written.
// - Host waits: Work::wait() polls through nn::internal::WaitUntil, so it is
//   stop-aware on a rank thread, like item(). BlockingDeviceSync() is not: it
//   models an implicit device sync (cudnnDestroy at thread exit) that only the
//   completion or the abort of every enqueued collective ends.
// - Abort runs under an AbortGuard, like NcclCommunicator's: it "frees" a
//   handle that every use dereferences under the guard (TSan sees a race if the
//   guard does not serialise them) and counts uses that overlap an abort.
//   Seams: a library call that does not return (StallNextCall), an asynchronous
//   library error (FailAsynchronouslyAfter).
// - Other collectives (broadcast, all_gather, ...) and non-float32 all-reduces
//   go to an in-process communicator over the same ranks.
#ifndef TANDEM_TESTS_SPAWN_FAKE_ASYNC_COMMUNICATOR_H_
#define TANDEM_TESTS_SPAWN_FAKE_ASYNC_COMMUNICATOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nn/interrupt.h"
#include "nn/tensor.h"
#include "spawn/comm/communicator.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"
#include "spawn/comm/internal/abort_guard.h"

namespace tandem::dist::testing {

// One collective of one rank, as the "device" sees it.
struct FakeOp {
  uint64_t sequence = 0;
  float* data = nullptr;  // what the device reads and writes
  int64_t numel = 0;
  ReduceOp op = ReduceOp::kSum;
  std::weak_ptr<nn::Storage> storage;  // only to detect use after free
  std::atomic<bool> done{false};
  std::atomic<bool> aborted{false};
  bool finished() const { return done.load(std::memory_order_acquire) || aborted.load(std::memory_order_acquire); }
};

class FakeGroup {
 public:
  explicit FakeGroup(int world_size, std::chrono::milliseconds delay = std::chrono::milliseconds(0))
      : world_size_(world_size), delay_(delay),
        inprocess_(std::make_shared<InProcessGroup>(world_size)),
        abort_calls_(world_size), overlapping_uses_(world_size),
        device_([this] { RunDevice(); }) {}
  ~FakeGroup() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutting_down_ = true;
    }
    cv_.notify_all();
    device_.join();
  }

  int world_size() const { return world_size_; }
  const std::shared_ptr<InProcessGroup>& inprocess() const { return inprocess_; }

  // While held, the device completes nothing.
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }
  // Written into every element of a completed collective instead of the
  // reduction, when set (a marker that shows when the device wrote).
  void SetCompletionValue(float value) {
    std::lock_guard<std::mutex> lock(mu_);
    completion_value_ = value;
    use_completion_value_ = true;
  }

  void Enqueue(int rank, std::shared_ptr<FakeOp> op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& entered = entered_[op->sequence];
      entered.resize(world_size_);
      entered[rank] = std::move(op);
    }
    cv_.notify_all();
  }

  // Wakes the device and every waiter after an abort.
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);  // a waiter between its check and its wait is not missed
    cv_.notify_all();
  }

  // Blocks (not stop-aware) until `op` is done or aborted, or `limit` passed;
  // returns whether it finished.
  bool BlockUntilFinished(const FakeOp& op, std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return op.finished(); });
  }

  int completions_on_freed_storage() const { return freed_completions_.load(); }
  // Per rank, kept here (the group outlives spawn's communicators): Abort()
  // calls, and uses of a communicator that overlapped its abort.
  int abort_calls(int rank) const { return abort_calls_[rank].load(); }
  int overlapping_uses(int rank) const { return overlapping_uses_[rank].load(); }
  void CountAbort(int rank) { abort_calls_[rank].fetch_add(1); }
  void CountOverlappingUse(int rank) { overlapping_uses_[rank].fetch_add(1); }
  int completed() const { return completed_.load(); }

 private:
  void RunDevice() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return shutting_down_ || (!held_ && ReadyLocked()); });
      if (shutting_down_) return;
      auto it = entered_.begin();
      std::vector<std::shared_ptr<FakeOp>> ops = std::move(it->second);
      entered_.erase(it);
      lock.unlock();
      if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
      Complete(ops);
      lock.lock();
      cv_.notify_all();
    }
  }

  // The lowest-numbered collective has every rank (collectives complete in order).
  bool ReadyLocked() const {
    if (entered_.empty()) return false;
    for (const auto& op : entered_.begin()->second) {
      if (op == nullptr) return false;
    }
    return true;
  }

  void Complete(const std::vector<std::shared_ptr<FakeOp>>& ops) {
    // Pin every storage that still exists while writing; count the ones gone.
    std::vector<std::shared_ptr<nn::Storage>> pinned;
    bool all_alive = true;
    for (const auto& op : ops) {
      pinned.push_back(op->storage.lock());
      if (pinned.back() == nullptr) all_alive = false;
    }
    if (!all_alive) {
      freed_completions_.fetch_add(1);
    } else {
      const int64_t n = ops[0]->numel;
      bool use_value;
      float value;
      {
        std::lock_guard<std::mutex> lock(mu_);
        use_value = use_completion_value_;
        value = completion_value_;
      }
      std::vector<float> result(n, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        float acc = ops[0]->op == ReduceOp::kMax ? ops[0]->data[i] : 0.0f;
        for (const auto& op : ops) {
          acc = op->op == ReduceOp::kMax ? std::max(acc, op->data[i]) : acc + op->data[i];
        }
        if (ops[0]->op == ReduceOp::kAvg) acc /= static_cast<float>(world_size_);
        result[i] = use_value ? value : acc;
      }
      for (const auto& op : ops) std::copy(result.begin(), result.end(), op->data);
    }
    completed_.fetch_add(1);
    // Unpinned before the ops are marked done: a waiter that wakes on done and
    // drops the last handle must see the storage go (it did not always when the
    // pins outlived the marking).
    pinned.clear();
    for (const auto& op : ops) {
      if (!op->aborted.load()) op->done.store(true, std::memory_order_release);
    }
  }

  const int world_size_;
  const std::chrono::milliseconds delay_;
  std::shared_ptr<InProcessGroup> inprocess_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::vector<std::shared_ptr<FakeOp>>> entered_;
  bool held_ = false;
  bool shutting_down_ = false;
  bool use_completion_value_ = false;
  float completion_value_ = 0;
  std::atomic<int> freed_completions_{0};
  std::atomic<int> completed_{0};
  std::vector<std::atomic<int>> abort_calls_;
  std::vector<std::atomic<int>> overlapping_uses_;
  std::thread device_;  // last: starts after every other member is built
};

class FakeAsyncCommunicator final : public Communicator {
 public:
  FakeAsyncCommunicator(int rank, nn::Device device, std::shared_ptr<FakeGroup> group)
      : Communicator(rank, group->world_size(), device),
        group_(std::move(group)),
        inner_(rank, device, group_->inprocess()),
        handle_(std::make_unique<int>(rank)) {}

  std::string kind() const override { return "fake-async"; }

  // Watchdog thread, as soon as the run stops.
  absl::Status Abort(std::chrono::nanoseconds deadline) override {
    group_->CountAbort(rank());
    std::string in_use;
    const internal::AbortGuard::Outcome outcome = guard_.Abort(
        [&] {
          if (in_use_.load() != 0) group_->CountOverlappingUse(rank());
          handle_.reset();  // as ncclCommAbort frees the communicator
          std::lock_guard<std::mutex> lock(ops_mu_);
          for (auto& op : ops_) op->aborted.store(true, std::memory_order_release);
        },
        deadline, &in_use);
    if (outcome == internal::AbortGuard::Outcome::kTimedOut) {
      return absl::DeadlineExceededError(
          absl::StrCat("fake communicator of rank ", rank(), ": still inside ", in_use));
    }
    group_->inprocess()->Cancel("fake communicator aborted");
    group_->Notify();
    return absl::OkStatus();
  }

  // Seam: the library call of this rank's next all-reduce does not return
  // (as an NCCL enqueue that spins) until ReleaseStall(); the abort must not
  // wait for it for good.
  void StallNextCall() { stall_.store(1); }
  void ReleaseStall() { stall_.store(0); }
  bool stalled() const { return stall_.load() == 2; }

  // Seam: device work of this rank that no collective call traced (as a CUDA
  // graph's replay of recorded collectives would be, untracked): one that no
  // other rank ever joins, so only the abort ends it; BlockingDeviceSync waits
  // for it.
  void EnqueueUntraced() {
    auto op = std::make_shared<FakeOp>();
    op->sequence = UINT64_MAX;  // after every traced collective
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      ops_.push_back(op);
    }
    group_->Enqueue(rank(), op);
  }

  // Seam: PollAsyncError reports `message` from its `after`-th call on (as
  // ncclCommGetAsyncError after a network failure).
  void FailAsynchronouslyAfter(int after, std::string message) {
    std::lock_guard<std::mutex> lock(ops_mu_);
    async_error_after_ = after;
    async_error_ = std::move(message);
  }
  absl::Status PollAsyncError() override {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ++async_polls_;
    if (async_error_after_ > 0 && async_polls_ >= async_error_after_) {
      return absl::InternalError(async_error_);
    }
    return absl::OkStatus();
  }

  // Not stop-aware: returns when every collective this rank enqueued is done
  // or aborted (or after `limit`, returning false), like a device sync.
  bool BlockingDeviceSync(std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::vector<std::shared_ptr<FakeOp>> ops;
    {
      std::lock_guard<std::mutex> lock(ops_mu_);
      ops.assign(ops_.begin(), ops_.end());
    }
    for (const auto& op : ops) {
      if (!group_->BlockUntilFinished(*op, limit)) return false;
    }
    return true;
  }

  bool aborted() const { return guard_.aborted(); }

  // Watchdog thread, as NcclCommunicator's: marks the asynchronous collectives
  // the device has completed complete in the trace, in order (a synchronous
  // one is marked when it returns). Aborted ones stay incomplete.
  void PollCompleted() override {
    std::lock_guard<std::mutex> lock(ops_mu_);
    for (const auto& op : ops_) {
      if (!op->done.load(std::memory_order_acquire)) break;
      MarkCompleted(op->sequence);
    }
  }

 protected:
  void AllReduceImpl(nn::Tensor& x, ReduceOp op) override {
    if (x.dtype() != nn::kFloat32) {
      inner_.all_reduce(x, op);
      return;
    }
    std::shared_ptr<Work> work = AllReduceAsyncImpl(x, op);
    work->wait();
  }

  std::shared_ptr<Work> AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op) override {
    TANDEM_CHECK(x.dtype() == nn::kFloat32, "fake communicator: float32 tensors only");
    auto fake = std::make_shared<FakeOp>();
    fake->sequence = sequence();
    fake->data = x.data<float>();
    fake->numel = x.numel();
    fake->op = op;
    fake->storage = x.storage();
    {
      internal::AbortGuard::Use use(guard_, "the fake all_reduce");
      if (use.aborted()) {
        throw CancelledError(absl::StrCat("rank ", rank(), ": all_reduce #", sequence(),
                                          " abandoned: the communicator was aborted"));
      }
      in_use_.fetch_add(1);
      volatile int handle = *handle_;  // the library call: reads the communicator
      (void)handle;
      int expected = 1;
      if (stall_.compare_exchange_strong(expected, 2)) {
        // Spins like a library call that checks no abort flag.
        while (stall_.load() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::this_thread::yield();
      in_use_.fetch_sub(1);
      std::lock_guard<std::mutex> lock(ops_mu_);
      ops_.push_back(fake);
      while (ops_.size() > 64 && ops_.front()->finished()) ops_.pop_front();
    }
    group_->Enqueue(rank(), fake);
    return std::make_shared<FakeWork>(fake, rank(), group_);
  }

  void BroadcastImpl(nn::Tensor& x, int root) override { inner_.broadcast(x, root); }
  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override {
    output.copy_(inner_.all_gather(input));
  }
  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) override {
    output.copy_(inner_.reduce_scatter(input, op));
  }
  void BarrierImpl() override { inner_.barrier(); }

 private:
  class FakeWork final : public Work {
   public:
    FakeWork(std::shared_ptr<FakeOp> op, int rank, std::shared_ptr<FakeGroup> group)
        : op_(std::move(op)), rank_(rank), group_(std::move(group)) {}
    // Unwaited: the CPU rule of Work's contract, wait for the collective.
    ~FakeWork() override {
      if (!waited_) group_->BlockUntilFinished(*op_, std::chrono::seconds(30));
    }
    // Stop-aware host wait, like item() on a stream behind the collective.
    void wait() override {
      waited_ = true;
      nn::internal::WaitUntil([&] { return op_->finished(); });
      if (op_->aborted.load(std::memory_order_acquire) && !op_->done.load()) {
        throw CancelledError(absl::StrCat("rank ", rank_, ": all_reduce #", op_->sequence,
                                          " ended by the abort"));
      }
    }

   private:
    std::shared_ptr<FakeOp> op_;
    int rank_;
    std::shared_ptr<FakeGroup> group_;
    bool waited_ = false;
  };

  std::shared_ptr<FakeGroup> group_;
  InProcessCommunicator inner_;
  internal::AbortGuard guard_;
  std::unique_ptr<int> handle_;  // guarded by guard_
  std::atomic<int> in_use_{0};
  std::atomic<int> stall_{0};  // 1: the next call stalls; 2: a call is stalled
  std::mutex ops_mu_;
  std::deque<std::shared_ptr<FakeOp>> ops_;
  int async_polls_ = 0;        // guarded by ops_mu_
  int async_error_after_ = 0;  // guarded by ops_mu_
  std::string async_error_;    // guarded by ops_mu_
};

// A SpawnHooks::make_communicators that builds fake communicators over `group`
// and remembers them in `made` (not owned; valid only while spawn runs: read
// their counters from the group afterwards).
inline auto MakeFakeCommunicators(std::shared_ptr<FakeGroup> group,
                                  std::vector<FakeAsyncCommunicator*>* made) {
  return [group, made](const std::vector<nn::Device>& devices)
             -> absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> {
    std::vector<std::unique_ptr<Communicator>> comms;
    made->clear();
    for (int r = 0; r < static_cast<int>(devices.size()); ++r) {
      auto comm = std::make_unique<FakeAsyncCommunicator>(r, devices[r], group);
      made->push_back(comm.get());
      comms.push_back(std::move(comm));
    }
    return comms;
  };
}

}  // namespace tandem::dist::testing

#endif  // TANDEM_TESTS_SPAWN_FAKE_ASYNC_COMMUNICATOR_H_
