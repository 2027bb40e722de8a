// A communicator whose all-reduces run asynchronously, the way NCCL's do on a
// GPU, and complete late or never: for testing shutdown and error handling
// (spawn's own, tests/spawn/shutdown_test.cc, and a user's) on CPU ranks.
//
//   auto group = std::make_shared<testing::FakeGroup>(2, std::chrono::milliseconds(50));
//   group->HoldFrom(3);   // the third collective, and every later one, never completes
//   testing::RunOptions options{.ranks = 2, .fake_group = group};
//
// - all_reduce / all_reduce_async (float32): the rank enqueues the collective and
//   returns; a helper thread (the "device") completes collective n once every
//   rank has entered it, after `delay`, unless the group is held (Hold/Release,
//   HoldFrom). A collective that some rank never enters never completes: only
//   Abort ends it, as ncclCommAbort ends a kernel waiting for a peer that never
//   came.
// - The device keeps only the tensor's data pointer, as NCCL does; the Work
//   (Communicator's wrapper) must keep the storage alive. A completion finding
//   its storage freed is counted (completions_on_freed_storage), not written.
// - Host waits: Work::wait() polls through nn::internal::WaitUntil, so it is
//   stop-aware on a rank thread, like item(). BlockingDeviceSync() is not: it
//   models an implicit device sync (cudnnDestroy at thread exit) that only the
//   completion or the abort of every enqueued collective ends.
// - Abort serialises with the rank's calls as NcclCommunicator's does: it
//   "frees" a handle that every use dereferences under the same guard (TSan sees
//   a race if the guard does not serialise them) and counts uses that overlap an
//   abort. Seams: a library call that does not return (StallNextCall), an
//   asynchronous library error (FailAsynchronouslyAfter), device work no call
//   traced (EnqueueUntraced).
// - Other collectives (broadcast, all_gather, ...) and non-float32 all-reduces
//   go to an in-process communicator over the same ranks.
//
// Thread-safety: FakeGroup is shared by the ranks and the test (every method
// may be called from any thread). A FakeAsyncCommunicator belongs to its rank's
// thread, except Abort, PollCompleted and PollAsyncError (spawn's watchdog) and
// the seams marked "any thread".
#ifndef TANDEM_TESTING_FAKE_COMMUNICATOR_H_
#define TANDEM_TESTING_FAKE_COMMUNICATOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nn/device.h"
#include "nn/tensor.h"
#include "spawn/comm/communicator.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"

namespace tandem::dist {
class AbortGuard;
}  // namespace tandem::dist

namespace tandem::testing {

// One collective of one rank, as the "device" sees it.
struct FakeOp {
  uint64_t sequence = 0;
  float* data = nullptr;  // what the device reads and writes
  int64_t numel = 0;
  dist::ReduceOp op = dist::ReduceOp::kSum;
  std::weak_ptr<nn::Storage> storage;  // only to detect use after free
  std::atomic<bool> done{false};
  std::atomic<bool> aborted{false};
  bool finished() const {
    return done.load(std::memory_order_acquire) || aborted.load(std::memory_order_acquire);
  }
};

// The "device" shared by the fake communicators of one run's ranks.
class FakeGroup {
 public:
  // delay: how long the device takes for each collective once every rank entered it.
  explicit FakeGroup(int world_size,
                     std::chrono::milliseconds delay = std::chrono::milliseconds(0));
  ~FakeGroup();
  FakeGroup(const FakeGroup&) = delete;
  FakeGroup& operator=(const FakeGroup&) = delete;

  int world_size() const { return world_size_; }
  const std::shared_ptr<dist::InProcessGroup>& inprocess() const { return inprocess_; }

  // While held, the device completes nothing.
  void Hold();
  void Release();
  // The device completes the all-reduces numbered below `sequence` (per rank,
  // 1 for the first collective of any kind) and none from it on, until Release().
  void HoldFrom(uint64_t sequence);
  // Written into every element of a completed collective instead of the
  // reduction, when set (a marker that shows when the device wrote).
  void SetCompletionValue(float value);

  // Rank `rank` entered `op` (FakeAsyncCommunicator calls it).
  void Enqueue(int rank, std::shared_ptr<FakeOp> op);
  // Wakes the device and every waiter after an abort.
  void Notify();
  // Blocks (not stop-aware) until `op` is done or aborted, or `limit` passed;
  // returns whether it finished.
  bool BlockUntilFinished(const FakeOp& op, std::chrono::seconds limit);

  // Counters, kept here because the group outlives spawn's communicators.
  int completions_on_freed_storage() const { return freed_completions_.load(); }
  // Per rank: Abort() calls, and uses of a communicator that overlapped its abort.
  int abort_calls(int rank) const { return abort_calls_[rank].load(); }
  int overlapping_uses(int rank) const { return overlapping_uses_[rank].load(); }
  void CountAbort(int rank) { abort_calls_[rank].fetch_add(1); }
  void CountOverlappingUse(int rank) { overlapping_uses_[rank].fetch_add(1); }
  // Collectives the device completed.
  int completed() const { return completed_.load(); }

 private:
  void RunDevice();
  // The lowest-numbered collective has every rank and is not held (collectives
  // complete in order).
  bool ReadyLocked() const;
  void Complete(const std::vector<std::shared_ptr<FakeOp>>& ops);

  const int world_size_;
  const std::chrono::milliseconds delay_;
  std::shared_ptr<dist::InProcessGroup> inprocess_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::vector<std::shared_ptr<FakeOp>>> entered_;
  bool held_ = false;
  uint64_t hold_from_ = std::numeric_limits<uint64_t>::max();
  bool shutting_down_ = false;
  bool use_completion_value_ = false;
  float completion_value_ = 0;
  std::atomic<int> freed_completions_{0};
  std::atomic<int> completed_{0};
  std::vector<std::atomic<int>> abort_calls_;
  std::vector<std::atomic<int>> overlapping_uses_;
  std::thread device_;  // last: starts after every other member is built
};

class FakeAsyncCommunicator final : public dist::Communicator {
 public:
  FakeAsyncCommunicator(int rank, nn::Device device, std::shared_ptr<FakeGroup> group);
  ~FakeAsyncCommunicator() override;

  std::string kind() const override { return "fake-async"; }

  // Watchdog thread, as soon as the run stops.
  absl::Status Abort(std::chrono::nanoseconds deadline) override;

  // Seam: the library call of this rank's next all-reduce does not return
  // (as an NCCL enqueue that spins) until ReleaseStall(); the abort must not
  // wait for it for good. ReleaseStall and stalled: any thread.
  void StallNextCall() { stall_.store(1); }
  void ReleaseStall() { stall_.store(0); }
  bool stalled() const { return stall_.load() == 2; }

  // Seam: device work of this rank that no collective call traced (as a CUDA
  // graph's replay of recorded collectives would be, untracked): one that no
  // other rank ever joins, so only the abort ends it; BlockingDeviceSync waits
  // for it.
  void EnqueueUntraced();

  // Seam: PollAsyncError reports `message` from its `after`-th call on (as
  // ncclCommGetAsyncError after a network failure). Any thread.
  void FailAsynchronouslyAfter(int after, std::string message);
  absl::Status PollAsyncError() override;

  // Not stop-aware: returns when every collective this rank enqueued is done
  // or aborted (or after `limit`, returning false), like a device sync.
  bool BlockingDeviceSync(std::chrono::seconds limit = std::chrono::seconds(30));

  bool aborted() const;

  // Watchdog thread, as NcclCommunicator's: marks the asynchronous collectives
  // the device has completed complete in the trace, in order (a synchronous
  // one is marked when it returns). Aborted ones stay incomplete.
  void PollCompleted() override;

 protected:
  void AllReduceImpl(nn::Tensor& x, dist::ReduceOp op) override;
  std::shared_ptr<dist::Work> AllReduceAsyncImpl(nn::Tensor& x, dist::ReduceOp op) override;
  void BroadcastImpl(nn::Tensor& x, int root) override { inner_.broadcast(x, root); }
  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override {
    output.copy_(inner_.all_gather(input));
  }
  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output,
                         dist::ReduceOp op) override {
    output.copy_(inner_.reduce_scatter(input, op));
  }
  void BarrierImpl() override { inner_.barrier(); }

 private:
  class FakeWork;
  // The library call of an all-reduce: under the guard, reads the handle,
  // stalls when asked to, and records the op.
  void EnterLibraryCall(const std::shared_ptr<FakeOp>& fake);

  std::shared_ptr<FakeGroup> group_;
  dist::InProcessCommunicator inner_;
  std::unique_ptr<dist::AbortGuard> guard_;
  std::unique_ptr<int> handle_;  // guarded by *guard_
  std::atomic<int> in_use_{0};
  std::atomic<int> stall_{0};  // 1: the next call stalls; 2: a call is stalled
  std::mutex ops_mu_;
  std::deque<std::shared_ptr<FakeOp>> ops_;  // guarded by ops_mu_
  int async_polls_ = 0;                      // guarded by ops_mu_
  int async_error_after_ = 0;                // guarded by ops_mu_
  std::string async_error_;                  // guarded by ops_mu_
};

// A SpawnHooks::make_communicators that builds fake communicators over `group`
// and, when `made` is not null, remembers them there (not owned; valid only
// while spawn runs: read their counters from the group afterwards). The group's
// world size must be the run's (else an InvalidArgument status naming both).
std::function<absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>>(
    const std::vector<nn::Device>&)>
MakeFakeCommunicators(std::shared_ptr<FakeGroup> group,
                      std::vector<FakeAsyncCommunicator*>* made = nullptr);

}  // namespace tandem::testing

#endif  // TANDEM_TESTING_FAKE_COMMUNICATOR_H_
