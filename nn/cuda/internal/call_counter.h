// Counts of the CUDA runtime calls tandem makes, by kind: for tests that check a
// path makes no allocation, free or device-wide synchronisation (mid-run, with
// peer access on, those can wait for other GPUs' NCCL kernels), and for
// counting the calls of one op. Internal to tandem: no CUDA header, so tests
// and spawn may include it.
//
// Counted where tandem makes the call (nn/cuda, optim/fused_cuda.cu, spawn's
// communicators), not inside libraries: NCCL, cuBLASLt and cuDNN make their own
// runtime calls and launches, which are not counted. What tandem asks of cuDNN
// and cuBLASLt is counted instead, one per call checked with TANDEM_CHECK_CUDNN /
// TANDEM_CHECK_CUBLAS (nn/cuda/handles.h): descriptor creation and set-up,
// heuristics, the convolution or matmul itself (descriptor destroys are not
// checked, hence not counted: one per create). Kernel launches are counted at
// their launch check (TANDEM_CHECK_LAUNCH, nn/cuda/context.h), so a kernel
// launched without one is not. Copies, fills and host waits are counted in
// nn/cuda/runtime.cc's services (Tensor::to / copy_, zeros, item(),
// nn::Synchronize) and the fused optimizer's table upload.
//
// Thread-safety: every function may be called from any thread. Process counts
// are relaxed atomics (a count read while other threads call is a lower bound
// of what they have done); thread counts are the calling thread's own.
//
//   const auto before = nn::internal::ProcessCudaCalls();
//   RunSteps();
//   const auto made = nn::internal::ProcessCudaCalls() - before;
//   EXPECT_EQ(made.Allocations(), 0) << made.ToString();
#ifndef TANDEM_NN_CUDA_INTERNAL_CALL_COUNTER_H_
#define TANDEM_NN_CUDA_INTERNAL_CALL_COUNTER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tandem::nn::internal {

enum class CudaCall : int {
  kMalloc,             // cudaMalloc: synchronous device allocation
  kFree,               // cudaFree
  kMallocAsync,        // cudaMallocAsync / cudaMallocFromPoolAsync: stream-ordered
  kFreeAsync,          // cudaFreeAsync
  kHostAlloc,          // cudaHostAlloc / cudaMallocHost: pinned host memory
  kFreeHost,           // cudaFreeHost
  kEventCreate,        // cudaEventCreate(WithFlags)
  kEventRecord,        // cudaEventRecord
  kStreamWaitEvent,    // cudaStreamWaitEvent
  kDeviceSynchronize,  // cudaDeviceSynchronize
  kKernelLaunch,       // a kernel launch checked with TANDEM_CHECK_LAUNCH
  kMemcpyAsync,        // cudaMemcpyAsync / cudaMemcpyPeerAsync
  kMemsetAsync,        // cudaMemsetAsync
  kHostWait,           // the host waits for a stream or an event (synchronize or polling)
  kCudnnCall,          // a cuDNN call checked with TANDEM_CHECK_CUDNN
  kCublasCall,         // a cuBLASLt call checked with TANDEM_CHECK_CUBLAS
  kNumCalls,
};

inline const char* CudaCallName(CudaCall call) {
  switch (call) {
    case CudaCall::kMalloc: return "cudaMalloc";
    case CudaCall::kFree: return "cudaFree";
    case CudaCall::kMallocAsync: return "cudaMallocAsync";
    case CudaCall::kFreeAsync: return "cudaFreeAsync";
    case CudaCall::kHostAlloc: return "cudaHostAlloc";
    case CudaCall::kFreeHost: return "cudaFreeHost";
    case CudaCall::kEventCreate: return "cudaEventCreate";
    case CudaCall::kEventRecord: return "cudaEventRecord";
    case CudaCall::kStreamWaitEvent: return "cudaStreamWaitEvent";
    case CudaCall::kDeviceSynchronize: return "cudaDeviceSynchronize";
    case CudaCall::kKernelLaunch: return "kernel launch";
    case CudaCall::kMemcpyAsync: return "cudaMemcpyAsync";
    case CudaCall::kMemsetAsync: return "cudaMemsetAsync";
    case CudaCall::kHostWait: return "host wait";
    case CudaCall::kCudnnCall: return "cuDNN call";
    case CudaCall::kCublasCall: return "cuBLASLt call";
    case CudaCall::kNumCalls: break;
  }
  return "?";
}

constexpr int kNumCudaCalls = static_cast<int>(CudaCall::kNumCalls);

// A snapshot of counts; subtract two to count what happened in between.
struct CudaCallCounts {
  std::array<int64_t, kNumCudaCalls> n{};

  int64_t operator[](CudaCall call) const { return n[static_cast<int>(call)]; }
  CudaCallCounts operator-(const CudaCallCounts& earlier) const {
    CudaCallCounts d;
    for (int i = 0; i < kNumCudaCalls; ++i) d.n[i] = n[i] - earlier.n[i];
    return d;
  }
  // Calls that are not stream-ordered and may wait for the whole device (or
  // every device with peer access): cudaMalloc, cudaFree, cudaHostAlloc,
  // cudaFreeHost.
  int64_t Allocations() const {
    return (*this)[CudaCall::kMalloc] + (*this)[CudaCall::kFree] +
           (*this)[CudaCall::kHostAlloc] + (*this)[CudaCall::kFreeHost];
  }
  // Every counted call: what the host did through CUDA and its libraries.
  int64_t Total() const {
    int64_t total = 0;
    for (int64_t v : n) total += v;
    return total;
  }
  // "cudaMallocAsync 3, kernel launch 12" (kinds with a count of 0 left out).
  std::string ToString() const {
    std::string out;
    for (int i = 0; i < kNumCudaCalls; ++i) {
      if (n[i] == 0) continue;
      if (!out.empty()) out += ", ";
      out += CudaCallName(static_cast<CudaCall>(i));
      out += " " + std::to_string(n[i]);
    }
    return out.empty() ? "none" : out;
  }
};

// The inverse of CudaCallCounts::ToString: "cudaMallocAsync 3, kernel launch 12"
// (or "none") back to counts; nullopt for an unknown kind or a bad number. For
// budgets recorded as text (tests/nn/cuda_call_budgets.inc).
inline std::optional<CudaCallCounts> ParseCudaCallCounts(std::string_view text) {
  CudaCallCounts counts;
  if (text == "none") return counts;
  while (!text.empty()) {
    const size_t comma = text.find(", ");
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 2);
    const size_t space = item.rfind(' ');
    if (space == std::string_view::npos || space + 1 == item.size()) return std::nullopt;
    const std::string_view name = item.substr(0, space), number = item.substr(space + 1);
    int64_t value = 0;
    for (char c : number) {
      if (c < '0' || c > '9') return std::nullopt;
      value = value * 10 + (c - '0');
    }
    int kind = 0;
    while (kind < kNumCudaCalls && name != CudaCallName(static_cast<CudaCall>(kind))) ++kind;
    if (kind == kNumCudaCalls) return std::nullopt;
    counts.n[kind] = value;
  }
  return counts;
}

namespace call_counter_detail {
inline std::array<std::atomic<int64_t>, kNumCudaCalls> g_process{};
inline thread_local std::array<int64_t, kNumCudaCalls> t_thread{};
}  // namespace call_counter_detail

inline void CountCudaCall(CudaCall call) noexcept {
  const int i = static_cast<int>(call);
  call_counter_detail::g_process[i].fetch_add(1, std::memory_order_relaxed);
  ++call_counter_detail::t_thread[i];
}

// Every thread's calls since the process started.
inline CudaCallCounts ProcessCudaCalls() {
  CudaCallCounts c;
  for (int i = 0; i < kNumCudaCalls; ++i) {
    c.n[i] = call_counter_detail::g_process[i].load(std::memory_order_relaxed);
  }
  return c;
}

// The calling thread's calls since it started.
inline CudaCallCounts ThreadCudaCalls() {
  CudaCallCounts c;
  c.n = call_counter_detail::t_thread;
  return c;
}

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_CUDA_INTERNAL_CALL_COUNTER_H_
