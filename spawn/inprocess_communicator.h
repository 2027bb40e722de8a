// The in-process communicator: ranks of one process (CPU ranks, or several ranks
// sharing one GPU) exchange buffer addresses through a shared InProcessGroup and
// each rank reduces its own slice of everyone's buffers, adding ranks in the order
// 0, 1, ..., so the result has the same bits on every rank and every run.
//
// CPU tensors: plain loops on the calling thread. CUDA tensors (ranks on one GPU):
// kernels on the rank's compute stream, ordered against the other ranks' streams
// with events; the host does not wait for the GPU.
//
// Not capturable in a CUDA graph (nn/graph.h): every collective meets the other
// ranks on the host. A collective called while nn::CudaGraph captures on the
// calling thread throws tandem::Error ("in-process communicator cannot be
// captured in a CUDA graph; use NCCL ...") before touching the group.
#ifndef TANDEM_SPAWN_INPROCESS_COMMUNICATOR_H_
#define TANDEM_SPAWN_INPROCESS_COMMUNICATOR_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spawn/communicator.h"

namespace tandem::dist {

// State shared by the ranks of one run. Thread-safe.
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size);
  ~InProcessGroup();

  int world_size() const { return world_size_; }

  // A reusable barrier (generation counter): returns once all world_size ranks
  // have arrived. Throws CancelledError(reason) when the group is or becomes
  // cancelled while waiting; a generation that completed before the cancel
  // returns normally.
  void ArriveAndWait();
  // Wakes every waiter (they throw) and makes every later ArriveAndWait throw.
  // The first reason is kept. Callable from any thread, more than once.
  void Cancel(const std::string& reason);
  bool cancelled() const;

  // What each rank published for the collective running now. Rank r writes
  // slot(r) before the first barrier of a collective; all read after it; nobody
  // writes again before the collective's last barrier.
  struct Slot {
    const char* op = "";
    uint64_t sequence = 0;
    int64_t numel = 0;
    nn::DType dtype = nn::DType::kFloat32;
    int arg = 0;  // ReduceOp or root
    nn::Device device;
    const void* send = nullptr;
    void* recv = nullptr;
    void* event = nullptr;  // CUDA: an event recorded after this rank's inputs are ready
  };
  Slot& slot(int rank) { return slots_[rank]; }

 private:
  const int world_size_;
  std::vector<Slot> slots_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool cancelled_ = false;
  std::string reason_;
};

class InProcessCommunicator final : public Communicator {
 public:
  // group: shared by all world_size ranks of the run.
  InProcessCommunicator(int rank, nn::Device device, std::shared_ptr<InProcessGroup> group);
  ~InProcessCommunicator() override;
  std::string kind() const override { return "in-process"; }

 protected:
  void AllReduceImpl(nn::Tensor& x, ReduceOp op) override;
  void BroadcastImpl(nn::Tensor& x, int root) override;
  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override;
  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) override;
  void BarrierImpl() override;

 private:
  // Publishes this rank's slot, waits for all, and checks that every rank called
  // the same collective with the same sizes (throws tandem::Error naming both).
  void Publish(const char* op, const nn::Tensor* send, nn::Tensor* recv, int arg);
  // Second half of every collective: waits until no rank still reads or writes
  // another's buffer.
  void Finish();
  void CheckDevice(const nn::Tensor& t, const char* op) const;

  std::shared_ptr<InProcessGroup> group_;
  void* event_ = nullptr;  // CUDA event of this rank (created on first CUDA use)
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_INPROCESS_COMMUNICATOR_H_
