// Per-(thread, device) cuBLASLt and cuDNN handles bound to the thread's stream,
// RAII cuDNN descriptors, and the status checks of both libraries. Internal to
// nn: only nn's *_cuda.cc files include this (it pulls in cublasLt.h and cudnn.h).
#ifndef TANDEM_NN_CUDA_HANDLES_H_
#define TANDEM_NN_CUDA_HANDLES_H_

#include "nn/cuda/cublaslt_api.h"
#include <cudnn.h>

#include <cstdint>
#include <string>

#include "nn/cuda/internal/call_counter.h"
#include "nn/device.h"
#include "nn/dtype.h"

namespace tandem::nn::internal {

// The calling thread's cuBLASLt handle for `device` and its workspace (allocated
// once, with the handle, from the stream-ordered pool; used only on
// ThreadStream(device)). Created on first use; destroyed when the thread ends.
struct CublasLtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
const CublasLtContext& ThreadCublasLt(Device device);

// The calling thread's cuDNN handle for `device`, set to ThreadStream(device).
// Created on first use; destroyed when the thread ends.
cudnnHandle_t ThreadCudnn(Device device);

// Throw tandem::Error naming the call, the device, the library's message and
// `shapes` (what the op was doing).
[[noreturn]] void FailCublas(cublasStatus_t status, const char* call, Device device,
                             const std::string& shapes);
[[noreturn]] void FailCudnn(cudnnStatus_t status, const char* call, Device device,
                            const std::string& shapes);

// cuDNN's element type for a float dtype (float32 / float64; others throw).
cudnnDataType_t CudnnDataType(DType dtype, const char* op);
// Checks that a size fits the int that cuDNN's legacy API takes.
int CudnnInt(int64_t v, const char* op);

// Owns a cuDNN tensor descriptor set to a 4-D NCHW shape.
class CudnnTensor4d {
 public:
  CudnnTensor4d(DType dtype, int64_t n, int64_t c, int64_t h, int64_t w, Device device,
                const char* op);
  ~CudnnTensor4d();
  CudnnTensor4d(const CudnnTensor4d&) = delete;
  CudnnTensor4d& operator=(const CudnnTensor4d&) = delete;
  cudnnTensorDescriptor_t get() const { return desc_; }

 private:
  cudnnTensorDescriptor_t desc_ = nullptr;
};

}  // namespace tandem::nn::internal

// The shapes argument is evaluated only on failure. Each call is counted
// (nn/cuda/internal/call_counter.h: kCublasCall, kCudnnCall).
#define TANDEM_CHECK_CUBLAS(expr, device, shapes)                                  \
  do {                                                                            \
    ::tandem::nn::internal::CountCudaCall(::tandem::nn::internal::CudaCall::kCublasCall); \
    const cublasStatus_t tandem_status_ = (expr);                                 \
    if (tandem_status_ != CUBLAS_STATUS_SUCCESS) {                                \
      ::tandem::nn::internal::FailCublas(tandem_status_, #expr, (device), (shapes)); \
    }                                                                             \
  } while (0)
#define TANDEM_CHECK_CUDNN(expr, device, shapes)                                  \
  do {                                                                            \
    ::tandem::nn::internal::CountCudaCall(::tandem::nn::internal::CudaCall::kCudnnCall); \
    const cudnnStatus_t tandem_status_ = (expr);                                  \
    if (tandem_status_ != CUDNN_STATUS_SUCCESS) {                                 \
      ::tandem::nn::internal::FailCudnn(tandem_status_, #expr, (device), (shapes)); \
    }                                                                             \
  } while (0)

#endif  // TANDEM_NN_CUDA_HANDLES_H_
