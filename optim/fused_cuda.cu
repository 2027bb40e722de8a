// Multi-tensor CUDA kernels of the optimizer updates and of gradient clipping.
//
// A launch covers every tensor of a parameter group: a table of (pointers,
// numel, offset) entries in device memory describes the tensors as one
// concatenated index space, cut into chunks of kChunk elements; each block
// walks its chunks (grid-stride) and finds a chunk's first tensor by binary
// search over the offsets. The table is uploaded from a pinned host buffer
// with cudaMemcpyAsync only when the tensors' addresses change (in steady
// training they never do: zero_grad keeps the gradient tensors), so a step is
// one kernel launch with its scalars passed by value, and no host sync; an
// upload when they change does not wait on the host either (DeviceTables).
//
// CUDA graph capture (nn/graph.h): a captured launch reads its scalars from a
// device buffer that the optimizer's pre-replay hook rewrites before every
// replay (WriteUpdateScalarsCuda), and its table must be cached already; a
// table a graph uses is never evicted or rewritten afterwards.
#include <algorithm>
#include <cstring>
#include <list>

#include "nn/cuda/context.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/graph.h"
#include "optim/internal/fused_kernels.h"

namespace tandem::optim::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 4096;         // elements per block iteration
constexpr int64_t kMaxBlocks = 2048;
constexpr size_t kMaxCachedTables = 4;   // distinct tensor sets kept per group

// One tensor of a launch. Pointers are stored as integers so that a table is a
// plain int64 array (the device buffer is an int64 tensor).
struct TableEntry {
  int64_t param, grad, s0, s1, s2;  // addresses; 0 where unused
  int64_t numel;
  int64_t offset;  // first element in the concatenated index space
};
constexpr int64_t kEntryWords = sizeof(TableEntry) / sizeof(int64_t);
static_assert(sizeof(TableEntry) == 7 * sizeof(int64_t));

int64_t Address(const nn::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())) : 0;
}

// Index of the last entry whose offset is <= i (entries have numel > 0).
__device__ int FindEntry(const TableEntry* table, int n, int64_t i) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].offset <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Calls fn(entry, j) for every element j of every tensor, chunk by chunk.
template <typename Fn>
__device__ void ForEachElement(const TableEntry* table, int n, int64_t total, Fn&& fn) {
  const int64_t num_chunks = (total + kChunk - 1) / kChunk;
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    const int64_t begin = chunk * kChunk;
    const int64_t end = begin + kChunk < total ? begin + kChunk : total;
    int t = FindEntry(table, n, begin);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      while (i >= table[t].offset + table[t].numel) ++t;
      fn(table[t], i - table[t].offset);
    }
  }
}

template <typename T>
__device__ T* At(int64_t address, int64_t j) {
  return address == 0 ? nullptr : reinterpret_cast<T*>(static_cast<intptr_t>(address)) + j;
}

template <typename T>
__global__ void FusedUpdateKernel(Algorithm algo, UpdateScalars by_value,
                                  const UpdateScalars* device_scalars, const TableEntry* table,
                                  int n, int64_t total) {
  const UpdateScalars scalars = device_scalars != nullptr ? *device_scalars : by_value;
  ForEachElement(table, n, total, [&](const TableEntry& e, int64_t j) {
    UpdateElement<T>(algo, scalars, At<T>(e.param, j), *At<T>(e.grad, j), At<T>(e.s0, j),
                     At<T>(e.s1, j), At<T>(e.s2, j));
  });
}

// partials[block] = sum of squares of the block's elements (fixed assignment of
// chunks to blocks: the result does not depend on timing).
template <typename T>
__global__ void SumSquaresKernel(const TableEntry* table, int n, int64_t total, double* partials) {
  __shared__ double shared[kThreads];
  double sum = 0;
  ForEachElement(table, n, total, [&](const TableEntry& e, int64_t j) {
    const double v = static_cast<double>(*At<T>(e.grad, j));
    sum += v * v;
  });
  shared[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = shared[0];
}

// One block: total = sqrt(sum of partials) in T; coef = min(1, max_norm / (total + 1e-6)).
template <typename T>
__global__ void FinishNormKernel(const double* partials, int num_partials, double max_norm,
                                 T* total_out, double* coef_out) {
  __shared__ double shared[kThreads];
  double sum = 0;
  for (int i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
  shared[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const T total = static_cast<T>(::sqrt(shared[0]));
    *total_out = total;
    const double coef = max_norm / (static_cast<double>(total) + 1e-6);
    *coef_out = coef < 1.0 ? coef : 1.0;
  }
}

template <typename T>
__global__ void ScaleGradsKernel(const TableEntry* table, int n, int64_t total, const double* coef) {
  const T c = static_cast<T>(*coef);
  ForEachElement(table, n, total, [&](const TableEntry& e, int64_t j) { *At<T>(e.grad, j) *= c; });
}

__global__ void WriteScalarsKernel(UpdateScalars scalars, UpdateScalars* dst) { *dst = scalars; }

int Blocks(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + kChunk - 1) / kChunk, kMaxBlocks));
}

}  // namespace

// Up to kMaxCachedTables tables, least recently used first. Each has a pinned
// host buffer (from nn's pinned host cache, needed for a truly asynchronous
// upload, so a run that has warmed the cache calls no cudaHostAlloc /
// cudaFreeHost, which mid-run can wait behind other GPUs' NCCL kernels) and an
// int64 device tensor (the device's stream-ordered pool). A table rewritten
// with other words (the set of tensors changed) takes a fresh pinned buffer
// from the cache and gives the old one back: each upload records its use of
// its buffer (RecordPinnedUse), so the cache hands a buffer out again only
// once its copy is done, and the host never waits for an earlier upload (more
// tensor sets than cached tables, or gradients that move every step, would
// otherwise make every step wait for the GPU). The device copy is rewritten on
// the calling thread's stream, after the kernels queued there that read it. A
// table used by a captured graph is kept as it is for the tables' lifetime
// (the graph reads it at every replay): it is never chosen for reuse.
class DeviceTables {
 public:
  DeviceTables() = default;
  DeviceTables(const DeviceTables&) = delete;
  DeviceTables& operator=(const DeviceTables&) = delete;

  // Device address of a table holding `words`, uploading it if no cached table
  // on `device` holds exactly these words. Under capture (`what` names the
  // caller for the error) the table must be cached: it is then kept for good.
  const TableEntry* Get(const std::vector<int64_t>& words, nn::Device device, const char* what) {
    const bool capturing = nn::CudaGraph::IsCapturing();
    for (auto it = tables_.begin(); it != tables_.end(); ++it) {
      if (it->device == device && it->words == words) {
        it->captured = it->captured || capturing;
        tables_.splice(tables_.end(), tables_, it);  // most recently used
        return static_cast<const TableEntry*>(tables_.back().on_device.data_ptr());
      }
    }
    TANDEM_CHECK(!capturing, what, " on ", device.ToString(),
                 ": its tensors changed since the last eager step, or there was none; run one "
                 "eager step before capturing (a captured step cannot upload its pointer table)");
    auto reusable = std::find_if(tables_.begin(), tables_.end(),
                                 [](const Table& t) { return !t.captured; });
    const size_t live = static_cast<size_t>(
        std::count_if(tables_.begin(), tables_.end(), [](const Table& t) { return !t.captured; }));
    if (live < kMaxCachedTables || reusable == tables_.end()) {
      tables_.emplace_back();
    } else {
      tables_.splice(tables_.end(), tables_, reusable);  // reuse the oldest not in a graph
    }
    Table& t = tables_.back();
    t.words.clear();  // holds nothing a lookup may match until the upload is queued
    const size_t bytes = words.size() * sizeof(int64_t);
    // A fresh pinned buffer for every upload: the old one goes back to the
    // cache, which keeps it until its upload is done (no host wait here).
    t.pinned = nn::empty({static_cast<int64_t>(words.size())},
                         {.dtype = nn::kInt64, .device = nn::Device::CPU(), .pinned = true});
    if (!t.on_device.defined() || t.capacity_words < words.size() || !(t.device == device)) {
      // Size and device change with the tensor only: an allocation that throws
      // leaves the old tensor with its own size and device, so that a later
      // upload that fits the size asked for here does not copy past its end.
      t.on_device = nn::empty({static_cast<int64_t>(words.size())},
                              {.dtype = nn::kInt64, .device = device});
      t.capacity_words = words.size();
      t.device = device;
    }
    void* pinned = t.pinned.host_ptr();
    std::memcpy(pinned, words.data(), bytes);
    cudaStream_t stream = nn::internal::ThreadStream(device);
    nn::internal::CountCudaCall(nn::internal::CudaCall::kMemcpyAsync);
    TANDEM_CHECK_CUDA(cudaMemcpyAsync(t.on_device.data_ptr(), pinned, bytes,
                                      cudaMemcpyHostToDevice, stream),
                      device);
    t.words = words;
    nn::internal::RecordPinnedUse(pinned, device, stream);
    return static_cast<const TableEntry*>(t.on_device.data_ptr());
  }

 private:
  struct Table {
    std::vector<int64_t> words;  // what the device copy holds
    nn::Tensor pinned;  // int64, pinned host memory (nn's pinned cache): the last upload's source
    size_t capacity_words = 0;  // of on_device
    nn::Tensor on_device;
    nn::Device device;
    bool captured = false;  // read by a captured graph: never reused
  };
  std::list<Table> tables_;
};

std::shared_ptr<DeviceTables> MakeDeviceTables() { return std::make_shared<DeviceTables>(); }

namespace {

// Table words of `tensors` (zero-size tensors left out); sets *total.
template <typename Get>
std::vector<int64_t> BuildTable(size_t count, Get&& get, int64_t* total) {
  std::vector<int64_t> words;
  *total = 0;
  for (size_t k = 0; k < count; ++k) {
    TableEntry e = get(k);
    if (e.numel == 0) continue;
    e.offset = *total;
    *total += e.numel;
    const int64_t* w = reinterpret_cast<const int64_t*>(&e);
    words.insert(words.end(), w, w + kEntryWords);
  }
  return words;
}

}  // namespace

void FusedUpdateCuda(Algorithm algo, const std::vector<UpdateTensors>& tensors,
                     const UpdateScalars& scalars, const UpdateScalars* device_scalars,
                     DeviceTables& tables) {
  const nn::Device device = tensors.front().param.device();
  int64_t total = 0;
  const std::vector<int64_t> words = BuildTable(
      tensors.size(),
      [&](size_t k) {
        const UpdateTensors& t = tensors[k];
        return TableEntry{Address(t.param), Address(t.grad), Address(t.state[0]),
                          Address(t.state[1]), Address(t.state[2]), t.param.numel(), 0};
      },
      &total);
  if (total == 0) return;
  const int n = static_cast<int>(words.size() / kEntryWords);
  const TableEntry* table = tables.Get(words, device, "optimizer step");
  cudaStream_t stream = nn::internal::ThreadStream(device);
  TANDEM_DISPATCH_FLOAT(tensors.front().param.dtype(), "optimizer step", [&]<typename T>() {
    FusedUpdateKernel<T><<<Blocks(total), kThreads, 0, stream>>>(algo, scalars, device_scalars,
                                                                 table, n, total);
  });
  TANDEM_CHECK_LAUNCH("FusedUpdateKernel", device);
}

void WriteUpdateScalarsCuda(const UpdateScalars& scalars, UpdateScalars* dst, nn::Device device) {
  WriteScalarsKernel<<<1, 1, 0, nn::internal::ThreadStream(device)>>>(scalars, dst);
  TANDEM_CHECK_LAUNCH("WriteScalarsKernel", device);
}

nn::Tensor ClipGradNormCuda(const std::vector<nn::Tensor>& grads, double max_norm) {
  // The calling thread's (rank's) cache of gradient tables. Graphs captured on
  // the thread read them at every replay: released before the tables go at the
  // thread's exit (a replay from another thread then throws).
  struct ThreadTables {
    DeviceTables tables;
    ~ThreadTables() { nn::internal::ReleaseThreadGraphs(); }
  };
  thread_local ThreadTables local;
  DeviceTables& tables = local.tables;
  const nn::Device device = grads.front().device();
  const nn::DType dtype = grads.front().dtype();
  int64_t total = 0;
  const std::vector<int64_t> words = BuildTable(
      grads.size(),
      [&](size_t k) { return TableEntry{0, Address(grads[k]), 0, 0, 0, grads[k].numel(), 0}; },
      &total);
  nn::Tensor norm = nn::empty({}, {.dtype = dtype, .device = device});
  if (total == 0) return norm.zero_();
  const int n = static_cast<int>(words.size() / kEntryWords);
  const TableEntry* table = tables.Get(words, device, "clip_grad_norm_");
  const int blocks = Blocks(total);
  nn::Tensor partials = nn::empty({blocks}, {.dtype = nn::kFloat64, .device = device});
  nn::Tensor coef = nn::empty({}, {.dtype = nn::kFloat64, .device = device});
  cudaStream_t stream = nn::internal::ThreadStream(device);
  TANDEM_DISPATCH_FLOAT(dtype, "clip_grad_norm_", [&]<typename T>() {
    SumSquaresKernel<T><<<blocks, kThreads, 0, stream>>>(table, n, total, partials.data<double>());
    TANDEM_CHECK_LAUNCH("SumSquaresKernel", device);
    FinishNormKernel<T><<<1, kThreads, 0, stream>>>(partials.data<double>(), blocks, max_norm,
                                                    norm.data<T>(), coef.data<double>());
    TANDEM_CHECK_LAUNCH("FinishNormKernel", device);
    ScaleGradsKernel<T><<<blocks, kThreads, 0, stream>>>(table, n, total, coef.data<double>());
    TANDEM_CHECK_LAUNCH("ScaleGradsKernel", device);
  });
  return norm;
}

}  // namespace tandem::optim::internal
