// CUDA runtime services of the core: per-thread streams, the stream-ordered
// allocator, copies (through the pinned host cache) and the deferred device
// error words. Built only when TANDEM_WITH_CUDA.
#include <cuda.h>  // CUcontext, for the driver entry point below (no libcuda link)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nn/cuda/context.h"
#include "nn/error.h"
#include "nn/internal/allocator.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/internal/device_error.h"
#include "nn/internal/spare_streams.h"
#include "nn/interrupt.h"
#include "nn/tensor.h"

namespace tandem::nn::internal {

void CheckCuda(cudaError_t status, const char* call, Device device) {
  if (status != cudaSuccess) {
    // The error is reported here: cleared from the thread's last error (unless
    // sticky), so that the next kernel's launch check does not report it again
    // against that kernel after a caller has caught this one (an out-of-memory).
    cudaGetLastError();
    Fail(call, " failed on ", device.ToString(), ": ", cudaGetErrorName(status), " (",
         cudaGetErrorString(status), ")");
  }
}

namespace {

// True when the calling thread has a current CUDA context (it selected or used a
// device). cuCtxGetCurrent through the runtime's driver entry point, so nn does
// not link libcuda; if the driver cannot say, assume a context (restore).
bool HasCurrentContext() {
  using CtxGetCurrent = CUresult (*)(CUcontext*);
  static const CtxGetCurrent get_current = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<CtxGetCurrent>(fn);
  }();
  if (get_current == nullptr) return true;
  CUcontext context = nullptr;
  return get_current(&context) != CUDA_SUCCESS || context != nullptr;
}

}  // namespace

CudaDeviceScope::CudaDeviceScope(Device device) {
  int previous = 0;
  CheckCuda(cudaGetDevice(&previous), "cudaGetDevice", device);
  if (previous == device.index) return;
  const bool restore = HasCurrentContext();
  CheckCuda(cudaSetDevice(device.index), "cudaSetDevice", device);
  if (restore) previous_ = previous;
}

CudaDeviceScope::CudaDeviceScope(Device device, std::nothrow_t) noexcept {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  if (previous == device.index) return;
  const bool restore = HasCurrentContext();
  if (cudaSetDevice(device.index) != cudaSuccess) {
    cudaGetLastError();  // not sticky: a launch check must not see it; a broken context resurfaces
    return;
  }
  if (restore) previous_ = previous;
}

CudaDeviceScope::~CudaDeviceScope() {
  // Must not throw. A failed restore is cleared from the thread's last error, so
  // that the next launch check does not blame an unrelated kernel for it.
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

namespace {

// Streams are never destroyed while the process runs: a storage names its
// owning stream (Storage::stream()) and may outlive the thread that made it (a
// CUDA tensor returned from spawn), and its free is enqueued there. A thread
// that ends gives its streams back here, and the next thread that needs a
// stream on that device takes one (its work then simply follows the old
// thread's). Leaked at exit on purpose: the driver reclaims them.
SpareStreams& Pool() {
  static SpareStreams* pool = new SpareStreams;
  return *pool;
}

// The calling thread's streams, and one event per device for stream-to-stream
// waits (CudaStreamWait), both made on first use.
struct ThreadStreams {
  std::unordered_map<int, cudaStream_t> streams;
  std::unordered_map<int, cudaEvent_t> wait_events;
  int last_index = -1;  // one-entry cache of streams: ops ask for the same device
  cudaStream_t last_stream = nullptr;
  ~ThreadStreams();
};
// Set when the thread's ThreadStreams is gone (a thread_local destroyed after it
// may still free storages: CudaThreadStreamIfAny must not read it then).
thread_local bool t_streams_gone = false;

thread_local ThreadStreams t_streams;

ThreadStreams::~ThreadStreams() {
  t_streams_gone = true;
  for (auto& [index, event] : wait_events) cudaEventDestroy(event);  // released once complete
  for (auto& [index, stream] : streams) Pool().Give(index, stream);
}

cudaStream_t NewStream(Device device) {
  if (cudaStream_t stream = Pool().Take(device.index)) return stream;
  CudaDeviceScope current(device);
  cudaStream_t stream;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate", device);
  return stream;
}

// The calling thread's event of `device` for CudaStreamWait. Reusing one event
// is safe: cudaStreamWaitEvent waits for the record made before the call, and
// later records do not change what an enqueued wait waits for.
cudaEvent_t WaitEvent(Device device) {
  auto it = t_streams.wait_events.find(device.index);
  if (it != t_streams.wait_events.end()) return it->second;
  CudaDeviceScope current(device);
  cudaEvent_t event;
  CountCudaCall(CudaCall::kEventCreate);
  CheckCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate", device);
  t_streams.wait_events.emplace(device.index, event);
  return event;
}

// Makes `device` current until destruction unless it already is; never throws
// (for destructors: a failure is left for the next checked call).

}  // namespace

bool ThreadStreamsGone() noexcept { return t_streams_gone; }

cudaStream_t ThreadStream(Device device) {
  // A thread_local destroyed after the thread's ThreadStreams (one made before
  // the thread's first stream) may still reach here from a destructor: its
  // maps are gone. Destructors catch this (a broken context's path).
  TANDEM_CHECK(!t_streams_gone, "ThreadStream(", device.ToString(), "): the calling thread "
               "is exiting and its streams have been given back");
  ThreadStreams& local = t_streams;
  if (device.index == local.last_index) return local.last_stream;
  auto it = local.streams.find(device.index);
  cudaStream_t stream;
  if (it != local.streams.end()) {
    stream = it->second;
  } else {
    stream = NewStream(device);
    local.streams.emplace(device.index, stream);
    // Every kernel that reports deferred errors runs on some thread's stream, so
    // the device's error word exists before any of them (and before any capture).
    DeviceErrorSlot(device);
  }
  local.last_index = device.index;
  local.last_stream = stream;
  return stream;
}

CUstream_st* CudaThreadStream(Device device) { return ThreadStream(device); }

CUstream_st* CudaThreadStreamIfAny(Device device) noexcept {
  if (t_streams_gone) return nullptr;
  const ThreadStreams& local = t_streams;
  if (device.index == local.last_index) return local.last_stream;
  auto it = local.streams.find(device.index);
  return it == local.streams.end() ? nullptr : it->second;
}

void CudaStreamWait(CUstream_st* waiter, CUstream_st* producer, Device producer_device) {
  if (waiter == producer) return;
  if (t_streams_gone) {
    // At the thread's exit, after its ThreadStreams (and its wait events) went:
    // a storage held by a thread_local destroyed later is freed after its
    // owner waits for its users. An event made for this wait.
    CudaDeviceScope current(producer_device);
    cudaEvent_t event = nullptr;
    CountCudaCall(CudaCall::kEventCreate);
    CheckCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate",
              producer_device);
    CountCudaCall(CudaCall::kEventRecord);
    cudaError_t status = cudaEventRecord(event, producer);
    if (status == cudaSuccess) {
      CountCudaCall(CudaCall::kStreamWaitEvent);
      status = cudaStreamWaitEvent(waiter, event, 0);
    }
    cudaEventDestroy(event);  // released once the record completes
    CheckCuda(status, "cudaEventRecord / cudaStreamWaitEvent", producer_device);
    return;
  }
  cudaEvent_t event = WaitEvent(producer_device);
  // Recording on a stream of another thread is allowed (the runtime is thread-safe);
  // the event takes the producer's work enqueued up to this call.
  CudaDeviceScope current(producer_device);
  CountCudaCall(CudaCall::kEventRecord);
  CheckCuda(cudaEventRecord(event, producer), "cudaEventRecord", producer_device);
  CountCudaCall(CudaCall::kStreamWaitEvent);
  CheckCuda(cudaStreamWaitEvent(waiter, event, 0), "cudaStreamWaitEvent", producer_device);
}

void CudaStreamWaitNoThrow(CUstream_st* waiter, CUstream_st* producer,
                           Device producer_device) noexcept {
  try {
    CudaStreamWait(waiter, producer, producer_device);
  } catch (...) {  // a broken context: the next checked call reports it
  }
}

// --- Deferred device errors (device_error.h) ---------------------------------------
namespace {

constexpr int kMaxDevices = 64;
// Host and device addresses of each device's word; set once, never freed.
std::atomic<DeviceErrorWord*> host_error_words[kMaxDevices];
std::atomic<DeviceErrorWord*> device_error_words[kMaxDevices];

}  // namespace

DeviceErrorWord* DeviceErrorSlot(Device device) {
  TANDEM_CHECK(device.is_cuda() && device.index >= 0 && device.index < kMaxDevices,
               "DeviceErrorSlot: ", device.ToString(), " is not a CUDA device below cuda:",
               kMaxDevices);
  const int i = device.index;
  if (DeviceErrorWord* word = device_error_words[i].load(std::memory_order_acquire)) return word;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (DeviceErrorWord* word = device_error_words[i].load(std::memory_order_acquire)) return word;
  CudaDeviceScope current(device);
  void* host = nullptr;
  CountCudaCall(CudaCall::kHostAlloc);
  CheckCuda(cudaHostAlloc(&host, sizeof(DeviceErrorWord), cudaHostAllocMapped | cudaHostAllocPortable),
            "cudaHostAlloc(device error word)", device);
  std::memset(host, 0, sizeof(DeviceErrorWord));
  void* mapped = nullptr;
  CheckCuda(cudaHostGetDevicePointer(&mapped, host, 0), "cudaHostGetDevicePointer", device);
  host_error_words[i].store(static_cast<DeviceErrorWord*>(host), std::memory_order_release);
  device_error_words[i].store(static_cast<DeviceErrorWord*>(mapped), std::memory_order_release);
  return static_cast<DeviceErrorWord*>(mapped);
}

std::string DeviceErrorMessage(unsigned long long code, long long a, long long b, long long c,
                               Device device) {
  switch (code) {
    case kDeviceErrorCrossEntropyTarget:
      return absl::StrCat("cross_entropy: target ", a, " of sample ", b, " is out of range [0, ",
                          c, ") on ", device.ToString());
    case kDeviceErrorNllLossTarget:
      return absl::StrCat("nll_loss: target ", a, " of sample ", b, " is out of range [0, ", c,
                          ") on ", device.ToString());
    default:
      return absl::StrCat("device error code ", code, " (", a, ", ", b, ", ", c, ") on ",
                          device.ToString());
  }
}

std::string TakeDeviceError(Device device) {
  if (!device.is_cuda() || device.index < 0 || device.index >= kMaxDevices) return "";
  DeviceErrorWord* word = host_error_words[device.index].load(std::memory_order_acquire);
  if (word == nullptr) return "";  // no stream on the device yet: nothing ran there
  unsigned long long code = __atomic_load_n(&word->code, __ATOMIC_ACQUIRE);
  // kDeviceErrorWriting: a kernel of another stream is filling the word in; the
  // next synchronisation raises it.
  if (code == kDeviceErrorNone || code == kDeviceErrorWriting) return "";
  const long long a = __atomic_load_n(&word->a, __ATOMIC_RELAXED);
  const long long b = __atomic_load_n(&word->b, __ATOMIC_RELAXED);
  const long long c = __atomic_load_n(&word->c, __ATOMIC_RELAXED);
  // Only the thread that clears the word reports it.
  if (!__atomic_compare_exchange_n(&word->code, &code, static_cast<unsigned long long>(kDeviceErrorNone),
                                   false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    return "";
  }
  return DeviceErrorMessage(code, a, b, c, device);
}

void RaiseDeviceError(Device device) {
  const std::string message = TakeDeviceError(device);
  if (!message.empty()) Fail(message);
}

std::string TakeDeviceErrorOfEndedThreads(Device device,
                                          std::chrono::steady_clock::time_point deadline,
                                          std::string* context_error) noexcept {
  if (context_error != nullptr) context_error->clear();
  if (!device.is_cuda() || device.index < 0 || device.index >= kMaxDevices) return "";
  try {
    {
      // Out of the pool while they are polled: no thread takes one of these
      // streams (and could begin a capture on it, which the query would
      // invalidate) meanwhile. Not under the pool's lock, which every thread
      // that starts or ends needs: a thread that wants a stream on this device
      // now makes a new one (nn/internal/spare_streams.h).
      SpareStreams::Borrowed ended = Pool().Borrow(device.index);
      if (!ended.streams().empty()) {
        CudaDeviceScope current(device, std::nothrow);
        // Polled with a deadline, not cudaStreamSynchronize: a kernel that never
        // ends (a user kernel's endless loop; a collective nobody aborted) must
        // not turn a failed run into a hang of spawn. Past the deadline the
        // report (if any) is left on the word, as before this wait existed.
        cudaError_t failed = cudaSuccess;
        for (cudaStream_t stream : ended.streams()) {
          CountCudaCall(CudaCall::kHostWait);
          while (true) {
            const cudaError_t status = cudaStreamQuery(stream);
            if (status == cudaSuccess) break;
            cudaGetLastError();  // not ready, or a broken context: not for a launch check
            if (status != cudaErrorNotReady) {
              failed = status;  // an earlier kernel's fault: every stream reports it
              break;
            }
            if (std::chrono::steady_clock::now() >= deadline) return "";
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
          if (failed != cudaSuccess) break;
        }
        if (failed != cudaSuccess && context_error != nullptr) {
          *context_error =
              absl::StrCat(cudaGetErrorName(failed), " (", cudaGetErrorString(failed), ")");
        }
      }
    }
    return TakeDeviceError(device);
  } catch (...) {  // the message could not be made (out of memory): nothing to add
    return "";
  }
}

namespace {

// Keeps freed memory in the device's pool instead of returning it to the driver
// at each synchronisation, so a training step never reaches cudaMalloc.
// Every allocation asks: after the first, one atomic load, no lock shared by
// the rank threads.
void ConfigurePoolOnce(Device device) {
  static std::atomic<bool> configured[kMaxDevices];
  const bool indexed = device.index >= 0 && device.index < kMaxDevices;
  if (indexed && configured[device.index].load(std::memory_order_acquire)) return;
  static std::mutex mu;
  static std::unordered_map<int, bool> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done[device.index]) return;
  cudaMemPool_t pool;
  CheckCuda(cudaDeviceGetDefaultMemPool(&pool, device.index), "cudaDeviceGetDefaultMemPool", device);
  uint64_t threshold = UINT64_MAX;
  CheckCuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
        "cudaMemPoolSetAttribute", device);
  done[device.index] = true;
  if (indexed) configured[device.index].store(true, std::memory_order_release);
}

}  // namespace

void* CudaAllocate(int64_t bytes, Device device) {
  ConfigurePoolOnce(device);
  CudaDeviceScope current(device);  // pool memory is handled with its device current
  void* ptr = nullptr;
  CountCudaCall(CudaCall::kMallocAsync);
  const cudaError_t status =
      cudaMallocAsync(&ptr, static_cast<size_t>(bytes), ThreadStream(device));
  if (status != cudaSuccess) {
    CheckCuda(status, absl::StrCat("cudaMallocAsync of ", bytes, " bytes").c_str(), device);
  }
  return ptr;
}

void CudaFree(void* ptr, Device device, CUstream_st* stream) noexcept {
  // Destructors must not throw: a failing free is reported by the next checked call.
  // Pool memory is freed with its device current (as copies of it need).
  CudaDeviceScope current(device, std::nothrow);
  CountCudaCall(CudaCall::kFreeAsync);
  cudaFreeAsync(ptr, stream);
}

namespace {

// Host waits on the GPU (nn/interrupt.h): block in the runtime when the calling
// thread has no interrupt check; otherwise poll, calling the check between polls,
// so a stream stuck behind a collective that will never complete cannot hold a
// rank thread for good.
void HostWait(cudaError_t (*query)(void*), cudaError_t (*block)(void*), void* what,
              const char* call, Device device) {
  CountCudaCall(CudaCall::kHostWait);
  if (!HasInterruptCheck()) {
    CheckCuda(block(what), call, device);
    return;
  }
  WaitUntil([&] {
    const cudaError_t status = query(what);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is no error: not for the next launch check to see
      return false;
    }
    CheckCuda(status, call, device);
    return true;
  });
}

void WaitStream(cudaStream_t stream, Device device) {
  HostWait([](void* s) { return cudaStreamQuery(static_cast<cudaStream_t>(s)); },
           [](void* s) { return cudaStreamSynchronize(static_cast<cudaStream_t>(s)); }, stream,
           "cudaStreamSynchronize", device);
}

void WaitEvent(cudaEvent_t event, Device device) {
  HostWait([](void* e) { return cudaEventQuery(static_cast<cudaEvent_t>(e)); },
           [](void* e) { return cudaEventSynchronize(static_cast<cudaEvent_t>(e)); }, event,
           "cudaEventSynchronize", device);
}

// WaitStream for a copy into pinned `host` (a block of the pinned cache): if the
// wait is abandoned, the block is recorded as in use by `stream` first, so the
// cache does not hand it out while the queued copy may still write it.
void WaitStreamWritingPinned(cudaStream_t stream, Device device, const void* host) {
  try {
    WaitStream(stream, device);
  } catch (...) {
    if (IsPinnedHostPointer(host)) {
      try {
        RecordPinnedUse(host, device, stream);
      } catch (...) {  // the original error is the one to report
      }
    }
    throw;
  }
}

// Pageable copies larger than this go through pinned staging in chunks.
constexpr int64_t kStagingChunkBytes = int64_t{32} << 20;

bool Capturing(cudaStream_t stream, Device device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CheckCuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing", device);
  return status != cudaStreamCaptureStatusNone;
}

// A block of the pinned host cache, given back to it on destruction (uses
// recorded on it with RecordPinnedUse keep it from being reused too early).
class StagingBlock {
 public:
  explicit StagingBlock(int64_t bytes)
      : bytes_(bytes), data_(static_cast<char*>(PinnedHostAllocator()->Allocate(bytes, Device::CPU()))) {}
  ~StagingBlock() { PinnedHostAllocator()->Free(data_, bytes_, Device::CPU()); }
  StagingBlock(const StagingBlock&) = delete;
  StagingBlock& operator=(const StagingBlock&) = delete;
  char* data() const { return data_; }

 private:
  int64_t bytes_;
  char* data_;
};

// An event of `device` (created with the device current), destroyed with this.
class Event {
 public:
  explicit Event(Device device) {
    CudaDeviceScope current(device);
    CountCudaCall(CudaCall::kEventCreate);
    CheckCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate", device);
  }
  ~Event() { cudaEventDestroy(event_); }  // released once complete, even if pending
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

void CopyHostToDevice(char* dst, Device device, const char* src, int64_t bytes,
                      cudaStream_t stream) {
  if (IsPinnedHostPointer(src)) {
    CountCudaCall(CudaCall::kMemcpyAsync);
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync", device);
    RecordPinnedUse(src, device, stream);
    return;
  }
  if (bytes <= kStagingChunkBytes) {
    StagingBlock staging(bytes);
    std::memcpy(staging.data(), src, static_cast<size_t>(bytes));
    CountCudaCall(CudaCall::kMemcpyAsync);
    CheckCuda(cudaMemcpyAsync(dst, staging.data(), static_cast<size_t>(bytes),
                              cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync", device);
    RecordPinnedUse(staging.data(), device, stream);
    return;
  }
  // Large pageable source: two chunk buffers in turn. Before refilling one the
  // host waits for the copy out of it, as the driver would for pageable memory;
  // the last two copies stay in flight.
  StagingBlock buffers[2] = {StagingBlock(kStagingChunkBytes), StagingBlock(kStagingChunkBytes)};
  Event emptied[2] = {Event(device), Event(device)};
  for (int64_t offset = 0, k = 0; offset < bytes; offset += kStagingChunkBytes, ++k) {
    const int64_t n = std::min(kStagingChunkBytes, bytes - offset);
    const int b = static_cast<int>(k % 2);
    if (k >= 2) WaitEvent(emptied[b].get(), device);
    std::memcpy(buffers[b].data(), src + offset, static_cast<size_t>(n));
    CountCudaCall(CudaCall::kMemcpyAsync);
    CheckCuda(cudaMemcpyAsync(dst + offset, buffers[b].data(), static_cast<size_t>(n),
                              cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync", device);
    // Recorded per chunk, so that a failure later in the loop cannot hand the
    // buffer out again while this copy may still read it.
    RecordPinnedUse(buffers[b].data(), device, stream);
    CountCudaCall(CudaCall::kEventRecord);
    CheckCuda(cudaEventRecord(emptied[b].get(), stream), "cudaEventRecord", device);
  }
}

void CopyDeviceToHost(char* dst, const char* src, Device device, int64_t bytes,
                      cudaStream_t stream) {
  if (IsPinnedHostPointer(dst)) {
    CountCudaCall(CudaCall::kMemcpyAsync);
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync", device);
    WaitStreamWritingPinned(stream, device, dst);
  } else {
    const int64_t chunk = std::min(bytes, kStagingChunkBytes);
    StagingBlock staging(chunk);
    for (int64_t offset = 0; offset < bytes; offset += chunk) {
      const int64_t n = std::min(chunk, bytes - offset);
      CountCudaCall(CudaCall::kMemcpyAsync);
      CheckCuda(cudaMemcpyAsync(staging.data(), src + offset, static_cast<size_t>(n),
                                cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync", device);
      WaitStreamWritingPinned(stream, device, staging.data());
      std::memcpy(dst + offset, staging.data(), static_cast<size_t>(n));
    }
  }
  RaiseDeviceError(device);
}

}  // namespace

namespace {

// Grants `accessor` read/write access to `owner`'s default pool once, where the
// GPUs have a peer path, so peer copies out of pool memory go direct instead of
// being staged by the driver. Best effort: a refusal leaves the staged path.
void GrantPeerPoolAccessOnce(Device owner, Device accessor) {
  static std::mutex mu;
  static std::unordered_map<int64_t, bool> tried;  // owner * 65536 + accessor
  std::lock_guard<std::mutex> lock(mu);
  bool& done = tried[int64_t{owner.index} * 65536 + accessor.index];
  if (done) return;
  done = true;
  int can_access = 0;
  if (cudaDeviceCanAccessPeer(&can_access, accessor.index, owner.index) != cudaSuccess ||
      can_access == 0) {
    cudaGetLastError();
    return;
  }
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, owner.index) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  cudaMemAccessDesc desc = {};
  desc.location.type = cudaMemLocationTypeDevice;
  desc.location.id = accessor.index;
  desc.flags = cudaMemAccessFlagsProtReadWrite;
  if (cudaMemPoolSetAccess(pool, &desc, 1) != cudaSuccess) cudaGetLastError();
}

}  // namespace

void CudaCopy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes) {
  const Device stream_device = dst_device.is_cuda() ? dst_device : src_device;
  cudaStream_t stream = ThreadStream(stream_device);
  if (bytes <= 0) return;
  // Copies of stream-ordered pool memory fail unless its device is current.
  CudaDeviceScope current(stream_device);
  if (dst_device.is_cuda() && src_device.is_cuda()) {
    if (dst_device != src_device) {
      // An event wait across devices and a pool-access change have no place in
      // a captured graph: say so rather than break the capture (review finding).
      TANDEM_CHECK(!Capturing(stream, stream_device) &&
                       !Capturing(ThreadStream(src_device), src_device),
                   "copy from ", src_device.ToString(), " to ", dst_device.ToString(),
                   " cannot be captured in a CUDA graph: copy between GPUs outside the "
                   "captured step");
      // The source was produced on this thread's stream of its device (ordered
      // after the source's owner by Tensor::data_ptr()): the destination's
      // stream waits for it. A plain cudaMemcpyAsync between two devices' pool
      // memory fails (pool memory is mapped on its own device only, whatever
      // cudaDeviceEnablePeerAccess says); cudaMemcpyPeerAsync does not need
      // the mapping.
      CudaStreamWait(stream, ThreadStream(src_device), src_device);
      GrantPeerPoolAccessOnce(src_device, dst_device);
      CountCudaCall(CudaCall::kMemcpyAsync);
      CheckCuda(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index,
                                    static_cast<size_t>(bytes), stream),
                "cudaMemcpyPeerAsync", stream_device);
      return;
    }
    CountCudaCall(CudaCall::kMemcpyAsync);
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                              stream),
              "cudaMemcpyAsync", stream_device);
    return;
  }
  if (Capturing(stream, stream_device)) {
    // Under graph capture: the plain copy (a copy to the host fails the capture).
    CountCudaCall(CudaCall::kMemcpyAsync);
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream),
              "cudaMemcpyAsync", stream_device);
    if (dst_device.is_cpu()) {
      CountCudaCall(CudaCall::kHostWait);
      CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", src_device);
    }
    return;
  }
  if (dst_device.is_cuda()) {
    CopyHostToDevice(static_cast<char*>(dst), dst_device, static_cast<const char*>(src), bytes, stream);
  } else {
    CopyDeviceToHost(static_cast<char*>(dst), static_cast<const char*>(src), src_device, bytes, stream);
  }
}

void CudaSynchronize(Device device) {
  WaitStream(ThreadStream(device), device);
  RaiseDeviceError(device);
}

void CudaMemsetZero(void* dst, Device device, int64_t bytes) {
  CudaDeviceScope current(device);  // pool memory: its device current
  CountCudaCall(CudaCall::kMemsetAsync);
  CheckCuda(cudaMemsetAsync(dst, 0, static_cast<size_t>(bytes), ThreadStream(device)),
        "cudaMemsetAsync", device);
}

void CudaSetDevice(int index) { CheckCuda(cudaSetDevice(index), "cudaSetDevice", Device::CUDA(index)); }

int CudaGetDevice() {
  int index = 0;
  CheckCuda(cudaGetDevice(&index), "cudaGetDevice", Device::CUDA(0));
  return index;
}

std::string CudaDeviceUuid(int index) {
  // cudaGetDeviceProperties reads the device's attributes without making a
  // context on it.
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

int CudaDeviceCount() {
  int count = 0;
  // No driver (cudaErrorInsufficientDriver / cudaErrorNoDevice) means zero GPUs.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace tandem::nn::internal
