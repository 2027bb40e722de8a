// CUDA side of the in-process communicator: ranks sharing one GPU reduce each
// other's buffers with a kernel on their own compute stream (see
// spawn/internal/inprocess_cuda.h for the event protocol).
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "nn/cuda/context.h"
#include "nn/error.h"
#include "spawn/comm/inprocess/internal/inprocess_cuda.h"

namespace tandem::dist::internal {
namespace {

constexpr int kMaxRanks = 64;

template <typename T>
struct Pointers {
  const T* in[kMaxRanks];
  T* out[kMaxRanks];
};

// bfloat16 in device memory: the upper 16 bits of a float32 (nn::BFloat16's layout).
struct Bf16Bits {
  uint16_t bits;
};

// float16 in device memory: IEEE binary16 bits (nn::Float16's layout).
struct F16Bits {
  uint16_t bits;
};

// What an element is combined in: itself, or float32 for bfloat16 and float16
// (rounded once at the end, to nearest even as nn::BFloat16::FromFloat and
// nn::Float16::FromFloat: the CPU path's bits).
template <typename T>
struct Acc {
  using type = T;
  __device__ static T Load(T v) { return v; }
  __device__ static T Store(T a) { return a; }
};
template <>
struct Acc<Bf16Bits> {
  using type = float;
  __device__ static float Load(Bf16Bits v) { return __uint_as_float(static_cast<uint32_t>(v.bits) << 16); }
  __device__ static Bf16Bits Store(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return Bf16Bits{static_cast<uint16_t>((u >> 16) | 0x0040u)};  // quiet NaN stays NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return Bf16Bits{static_cast<uint16_t>(u >> 16)};
  }
};
template <>
struct Acc<F16Bits> {
  using type = float;
  __device__ static float Load(F16Bits v) { return __half2float(__ushort_as_half(v.bits)); }
  __device__ static F16Bits Store(float f) {
    // NaN as the host's Float16::FromFloat writes it (CUDA's own is 0x7fff);
    // otherwise __float2half_rn rounds as the host does (overflow to infinity).
    if (isnan(f)) return F16Bits{static_cast<uint16_t>(signbit(f) ? 0xfe00u : 0x7e00u)};
    return F16Bits{__half_as_ushort(__float2half_rn(f))};
  }
};

// One thread per element of [begin, end): ranks combined in order 0, 1, ...
template <typename T>
__global__ void ReduceSliceKernel(Pointers<T> p, int n_in, int n_out, int64_t begin, int64_t end,
                                  int op) {
  using A = typename Acc<T>::type;
  const int64_t i = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= end) return;
  A acc = Acc<T>::Load(p.in[0][i]);
  for (int k = 1; k < n_in; ++k) {
    const A v = Acc<T>::Load(p.in[k][i]);
    acc = op == 2 ? (v > acc ? v : acc) : static_cast<A>(acc + v);
  }
  if (op == 1) acc = static_cast<A>(acc / static_cast<A>(n_in));
  const T result = Acc<T>::Store(acc);
  for (int k = 0; k < n_out; ++k) p.out[k][i] = result;
}

template <typename T>
void Launch(const std::vector<const void*>& in, const std::vector<void*>& out, int64_t begin,
            int64_t end, int op, nn::Device device) {
  Pointers<T> p{};
  for (size_t k = 0; k < in.size(); ++k) p.in[k] = static_cast<const T*>(in[k]);
  for (size_t k = 0; k < out.size(); ++k) p.out[k] = static_cast<T*>(out[k]);
  const int threads = 256;
  const int64_t blocks = (end - begin + threads - 1) / threads;
  ReduceSliceKernel<T><<<static_cast<unsigned>(blocks), threads, 0,
                         nn::internal::ThreadStream(device)>>>(
      p, static_cast<int>(in.size()), static_cast<int>(out.size()), begin, end, op);
  TANDEM_CHECK_LAUNCH("ReduceSliceKernel", device);
}

}  // namespace

void* CreateEvent(nn::Device device) {
  cudaEvent_t event;
  // The event belongs to the device current at creation; the caller's device
  // is restored.
  nn::internal::CudaDeviceScope current(device);
  nn::internal::CountCudaCall(nn::internal::CudaCall::kEventCreate);
  TANDEM_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), device);
  return event;
}

void DestroyEvent(void* event, nn::Device device) {
  // Called by ~InProcessCommunicator on spawn's thread, which may never have
  // selected a device: with the event's device current, the runtime does not
  // make a context on GPU 0 for the call.
  nn::internal::CudaDeviceScope current(device, std::nothrow);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void RecordEvent(void* event, nn::Device device) {
  nn::internal::CountCudaCall(nn::internal::CudaCall::kEventRecord);
  TANDEM_CHECK_CUDA(
      cudaEventRecord(static_cast<cudaEvent_t>(event), nn::internal::ThreadStream(device)), device);
}

void WaitEvents(const std::vector<void*>& events, nn::Device device) {
  cudaStream_t stream = nn::internal::ThreadStream(device);
  for (void* e : events) {
    nn::internal::CountCudaCall(nn::internal::CudaCall::kStreamWaitEvent);
    TANDEM_CHECK_CUDA(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(e), 0), device);
  }
}

void ReduceSliceCuda(const std::vector<const void*>& in, const std::vector<void*>& out,
                     int64_t begin, int64_t end, nn::DType dtype, int op, nn::Device device) {
  TANDEM_CHECK(in.size() <= kMaxRanks && out.size() <= kMaxRanks,
               "in-process collective on ", device.ToString(), ": at most ", kMaxRanks,
               " ranks may share a GPU, not ", in.size());
  // A grid has at most 2^31-1 blocks in x: split larger slices.
  const int64_t max_elems = int64_t{2147483647} * 256;
  for (int64_t lo = begin; lo < end; lo += max_elems) {
    const int64_t hi = end - lo > max_elems ? lo + max_elems : end;
    switch (dtype) {
      case nn::DType::kFloat32: Launch<float>(in, out, lo, hi, op, device); break;
      case nn::DType::kFloat64: Launch<double>(in, out, lo, hi, op, device); break;
      case nn::DType::kInt64: Launch<int64_t>(in, out, lo, hi, op, device); break;
      case nn::DType::kBFloat16: Launch<Bf16Bits>(in, out, lo, hi, op, device); break;
      case nn::DType::kFloat16: Launch<F16Bits>(in, out, lo, hi, op, device); break;
      default:
        tandem::Fail("in-process collective on ", device.ToString(), ": dtype ",
                     nn::DTypeName(dtype),
                     " is not supported (float32, float64, bfloat16, float16, int64)");
    }
  }
}

void CopyCuda(void* dst, const void* src, int64_t bytes, nn::Device device) {
  TANDEM_CHECK_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                                    nn::internal::ThreadStream(device)),
                    device);
}

}  // namespace tandem::dist::internal
