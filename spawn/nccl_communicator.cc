// NCCL communicators for ranks on distinct GPUs. Compiled only with CUDA; the
// only file of tandem that includes nccl.h.
//
// Creation: spawn's thread makes every rank's communicator at once, before any
// rank thread starts, the way ncclCommInitAll does (one unique id, one
// ncclCommInitRankConfig per device inside ncclGroupStart/End) but with a config:
// ncclCommInitAll takes none, and we need blocking = 0 (below). NCCL_RUNTIME_CONNECT
// is set to 0 first (unless the user set it) so every connection is made during
// init: a later collective never waits on a peer's connection set-up.
//
// Streams: each rank has a communication stream. A collective records an event
// on the rank's compute stream (nn::internal::ThreadStream), the communication
// stream waits for it, NCCL runs there, and an event recorded after it is waited
// for by the compute stream (synchronous calls) or by Work::wait (asynchronous).
// The host never waits for the GPU except in barrier(), which polls.
//
// Why ncclCommAbort is safe here. NCCL requires, for a safe abort, that no thread
// be inside an NCCL call on the communicator and that every rank's communicator
// be aborted. (1) The communicators are non-blocking (config.blocking = 0): an
// NCCL call returns at once (ncclInProgress at worst) and rank threads then poll
// ncclCommGetAsyncError, checking the run's stop flag between polls, so a rank
// thread is never stuck inside NCCL: once spawn sets the stop flag every rank
// thread leaves NCCL and returns. (2) spawn calls AbortNcclCommunicators only
// after joining every rank thread, so no thread can be inside an NCCL call then.
// (3) It aborts all of them, from that one thread. Kernels stuck on a GPU waiting
// for a peer that never came are ended by the abort.
//
// Watchdog: every collective records an event on the communication stream; the
// watchdog thread polls them (PollCompleted) and marks a collective complete
// when its event has fired, so a collective stuck on the GPU (a peer that never
// came) shows up in the watchdog's report as the op and sequence number it is.
//
// CUDA graph capture (nn/graph.h): the event record / wait pair between the
// compute and communication streams makes the communication stream join the
// capture, and the compute stream's wait on the collective's end event (done_,
// or Work::wait) joins it back, so the collectives are recorded in the graph.
// Collectives recorded in a graph are not traced for the watchdog (an event
// recorded in a capture cannot be queried); barrier() cannot be captured.
#include <nccl.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/graph.h"
#include "spawn/internal/nccl.h"

namespace tandem::dist::internal {
namespace {

ncclDataType_t NcclType(nn::DType dtype) {
  switch (dtype) {
    case nn::DType::kFloat32: return ncclFloat32;
    case nn::DType::kFloat64: return ncclFloat64;
    case nn::DType::kBFloat16: return ncclBfloat16;
    case nn::DType::kInt64: return ncclInt64;
    case nn::DType::kUInt8: return ncclUint8;
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

std::string NcclText(ncclResult_t result, ncclComm_t comm) {
  std::string text = ncclGetErrorString(result);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') absl::StrAppend(&text, ": ", last);
  }
  return text;
}

// Polls a non-blocking communicator until its pending operation is done.
// `stop` (may be null) is checked between polls: the caller then throws.
ncclResult_t WaitComm(ncclComm_t comm, const std::stop_token* stop) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (stop != nullptr && stop->stop_requested()) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

class NcclWork final : public Work {
 public:
  NcclWork(cudaEvent_t done, nn::Device device) : done_(done), device_(device) {}
  ~NcclWork() override { cudaEventDestroy(done_); }
  void wait() override {
    TANDEM_CHECK_CUDA(cudaStreamWaitEvent(nn::internal::ThreadStream(device_), done_, 0), device_);
  }

 private:
  cudaEvent_t done_;
  nn::Device device_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world_size, nn::Device device, ncclComm_t comm,
                   cudaStream_t stream)
      : Communicator(rank, world_size, device), comm_(comm), stream_(stream) {
    TANDEM_CHECK_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), device);
    TANDEM_CHECK_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), device);
  }

  ~NcclCommunicator() override {
    cudaSetDevice(device().index);
    if (!aborted_) {
      // A clean run: flush and free. Non-blocking: wait for the finalize to finish.
      if (ncclCommFinalize(comm_) == ncclInProgress) WaitComm(comm_, nullptr);
      ncclCommDestroy(comm_);
    }
    for (auto& [sequence, event] : inflight_) cudaEventDestroy(event);
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }

  // Watchdog thread: marks collectives whose events fired complete, in order.
  void PollCompleted() override {
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    while (!inflight_.empty()) {
      auto [sequence, event] = inflight_.front();
      if (cudaEventQuery(event) != cudaSuccess) break;  // not yet (or failed: stays stuck)
      cudaEventDestroy(event);
      inflight_.pop_front();
      MarkCompleted(sequence);
    }
  }

  std::string kind() const override { return "nccl"; }
  bool CompletesOnReturn() const override { return false; }

  // See the file comment for why this is safe. Spawn's thread only.
  void Abort() {
    if (aborted_) return;
    aborted_ = true;
    cudaSetDevice(device().index);
    ncclCommAbort(comm_);
  }

 protected:
  void AllReduceImpl(nn::Tensor& x, ReduceOp op) override {
    Launch("all_reduce", x, [&] {
      return ncclAllReduce(x.data_ptr(), x.data_ptr(), x.numel(), NcclType(x.dtype()), NcclOp(op),
                           comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  std::shared_ptr<Work> AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op) override {
    Launch("all_reduce_async", x, [&] {
      return ncclAllReduce(x.data_ptr(), x.data_ptr(), x.numel(), NcclType(x.dtype()), NcclOp(op),
                           comm_, stream_);
    });
    cudaEvent_t done;
    TANDEM_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), device());
    TANDEM_CHECK_CUDA(cudaEventRecord(done, stream_), device());
    return std::make_shared<NcclWork>(done, device());
  }

  void BroadcastImpl(nn::Tensor& x, int root) override {
    Launch("broadcast", x, [&] {
      return ncclBroadcast(x.data_ptr(), x.data_ptr(), x.numel(), NcclType(x.dtype()), root,
                           comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override {
    Launch("all_gather", input, [&] {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), input.numel(),
                           NcclType(input.dtype()), comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) override {
    Launch("reduce_scatter", input, [&] {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                               NcclType(input.dtype()), NcclOp(op), comm_, stream_);
    });
    JoinComputeStream(done_);
  }

  void BarrierImpl() override {
    TANDEM_CHECK(!nn::CudaGraph::IsCapturing(), "NCCL barrier (rank ", rank(), ", ",
                 device().ToString(), ") cannot run inside a CUDA graph capture: the host "
                 "waits for it");
    nn::Tensor token = nn::zeros({1}, {.dtype = nn::kFloat32, .device = device()});
    Launch("barrier", token, [&] {
      return ncclAllReduce(token.data_ptr(), token.data_ptr(), 1, ncclFloat32, ncclSum, comm_,
                           stream_);
    });
    JoinComputeStream(done_);
    // The host waits here, polling so that a stop or an NCCL error ends the wait.
    while (true) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) TANDEM_CHECK_CUDA(q, device());
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      TANDEM_CHECK(state == ncclSuccess || state == ncclInProgress, "NCCL barrier on ",
                   device().ToString(), ": ", NcclText(state, comm_));
      if (stop_requested()) {
        throw CancelledError(absl::StrCat("rank ", rank(), ": barrier #", sequence(),
                                          " abandoned: the run is stopping"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  // Orders the call after the compute stream's work and runs it on stream_,
  // then records done_ there. Throws on an NCCL error or when the run stops
  // while NCCL is still accepting the call.
  template <typename Call>
  void Launch(const char* op, const nn::Tensor& t, Call call) {
    TANDEM_CHECK(t.device() == device(), op, ": tensor ", t.ToString(), " is not on rank ", rank(),
                 "'s device ", device().ToString());
    TANDEM_CHECK_CUDA(cudaEventRecord(ready_, nn::internal::ThreadStream(device())), device());
    TANDEM_CHECK_CUDA(cudaStreamWaitEvent(stream_, ready_, 0), device());
    ncclResult_t r = call();
    if (r == ncclInProgress) {
      r = WaitComm(comm_, &stop_token());
      if (r == ncclInProgress) {
        throw CancelledError(absl::StrCat("rank ", rank(), ": ", op, " #", sequence(),
                                          " abandoned: the run is stopping"));
      }
    }
    TANDEM_CHECK(r == ncclSuccess, "NCCL ", op, " #", sequence(), " on ", device().ToString(),
                 " (rank ", rank(), "): ", NcclText(r, comm_));
    TANDEM_CHECK_CUDA(cudaEventRecord(done_, stream_), device());
    if (nn::CudaGraph::IsCapturing()) {
      // Recorded into a graph, not run: an event recorded in a capture cannot be
      // queried (cudaErrorCapturedEvent), so the watchdog does not follow this
      // collective; it runs at every replay, untraced.
      MarkCompleted(sequence());
      return;
    }
    cudaEvent_t traced;
    TANDEM_CHECK_CUDA(cudaEventCreateWithFlags(&traced, cudaEventDisableTiming), device());
    TANDEM_CHECK_CUDA(cudaEventRecord(traced, stream_), device());
    std::lock_guard<std::mutex> lock(inflight_mutex_);
    inflight_.emplace_back(sequence(), traced);
  }

  void JoinComputeStream(cudaEvent_t event) {
    TANDEM_CHECK_CUDA(cudaStreamWaitEvent(nn::internal::ThreadStream(device()), event, 0),
                      device());
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t done_ = nullptr;
  bool aborted_ = false;
  // (sequence, event after it) of collectives not yet seen complete; the rank
  // thread appends, the watchdog thread pops.
  std::mutex inflight_mutex_;
  std::deque<std::pair<uint64_t, cudaEvent_t>> inflight_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<nn::Device>& devices) {
  const int n = static_cast<int>(devices.size());
  setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
  auto describe = [&] {
    std::string text;
    for (const nn::Device& d : devices) absl::StrAppend(&text, text.empty() ? "" : ",", d.index);
    return text;
  };
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetUniqueId: ", NcclText(r, nullptr)));
  }
  std::vector<ncclComm_t> comms(n, nullptr);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclGroupStart();
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(devices[i].index);
    r = ncclCommInitRankConfig(&comms[i], n, id, i, &config);
    if (r != ncclSuccess && r != ncclInProgress) break;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  if (r == ncclInProgress) r = ncclSuccess;
  for (int i = 0; i < n && r == ncclSuccess; ++i) {
    if (comms[i] != nullptr) r = WaitComm(comms[i], nullptr);
  }
  if (r != ncclSuccess) {
    for (ncclComm_t c : comms) {
      if (c != nullptr) ncclCommAbort(c);
    }
    return absl::InternalError(absl::StrCat("NCCL init over GPUs ", describe(), ": ",
                                            NcclText(r, nullptr)));
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(devices[i].index);
    cudaStream_t stream;
    const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      for (int k = i; k < n; ++k) ncclCommAbort(comms[k]);
      return absl::InternalError(absl::StrCat("cudaStreamCreate on cuda:", devices[i].index, ": ",
                                              cudaGetErrorString(e)));
    }
    out.push_back(std::make_unique<NcclCommunicator>(i, n, devices[i], comms[i], stream));
  }
  return out;
}

void AbortNcclCommunicators(const std::vector<std::unique_ptr<Communicator>>& comms) {
  for (const auto& c : comms) {
    if (auto* nccl = dynamic_cast<NcclCommunicator*>(c.get())) nccl->Abort();
  }
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
  const int n = static_cast<int>(devices.size());
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL unique id of ", unique_id.size(),
                                                   " bytes, expected ", sizeof(ncclUniqueId)));
  }
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
  std::vector<ncclComm_t> comms(n, nullptr);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclSuccess;
  ncclGroupStart();
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(devices[i].index);
    r = ncclCommInitRankConfig(&comms[i], world_size, id, first_rank + i, &config);
    if (r != ncclSuccess && r != ncclInProgress) break;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  if (r == ncclInProgress) r = ncclSuccess;
  for (int i = 0; i < n && r == ncclSuccess; ++i) {
    if (comms[i] != nullptr) r = WaitComm(comms[i], nullptr);
  }
  if (r != ncclSuccess) {
    for (ncclComm_t c : comms) {
      if (c != nullptr) ncclCommAbort(c);
    }
    return absl::InternalError(absl::StrCat("NCCL init of global ranks ", first_rank, "..",
                                            first_rank + n - 1, " of ", world_size, ": ",
                                            NcclText(r, nullptr)));
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(devices[i].index);
    cudaStream_t stream;
    const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      for (int k = i; k < n; ++k) ncclCommAbort(comms[k]);
      return absl::InternalError(absl::StrCat("cudaStreamCreate on cuda:", devices[i].index, ": ",
                                              cudaGetErrorString(e)));
    }
    out.push_back(std::make_unique<NcclCommunicator>(first_rank + i, world_size, devices[i],
                                                     comms[i], stream));
  }
  return out;
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
