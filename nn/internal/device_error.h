// Deferred device errors: how a CUDA kernel reports bad input without killing
// the CUDA context (a __trap() or an assert would make every later CUDA call of
// the process fail).
//
// Each CUDA device has one error word in mapped pinned host memory
// (cudaHostAllocMapped: kernels write it directly, the host reads it without a
// copy). A kernel that meets bad input calls ReportDeviceError(word, code, a, b, c)
// and carries on with a harmless result (e.g. NaN for the bad sample); the first
// report on a device wins (atomicCAS), later ones are dropped until the host has
// raised it. The host raises the error as tandem::Error where it synchronises with
// the device anyway, so no host synchronisation is added to a training step:
// CudaCopy to the host (Tensor::item(), to_vector(), to(cpu), copy_ to a host
// tensor) and nn::Synchronize(device). The error is raised once, by the first
// thread to see it, then the word is cleared; the context stays usable.
//
// The word is per device, not per stream: with several threads on one device
// (ranks sharing a GPU) the thread that synchronises first raises it, whichever
// thread's kernel reported it.
//
// To use it in a kernel: take `DeviceErrorWord* error = DeviceErrorSlot(device)`
// on the host (a stable pointer, safe to bake into a CUDA graph), pass it as a
// kernel argument, call ReportDeviceError in the kernel, and add the code and its
// message to DeviceErrorMessage (nn/cuda/runtime.cc).
//
// Internal to nn. The device function is compiled only by nvcc (__CUDACC__).
#ifndef TANDEM_NN_INTERNAL_DEVICE_ERROR_H_
#define TANDEM_NN_INTERNAL_DEVICE_ERROR_H_

#include <chrono>
#include <string>

#include "nn/device.h"

namespace tandem::nn::internal {

// What went wrong; a, b, c are the values the message names.
enum DeviceErrorCode : unsigned long long {
  kDeviceErrorNone = 0,
  kDeviceErrorWriting = 1,  // a kernel has claimed the word and is filling it in
  // cross_entropy: a = the target, b = the sample (row), c = the number of classes.
  kDeviceErrorCrossEntropyTarget = 2,
  // nll_loss: a = the target, b = the sample (row), c = the number of classes.
  kDeviceErrorNllLossTarget = 3,
};

struct DeviceErrorWord {
  unsigned long long code;  // a DeviceErrorCode
  long long a, b, c;
};

// The error word of `device` as kernels address it. Made (cudaHostAlloc, once
// per device, never freed) when the first thread creates its stream on the
// device, so a call during graph capture allocates nothing. Throws
// tandem::Error if the allocation fails.
DeviceErrorWord* DeviceErrorSlot(Device device);

// "<message> on cuda:N" for a reported error (e.g. "cross_entropy: target 12
// of sample 3 is out of range [0, 10) on cuda:0").
std::string DeviceErrorMessage(unsigned long long code, long long a, long long b, long long c,
                               Device device);

// If a kernel on `device` has reported an error, clears the word and throws it
// as tandem::Error. Call only after synchronising with the work that may have
// reported it (its writes are visible to the host once the stream is done).
void RaiseDeviceError(Device device);

// The same without throwing: the message of the report pending on `device`,
// the word cleared, or "" when none is pending (or a kernel is still filling
// it in).
std::string TakeDeviceError(Device device);

// For spawn, once the rank threads of a failed attempt have been joined and
// their communicators destroyed (SpawnOptions::restart): waits for the work
// left on the streams that ended threads gave back to the pool (no live thread
// uses them, so none is being captured), then takes the report pending on
// `device` as TakeDeviceError does. A report raised in a failed attempt and not
// yet read so belongs to that attempt's failure (spawn adds it to the
// failure's message) and cannot surface in, and fail, the next attempt, whose
// word starts clean. The wait ends at `deadline` (spawn passes one deadline,
// 5 s away, for all of an attempt's devices): work that has not ended by then
// (a kernel that never ends) leaves the report on the word, and this returns
// "". The streams are taken out of the pool while they are waited for
// (nn/internal/spare_streams.h), not waited for under its lock: threads that
// start or end meanwhile are not held up. Never throws: a failing wait (a
// broken context) is cleared from the thread's last error and, when
// `context_error` is given, written there as CUDA's name and text of the error
// (a fault on the device, such as cudaErrorIllegalAddress, which CUDA keeps in
// the device's context for the rest of the process; "" when none); "" for a
// device that is not CUDA or has no word yet.
std::string TakeDeviceErrorOfEndedThreads(
    Device device,
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::now() +
                                                     std::chrono::seconds(5),
    std::string* context_error = nullptr) noexcept;

#ifdef __CUDACC__
// Reports (code, a, b, c) unless an earlier report is pending. Device atomics on
// mapped host memory are atomic among the threads of this device, which is all
// the first-wins rule needs (only kernels of this device write this word).
__device__ inline void ReportDeviceError(DeviceErrorWord* word, unsigned long long code,
                                         long long a, long long b, long long c) {
  if (atomicCAS(&word->code, static_cast<unsigned long long>(kDeviceErrorNone),
                static_cast<unsigned long long>(kDeviceErrorWriting)) != kDeviceErrorNone) {
    return;
  }
  volatile DeviceErrorWord* w = word;
  w->a = a;
  w->b = b;
  w->c = c;
  __threadfence_system();  // the payload reaches the host before the code
  atomicExch(&word->code, code);
}
#endif

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_DEVICE_ERROR_H_
