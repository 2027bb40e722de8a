// Collective communication between the ranks of one spawn run.
//
// Every rank of a run holds one Communicator; a collective must be called by
// every rank, in the same order, with the same op and sizes (the in-process
// implementation checks and throws on a difference; NCCL would hang, which the
// watchdog then reports). Reductions combine ranks in a fixed order (rank 0, 1,
// ...), so one run gives the same bits every time.
//
// Streams (CUDA tensors): a collective is ordered after the work already queued on
// the calling thread's compute stream (nn::internal::ThreadStream) and later work
// on that stream is ordered after it; the host does not wait for the GPU.
//
// Errors: graph-style. A collective throws tandem::Error on a programming error
// (sizes differ across ranks, unsupported dtype, a tensor on another device than
// the rank's: that one before the collective is entered, so a caller that catches
// it leaves nothing in flight), dist::CancelledError when the
// run is stopping (another rank failed, the watchdog fired, Ctrl-C): spawn then
// reports the first failure and logs this one as a consequence, and
// dist::DeviceError when the device itself failed (below).
//
// Stopping: as soon as a run stops, spawn's watchdog calls Abort on every
// rank's communicator, from its own thread, while the ranks may still be using
// them. Abort ends the collectives in flight (a peer that failed before issuing
// one would otherwise leave it waiting for good), so every host wait on a stream
// behind them returns; implementations serialise it with their own calls
// (spawn/comm/abort_guard.h). Host waits on a rank thread are stop-aware
// (nn/interrupt.h): they throw CancelledError once the run stops.
//
// CUDA graphs (nn/graph.h): NCCL collectives (and hence DataParallel's
// gradient all-reduce) may be captured in a step and replayed; every rank must
// replay its graph, as it would run the step, on the rank thread that captured
// it: each replay is followed by the watchdog as one collective, "graph
// replay". barrier() and the in-process communicator
// cannot be captured (both wait on the host) and throw tandem::Error under
// capture.
//
// Thread-safety: a Communicator belongs to its rank's thread, except
// PollCompleted() and Abort(), which spawn's watchdog calls from its own.
#ifndef TANDEM_SPAWN_COMM_COMMUNICATOR_H_
#define TANDEM_SPAWN_COMM_COMMUNICATOR_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "nn/error.h"
#include "nn/tensor.h"
#include "spawn/comm/flight_recorder.h"

namespace tandem::dist {

enum class ReduceOp { kSum, kAvg, kMax };
const char* ReduceOpName(ReduceOp op);  // "sum", "avg", "max"

// Thrown from a collective or a wait when the run is being stopped.
class CancelledError : public Error {
 public:
  explicit CancelledError(const std::string& what) : Error(what) {}
};

// Thrown by a rank whose failure is another rank's (e.g. "rank 0 could not write
// the checkpoint"): spawn returns that rank's own error as the run's cause when it
// comes, even if this one came first.
class PeerFailedError : public Error {
 public:
  explicit PeerFailedError(const std::string& what) : Error(what) {}
};

// Thrown from a collective when the device itself failed (a CUDA error that a
// query of the device's work returned: a fault on the device, which CUDA keeps
// in the device's context for the rest of the process). spawn ends the run
// with it, naming the device, and never restarts after it (spawn/restart.h).
class DeviceError : public Error {
 public:
  explicit DeviceError(const std::string& what) : Error(what) {}
};

// A status that reports another rank's failure (MarkPeerFailure adds a payload),
// and ThrowIfError, which turns a non-OK status into PeerFailedError for such a
// status and tandem::Error otherwise, its message prefixed by `context`.
absl::Status MarkPeerFailure(absl::Status status);
bool IsPeerFailure(const absl::Status& status);
void ThrowIfError(const absl::Status& status, const std::string& context);

// The handle of an asynchronous collective. It keeps the collective's tensor
// (its storage) alive until the work is done, so dropping the tensor before
// wait() cannot free memory the collective still reads and writes.
//
// Destroying a handle that was never waited for is allowed (a backward pass that
// threw, say): for CUDA tensors later work on the destroying thread's compute
// stream is then ordered after the collective (no host wait), and only then is
// the tensor released; for CPU tensors the destructor waits for the collective
// (the watchdog's abort bounds that wait in a stopping run). Where the compute
// stream cannot wait (NCCL, spawn/comm/nccl/internal/work_wait.h: a handle made outside
// a CUDA graph capture, waited for or destroyed inside one of that stream; a
// thread_local's handle destroyed at its thread's exit after the thread's
// streams), the host waits for the collective instead, stop-aware.
//
// Thread-safety: a Work belongs to the rank thread that started it.
class Work {
 public:
  virtual ~Work() = default;
  // CPU tensors: returns when the result is in place. CUDA tensors: makes the
  // calling thread's compute stream wait for the collective (no host wait).
  // Throws like the collective itself.
  virtual void wait() = 0;
  // After wait(): when the collective finished on the host, for implementations
  // that run it on another thread (the cross-process communicator); nullopt when
  // unknown (it ran inside the call, or on a device stream).
  virtual std::optional<std::chrono::steady_clock::time_point> finished_at() const {
    return std::nullopt;
  }
  // Non-blocking: true once the collective has finished, or failed (wait()
  // then throws). CPU tensors: the result is in place. CUDA tensors: the
  // device work has finished (NCCL: its event has completed), so no stream
  // needs to wait any more; a stopping run's aborted collective counts as
  // finished. Any thread, as wait()'s owner may poll it while another waits
  // (not while the handle is being destroyed). The base class returns false:
  // a handle that cannot tell is finished only once wait() has returned. A
  // handle made inside a CUDA graph capture (NCCL) is finished at once: its
  // collective is recorded in the graph and runs in the replays (wait() for it
  // inside the captured step all the same, to join the capture back).
  virtual bool is_completed() const { return false; }
  // The collective's sequence number on its rank (Communicator::Enter's,
  // the watchdog's "#N" and the flight recorder's), 1 for the first; 0 for a
  // handle that does not know it.
  virtual uint64_t sequence() const { return 0; }
};

namespace internal {

// What a rank's collectives are doing, read by spawn's watchdog from its own
// thread (hence atomics). Collectives complete in the order they were entered.
struct CollectiveTrace {
  std::atomic<uint64_t> entered{0};     // sequence number of the last collective entered
  std::atomic<uint64_t> completed{0};   // sequence number of the last one completed
  std::atomic<const char*> op{"none"};  // name of the last one entered (static string)
  // Its caller's label (Communicator::Label), or null: a static string.
  std::atomic<const char*> label{nullptr};
  std::atomic<int64_t> entered_ns{0};   // steady-clock time it was entered
  // The last collectives in detail (spawn sizes it: SpawnOptions::flight_recorder_entries).
  FlightRecorder flight;
};

// Nanoseconds on the steady clock.
int64_t SteadyNowNs();

// " from <label>" for a collective made under Communicator::Label (label not
// null nor empty), else "": how every mismatch message and the watchdog name a
// labelled call after the collective it describes.
std::string FromLabel(const char* label);

// Tells the CPU that the caller spin-waits (x86 pause, Arm yield; nothing elsewhere).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace internal

class Communicator {
 public:
  Communicator(int rank, int world_size, nn::Device device);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  nn::Device device() const { return device_; }
  // "in-process", "nccl" or "hierarchical (in-process + MPI)" (tests add their own).
  virtual std::string kind() const = 0;

  // x: any shape, the same on every rank, on this rank's device. In place: every
  // rank ends with the reduction of all ranks' x (kAvg: the sum divided by
  // world_size).
  void all_reduce(nn::Tensor& x, ReduceOp op = ReduceOp::kSum);
  // The same, started now; the result is in x after wait().
  std::shared_ptr<Work> all_reduce_async(nn::Tensor& x, ReduceOp op = ReduceOp::kSum);
  // x: the same shape on every rank. Every rank ends with root's x.
  void broadcast(nn::Tensor& x, int root = 0);
  // input: the same shape S on every rank. Returns (world_size, *S), row r = rank r's input.
  nn::Tensor all_gather(const nn::Tensor& input);
  // The same into `output`, allocated by the caller: world_size * input.numel()
  // elements of input's dtype on input's device, any shape (rank r's input at
  // elements [r*n, (r+1)*n)); it must not overlap input. The sharded optimizer
  // gathers each bucket's parameters into the bucket's gradient buffer so.
  void all_gather_into(const nn::Tensor& input, nn::Tensor& output);
  // input: (world_size * k, ...) on every rank. Returns (k, ...): rank r gets the
  // reduction of every rank's rows [r*k, (r+1)*k).
  nn::Tensor reduce_scatter(const nn::Tensor& input, ReduceOp op = ReduceOp::kSum);
  // The same into `output` (input.size(0) / world_size, ...), allocated by the
  // caller with input's dtype and device, started now; the result is in output
  // after wait(). output may be this rank's own block of input (rows
  // [rank*k, (rank+1)*k): the sharded optimizer reduces
  // each gradient bucket in place so). In-process the collective runs inside
  // the call (like all_reduce_async); hierarchical: on the communication
  // thread; NCCL: on the communication stream.
  std::shared_ptr<Work> reduce_scatter_async(const nn::Tensor& input, nn::Tensor& output,
                                             ReduceOp op = ReduceOp::kSum);
  // Returns when every rank has called barrier.
  void barrier();

  // Names the caller of the collectives this rank makes while it is held (a
  // static string, e.g. "hapi::Model::save, which every rank calls"): a
  // library call that is a collective says so where a rank that called it
  // alone fails: in the "collective mismatch" of the in-process check, of the
  // hierarchical communicator's check of a process's ranks and of the check
  // between processes (every process names every side's label, which travels
  // with the mismatch: spawn/comm/mpi/collective_fingerprint.h), and in the
  // watchdog's message about a rank that returned while another waits (also
  // CollectiveTrace::label). Labels are never compared. Nests (the innermost
  // names). Rank thread only.
  class Label {
   public:
    Label(Communicator& comm, const char* label)
        : comm_(comm), outer_(std::exchange(comm.label_, label)) {}
    ~Label() { comm_.label_ = outer_; }
    Label(const Label&) = delete;
    Label& operator=(const Label&) = delete;

   private:
    Communicator& comm_;
    const char* outer_;
  };
  // The label held now, or null.
  const char* label() const { return label_; }
  // How many collectives this rank has entered (the sequence number of the last);
  // DataParallel::join() counts the collectives of a step with it.
  uint64_t collectives_entered() const { return sequence_; }

  // The flight recorder (spawn/comm/flight_recorder.h) of this rank: its last
  // collectives as text (a heading, then one line per collective, oldest
  // first, each ending in '\n'), or their records. Any thread; the text is for
  // people, not parsers.
  std::string DumpFlightRecorder() const;
  std::vector<FlightRecord> FlightRecords() const { return trace_->flight.Snapshot(); }

  // A failure found where it could not be thrown: a guard's destructor
  // (DataParallel::JoinGuard) that ran collectives. The next collective of this
  // rank throws it instead of starting (CancelledError for a kCancelled status,
  // tandem::Error otherwise); when the rank's function returns without making
  // one, spawn fails the rank with it. The first deferred error is kept.
  // Rank thread only.
  void DeferError(absl::Status error);
  // The deferred error not thrown yet (OK: none), cleared.
  absl::Status TakeDeferredError();

  // Host seconds this rank has spent inside collectives and in wait() of
  // asynchronous ones since the communicator was made (any thread may read it).
  // On GPU ranks a collective returns once queued: this is host time, not device time.
  double waited_seconds() const { return waited_ns_.load(std::memory_order_relaxed) * 1e-9; }
  // Adds the time from `start` to now to waited_seconds().
  void AddWaitedSince(std::chrono::steady_clock::time_point start) {
    waited_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start).count(),
                         std::memory_order_relaxed);
  }

  // spawn attaches the run's stop token and this rank's trace before fn starts.
  void Attach(std::stop_token stop, internal::CollectiveTrace* trace);
  bool stop_requested() const { return stop_.stop_requested(); }
  // Called by spawn's watchdog thread (any thread): marks collectives whose
  // device work has finished complete in the trace. Default: nothing, for
  // implementations whose collectives are complete when they return.
  virtual void PollCompleted() {}
  // Called by spawn's watchdog thread as soon as the run stops, while the rank
  // thread may be inside a collective or a host wait: ends the collectives in
  // flight (their results are garbage) so that nothing waits on them for good,
  // and makes every later collective throw CancelledError. Thread-safe,
  // idempotent, never throws. Waits for a library call in progress on the rank
  // thread at most `deadline`; a non-OK status says the abort could not run
  // because that call had not returned (it names the call), and spawn then ends
  // the process with it rather than wait for good. Default: OK, for
  // implementations whose waits already end on the stop token.
  virtual absl::Status Abort(std::chrono::nanoseconds deadline) {
    (void)deadline;
    return absl::OkStatus();
  }
  // Called by spawn on the rank thread once the rank's function has returned
  // (or thrown): releases the CUDA graphs that still hold this communicator's
  // collectives (nn::CudaGraph::ReleaserOfCurrentCapture), so that nothing
  // waits for them (NCCL's abort and destroy wait until every such graph is
  // gone), and returns their descriptions; a later replay of one throws
  // `reason`. Default: none.
  virtual std::vector<std::string> ReleaseGraphs(const std::string& reason) {
    (void)reason;
    return {};
  }
  // Called by spawn's watchdog thread between its polls while the run goes on:
  // a non-OK status is an asynchronous failure the library reported outside any
  // call (NCCL: a network or proxy error, ncclCommGetAsyncError), which fails the
  // run with the library's message. Never waits for a rank's call in progress
  // (it then reports OK and looks again at the next poll). Default: OK.
  virtual absl::Status PollAsyncError() { return absl::OkStatus(); }
  // Called by spawn's watchdog thread like PollAsyncError, and for every rank
  // before any rank's PollAsyncError: a non-OK status is a failure of the
  // device itself that the communicator met while following its work (NCCL: a
  // CUDA error that a query of a collective's event returned, such as
  // cudaErrorIllegalAddress), naming the device. Not a communicator error: the
  // run ends with it, whatever RestartPolicy::on_comm_error says (the device's
  // CUDA context keeps the error for the rest of the process). Default: OK.
  virtual absl::Status PollDeviceError() { return absl::OkStatus(); }

 protected:
  virtual void AllReduceImpl(nn::Tensor& x, ReduceOp op) = 0;
  // Default: runs AllReduceImpl now and returns a finished Work.
  virtual std::shared_ptr<Work> AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op);
  virtual void BroadcastImpl(nn::Tensor& x, int root) = 0;
  // output: (world_size, *input.shape), allocated by the caller.
  virtual void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) = 0;
  // output: (input.size(0) / world_size, ...), allocated by the caller.
  virtual void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) = 0;
  // Default: runs ReduceScatterImpl now and returns a finished Work.
  virtual std::shared_ptr<Work> ReduceScatterAsyncImpl(const nn::Tensor& input, nn::Tensor& output,
                                                       ReduceOp op);
  virtual void BarrierImpl() = 0;

  // The run's stop token (never stops before Attach).
  const std::stop_token& stop_token() const { return stop_; }
  // The sequence number of the collective running now (1 for the first).
  uint64_t sequence() const { return sequence_; }
  // Marks the collective `sequence` complete. Thread-safe.
  void MarkCompleted(uint64_t sequence);
  // True (default): a collective is complete when its Impl returns. False: the
  // implementation calls MarkCompleted itself (from PollCompleted).
  virtual bool CompletesOnReturn() const { return true; }
  // Records the entry of `op` (a static string) in the trace and returns its
  // sequence number; throws CancelledError when the run is stopping. Every
  // collective call does it; an implementation calls it itself for device work
  // that runs without a call, such as a CUDA graph's replay of recorded
  // collectives, so that the watchdog follows that work too.
  // x: the collective's tensor (its input), for the flight recorder's dtype and
  // element count; null for none.
  uint64_t Enter(const char* op, const nn::Tensor* x = nullptr);

 private:
  class Scope;
  class HeldWork;
  // Collective `sequence` threw, or its wait did (the flight recorder's "failed").
  void MarkFailed(uint64_t sequence);
  // Enter and MarkCompleted with the caller's clock reads (Scope's).
  uint64_t EnterAt(const char* op, const nn::Tensor* x, int64_t* now_ns);
  void MarkCompletedAt(uint64_t sequence, int64_t now_ns);
  // Throws unless t is on this rank's device; before the collective is entered.
  void CheckOnDevice(const nn::Tensor& t, const char* op, const char* name) const;

  int rank_;
  int world_size_;
  nn::Device device_;
  std::stop_token stop_;
  internal::CollectiveTrace own_trace_;
  internal::CollectiveTrace* trace_ = &own_trace_;
  uint64_t sequence_ = 0;
  const char* label_ = nullptr;  // Label's
  absl::Status deferred_;  // DeferError's, until thrown or taken
  std::atomic<int64_t> waited_ns_{0};
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_COMM_COMMUNICATOR_H_
