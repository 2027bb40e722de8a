// RelaxedCaptureMode: the calling thread's CUDA stream capture mode set to
// relaxed for a scope. Internal to the CUDA code of nn and spawn's NCCL
// communicator (includes the CUDA runtime header).
//
// A thread that captures (nn::CudaGraph captures in thread-local mode) may not
// make "potentially unsafe" calls, such as cudaMalloc or cudaEventQuery: CUDA
// refuses them and invalidates the capture. In relaxed mode they run, not
// recorded; what necessarily conflicts with the capture stays refused (a query
// of an event last recorded inside a capture, a wait of a capturing stream on
// an event recorded outside it).
#ifndef TANDEM_NN_CUDA_INTERNAL_CAPTURE_MODE_H_
#define TANDEM_NN_CUDA_INTERNAL_CAPTURE_MODE_H_

#include <cuda_runtime_api.h>

namespace tandem::nn::internal {

// Restores the thread's previous mode when destroyed, also when the scope is
// left by an exception; nothing is restored if setting the mode failed (a
// broken context), so the thread never stays relaxed. Never throws.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept
      : set_(cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess) {}
  ~RelaxedCaptureMode() {
    if (set_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;  // the previous one once set_
  bool set_;
};

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_CUDA_INTERNAL_CAPTURE_MODE_H_
