// Per-(thread, device) cuBLASLt and cuDNN handles. Built only when TANDEM_WITH_CUDA.
#include "nn/cuda/handles.h"

#include <limits>
#include <unordered_map>

#include "nn/cuda/context.h"
#include "nn/error.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/tensor.h"

namespace tandem::nn::internal {
namespace {

// 32 MiB: what cuBLASLt's heuristics want for large H100 GEMMs.
constexpr int64_t kCublasLtWorkspaceBytes = int64_t{32} << 20;

struct CublasLtEntry {
  CublasLtContext context;
  Tensor workspace;  // keeps context.workspace alive
};

struct ThreadHandles {
  std::unordered_map<int, CublasLtEntry> cublaslt;
  std::unordered_map<int, cudnnHandle_t> cudnn;
  ~ThreadHandles() {
    // Graphs captured on this thread read the cuBLASLt workspaces at every
    // replay: released first (a replay from another thread then throws).
    ReleaseThreadGraphs();
    // Destructors must not throw; a failing destroy has nothing left to report to.
    // Each handle is destroyed with its device current, and the thread's device
    // restored after.
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    for (auto& [index, entry] : cublaslt) {
      cudaSetDevice(index);
      CublasLt().Destroy(entry.context.handle);
    }
    for (auto& [index, handle] : cudnn) {
      cudaSetDevice(index);
      cudnnDestroy(handle);
    }
    if (previous >= 0) cudaSetDevice(previous);
    // The workspace tensors are freed after this body, on their owning stream
    // (this thread's, which streams' pool keeps alive: see ThreadStream).
  }
};

// Creating a handle (and the cuBLASLt workspace) is not capturable: cudaMalloc
// inside cuBLAS/cuDNN invalidates the capture, with an error naming neither.
void CheckNotCapturing(Device device, const char* library) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CheckCuda(cudaStreamIsCapturing(ThreadStream(device), &status), "cudaStreamIsCapturing", device);
  TANDEM_CHECK(status == cudaStreamCaptureStatusNone, "the first ", library, " call of this thread on ",
               device.ToString(), " is inside a CUDA graph capture, where its handle cannot be "
               "created: run one eager step before capturing");
}

ThreadHandles& Local(Device device) {
  // ThreadStream's thread-local is constructed before ours, so it is destroyed
  // after ours and the workspaces' stream-ordered frees still have their stream.
  ThreadStream(device);
  thread_local ThreadHandles handles;
  return handles;
}

}  // namespace

const CublasLtContext& ThreadCublasLt(Device device) {
  ThreadHandles& local = Local(device);
  auto it = local.cublaslt.find(device.index);
  if (it != local.cublaslt.end()) return it->second.context;
  CheckNotCapturing(device, "cuBLASLt");
  CudaDeviceScope current(device);  // the handle binds to the current device
  CublasLtEntry entry;
  TANDEM_CHECK_CUBLAS(CublasLt().Create(&entry.context.handle), device, "creating the handle");
  try {
    entry.workspace = empty({kCublasLtWorkspaceBytes}, {.dtype = kUInt8, .device = device});
  } catch (...) {
    CublasLt().Destroy(entry.context.handle);
    throw;
  }
  entry.context.workspace = entry.workspace.data_ptr();
  entry.context.workspace_bytes = static_cast<size_t>(kCublasLtWorkspaceBytes);
  return local.cublaslt.emplace(device.index, std::move(entry)).first->second.context;
}

cudnnHandle_t ThreadCudnn(Device device) {
  ThreadHandles& local = Local(device);
  auto it = local.cudnn.find(device.index);
  if (it != local.cudnn.end()) return it->second;
  CheckNotCapturing(device, "cuDNN");
  CudaDeviceScope current(device);  // the handle binds to the current device
  cudnnHandle_t handle = nullptr;
  TANDEM_CHECK_CUDNN(cudnnCreate(&handle), device, "creating the handle");
  const cudnnStatus_t status = cudnnSetStream(handle, ThreadStream(device));
  if (status != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(handle);
    FailCudnn(status, "cudnnSetStream", device, "binding the handle to the thread's stream");
  }
  local.cudnn.emplace(device.index, handle);
  return handle;
}

void FailCublas(cublasStatus_t status, const char* call, Device device, const std::string& shapes) {
  Fail(call, " failed on ", device.ToString(), ": cuBLAS status ", static_cast<int>(status), " (",
       CublasLt().GetStatusString(status), ") while ", shapes);
}

void FailCudnn(cudnnStatus_t status, const char* call, Device device, const std::string& shapes) {
  Fail(call, " failed on ", device.ToString(), ": ", cudnnGetErrorString(status), " while ",
       shapes);
}

cudnnDataType_t CudnnDataType(DType dtype, const char* op) {
  switch (dtype) {
    case DType::kFloat32: return CUDNN_DATA_FLOAT;
    case DType::kFloat64: return CUDNN_DATA_DOUBLE;
    case DType::kBFloat16: return CUDNN_DATA_BFLOAT16;
    default:
      Fail(op, ": unsupported dtype ", DTypeName(dtype), " (float32, float64 and bfloat16 only)");
  }
}

int CudnnInt(int64_t v, const char* op) {
  TANDEM_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), op, ": size ", v,
               " exceeds cuDNN's int range");
  return static_cast<int>(v);
}

CudnnTensor4d::CudnnTensor4d(DType dtype, int64_t n, int64_t c, int64_t h, int64_t w,
                             Device device, const char* op) {
  // Everything that may throw runs before the descriptor exists.
  const cudnnDataType_t type = CudnnDataType(dtype, op);
  const int dims[4] = {CudnnInt(n, op), CudnnInt(c, op), CudnnInt(h, op), CudnnInt(w, op)};
  TANDEM_CHECK_CUDNN(cudnnCreateTensorDescriptor(&desc_), device, op);
  CountCudaCall(CudaCall::kCudnnCall);  // checked below, not by the macro
  const cudnnStatus_t status = cudnnSetTensor4dDescriptor(desc_, CUDNN_TENSOR_NCHW, type, dims[0],
                                                          dims[1], dims[2], dims[3]);
  if (status != CUDNN_STATUS_SUCCESS) {
    cudnnDestroyTensorDescriptor(desc_);
    FailCudnn(status, "cudnnSetTensor4dDescriptor", device,
              absl::StrCat(op, " with a (", n, ", ", c, ", ", h, ", ", w, ") tensor"));
  }
}

CudnnTensor4d::~CudnnTensor4d() { cudnnDestroyTensorDescriptor(desc_); }

}  // namespace tandem::nn::internal
