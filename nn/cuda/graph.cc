// CudaGraph (nn/graph.h): stream capture of a training step on the calling
// thread's stream, a private allocation arena for the captured step, and replay.
// Built only when TANDEM_WITH_CUDA (nn/graph.cc is the build without CUDA).
//
// Capture sequence (all on the capturing thread):
//   1. route the thread's CUDA allocations to a fresh CaptureArena and its pool
//      frees to a deferred list (nn/internal/allocator.h);
//   2. under the device's capture lock, record a mark event on
//      ThreadStream(device) (its eager work) and register the capture with the
//      device's capture registry (nn/internal/capture_registry.h: other
//      threads' work on this stream waits or is handed to the capture from now
//      on); cudaStreamBeginCapture(ThreadStream(device),
//      cudaStreamCaptureModeThreadLocal): other threads (other ranks) are not
//      affected by this capture;
//   3. run the step; every kernel, copy and memset enqueued on the thread's stream
//      (and on streams that join it through event waits, e.g. NCCL's) is recorded;
//   4. cudaStreamEndCapture, whatever happened in 3 (a capture must not outlive
//      Capture()); unregister the capture and do the frees other threads handed
//      to it; restore the allocator, hand the pool memory released during
//      the step to the arena (the graph may read it at every replay), clear
//      CUDA's last error; on failure throw (see the header) with the thread usable;
//   5. order the thread's stream after the arena's allocations; cudaGraphInstantiate
//      and cudaGraphUpload.
//
// Memory: no cudaMalloc, cudaFree or device synchronisation, from capture to
// release. Mid-run, with peer access on, those can wait behind the NCCL kernels
// of every GPU; a graph is typically captured after the run's first
// collectives. The arena takes its chunks stream-ordered (cudaMallocAsync from
// the device's pool) on a stream of its own that is never captured, and gives
// them back (cudaFreeAsync) on that stream once it has been ordered after every
// stream that launched the graph and every stream that owned memory the
// capture released.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/cuda/internal/capture_mode.h"
#include "nn/error.h"
#include "nn/graph.h"
#include "nn/internal/allocator.h"
#include "nn/internal/capture_registry.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/tensor.h"

namespace tandem::nn {
namespace {

constexpr int64_t kArenaAlignment = 256;
constexpr int64_t kArenaChunkBytes = int64_t{64} << 20;

// Device memory that a graph may read at every replay, to be released when
// nothing can replay it any more.
struct GraphMemory {
  Device device;
  std::vector<void*> chunks;               // the arena's, from GraphMemoryStream(device)
  internal::DeferredCudaFrees pool_frees;  // pool memory released during the capture
  std::vector<cudaStream_t> users;         // streams the graph was uploaded or launched on
};

// The stream of `device` on which capture arenas take and give back their
// memory (cudaMallocAsync / cudaFreeAsync): made once, never destroyed, never
// captured. Null when it cannot be made (a broken context; the caller reports
// or leaks).
cudaStream_t GraphMemoryStream(Device device) noexcept {
  static std::mutex mu;
  static auto* streams = new std::map<int, cudaStream_t>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find(device.index);
  if (it != streams->end()) return it->second;
  internal::CudaDeviceScope on_device(device, std::nothrow);
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  streams->emplace(device.index, stream);
  return stream;
}

// Orders `waiter` (a stream of any device) after the work queued on `producer`
// (a stream of `producer_device`) so far, with an event made for it. Never
// throws; a failure is cleared from the thread's last error (so that the next
// launch check does not blame its kernel) and returned: the memory-release
// paths go on regardless, Capture and Replay throw it (their stream would
// otherwise read the graph's memory unordered after its allocation).
cudaError_t OrderAfter(cudaStream_t waiter, cudaStream_t producer,
                       Device producer_device) noexcept {
  if (waiter == producer) return cudaSuccess;
  internal::CudaDeviceScope on_device(producer_device, std::nothrow);
  cudaEvent_t event = nullptr;
  internal::CountCudaCall(internal::CudaCall::kEventCreate);
  cudaError_t status = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return status;
  }
  internal::CountCudaCall(internal::CudaCall::kEventRecord);
  status = cudaEventRecord(event, producer);
  if (status == cudaSuccess) {
    internal::CountCudaCall(internal::CudaCall::kStreamWaitEvent);
    status = cudaStreamWaitEvent(waiter, event, 0);
  }
  cudaEventDestroy(event);  // released once the record completes
  if (status != cudaSuccess) cudaGetLastError();
  return status;
}

// What a capture on this thread collects (null when none runs).
struct CaptureState {
  std::vector<std::function<void()>>* hooks;
  // Post-replay hooks with their keys (at most one per key).
  std::vector<std::pair<const void*, std::function<void()>>>* post_hooks;
  // Releases the graph being captured (CudaGraph::ReleaserOfCurrentCapture).
  std::function<std::string(const std::string&)> releaser;
  // Graph memory whose owner died during this capture: released after it ends
  // (the device synchronisation that releasing needs is not allowed inside).
  std::vector<GraphMemory> released;
  // CudaGraph::CaptureId(): from NextCaptureId, never 0.
  uint64_t id = 0;
};
thread_local CaptureState* t_capture = nullptr;

uint64_t NextCaptureId() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

// Gives the memory back, stream-ordered: on each device's GraphMemoryStream,
// after every stream that launched the graph (a replay may still be pending)
// and, for pool memory released during the capture, after the stream that
// owned it. No host wait, no device synchronisation. Destructors call this:
// nothing throws, and a failure is cleared from the thread's last error (the
// next kernel's launch check must not report it). Only when no stream of the
// devices involved captures (Captures()): an event recorded on a stream
// that another thread captures would join that capture.
void ReleaseNow(GraphMemory& memory) {
  if (memory.chunks.empty() && memory.pool_frees.empty()) return;
  const Device device = memory.device;
  // A stream that cannot be had means a broken context: the memory is leaked
  // rather than freed while it may be in use.
  if (cudaStream_t release = GraphMemoryStream(device)) {
    for (cudaStream_t user : memory.users) OrderAfter(release, user, device);
    internal::CudaDeviceScope on_device(device, std::nothrow);
    for (void* chunk : memory.chunks) {
      internal::CountCudaCall(internal::CudaCall::kFreeAsync);
      cudaFreeAsync(chunk, release);
    }
  }
  for (const internal::DeferredCudaFree& f : memory.pool_frees) {
    // The graph's device: its release stream is already after the graph's
    // launches. Another device (a tensor of it died on the capturing thread):
    // the graph does not read it, only its owner's work must be done.
    cudaStream_t release = GraphMemoryStream(f.device);
    if (release == nullptr) continue;
    if (f.stream != nullptr) OrderAfter(release, f.stream, f.device);
    internal::CudaDeviceScope on_device(f.device, std::nothrow);
    internal::CountCudaCall(internal::CudaCall::kFreeAsync);
    cudaFreeAsync(f.ptr, release);
  }
  cudaGetLastError();
  memory.chunks.clear();
  memory.pool_frees.clear();
  memory.users.clear();
}

// The captures running now, per device (nn/internal/capture_registry.h).
// Releasing graph memory records events on the streams that launched the
// graph, which must not be captured at that moment (the record would join
// another thread's capture: two ranks sharing a GPU capture at once, and one's
// graph memory goes; when releasing synchronised the device, CUDA refused it
// with cudaErrorStreamCaptureUnsupported and invalidated that capture). Such a
// release waits until the last capture on its devices has ended; that
// capture's thread then releases it. The release runs under the locks of its
// devices: no capture can start on a stream between the check and the events
// ReleaseNow records there (such a record would fork GraphMemoryStream into
// that capture, with the frees after it).
internal::CaptureRegistry& Captures() {
  static auto* captures = new internal::CaptureRegistry();  // never destroyed
  return *captures;
}

// The devices whose streams releasing `memory` touches.
std::vector<int> DevicesOf(const GraphMemory& memory) {
  std::vector<int> devices{memory.device.index};
  for (const internal::DeferredCudaFree& f : memory.pool_frees) devices.push_back(f.device.index);
  return devices;
}

void Release(GraphMemory memory) {
  if (memory.chunks.empty() && memory.pool_frees.empty()) return;
  if (t_capture != nullptr) {
    t_capture->released.push_back(std::move(memory));
    return;
  }
  std::vector<int> devices = DevicesOf(memory);
  try {
    auto held = std::make_shared<GraphMemory>(std::move(memory));
    Captures().ReleaseOrDefer(std::move(devices), [held] { ReleaseNow(*held); });
  } catch (...) {  // out of memory for the bookkeeping: leaked rather than freed in use
  }
}

// Releases that waited for a capture to end: again, now that one has.
void RetryDeferredReleases() {
  for (internal::CaptureRegistry::Release& r : Captures().TakeDeferred()) {
    Captures().ReleaseOrDefer(std::move(r.first), std::move(r.second));
  }
}

// The memory of a captured step: bump allocation from chunks taken from the
// device's pool on GraphMemoryStream, never reused (a replay rewrites every
// byte the capture handed out, so two tensors of the step must never share
// memory). Free is a no-op. The arena also keeps the pool memory released
// during the capture (the graph may read it). Everything goes back when the
// last Storage of the arena and the graph are gone (ReleaseNow). Thread-safe (a
// tensor of the step may die on another thread).
class CaptureArena final : public Allocator {
 public:
  explicit CaptureArena(Device device) { memory_.device = device; }
  ~CaptureArena() override { Release(std::move(memory_)); }

  void* Allocate(int64_t bytes, Device device) override {
    const Device own = memory_.device;
    TANDEM_CHECK(device == own, "CudaGraph arena of ", own.ToString(), " asked for memory on ",
                 device.ToString(), " (a captured step must use only the graph's device)");
    TANDEM_CHECK(bytes > 0, "CudaGraph arena: bad allocation size ", bytes);
    const int64_t rounded = (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
    std::lock_guard<std::mutex> lock(mu_);
    if (memory_.chunks.empty() || used_ + rounded > chunk_bytes_) {
      const int64_t chunk_bytes = std::max(rounded, kArenaChunkBytes);
      void* chunk = nullptr;
      {
        // Stream-ordered on a stream no one captures; Capture orders the
        // capturing stream after it before the graph is uploaded. Relaxed:
        // the stream's creation and this allocation run during the capture
        // (unsafe calls to a thread that captures), not recorded.
        internal::RelaxedCaptureMode relaxed;
        cudaStream_t stream = GraphMemoryStream(own);
        TANDEM_CHECK(stream != nullptr, "CudaGraph: no stream for the arena on ", own.ToString());
        internal::CudaDeviceScope current(own);
        internal::CountCudaCall(internal::CudaCall::kMallocAsync);
        const cudaError_t status =
            cudaMallocAsync(&chunk, static_cast<size_t>(chunk_bytes), stream);
        if (status != cudaSuccess) {
          cudaGetLastError();
          Fail("CudaGraph: cudaMallocAsync of ", chunk_bytes, " bytes for the captured step on ",
               own.ToString(), " failed: ", cudaGetErrorString(status), " (the step has used ",
               total_bytes_, " bytes so far; captured memory is not reused within the step)");
        }
      }
      memory_.chunks.push_back(chunk);
      chunk_bytes_ = chunk_bytes;
      used_ = 0;
    }
    void* ptr = static_cast<char*>(memory_.chunks.back()) + used_;
    used_ += rounded;
    total_bytes_ += rounded;
    return ptr;
  }

  void Free(void*, int64_t, Device) noexcept override {}

  // Whether `stream` is already one of the graph's users (AddUser).
  bool HasUser(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    return std::find(memory_.users.begin(), memory_.users.end(), stream) != memory_.users.end();
  }

  // `stream` uploaded or launched the graph: the memory goes back after its
  // work (ReleaseNow). Returns whether `stream` is new to the graph.
  bool AddUser(cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(memory_.users.begin(), memory_.users.end(), stream) != memory_.users.end()) {
      return false;
    }
    memory_.users.push_back(stream);
    return true;
  }

  // Takes over pool memory released during the capture.
  void Keep(const internal::DeferredCudaFrees& frees) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& f : frees) memory_.pool_frees.push_back(f);
  }

 private:
  std::mutex mu_;
  GraphMemory memory_;
  int64_t chunk_bytes_ = 0;  // size of memory_.chunks.back()
  int64_t used_ = 0;         // bytes handed out from memory_.chunks.back()
  int64_t total_bytes_ = 0;
};

bool IsCaptureFailure(cudaError_t e) {
  return e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
         e == cudaErrorStreamCaptureImplicit || e == cudaErrorCapturedEvent ||
         e == cudaErrorStreamCaptureWrongThread || e == cudaErrorStreamCaptureIsolation ||
         e == cudaErrorStreamCaptureMerge || e == cudaErrorStreamCaptureUnmatched;
}

}  // namespace

struct CudaGraph::Impl {
  // Guards exec and released: the thread that captured the graph releases it
  // when it exits (ReleaseThreadGraphs), maybe while another thread replays it.
  std::mutex mu;
  cudaGraphExec_t exec = nullptr;
  int64_t num_nodes = 0;
  std::shared_ptr<CaptureArena> arena;
  std::vector<std::function<void()>> hooks;
  std::vector<std::pair<const void*, std::function<void()>>> post_hooks;
  std::string released;  // why Release ran ("" while the graph may be replayed)
  cudaStream_t last_user = nullptr;  // the stream last given to arena->AddUser
  // The capturing thread's stream: it owns the tensors made before the capture
  // that the graph reads and writes (weights, gradients, optimizer state).
  cudaStream_t capture_stream = nullptr;
};

CudaGraph::CudaGraph(Device device) : device_(device) {
  TANDEM_CHECK(device.is_cuda(), "CudaGraph: device ", device.ToString(),
               " is not a CUDA device (CUDA graphs capture GPU work only)");
  const int count = internal::CudaDeviceCount();
  TANDEM_CHECK(device.index >= 0 && device.index < count, "CudaGraph: device ", device.ToString(),
               " is not visible (", count, " CUDA device", count == 1 ? "" : "s", " visible)");
  impl_ = std::make_shared<Impl>();
}

CudaGraph::~CudaGraph() {
  if (impl_ == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->exec != nullptr) {
    // Destroying an executable graph is safe while a launch of it is pending
    // (the driver defers the release). Destructors must not throw; a failure
    // is not left for the next kernel's launch check.
    cudaGraphExecDestroy(impl_->exec);
    cudaGetLastError();
  }
}

bool CudaGraph::captured() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->exec != nullptr;
}
int64_t CudaGraph::num_nodes() const { return impl_->num_nodes; }
Device CudaGraph::device() const { return device_; }

bool CudaGraph::IsCapturing() { return t_capture != nullptr; }

uint64_t CudaGraph::CaptureId() { return t_capture != nullptr ? t_capture->id : 0; }

bool CudaGraph::AddPreReplayHook(std::function<void()> hook) {
  if (t_capture == nullptr) return false;
  TANDEM_CHECK(hook != nullptr, "CudaGraph::AddPreReplayHook: empty hook");
  t_capture->hooks->push_back(std::move(hook));
  return true;
}

std::function<std::string(const std::string&)> CudaGraph::ReleaserOfCurrentCapture() {
  if (t_capture == nullptr) return nullptr;
  return t_capture->releaser;
}

bool CudaGraph::HasPostReplayHook(const void* key) {
  if (t_capture == nullptr) return false;
  for (const auto& [k, h] : *t_capture->post_hooks) {
    if (k == key) return true;
  }
  return false;
}

bool CudaGraph::AddPostReplayHook(const void* key, std::function<void()> hook) {
  if (t_capture == nullptr) return false;
  TANDEM_CHECK(hook != nullptr, "CudaGraph::AddPostReplayHook: empty hook");
  for (const auto& [k, h] : *t_capture->post_hooks) {
    if (k == key) return true;
  }
  t_capture->post_hooks->emplace_back(key, std::move(hook));
  return true;
}

namespace {

// The graphs captured on this thread, for ReleaseThreadGraphs: each one's
// liveness and its releaser (the function a communicator's ReleaseGraphs
// calls). A plain pointer, trivially destroyed: readable from any
// thread-local's destructor at the thread's exit.
struct ThreadGraph {
  std::weak_ptr<void> alive;
  std::function<std::string(const std::string&)> release;
};
thread_local std::vector<ThreadGraph>* t_graphs = nullptr;

// Made at the end of the thread's first capture: destroyed at its exit before
// the thread-locals the step made earlier (the cuBLASLt workspace,
// clip_grad_norm_'s tables), whose own destructors release the graphs too.
struct ReleaseThreadGraphsAtExit {
  ~ReleaseThreadGraphsAtExit() { internal::ReleaseThreadGraphs(); }
};

void RegisterThreadGraph(std::weak_ptr<void> alive,
                         std::function<std::string(const std::string&)> release) {
  thread_local ReleaseThreadGraphsAtExit at_exit;
  (void)at_exit;
  if (t_graphs == nullptr) t_graphs = new std::vector<ThreadGraph>();
  std::erase_if(*t_graphs, [](const ThreadGraph& g) { return g.alive.expired(); });
  t_graphs->push_back({std::move(alive), std::move(release)});
}

// Capture's steps, in the order it runs them.

// The thread may start a capture on `device` now: returns the thread's stream.
cudaStream_t CheckCaptureCanStart(Device device, const std::function<void()>& step) {
  TANDEM_CHECK(t_capture == nullptr,
               "CudaGraph::Capture: a capture is already running on this thread (nested capture)");
  TANDEM_CHECK(current_device() == device, "CudaGraph::Capture: the calling thread's current "
               "device is ", current_device().ToString(), " but the graph is for ",
               device.ToString(), " (use nn::DeviceGuard)");
  TANDEM_CHECK(step != nullptr, "CudaGraph::Capture: empty step");
  cudaStream_t stream = internal::ThreadStream(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TANDEM_CHECK_CUDA(cudaStreamIsCapturing(stream, &status), device);
  TANDEM_CHECK(status == cudaStreamCaptureStatusNone, "CudaGraph::Capture: the thread's stream "
               "on ", device.ToString(), " is already being captured by someone else");
  return stream;
}

// What a capture left: the CUDA results of beginning and ending it, the error
// it left behind, the graph (null unless it ended well), the step's exception.
struct CaptureRun {
  cudaError_t begin = cudaSuccess;
  const char* begin_call = "cudaStreamBeginCapture";  // what `begin` is the result of
  cudaError_t end = cudaSuccess;
  cudaError_t last = cudaSuccess;
  cudaGraph_t graph = nullptr;
  std::exception_ptr step_error;

  void DestroyGraph() {
    if (graph != nullptr) cudaGraphDestroy(graph);
    graph = nullptr;
  }
};

// Runs `step` with the thread's stream in capture mode and its CUDA memory from
// `arena`; restores the thread's allocator and deferred frees afterwards, and
// releases the graph memory that waited for the capture to end. Throws nothing
// (the step's exception is in the result).
CaptureRun CaptureStep(Device device, cudaStream_t stream,
                       const std::shared_ptr<CaptureArena>& arena, CaptureState& state,
                       const std::function<void()>& step) {
  // An earlier, unrelated error must not be blamed on the capture.
  cudaGetLastError();
  internal::DeferredCudaFrees deferred;
  std::shared_ptr<Allocator> previous_allocator = SetThreadCudaAllocator(arena);
  internal::DeferredCudaFrees* previous_deferred = internal::SetThreadDeferredCudaFrees(&deferred);
  CaptureRun run;
  // After the stream's eager work: what another stream's first use of a tensor
  // this stream owns waits for while the capture runs (WaitForOwner). Recorded
  // under the device's capture lock (Begin): after the waits other threads put
  // on this stream (a replay from another thread: the tensors it writes are
  // this stream's), which a mark recorded before the lock would miss.
  cudaEvent_t mark = nullptr;
  internal::CountCudaCall(internal::CudaCall::kEventCreate);
  run.begin = cudaEventCreateWithFlags(&mark, cudaEventDisableTiming);
  run.begin_call = "cudaEventCreateWithFlags (the capture's mark event)";
  bool registered = false;
  if (run.begin == cudaSuccess) {
    try {
      registered = Captures().Begin(device.index, stream, mark, [&] {
        internal::CountCudaCall(internal::CudaCall::kEventRecord);
        run.begin = cudaEventRecord(mark, stream);
        run.begin_call = "cudaEventRecord (the capture's mark event)";
        return run.begin == cudaSuccess;
      });
    } catch (...) {  // out of memory for the registry: this function must not
                     // throw with the thread's allocator still the arena
      run.begin = cudaErrorMemoryAllocation;
      run.begin_call = "registering the capture (out of host memory)";
    }
  }
  if (registered) {
    run.begin = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    run.begin_call = "cudaStreamBeginCapture";
  }
  if (run.begin == cudaSuccess) {
    t_capture = &state;
    try {
      step();
    } catch (...) {
      run.step_error = std::current_exception();
    }
    t_capture = nullptr;
    // Always end the capture (also after a throw or an invalidation), so the
    // stream and the thread leave capture mode.
    run.end = cudaStreamEndCapture(stream, &run.graph);
  }
  run.last = cudaGetLastError();  // clears a sticky capture error
  // What other threads left for the end of the capture (frees of storages this
  // stream owns, with the waits for their users): now, with the thread's
  // deferred frees still set, so pool memory freed there stays with the arena
  // (the graph may read it, as memory this thread released during the step).
  for (const std::function<void()>& after : Captures().End(device.index, stream)) after();
  if (mark != nullptr) cudaEventDestroy(mark);  // released once its waits are done
  cudaGetLastError();
  SetThreadCudaAllocator(std::move(previous_allocator));
  internal::SetThreadDeferredCudaFrees(previous_deferred);
  // Pool memory released during the step may be read by the graph: it lives
  // with the arena.
  arena->Keep(deferred);
  // Graph memory of others that died during the capture, and releases that
  // waited for captures to end: now, unless another capture on their devices
  // still runs (they wait again).
  for (GraphMemory& memory : state.released) Release(std::move(memory));
  RetryDeferredReleases();
  return run;
}

[[noreturn]] void FailSynchronised(const std::string& what) {
  Fail("CudaGraph::Capture: the step synchronised with the host (", what,
       "); a captured step must not read values on the host (item(), copies to the "
       "host, stream or device synchronisation)");
}

// Throws the error that explains a failed capture (destroying its graph): the
// step's own exception, or what CUDA reported.
void ThrowIfCaptureFailed(CaptureRun& run, Device device) {
  if (run.begin != cudaSuccess) {
    Fail("CudaGraph::Capture: ", run.begin_call, " on ", device.ToString(), " failed: ",
         cudaGetErrorName(run.begin), " (", cudaGetErrorString(run.begin), ")");
  }
  const bool invalidated = IsCaptureFailure(run.end) || IsCaptureFailure(run.last);
  if (run.step_error) {
    run.DestroyGraph();
    if (!invalidated) std::rethrow_exception(run.step_error);
    std::string what = "an exception";
    try {
      std::rethrow_exception(run.step_error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    FailSynchronised(what);
  }
  if (run.end == cudaSuccess && run.graph != nullptr) return;
  run.DestroyGraph();
  if (run.end == cudaErrorStreamCaptureUnjoined) {
    Fail("CudaGraph::Capture: the step forked work onto another stream and did not join it "
         "back into the thread's stream on ", device.ToString(), " (",
         cudaGetErrorName(run.end), "); wait for every collective (Work::wait) inside the step");
  }
  if (invalidated || run.end == cudaErrorStreamCaptureInvalidated) {
    FailSynchronised(cudaGetErrorName(run.end != cudaSuccess ? run.end : run.last));
  }
  Fail("CudaGraph::Capture: cudaStreamEndCapture on ", device.ToString(), " failed: ",
       cudaGetErrorName(run.end), " (", cudaGetErrorString(run.end), ")");
}

// The graph's work nodes: kernels, copies and memsets (the benchmark's
// launch-cost model).
int64_t CountWorkNodes(cudaGraph_t graph) {
  size_t count = 0;
  const cudaError_t nodes_status = cudaGraphGetNodes(graph, nullptr, &count);
  std::vector<cudaGraphNode_t> nodes(count);
  int64_t work_nodes = 0;
  if (nodes_status == cudaSuccess && count > 0 &&
      cudaGraphGetNodes(graph, nodes.data(), &count) == cudaSuccess) {
    for (size_t i = 0; i < count; ++i) {
      cudaGraphNodeType type;
      if (cudaGraphNodeGetType(nodes[i], &type) != cudaSuccess) continue;
      if (type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemcpy ||
          type == cudaGraphNodeTypeMemset) {
        ++work_nodes;
      }
    }
  }
  return work_nodes;
}

// The executable graph of `run.graph` (destroyed here), uploaded on `stream`.
cudaGraphExec_t InstantiateAndUpload(CaptureRun& run, cudaStream_t stream, Device device) {
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, run.graph, 0);
  run.DestroyGraph();
  if (inst != cudaSuccess) {
    cudaGetLastError();
    Fail("CudaGraph::Capture: cudaGraphInstantiate on ", device.ToString(), " failed: ",
         cudaGetErrorName(inst), " (", cudaGetErrorString(inst), ")");
  }
  const cudaError_t upload = cudaGraphUpload(exec, stream);
  if (upload != cudaSuccess) {
    cudaGraphExecDestroy(exec);
    cudaGetLastError();
    Fail("CudaGraph::Capture: cudaGraphUpload on ", device.ToString(), " failed: ",
         cudaGetErrorName(upload), " (", cudaGetErrorString(upload), ")");
  }
  return exec;
}

}  // namespace

void CudaGraph::Capture(const std::function<void()>& step) {
  {
    // A released graph has no exec either, but its Replay() throws for good.
    std::lock_guard<std::mutex> lock(impl_->mu);
    TANDEM_CHECK(impl_->exec == nullptr && impl_->released.empty(), "CudaGraph::Capture: this "
                 "graph of ", device_.ToString(), " was already captured (a CudaGraph captures "
                 "once; make a new one)");
  }
  cudaStream_t stream = CheckCaptureCanStart(device_, step);
  auto arena = std::make_shared<CaptureArena>(device_);
  std::vector<std::function<void()>> hooks;
  std::vector<std::pair<const void*, std::function<void()>>> post_hooks;
  CaptureState state{&hooks, &post_hooks,
                     [impl = std::weak_ptr<Impl>(impl_), device = device_](
                         const std::string& reason) -> std::string {
                       std::shared_ptr<Impl> graph = impl.lock();
                       if (graph == nullptr) return "";
                       std::lock_guard<std::mutex> lock(graph->mu);
                       if (graph->exec == nullptr) return "";
                       // Safe while a launch is pending: the driver defers the
                       // release. The graph memory (arena) stays until the
                       // CudaGraph goes.
                       cudaGraphExecDestroy(graph->exec);
                       graph->exec = nullptr;
                       graph->released = reason;
                       return absl::StrCat("CUDA graph of ", device.ToString(), " (",
                                           graph->num_nodes, " nodes)");
                     },
                     {},
                     NextCaptureId()};
  CaptureRun run = CaptureStep(device_, stream, arena, state, step);
  ThrowIfCaptureFailed(run, device_);
  const int64_t work_nodes = CountWorkNodes(run.graph);
  // The arena's chunks were taken on GraphMemoryStream: the upload and every
  // replay on this stream come after them.
  if (cudaStream_t memory_stream = GraphMemoryStream(device_)) {
    const cudaError_t ordered = OrderAfter(stream, memory_stream, device_);
    if (ordered != cudaSuccess) run.DestroyGraph();
    TANDEM_CHECK_CUDA(ordered, device_);
  }
  arena->AddUser(stream);
  // Released when this thread exits (its cuBLASLt workspace and pointer tables,
  // which the graph reads, go with it); harmless if the graph never gets exec.
  try {
    RegisterThreadGraph(impl_, state.releaser);
  } catch (...) {  // out of memory for the list
    run.DestroyGraph();
    throw;
  }
  impl_->last_user = stream;
  impl_->capture_stream = stream;
  cudaGraphExec_t exec = InstantiateAndUpload(run, stream, device_);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->exec = exec;
  impl_->num_nodes = work_nodes;
  impl_->arena = std::move(arena);
  impl_->hooks = std::move(hooks);
  impl_->post_hooks = std::move(post_hooks);
}

void CudaGraph::Replay() {
  // Held to the end: the capturing thread's exit may release the graph
  // (ReleaseThreadGraphs) while another thread replays it.
  std::lock_guard<std::mutex> lock(impl_->mu);
  TANDEM_CHECK(impl_->released.empty(), "CudaGraph::Replay: the graph of ", device_.ToString(),
               " was released: ", impl_->released);
  TANDEM_CHECK(impl_->exec != nullptr, "CudaGraph::Replay: the graph of ", device_.ToString(),
               " has not been captured (call Capture first)");
  TANDEM_CHECK(t_capture == nullptr,
               "CudaGraph::Replay: cannot replay a graph while capturing another on this thread");
  TANDEM_CHECK(current_device() == device_, "CudaGraph::Replay: the calling thread's current "
               "device is ", current_device().ToString(), " but the graph is for ",
               device_.ToString(), " (use nn::DeviceGuard)");
  cudaStream_t stream = internal::ThreadStream(device_);
  auto launch = [&] {
    for (const std::function<void()>& hook : impl_->hooks) hook();
    if (stream != impl_->last_user) {  // another thread's stream: its memory waits for it too
      if (!impl_->arena->HasUser(stream)) {
        // Only the capturing stream was ordered after the arena's cudaMallocAsync
        // calls on GraphMemoryStream (and the waits the pool may have put there
        // before reusing a block another stream freed): this one must be too,
        // before it becomes a user (a failed ordering is tried again next time).
        if (cudaStream_t memory_stream = GraphMemoryStream(device_)) {
          TANDEM_CHECK_CUDA(OrderAfter(stream, memory_stream, device_), device_);
        }
        impl_->arena->AddUser(stream);
      }
      impl_->last_user = stream;
    }
    TANDEM_CHECK_CUDA(cudaGraphLaunch(impl_->exec, stream), device_);
  };
  if (stream == impl_->capture_stream) {
    launch();
  } else {
    // Another thread's stream. The graph reads and writes tensors that the
    // capturing stream owns, so, as for any tensor read on another stream,
    // this stream first waits for the work queued there (an earlier replay,
    // the writes of the inputs, which the hooks' writes must follow too), and
    // the capturing stream then waits for this replay (its later writes and
    // frees of those tensors, and its use of the thread's cuBLASLt workspace
    // that the graph's matmuls use, come after it). Under the device's capture
    // lock (Captures()): neither wait may join a capture. A per-device lock: a
    // capture records only work of its own device, so a replay here (its
    // hooks, waits and launch, all on this device's streams) cannot reach a
    // capture on another GPU and does not hold it up.
    // A hook that throws (an NCCL graph replayed here is refused by its
    // pre-replay hook) may follow hooks that already wrote, on this stream,
    // the arena memory the graph reads (a dropout's offset): the capturing
    // stream waits for those writes too, or its next replay could read them
    // late.
    const bool ran = Captures().RunUnlessCapturing(device_.index, [&] {
      internal::CudaStreamWait(stream, impl_->capture_stream, device_);
      try {
        launch();
      } catch (...) {
        internal::CudaStreamWaitNoThrow(impl_->capture_stream, stream, device_);
        throw;
      }
      internal::CudaStreamWait(impl_->capture_stream, stream, device_);
    });
    TANDEM_CHECK(ran, "CudaGraph::Replay: the graph of ", device_.ToString(), " was captured on "
                 "another thread and a capture runs on ", device_.ToString(), " now: a replay "
                 "from this thread must be ordered against the capturing thread's stream, which "
                 "cannot be done during a capture; replay it after the capture has ended, or on "
                 "the thread that captured it");
  }
  for (const auto& [key, hook] : impl_->post_hooks) hook();
}

}  // namespace tandem::nn

namespace tandem::nn::internal {

void ReleaseThreadGraphs() noexcept {
  std::vector<ThreadGraph>* graphs = t_graphs;
  if (graphs == nullptr) return;
  t_graphs = nullptr;
  try {
    std::ostringstream thread;
    thread << std::this_thread::get_id();
    const std::string reason = absl::StrCat(
        "it was captured on thread ", thread.str(), ", which has exited: the memory of that "
        "thread the graph reads at every replay (its cuBLASLt workspace, clip_grad_norm_'s "
        "pointer tables) went with it; replay a graph only while the thread that captured it runs");
    for (ThreadGraph& g : *graphs) g.release(reason);
  } catch (...) {  // no memory for the reason: the graphs stay (as before this release existed)
  }
  cudaGetLastError();  // a failed cudaGraphExecDestroy is not for the next launch check
  delete graphs;
}

namespace {

// A storage's memory to free on its owner once the owner has waited for the
// users.
struct PendingFree {
  std::shared_ptr<Allocator> allocator;
  void* ptr;
  int64_t bytes;
  Device device;
  cudaStream_t owner;
  std::vector<StreamRef> users;
};

void FreeAfterUsers(PendingFree free) noexcept;

// A free queued for the end of the capture that runs on its owner: run by the
// capturing thread after cudaStreamEndCapture (CaptureStep).
struct QueuedFree {
  PendingFree free;
  void operator()() const noexcept {
    try {
      FreeAfterUsers(free);  // a copy, which may be queued again
    } catch (...) {  // out of memory for the copy: leaked, never freed into a capture
    }
  }
};

// The owner's waits for the users, then the free through the allocator on the
// owner, under the locks of the devices involved (CaptureRegistry::
// RunAfterUsersOrQueue), or, while a capture runs on the owner, by the
// capturing thread once it has ended. A user stream that another thread
// captures now (of the owner's device or of another GPU) must not get the
// event record (it would join the owner to that capture): the owner waits for
// the event recorded on it just before its capture began (the user's eager
// work). Nothing is copied unless the free is queued. Never throws (out of
// memory for the hand-over: the memory is leaked, never freed into a capture).
void FreeAfterUsers(PendingFree free) noexcept {
  // The registry reads `f` (the users among it) before it moves `later`,
  // which holds it, into the capture's queue, and not after.
  QueuedFree later{std::move(free)};
  const PendingFree& f = later.free;
  try {
    Captures().RunAfterUsersOrQueue(
        f.device.index, f.owner, f.users,
        [&](const StreamRef& user) {
          CudaStreamWaitNoThrow(f.owner, user.stream, Device::CUDA(user.device));
        },
        [&](const StreamRef&, CUevent_st* mark) {
          CudaDeviceScope current(f.device, std::nothrow);
          CountCudaCall(CudaCall::kStreamWaitEvent);
          if (cudaStreamWaitEvent(f.owner, mark, 0) != cudaSuccess) cudaGetLastError();
        },
        [&] { f.allocator->FreeOnStream(f.ptr, f.bytes, f.device, f.owner); },
        std::move(later));
  } catch (...) {  // out of memory for the bookkeeping: leaked, never freed into a capture
  }
}

}  // namespace

void FreeOnOwnerUnlessCaptured(std::shared_ptr<Allocator> allocator, void* ptr, int64_t bytes,
                               Device device, CUstream_st* owner,
                               std::vector<StreamRef> users) noexcept {
  FreeAfterUsers({std::move(allocator), ptr, bytes, device, owner, std::move(users)});
}

void WaitForOwner(CUstream_st* stream, CUstream_st* owner, Device device) {
  Captures().RunOrMark(
      device.index, owner, [&] { CudaStreamWait(stream, owner, device); },
      [&](CUevent_st* mark) {
        CudaDeviceScope current(device);
        CountCudaCall(CudaCall::kStreamWaitEvent);
        CheckCuda(cudaStreamWaitEvent(stream, mark, 0), "cudaStreamWaitEvent", device);
      });
}

}  // namespace tandem::nn::internal
