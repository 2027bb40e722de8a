// NCCL communicators for ranks on distinct GPUs. Compiled only with CUDA; the
// only file of tandem that includes nccl.h. docs/gpu.md ("The contracts") has
// the long form of the arguments below, with references into NCCL 2.28's source.
//
// Creation: one process's world is made by ncclCommInitAll on spawn's thread,
// before any rank thread starts (one communicator per device, in one group).
// Several processes (mpirun/srun): each makes its local ranks' communicators
// with ncclCommInitRankConfig inside ncclGroupStart/End from process 0's unique
// id. Before either, PrepareNcclEnvironment sets NCCL_RUNTIME_CONNECT=0 (every
// connection is made during init: a later collective never waits on a peer's
// connection set-up inside a call that the abort cannot end) and
// NCCL_GRAPH_REGISTER=0 (the same for buffer registration under capture), and
// refuses a user's setting that contradicts them, NCCL_LAUNCH_MODE=GROUP and
// NCCL_COMM_BLOCKING=0.
//
// Blocking communicators (ncclCommInitAll's default; config.blocking = 1 across
// processes). In NCCL 2.28 a collective on a
// non-blocking communicator always takes the asynchronous group path
// (ncclEnqueueCheck -> ncclGroupEndInternal starts a thread per call and returns
// ncclInProgress, and the next call must wait for that thread): tens of
// microseconds of host time per all-reduce, inside DataParallel's grad-ready
// hook. A blocking communicator enqueues on the calling thread and returns.
//
// Streams: each rank has a communication stream. A collective first takes its
// tensors' pointers (which orders the rank's compute stream after each tensor's
// owning stream, Storage::PrepareUse), then records an event on the rank's
// compute stream (nn::internal::ThreadStream), the communication stream waits
// for it, NCCL runs there, and an event recorded after it is waited
// for by the compute stream (synchronous calls) or by Work::wait (asynchronous).
// The host never waits for the GPU except in barrier(), which polls against the
// stop token, and when kMaxInflight collectives are already in flight (below).
//
// Stopping. spawn's watchdog calls Abort() on every communicator as soon as the
// run stops (first failure, timeout, Ctrl-C), not after the joins: a rank thread
// waiting on the host for a stream behind a collective that a failed peer never
// joined would never join. ncclCommAbort sets the communicator's abort flags
// (which NCCL's kernels poll, so the stuck kernel exits and every stream behind
// it drains), and the last of the process's communicators to be aborted frees
// them all (init.cc: ncclCommAbort -> commReclaim). NCCL's conditions for that,
// and how they hold:
//  (1) No thread may be inside an NCCL call on the communicator while it is
//      aborted (or after: it may be freed). Every NCCL call here runs under
//      guard_ (spawn/comm/abort_guard.h), which Abort() takes too; once
//      aborted, calls throw CancelledError instead of touching the communicator.
//  (2) The abort must not wait for a rank thread stuck in an NCCL call. A rank
//      thread holds guard_ only inside an enqueue call, and an enqueue of a
//      blocking communicator waits for the device only when NCCL's work FIFO is
//      full (enqueue.cc, waitWorkFifoAvailable). At most kMaxInflight collectives
//      (eager or graph replays) are in flight per rank (the rank thread waits,
//      stop-aware and outside the guard, for the oldest before issuing more),
//      far below the FIFO's 1 MiB; the communication stream then holds at most
//      a few hundred pending operations, below the launch queue's depth, so the
//      kernel launch inside the enqueue does not block either. Should a call
//      still not return (a bug, or a NCCL path this reasoning missed), the
//      abort waits for it at most its deadline and spawn then ends the process
//      naming the call, rather than hang (AbortGuard). A rank thread never
//      waits behind an abort: its next call sees it and throws.
//  (3) Every rank's communicator is aborted: the watchdog aborts all of them,
//      from its one thread.
// Host waits on the rank threads poll against the stop flag (nn/interrupt.h), so
// they end with the stop; the abort then lets the streams drain, so the
// implicit device syncs at thread exit (cudnnDestroy) return too.
//
// Watchdog: every collective records an event on the communication stream; the
// watchdog thread polls them (PollCompleted) and marks a collective complete
// when its event has fired, so a collective stuck on the GPU (a peer that never
// came) shows up in the watchdog's report as the op and sequence number it is.
// The watchdog thread sets the communicator's device before each CUDA call: it
// never selects GPU 0 (a context there) unless GPU 0 is one of the run's.
//
// CUDA graph capture (nn/graph.h): the event record / wait pair between the
// compute and communication streams makes the communication stream join the
// capture, and the compute stream's wait on the collective's end event (done_,
// or Work::wait) joins it back, so the collectives are recorded in the graph.
// An event recorded in a capture cannot be queried, so a replay is traced
// instead: a post-replay hook (nn::CudaGraph::AddPostReplayHook) enters one
// collective "graph replay" and records an event on the compute stream behind
// the graph (a pre-replay hook first refuses a replay from another thread, or
// after the run, before the graph is launched); a rank that replays once more
// than its peers shows in the watchdog's report like any stuck collective.
// barrier() cannot be captured.
//
// Asynchronous errors: the watchdog polls ncclCommGetAsyncError (PollAsyncError,
// under a try-lock of the guard, never waiting for a rank's call) and fails the
// run with NCCL's message, instead of a timeout that would lose it. A CUDA error
// that a query of a collective's event returns (a fault on the device) is kept
// and reported apart (PollDeviceError), and thrown by the rank's next
// collective as DeviceError: the device's failure, not the communicator's, so
// a RestartPolicy does not restart after it (the device's CUDA context keeps
// it for the rest of the process).
#include <nccl.h>
#include <cuda_runtime_api.h>

#include <strings.h>  // strcasecmp

#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/graph.h"
#include "nn/interrupt.h"
#include "nn/status_macros.h"
#include "spawn/comm/abort_guard.h"
#include "spawn/comm/nccl/nccl_communicator.h"
#include "spawn/comm/nccl/internal/nccl_work.h"

namespace tandem::dist::internal {
namespace {

// Collectives in flight per rank before the rank thread waits for the oldest.
// NCCL's work FIFO (NCCL_WORK_FIFO_BYTES, 1 MiB by default) holds a collective's
// work descriptors (at most a few KiB each) until its kernel has read them; with
// this bound it never fills, so an enqueue never waits for the device.
constexpr size_t kMaxInflight = 128;

ncclDataType_t NcclType(nn::DType dtype) {
  switch (dtype) {
    case nn::DType::kFloat32: return ncclFloat32;
    case nn::DType::kFloat64: return ncclFloat64;
    case nn::DType::kBFloat16: return ncclBfloat16;
    case nn::DType::kInt64: return ncclInt64;
    case nn::DType::kUInt8: return ncclUint8;
    case nn::DType::kFloat16: return ncclFloat16;
  }
  Fail("NCCL: unsupported dtype");
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

// NCCL's text for `result`, with the communicator's last error when `comm` is
// given (call it only where the communicator may be used: under its guard).
// The last error is best effort: NCCL keeps one buffer for the whole process,
// which any of its threads may be writing, so the text can belong to another
// communicator's failure.
std::string NcclText(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') absl::StrAppend(&text, ": ", last);
  }
  return text;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world_size, nn::Device device, ncclComm_t comm,
                   cudaStream_t stream)
      : Communicator(rank, world_size, device),
        comm_(comm),
        stream_(stream),
        events_(std::make_shared<EventPool>(device)) {
    TANDEM_CHECK_CUDA(EventCreate(&ready_), device);
    TANDEM_CHECK_CUDA(EventCreate(&done_), device);
  }

  // On spawn's thread, after every rank thread and the watchdog have been joined.
  ~NcclCommunicator() override {
    nn::internal::CudaDeviceScope on_device(device(), std::nothrow);  // spawn's device stays
    {
      AbortGuard::Use use(guard_);
      if (!use.aborted()) {
        // A clean run: every collective has completed; flush and free.
        ncclCommFinalize(comm_);
        ncclCommDestroy(comm_);
      }
    }
    for (auto& [sequence, event] : inflight_) {
      if (event != nullptr) cudaEventDestroy(event);
    }
    events_.reset();  // the pool's events go with the last handle that uses them
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }

  // Watchdog thread: marks collectives whose events fired complete, in order.
  void PollCompleted() override {
    cudaSetDevice(device().index);  // never an implicit context on GPU 0
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    DrainCompletedLocked();
  }

  // Watchdog thread, as soon as the run stops. See the file comment.
  absl::Status Abort(std::chrono::nanoseconds deadline) override {
    std::string in_use;
    const AbortGuard::Outcome outcome = guard_.Abort(
        [&] {
          cudaSetDevice(device().index);
          ncclCommAbort(comm_);
        },
        deadline, &in_use);
    if (outcome != AbortGuard::Outcome::kTimedOut) return absl::OkStatus();
    return absl::DeadlineExceededError(absl::StrCat(
        "the NCCL communicator of rank ", rank(), " (", device().ToString(),
        ") cannot be aborted: its rank thread has been inside NCCL ", in_use, " for over ",
        std::chrono::duration<double>(deadline).count(),
        " s, and aborting under a call in progress could free what the call uses"));
  }

  // Watchdog thread, while the run goes on: NCCL's asynchronous error (a
  // network or proxy failure leaves the kernels spinning; without this the
  // user would see only the watchdog's timeout, NCCL's reason lost).
  absl::Status PollAsyncError() override {
    absl::Status status;
    guard_.TryUse([&] {
      const ncclResult_t error = AsyncErrorLocked();
      if (error != ncclSuccess) {
        status = absl::InternalError(
            absl::StrCat("NCCL reported an asynchronous error on rank ", rank(), " (",
                         device().ToString(), "): ", NcclText(error, comm_)));
      }
    });
    return status;
  }

  // Watchdog thread: a CUDA error that a query of a collective's event met (here,
  // in PollCompleted or in the rank's wait for room in flight): a fault on the
  // device, not an error of the communicator (spawn ends the run with it, no
  // restart). The events are queried first: the watchdog asks this before
  // PollAsyncError, and NCCL's proxy may report its own error for the same
  // fault (ncclUnhandledCudaError) before the round's PollCompleted has run.
  absl::Status PollDeviceError() override {
    PollCompleted();
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    return device_error_;
  }

  std::string kind() const override { return "nccl"; }

  // Rank thread, after the rank's function: see Communicator::ReleaseGraphs.
  std::vector<std::string> ReleaseGraphs(const std::string& reason) override {
    std::vector<std::string> released;
    for (const auto& release : graph_releasers_) {
      std::string graph = release(reason);
      if (!graph.empty()) released.push_back(std::move(graph));
    }
    graph_releasers_.clear();
    return released;
  }
  bool CompletesOnReturn() const override { return false; }

 protected:
  void AllReduceImpl(nn::Tensor& x, ReduceOp op) override {
    Launch("all_reduce", x, x, [&](const void* send, void* recv) {
      return ncclAllReduce(send, recv, x.numel(), NcclType(x.dtype()), NcclOp(op), comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  std::shared_ptr<Work> AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op) override {
    Launch("all_reduce_async", x, x, [&](const void* send, void* recv) {
      return ncclAllReduce(send, recv, x.numel(), NcclType(x.dtype()), NcclOp(op), comm_, stream_);
    });
    return DoneOnStream();
  }

  // In place when output is this rank's block of input (NCCL's in-place
  // reduce-scatter: recvbuff == sendbuff + rank * recvcount).
  std::shared_ptr<Work> ReduceScatterAsyncImpl(const nn::Tensor& input, nn::Tensor& output,
                                               ReduceOp op) override {
    Launch("reduce_scatter_async", input, output, [&](const void* send, void* recv) {
      return ncclReduceScatter(send, recv, output.numel(), NcclType(input.dtype()), NcclOp(op),
                               comm_, stream_);
    });
    return DoneOnStream();
  }

  void BroadcastImpl(nn::Tensor& x, int root) override {
    Launch("broadcast", x, x, [&](const void* send, void* recv) {
      return ncclBroadcast(send, recv, x.numel(), NcclType(x.dtype()), root, comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override {
    Launch("all_gather", input, output, [&](const void* send, void* recv) {
      return ncclAllGather(send, recv, input.numel(), NcclType(input.dtype()), comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) override {
    Launch("reduce_scatter", input, output, [&](const void* send, void* recv) {
      return ncclReduceScatter(send, recv, output.numel(), NcclType(input.dtype()), NcclOp(op),
                               comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  void BarrierImpl() override {
    TANDEM_CHECK(!nn::CudaGraph::IsCapturing(), "NCCL barrier (rank ", rank(), ", ",
                 device().ToString(), ") cannot run inside a CUDA graph capture: the host "
                 "waits for it");
    nn::Tensor token = nn::zeros({1}, {.dtype = nn::kFloat32, .device = device()});
    Launch("barrier", token, token, [&](const void* send, void* recv) {
      return ncclAllReduce(send, recv, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
    JoinComputeStream(done_);
    // The host waits here, polling so that a stop or an NCCL error ends the wait.
    nn::internal::WaitUntil([&] {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) return true;
      if (q != cudaErrorNotReady) TANDEM_CHECK_CUDA(q, device());
      cudaGetLastError();  // "not ready" is no error: not for the next launch check to see
      ThrowIfStopping("barrier");
      AbortGuard::Use use(guard_);
      if (use.aborted()) ThrowAborted("barrier");
      const ncclResult_t error = AsyncErrorLocked();
      TANDEM_CHECK(error == ncclSuccess, "NCCL barrier on ", device().ToString(), ": ",
                   NcclText(error, comm_));
      return false;
    });
  }

 private:
  // The handle of the collective just queued on stream_: an event recorded
  // after it, which wait() makes the compute stream wait for.
  std::shared_ptr<Work> DoneOnStream() {
    nn::internal::CudaDeviceScope on_device(device());
    cudaEvent_t done = events_->Take();
    const cudaError_t recorded = EventRecord(done, stream_);
    if (recorded != cudaSuccess) {
      events_->Give(done);
      TANDEM_CHECK_CUDA(recorded, device());
    }
    return MakeNcclWork(done, device(), events_, nn::CudaGraph::CaptureId());
  }

  // The communicator's asynchronous error, or ncclSuccess (ncclInProgress, an
  // operation still under way, is none). Under guard_.
  ncclResult_t AsyncErrorLocked() {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) return r;
    return state == ncclInProgress ? ncclSuccess : state;
  }

  [[noreturn]] void ThrowAborted(const char* op) const {
    throw CancelledError(absl::StrCat("rank ", rank(), ": ", op, " #", sequence(),
                                      " abandoned: the run is stopping (communicator aborted)"));
  }
  void ThrowIfStopping(const char* op) const {
    if (stop_requested()) {
      throw CancelledError(absl::StrCat("rank ", rank(), ": ", op, " #", sequence(),
                                        " abandoned: the run is stopping"));
    }
  }

  // Orders the call after the compute stream's work and runs it on stream_,
  // then records done_ there. Throws on an NCCL error, and CancelledError once
  // the communicator is aborted. The tensors are on this rank's device
  // (Communicator checked that before entering the collective); call gets
  // their pointers (send, recv: the same tensor for an in-place collective).
  template <typename Call>  // ncclResult_t(const void* send, void* recv)
  void Launch(const char* op, const nn::Tensor& send, const nn::Tensor& recv, Call call) {
    // The events are the communicator's device's: a rank inside a device guard
    // for another GPU would otherwise record them on the wrong one ("invalid
    // resource handle").
    nn::internal::CudaDeviceScope on_device(device());
    const bool capturing = nn::CudaGraph::IsCapturing();
    if (!capturing) WaitForInflightRoom(op);
    // Every pointer before the ready event: data_ptr() orders this thread's
    // stream after the stream that owns the tensor (Storage::PrepareUse), and
    // stream_ sees only what this thread's stream had queued when ready_ was
    // recorded. Taken later, NCCL would read a tensor another thread's kernels
    // were still writing.
    const void* send_ptr = send.data_ptr();
    void* recv_ptr = recv.data_ptr();
    try {
      TANDEM_CHECK_CUDA(EventRecord(ready_, nn::internal::ThreadStream(device())), device());
      TANDEM_CHECK_CUDA(StreamWaitEvent(stream_, ready_, 0), device());
      AbortGuard::Use use(guard_, op);
      if (use.aborted()) ThrowAborted(op);
      const ncclResult_t r = call(send_ptr, recv_ptr);
      TANDEM_CHECK(r == ncclSuccess, "NCCL ", op, " #", sequence(), " on ", device().ToString(),
                   " (rank ", rank(), "): ", NcclText(r, comm_));
    } catch (...) {
      // Entered but not enqueued (NCCL checks its arguments before it queues
      // anything): complete once the collectives before it are, so a caller
      // that catches the error does not leave the watchdog a phantom in flight.
      std::lock_guard<std::mutex> lock(inflight_mutex_);
      inflight_.emplace_back(sequence(), nullptr);
      throw;
    }
    TANDEM_CHECK_CUDA(EventRecord(done_, stream_), device());
    if (capturing) {
      // Recorded into a graph, not run: an event recorded in a capture cannot be
      // queried (cudaErrorCapturedEvent). The capture's entry completes in order,
      // once the eager collectives before it have (marking it complete now would
      // mark them complete too); each replay of the graph is followed instead,
      // as one collective "graph replay" (TrackReplay).
      {
        std::lock_guard<std::mutex> lock(inflight_mutex_);
        inflight_.emplace_back(sequence(), nullptr);
      }
      if (!nn::CudaGraph::HasPostReplayHook(this)) {  // once per capture
        if (auto release = nn::CudaGraph::ReleaserOfCurrentCapture()) {
          graph_releasers_.push_back(std::move(release));
        }
        // Before the launch: a replay that cannot be followed (another thread)
        // or whose communicator is gone must not run the collectives at all
        // (they would wait for peers that never join, untraced).
        nn::CudaGraph::AddPreReplayHook(
            [this, alive = std::weak_ptr<int>(alive_), thread = std::this_thread::get_id()] {
              TANDEM_CHECK(!alive.expired(), "CudaGraph::Replay: the graph holds NCCL collectives "
                           "of a spawn run that has ended (its communicators are gone): destroy "
                           "such graphs before the training function returns");
              TANDEM_CHECK(std::this_thread::get_id() == thread, "CudaGraph::Replay: the graph "
                           "holds NCCL collectives of rank ", rank(), ": replay it on the rank "
                           "thread that captured it (its replays are traced there)");
            });
        nn::CudaGraph::AddPostReplayHook(this, [this] { TrackReplay(); });
      }
      return;
    }
    cudaEvent_t traced = events_->Take();
    const cudaError_t recorded = EventRecord(traced, stream_);
    if (recorded != cudaSuccess) {
      events_->Give(traced);
      TANDEM_CHECK_CUDA(recorded, device());
    }
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    inflight_.emplace_back(sequence(), traced);
  }

  // Rank thread, right after a replay of a graph that holds this
  // communicator's collectives has been launched on its compute stream: the
  // replay is traced as one collective that completes when the graph has run.
  // Bounded like eager collectives, so the host never runs far ahead.
  void TrackReplay() {
    const uint64_t sequence = Enter("graph replay");
    nn::internal::CudaDeviceScope on_device(device());
    cudaEvent_t traced = events_->Take();
    const cudaError_t recorded = EventRecord(traced, nn::internal::ThreadStream(device()));
    if (recorded != cudaSuccess) {
      events_->Give(traced);
      TANDEM_CHECK_CUDA(recorded, device());
    }
    {
      std::lock_guard<std::mutex> lock(inflight_mutex_);
      inflight_.emplace_back(sequence, traced);
    }
    WaitForInflightRoom("graph replay");
  }

  // Waits (stop-aware, outside guard_) until fewer than kMaxInflight collectives
  // are in flight; see the file comment, condition (2).
  void WaitForInflightRoom(const char* op) {
    auto has_room = [&] {
      std::lock_guard<std::mutex> lock(inflight_mutex_);
      DrainCompletedLocked();
      if (!device_error_.ok()) {
        throw DeviceError(absl::StrCat(op, " #", sequence(), ": ", device_error_.message()));
      }
      return inflight_.size() < kMaxInflight;
    };
    if (has_room()) return;
    nn::internal::WaitUntil([&] {
      ThrowIfStopping(op);
      return has_room();
    });
  }

  void DrainCompletedLocked() {
    while (!inflight_.empty()) {
      auto [sequence, event] = inflight_.front();
      // No event: a collective recorded in a capture (or refused before it was
      // queued), complete once reached.
      const cudaError_t q = event != nullptr ? cudaEventQuery(event) : cudaSuccess;
      if (q != cudaSuccess) {
        // Cleared: this runs on the rank thread too (WaitForInflightRoom), whose
        // next launch check must not see "not ready". A failure stays stuck
        // here and is kept, so the run fails with it (PollDeviceError, the next
        // WaitForInflightRoom) rather than with a timeout that would lose it.
        cudaGetLastError();
        if (q != cudaErrorNotReady && device_error_.ok()) {
          device_error_ = absl::InternalError(absl::StrCat(
              "CUDA error on ", device().ToString(), " (rank ", rank(), ") while following NCCL "
              "collective #", sequence, ": ", cudaGetErrorName(q), " (", cudaGetErrorString(q),
              ")"));
        }
        break;
      }
      if (event != nullptr) events_->Give(event);
      inflight_.pop_front();
      MarkCompleted(sequence);
    }
  }

  void JoinComputeStream(cudaEvent_t event) {
    TANDEM_CHECK_CUDA(StreamWaitEvent(nn::internal::ThreadStream(device()), event, 0), device());
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  // Every NCCL call on comm_ runs under it; Abort() takes it too.
  AbortGuard guard_;
  // (sequence, event after it) of collectives not yet seen complete, and events
  // to reuse; the rank thread appends, the rank or the watchdog thread pops.
  std::mutex inflight_mutex_;
  std::deque<std::pair<uint64_t, cudaEvent_t>> inflight_;
  // The first CUDA error an event query of inflight_ returned (not "not ready").
  absl::Status device_error_;
  std::shared_ptr<EventPool> events_;
  // One per captured collective (rank thread only): releases its graph.
  std::vector<std::function<std::string(const std::string&)>> graph_releasers_;
  // Expires with the communicator: a graph replay's hook checks it.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

}  // namespace

namespace {

// Sets `name` to `value` unless it already has that value: after the first
// run nothing is written, so a later run does not race with NCCL's threads
// reading the environment. Serialised between concurrent spawns.
void SetEnvOnce(const char* name, const char* value) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const char* now = std::getenv(name);
  if (now == nullptr || std::string(now) != value) setenv(name, value, /*overwrite=*/1);
}

// NCCL_LAUNCH_MODE=GROUP makes every launch of an intra-process communicator
// spin in a barrier with the other ranks' launches (group.cc, doLaunches ->
// ncclCommIntraBarrierIn/Out), which no abort flag ends: a rank inside an
// enqueue (under its AbortGuard) would wait for good for a peer that failed
// before the collective, and the watchdog's abort would wait for that rank.
// That breaks condition (2) of the file comment; only PARALLEL (the default) works.
absl::Status RefuseGroupLaunchMode() {
  if (const char* mode = std::getenv("NCCL_LAUNCH_MODE");
      mode != nullptr && strcasecmp(mode, "GROUP") == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL_LAUNCH_MODE=", mode, " is not supported by spawn: its launches wait for every "
        "rank's launch in a barrier that an abort cannot end, so one failing rank would hang "
        "the run; unset it or set NCCL_LAUNCH_MODE=PARALLEL"));
  }
  return absl::OkStatus();
}

// Lazy connection (NCCL_RUNTIME_CONNECT=1) would make a rank's first collective
// wait, inside its guarded enqueue, for its peers' connection set-up: a peer
// that failed first would hold it there, and the abort behind it (the same
// shape as NCCL_LAUNCH_MODE=GROUP above). Every connection is made at init.
// Graph buffer registration (NCCL_GRAPH_REGISTER=1, NCCL's default) runs
// inside an enqueue under capture and, with NVLS (NVSwitch systems), exchanges
// with the other ranks in loops that check no abort flag (nvls.cc,
// ncclShmemAllgather): the same shape again. It is turned off; captured
// collectives then use NCCL's own buffers (a copy more on NVLS systems).
// Each is refused when set otherwise, else set to 0.
absl::Status TurnOffSetUpInsideCollectives() {
  struct Required {
    const char* name;
    const char* why;
  };
  for (const Required& r :
       {Required{"NCCL_RUNTIME_CONNECT", "a collective would set up its connections"},
        Required{"NCCL_GRAPH_REGISTER", "a captured collective would register its buffers "
                                        "with the other ranks"}}) {
    const char* value = std::getenv(r.name);
    if (value != nullptr && std::string(value) != "0") {
      return absl::FailedPreconditionError(absl::StrCat(
          r.name, "=", value, " is not supported by spawn: ", r.why, " inside a call that an "
          "abort cannot interrupt, so one failing rank could hang the run; unset it or set ",
          r.name, "=0"));
    }
    SetEnvOnce(r.name, "0");
  }
  return absl::OkStatus();
}

// ncclCommInitAll takes no config: its communicators are blocking unless
// NCCL_COMM_BLOCKING=0 says otherwise, which this code does not handle
// (every call would return ncclInProgress).
absl::Status RefuseNonBlocking() {
  if (const char* blocking = std::getenv("NCCL_COMM_BLOCKING");
      blocking != nullptr && std::string(blocking) == "0") {
    return absl::FailedPreconditionError(
        "NCCL_COMM_BLOCKING=0 is not supported by spawn: its communicators are blocking (see "
        "spawn/comm/nccl/nccl_communicator.cc); unset it");
  }
  return absl::OkStatus();
}

// The environment spawn's shutdown needs from NCCL, set before any
// communicator is made; a user's setting that would break it is refused.
absl::Status PrepareNcclEnvironment() {
  RETURN_IF_ERROR(RefuseGroupLaunchMode());
  RETURN_IF_ERROR(TurnOffSetUpInsideCollectives());
  RETURN_IF_ERROR(RefuseNonBlocking());
  // NCCL reads /etc/nccl.conf (or NCCL_CONF_FILE) at its first call and sets
  // what it finds there only where the environment has nothing: the values
  // spawn relies on are set here, so a config file cannot bring GROUP or
  // non-blocking back.
  SetEnvOnce("NCCL_LAUNCH_MODE", "PARALLEL");
  SetEnvOnce("NCCL_COMM_BLOCKING", "1");
  return absl::OkStatus();
}

// Wraps the communicators made for devices (rank first_rank + i on devices[i])
// with their communication streams; on failure aborts every one of them.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> WrapCommunicators(
    const std::vector<nn::Device>& devices, const std::vector<ncclComm_t>& comms, int first_rank,
    int world_size) {
  const int n = static_cast<int>(devices.size());
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i) {
    nn::internal::CudaDeviceScope on_device(devices[i]);  // the stream and events' device
    cudaStream_t stream;
    const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      // Every communicator is aborted, none destroyed; nothing uses them yet.
      for (auto& made : out) (void)made->Abort(std::chrono::seconds(1));
      for (int k = i; k < n; ++k) ncclCommAbort(comms[k]);
      return absl::InternalError(absl::StrCat("cudaStreamCreate on cuda:", devices[i].index, ": ",
                                              cudaGetErrorString(e)));
    }
    out.push_back(std::make_unique<NcclCommunicator>(first_rank + i, world_size, devices[i],
                                                     comms[i], stream));
  }
  return out;
}

absl::Status InitFailure(const std::vector<ncclComm_t>& comms, ncclResult_t r,
                         const std::string& what) {
  // NCCL's own words for why, read before the aborts can overwrite them
  // (ncclGetLastError ignores its argument in 2.28: the process's last error,
  // e.g. "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ...").
  std::string text = ncclGetErrorString(r);
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0') {
    absl::StrAppend(&text, ": ", last);
  }
  for (ncclComm_t c : comms) {
    if (c != nullptr) ncclCommAbort(c);
  }
  return absl::InternalError(absl::StrCat("NCCL init of ", what, ": ", text));
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<nn::Device>& devices) {
  RETURN_IF_ERROR(PrepareNcclEnvironment());
  const int n = static_cast<int>(devices.size());
  std::vector<int> devlist;
  std::string gpus;
  for (const nn::Device& d : devices) {
    devlist.push_back(d.index);
    absl::StrAppend(&gpus, gpus.empty() ? "" : ",", d.index);
  }
  std::vector<ncclComm_t> comms(n, nullptr);
  ncclResult_t r;
  {
    // ncclCommInitAll selects each device in turn and then restores the
    // thread's device with cudaSetDevice, which would make a context on GPU 0
    // for a thread that had none; the scope makes the first GPU of the run the
    // one restored (and, for such a thread, the one it keeps, as every
    // CudaDeviceScope does).
    nn::internal::CudaDeviceScope on_first(devices[0]);
    r = ncclCommInitAll(comms.data(), n, devlist.data());
  }
  if (r != ncclSuccess) return InitFailure(comms, r, absl::StrCat("GPUs ", gpus));
  return WrapCommunicators(devices, comms, 0, n);
}

// --- Across processes -------------------------------------------------------------

absl::StatusOr<std::string> NcclUniqueIdBytes() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", NcclText(r, nullptr)));
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicatorsAcross(
    const std::vector<nn::Device>& devices, const std::string& unique_id, int first_rank,
    int world_size) {
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL unique id of ", unique_id.size(),
                                                   " bytes, expected ", sizeof(ncclUniqueId)));
  }
  RETURN_IF_ERROR(PrepareNcclEnvironment());
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(n, nullptr);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;  // see the file comment: no asynchronous group path per collective
  ncclResult_t r = ncclSuccess;
  ncclGroupStart();
  for (int i = 0; i < n; ++i) {
    // NCCL reads the current device at this call; the scope gives the calling
    // thread its own device back afterwards.
    nn::internal::CudaDeviceScope on_device(devices[i]);
    r = ncclCommInitRankConfig(&comms[i], world_size, id, first_rank + i, &config);
    if (r != ncclSuccess) break;
  }
  const ncclResult_t end = ncclGroupEnd();  // blocking: returns when every init is done
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess) {
    return InitFailure(comms, r, absl::StrCat("global ranks ", first_rank, "..",
                                              first_rank + n - 1, " of ", world_size));
  }
  return WrapCommunicators(devices, comms, first_rank, world_size);
}

std::string CudaNcclVersions() {
  int nccl = 0, runtime = 0, driver = 0;
  ncclGetVersion(&nccl);
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  return absl::StrCat("NCCL ", nccl / 10000, ".", (nccl / 100) % 100, ".", nccl % 100,
                      ", CUDA runtime ", runtime / 1000, ".", (runtime % 1000) / 10, ", driver ",
                      driver / 1000, ".", (driver % 1000) / 10);
}

}  // namespace tandem::dist::internal
