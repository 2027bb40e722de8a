// CPU ranks across processes: hierarchical collectives (internal to spawn/).
//
// Each rank thread hands its request to the process's HierarchicalExchange and
// waits (stop-aware); the communication thread (the one that called spawn,
// HierarchicalExchange::Serve) takes a collective once every local rank has
// posted it, and does:
//   1. the in-process step in local rank order,
//   2. one transport collective per process (non-blocking, polled against the
//      run's stop flag; the watchdog sees the ranks' traces as in flight),
//   3. the in-process step back to every local rank.
// all_reduce_async and reduce_scatter_async post their request and return at
// once (the gradient buckets' collectives then overlap backward); wait() waits
// for the communication thread.
//
// Reduction tree (all_reduce, reduce_scatter): partial_p = x_{p,0} + x_{p,1} + ...
// in local order; then process q reduces its slice of the element range over
// partial_0, partial_1, ... in process order (an all-to-all brings them), and an
// all-gather returns the slices. With one rank per process this is
// x_0 + x_1 + ... + x_{N-1}, the in-process communicator's tree: P processes x 1
// rank give the same bits as 1 process x P ranks. Every run gives the same bits.
// kAvg divides the sum by the global world size at the end, as in-process does.
// bfloat16 and float16 (what Bf16CompressHook and Fp16CompressHook send):
// every fold adds in float32 and rounds once, so the wire carries the 16-bit
// type and the sums lose nothing more; with one rank per process the bits are
// the in-process communicator's, with several the local partial sum is rounded
// to the 16-bit type before it leaves the process.
//
// Traffic per process for n bytes: (P-1)/P * n out and in for the all-to-all,
// the same again for the all-gather: a ring all-reduce's volume.
//
// Errors: a local mismatch (op, size, dtype, root) throws tandem::Error on every
// local rank, naming both ranks' collectives and their Communicator::Labels; a
// transport error likewise, except that with background rounds the
// communication thread first ticks them for up to kVerdictWait: a
// transport error is often the symptom of collectives that differ between the
// processes (MPI_ERR_TRUNCATE), which the rounds compare (ControlPlane) and
// then report, naming both sides, as the run's first error. A stop (another
// rank failed, the watchdog, Ctrl-C) throws CancelledError and leaves the
// transport unusable (spawn then aborts the job).
//
// Every collective's fingerprint (spawn/comm/mpi/collective_fingerprint.h) and
// label are kept for the last kFingerprintHistory collectives, for those rounds.
// With CheckEachCollective the processes also compare it before each
// collective's data moves (a MAX all-reduce of two slots per process on the data
// channel: a round trip more per collective, off by default); a mismatch then
// brings the processes' labels of it (one more all-reduce) and throws
// tandem::Error naming each side and its label on every rank of every process,
// and MPI never sees the mismatched collective.
//
// Thread-safety: Post/Wait/RankExited from rank threads, Serve from one thread.
#ifndef TANDEM_SPAWN_COMM_MPI_HIERARCHICAL_COMMUNICATOR_H_
#define TANDEM_SPAWN_COMM_MPI_HIERARCHICAL_COMMUNICATOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "spawn/comm/communicator.h"
#include "spawn/comm/mpi/collective_fingerprint.h"
#include "spawn/comm/mpi/process_transport.h"

namespace tandem::dist::internal {

// Work the communication thread interleaves with the exchange's own: the
// launcher's control rounds (spawn's step agreement across processes).
class BackgroundRounds {
 public:
  virtual ~BackgroundRounds() = default;
  // Advances the rounds; false once they say every process's ranks exited.
  virtual bool Tick(const std::stop_token& stop) = 0;
  // How long the caller may sleep before the next Tick.
  virtual std::chrono::microseconds NextWait() const = 0;
};

class HierarchicalExchange {
 public:
  struct Request {
    const char* op = "";
    ReduceOp reduce = ReduceOp::kSum;
    int root = 0;  // broadcast: global rank
    const char* label = nullptr;  // the rank's Communicator::Label, or null
    nn::Tensor in;
    nn::Tensor out;
    uint64_t sequence = 0;
    // Set by the communication thread under the exchange's mutex.
    bool done = false;
    bool cancelled = false;
    std::chrono::steady_clock::time_point finished;  // when done was set
    std::string error;
  };

  // ranks_per_process: every process's local rank count, in process order.
  HierarchicalExchange(int process_index, std::vector<int> ranks_per_process,
                       ProcessTransport* transport);

  int local_size() const { return ranks_per_process_[process_index_]; }
  int rank_offset() const { return rank_offset_; }
  int world_size() const { return world_size_; }

  // Rank side.
  std::shared_ptr<Request> Post(int local_rank, Request request);
  // Returns when the request is done; throws CancelledError or tandem::Error.
  void Wait(const Request& request);
  // Non-blocking: the request is done (completed, failed or cancelled).
  bool IsDone(const Request& request) const;
  void RankExited(int local_rank);
  // The last sequence number of local_rank's requests that is done.
  uint64_t completed_through(int local_rank) const {
    return completed_[local_rank].load(std::memory_order_acquire);
  }

  // Communication thread only (also from BackgroundRounds::Tick, which it
  // calls): how many collectives it has started (taken every local rank's
  // request of), and the fingerprint of collective `sequence` while it is among
  // the last kFingerprintHistory started (nullopt: not started, or older), and
  // its label: the first local rank's (in local order) that called it under a
  // Communicator::Label, null when none did (or not kept).
  static constexpr uint64_t kFingerprintHistory = 4096;
  uint64_t started() const { return started_; }
  std::optional<Fingerprint> FingerprintOf(uint64_t sequence) const;
  const char* LabelOf(uint64_t sequence) const;
  // How long a transport error waits for the rounds' verdict (see Errors above).
  static constexpr std::chrono::milliseconds kVerdictWait{2000};
  // Compare each collective's fingerprint between the processes before its data
  // moves; `name` names a process in the error ("process 1 (host h, pid p, rank
  // 1)"). Every process must set it alike. Before Serve.
  void CheckEachCollective(std::function<std::string(int process)> name) {
    check_each_name_ = std::move(name);
  }

  // Communication thread: runs until every local rank exited or, with `control`
  // (may be null), until its rounds say every process's ranks exited. Ticks
  // `control` throughout, also while a collective is in flight.
  void Serve(std::stop_token stop, BackgroundRounds* control);

 private:
  // Runs one collective (every local rank's request). Returns false when the
  // stop was requested while it was in flight; throws tandem::Error on a
  // mismatch or a transport error.
  bool Execute(const std::vector<std::shared_ptr<Request>>& batch, const std::stop_token& stop);
  // Throws tandem::Error naming both ranks (and their labels) unless every
  // request of `batch` is the same collective (op, size, dtype, reduction, root).
  void CheckSameCollective(const std::vector<std::shared_ptr<Request>>& batch) const;
  // Execute's steps, one per collective; each returns false when stopped.
  using Batch = std::vector<std::shared_ptr<Request>>;
  bool ExecuteAllReduce(const Batch& batch, const std::stop_token& stop);
  bool ExecuteReduceScatter(const Batch& batch, const std::stop_token& stop);
  bool ExecuteBroadcast(const Batch& batch, const std::stop_token& stop);
  bool ExecuteAllGather(const Batch& batch, const std::stop_token& stop);
  // Tests `op` until done (true) or stopped (false); a transport error waits
  // for the rounds' verdict first (AwaitVerdict), then throws.
  bool Poll(PendingOp* op, const std::stop_token& stop);
  bool PollUntilDone(PendingOp* op, const std::stop_token& stop);
  // CheckEachCollective's comparison of collective `sequence` (started_ + 1: it
  // counts as started, and the rounds see it, only once it passed); false when
  // stopped, throws tandem::Error on a mismatch (after one more all-reduce,
  // which every process makes, that brings the processes' labels of it).
  bool CompareBeforehand(const Fingerprint& fingerprint, const char* label, uint64_t sequence,
                         const std::stop_token& stop);
  // After a transport error: ticks the rounds for up to kVerdictWait; true when
  // the run is stopping meanwhile (the rounds, or anything else, reported first).
  bool AwaitVerdict(const std::stop_token& stop);
  // inputs: local ranks' n elements each; result: n elements (may alias inputs[0]).
  bool AllReduceInto(const std::vector<const void*>& inputs, void* result, int64_t n,
                     nn::DType dtype, ReduceOp op, const std::stop_token& stop);
  void CancelLocked(const std::string& reason);

  const int process_index_;
  const std::vector<int> ranks_per_process_;
  int rank_offset_ = 0;
  int world_size_ = 0;
  ProcessTransport* transport_;
  BackgroundRounds* control_ = nullptr;  // during Serve, communication thread only
  std::atomic<int> waiting_{0};      // local ranks blocked in Wait

  mutable std::mutex mutex_;
  std::condition_variable rank_cv_;
  std::condition_variable comm_cv_;
  std::vector<std::deque<std::shared_ptr<Request>>> queues_;
  std::unique_ptr<std::atomic<uint64_t>[]> completed_;
  int exited_ = 0;
  bool broken_ = false;
  std::string broken_reason_;
  std::vector<char> partial_, recv_, result_;  // scratch of the communication thread
  uint64_t started_ = 0;                         // communication thread only
  std::vector<Fingerprint> fingerprints_;        // ring of kFingerprintHistory, by sequence
  std::vector<const char*> labels_;              // the same ring's labels (null: none)
  std::function<std::string(int)> check_each_name_;  // set: CheckEachCollective
  std::vector<int64_t> check_slots_;  // its all-reduce's buffer: Fingerprint::kWords a process
};

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(int local_rank, nn::Device device,
                           std::shared_ptr<HierarchicalExchange> exchange);
  std::string kind() const override { return "hierarchical (in-process + MPI)"; }
  void PollCompleted() override;

 protected:
  void AllReduceImpl(nn::Tensor& x, ReduceOp op) override;
  std::shared_ptr<Work> AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op) override;
  void BroadcastImpl(nn::Tensor& x, int root) override;
  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override;
  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) override;
  std::shared_ptr<Work> ReduceScatterAsyncImpl(const nn::Tensor& input, nn::Tensor& output,
                                               ReduceOp op) override;
  void BarrierImpl() override;

 private:
  // Hands the collective to the communication thread and returns at once.
  std::shared_ptr<Work> Start(const char* op, ReduceOp reduce, const nn::Tensor& in,
                              const nn::Tensor& out);
  void Run(const char* op, ReduceOp reduce, int root, const nn::Tensor& in, const nn::Tensor& out);

  int local_rank_;
  std::shared_ptr<HierarchicalExchange> exchange_;
};

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_MPI_HIERARCHICAL_COMMUNICATOR_H_
