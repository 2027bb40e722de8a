// CUDA runtime services of the core: per-thread streams, the stream-ordered
// allocator, copies (through the pinned host cache) and the deferred device
// error words. Built only when TANDEM_WITH_CUDA.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/error.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/internal/device_error.h"
#include "nn/interrupt.h"
#include "nn/tensor.h"

namespace tandem::nn::internal {

void CheckCuda(cudaError_t status, const char* call, Device device) {
  if (status != cudaSuccess) {
    Fail(call, " failed on ", device.ToString(), ": ", cudaGetErrorName(status), " (",
         cudaGetErrorString(status), ")");
  }
}

namespace {

// One non-blocking stream per (thread, device), created on first use and
// destroyed when the thread ends.
struct ThreadStreams {
  std::unordered_map<int, cudaStream_t> streams;
  ~ThreadStreams() {
    for (auto& [index, stream] : streams) cudaStreamDestroy(stream);
  }
};

}  // namespace

cudaStream_t ThreadStream(Device device) {
  thread_local ThreadStreams local;
  auto it = local.streams.find(device.index);
  if (it != local.streams.end()) return it->second;
  cudaStream_t stream;
  CheckCuda(cudaSetDevice(device.index), "cudaSetDevice", device);
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate", device);
  local.streams.emplace(device.index, stream);
  // Every kernel that reports deferred errors runs on some thread's stream, so
  // the device's error word exists before any of them (and before any capture).
  DeviceErrorSlot(device);
  return stream;
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
    default:
      return absl::StrCat("device error code ", code, " (", a, ", ", b, ", ", c, ") on ",
                          device.ToString());
  }
}

void RaiseDeviceError(Device device) {
  if (!device.is_cuda() || device.index < 0 || device.index >= kMaxDevices) return;
  DeviceErrorWord* word = host_error_words[device.index].load(std::memory_order_acquire);
  if (word == nullptr) return;  // no stream on the device yet: nothing ran there
  unsigned long long code = __atomic_load_n(&word->code, __ATOMIC_ACQUIRE);
  // kDeviceErrorWriting: a kernel of another stream is filling the word in; the
  // next synchronisation raises it.
  if (code == kDeviceErrorNone || code == kDeviceErrorWriting) return;
  const long long a = __atomic_load_n(&word->a, __ATOMIC_RELAXED);
  const long long b = __atomic_load_n(&word->b, __ATOMIC_RELAXED);
  const long long c = __atomic_load_n(&word->c, __ATOMIC_RELAXED);
  // Only the thread that clears the word raises it.
  if (!__atomic_compare_exchange_n(&word->code, &code, static_cast<unsigned long long>(kDeviceErrorNone),
                                   false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    return;
  }
  Fail(DeviceErrorMessage(code, a, b, c, device));
}

namespace {

// Keeps freed memory in the device's pool instead of returning it to the driver
// at each synchronisation, so a training step never reaches cudaMalloc.
void ConfigurePoolOnce(Device device) {
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
}

}  // namespace

void* CudaAllocate(int64_t bytes, Device device) {
  ConfigurePoolOnce(device);
  void* ptr = nullptr;
  CheckCuda(cudaMallocAsync(&ptr, static_cast<size_t>(bytes), ThreadStream(device)),
        "cudaMallocAsync", device);
  return ptr;
}

void CudaFree(void* ptr, Device device) {
  // Destructors must not throw: a failing free is reported by the next checked call.
  cudaFreeAsync(ptr, ThreadStream(device));
}

namespace {

// Host waits on the GPU (nn/interrupt.h): block in the runtime when the calling
// thread has no interrupt check; otherwise poll, calling the check between polls,
// so a stream stuck behind a collective that will never complete cannot hold a
// rank thread for good.
void HostWait(cudaError_t (*query)(void*), cudaError_t (*block)(void*), void* what,
              const char* call, Device device) {
  if (!HasInterruptCheck()) {
    CheckCuda(block(what), call, device);
    return;
  }
  WaitUntil([&] {
    const cudaError_t status = query(what);
    if (status == cudaErrorNotReady) return false;
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
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync", device);
    RecordPinnedUse(src, device, stream);
    return;
  }
  if (bytes <= kStagingChunkBytes) {
    StagingBlock staging(bytes);
    std::memcpy(staging.data(), src, static_cast<size_t>(bytes));
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
    CheckCuda(cudaMemcpyAsync(dst + offset, buffers[b].data(), static_cast<size_t>(n),
                              cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync", device);
    // Recorded per chunk, so that a failure later in the loop cannot hand the
    // buffer out again while this copy may still read it.
    RecordPinnedUse(buffers[b].data(), device, stream);
    CheckCuda(cudaEventRecord(emptied[b].get(), stream), "cudaEventRecord", device);
  }
}

void CopyDeviceToHost(char* dst, const char* src, Device device, int64_t bytes,
                      cudaStream_t stream) {
  if (IsPinnedHostPointer(dst)) {
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync", device);
    WaitStreamWritingPinned(stream, device, dst);
  } else {
    const int64_t chunk = std::min(bytes, kStagingChunkBytes);
    StagingBlock staging(chunk);
    for (int64_t offset = 0; offset < bytes; offset += chunk) {
      const int64_t n = std::min(chunk, bytes - offset);
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

void CudaCopy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes) {
  const Device stream_device = dst_device.is_cuda() ? dst_device : src_device;
  cudaStream_t stream = ThreadStream(stream_device);
  if (bytes <= 0) return;
  if (dst_device.is_cuda() && src_device.is_cuda()) {
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream),
              "cudaMemcpyAsync", stream_device);
    return;
  }
  if (Capturing(stream, stream_device)) {
    // Under graph capture: the plain copy (a copy to the host fails the capture).
    CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream),
              "cudaMemcpyAsync", stream_device);
    if (dst_device.is_cpu()) CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", src_device);
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
  CheckCuda(cudaMemsetAsync(dst, 0, static_cast<size_t>(bytes), ThreadStream(device)),
        "cudaMemsetAsync", device);
}

void CudaSetDevice(int index) { CheckCuda(cudaSetDevice(index), "cudaSetDevice", Device::CUDA(index)); }

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
