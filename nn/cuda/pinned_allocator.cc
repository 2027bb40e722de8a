// The caching pinned host allocator (contract in nn/internal/cuda_runtime.h).
// Built only when TANDEM_WITH_CUDA.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/error.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/tensor.h"

namespace tandem::nn::internal {
namespace {

constexpr int64_t kMinBlockBytes = 512;
constexpr int64_t kMaxBlockBytes = int64_t{1} << 62;

// The size class of a request: the next power of two, at least kMinBlockBytes.
int64_t SizeClass(int64_t bytes) {
  int64_t size = kMinBlockBytes;
  while (size < bytes) size *= 2;
  return size;
}

// An event recorded on a stream of `device` after a copy that used a block.
struct Use {
  cudaEvent_t event;
  int device;
};

struct Block {
  char* base = nullptr;
  int64_t bytes = 0;  // the size class
  bool in_use = false;
  std::vector<Use> uses;  // recorded uses not yet seen complete
};

class PinnedHostCache final : public Allocator {
 public:
  void* Allocate(int64_t bytes, Device device) override {
    TANDEM_CHECK(device.is_cpu(), "pinned host allocator: asked for memory on ",
                 device.ToString(), "; pinned memory is host memory (cpu)");
    TANDEM_CHECK(bytes > 0 && bytes <= kMaxBlockBytes, "pinned host allocator: bad size ", bytes,
                 " bytes");
    const int64_t size = SizeClass(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<Block*>& cached = free_[size];
      // Most recently freed first: its pages are the likeliest to be warm.
      for (size_t i = cached.size(); i-- > 0;) {
        Block* block = cached[i];
        if (!PollUsesLocked(*block)) continue;
        cached.erase(cached.begin() + static_cast<std::ptrdiff_t>(i));
        block->in_use = true;
        return block->base;
      }
    }
    void* ptr = nullptr;
    CountCudaCall(CudaCall::kHostAlloc);
    cudaError_t status = cudaHostAlloc(&ptr, static_cast<size_t>(size), cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so the next launch check does not see it
      ReleaseIdleBlocks();
      CountCudaCall(CudaCall::kHostAlloc);
      status = cudaHostAlloc(&ptr, static_cast<size_t>(size), cudaHostAllocPortable);
      if (status != cudaSuccess) {
        cudaGetLastError();
        Fail("pinned host allocator: cudaHostAlloc of ", size, " bytes (for ", bytes,
             ") failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    Block& block = blocks_[reinterpret_cast<uintptr_t>(ptr)];
    block.base = static_cast<char*>(ptr);
    block.bytes = size;
    block.in_use = true;
    return ptr;
  }

  void Free(void* ptr, int64_t, Device) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == blocks_.end() || !it->second.in_use) return;  // not ours: nothing to do
    it->second.in_use = false;
    free_[it->second.bytes].push_back(&it->second);
  }

  bool Contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mu_);
    return FindLocked(ptr) != nullptr;
  }

  void RecordUse(const void* ptr, Device device, cudaStream_t stream) {
    TANDEM_CHECK(device.is_cuda(), "RecordPinnedUse: ", device.ToString(), " is not a CUDA device");
    std::lock_guard<std::mutex> lock(mu_);
    Block* block = FindLocked(ptr);
    TANDEM_CHECK(block != nullptr, "RecordPinnedUse: 0x", absl::Hex(reinterpret_cast<uintptr_t>(ptr)),
                 " is not in a live block of the pinned host allocator");
    // Drop the uses that have finished (their events go back to the spare list), so
    // a block that lives long and is copied every step keeps a bounded list.
    PollUsesLocked(*block);
    cudaEvent_t event = TakeEventLocked(device);
    CountCudaCall(CudaCall::kEventRecord);
    const cudaError_t status = cudaEventRecord(event, stream);
    if (status != cudaSuccess) {
      cudaEventDestroy(event);
      CheckCuda(status, "cudaEventRecord", device);
    }
    block->uses.push_back({event, device.index});
  }

  PinnedCacheStats Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    PinnedCacheStats stats;
    for (auto& [base, block] : blocks_) {
      ++stats.blocks;
      stats.bytes += block.bytes;
      if (block.in_use) continue;
      ++stats.cached_blocks;
      if (!PollUsesLocked(block)) ++stats.pending_blocks;
    }
    return stats;
  }

 private:
  // The live (handed out) block containing `ptr`, or nullptr.
  Block* FindLocked(const void* ptr) {
    const auto addr = reinterpret_cast<uintptr_t>(ptr);
    auto it = blocks_.upper_bound(addr);
    if (it == blocks_.begin()) return nullptr;
    --it;
    Block& block = it->second;
    if (!block.in_use || addr >= it->first + static_cast<uintptr_t>(block.bytes)) return nullptr;
    return &block;
  }

  // Drops the completed uses of `block`; true when none is left. Never blocks.
  bool PollUsesLocked(Block& block) {
    std::erase_if(block.uses, [this](const Use& use) {
      const cudaError_t status = cudaEventQuery(use.event);
      if (status == cudaErrorNotReady) {
        cudaGetLastError();  // "not ready" is no error; do not leave it for a launch check
        return false;
      }
      if (status == cudaSuccess) {
        idle_events_[use.device].push_back(use.event);
      } else {
        // The context is broken (a sticky error): the copy will never touch the
        // block again. Drop the event; the error surfaces at the next checked call.
        cudaEventDestroy(use.event);
      }
      return true;
    });
    return block.uses.empty();
  }

  cudaEvent_t TakeEventLocked(Device device) {
    std::vector<cudaEvent_t>& idle = idle_events_[device.index];
    if (!idle.empty()) {
      cudaEvent_t event = idle.back();
      idle.pop_back();
      return event;
    }
    // Events belong to the device current at creation; the stream's device must match.
    CudaDeviceScope current(device);
    cudaEvent_t event = nullptr;
    CountCudaCall(CudaCall::kEventCreate);
    CheckCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags",
              device);
    return event;
  }

  // Gives the driver back the cached blocks no recorded use still needs.
  void ReleaseIdleBlocks() {
    std::vector<void*> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [size, cached] : free_) {
        std::erase_if(cached, [&](Block* block) {
          if (!PollUsesLocked(*block)) return false;
          release.push_back(block->base);
          return true;
        });
      }
      for (void* ptr : release) blocks_.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    for (void* ptr : release) {
      CountCudaCall(CudaCall::kFreeHost);
      cudaFreeHost(ptr);
    }
  }

  std::mutex mu_;
  std::map<uintptr_t, Block> blocks_;                        // every block, by base address
  std::unordered_map<int64_t, std::vector<Block*>> free_;     // cached blocks by size class
  std::unordered_map<int, std::vector<cudaEvent_t>> idle_events_;  // by device index
};

PinnedHostCache& Cache() {
  // Never destroyed: storages freed during static destruction or at thread exit
  // still find it, and no CUDA call runs after the driver has shut down.
  static PinnedHostCache* cache = new PinnedHostCache();
  return *cache;
}

}  // namespace

const std::shared_ptr<Allocator>& PinnedHostAllocator() {
  static const auto* allocator =
      new std::shared_ptr<Allocator>(&Cache(), [](Allocator*) { /* lives for the process */ });
  return *allocator;
}

bool IsPinnedHostPointer(const void* ptr) { return Cache().Contains(ptr); }

void RecordPinnedUse(const void* ptr, Device device, CUstream_st* stream) {
  Cache().RecordUse(ptr, device, stream);
}

PinnedCacheStats GetPinnedCacheStats() { return Cache().Stats(); }

}  // namespace tandem::nn::internal
