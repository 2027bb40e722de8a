// CUDA runtime services of the core: per-thread streams, the stream-ordered
// allocator and copies. Built only when TANDEM_WITH_CUDA.
#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>

#include "nn/error.h"
#include "nn/cuda/context.h"
#include "nn/internal/cuda_runtime.h"

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
  return stream;
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

void CudaCopy(void* dst, Device dst_device, const void* src, Device src_device, int64_t bytes) {
  const Device stream_device = dst_device.is_cuda() ? dst_device : src_device;
  cudaStream_t stream = ThreadStream(stream_device);
  CheckCuda(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream),
        "cudaMemcpyAsync", stream_device);
  if (dst_device.is_cpu()) CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", src_device);
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
