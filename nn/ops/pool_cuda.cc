// CUDA kernels of the pool family through cuDNN pooling, on the thread's stream.
// Max pooling: CUDNN_POOLING_MAX_DETERMINISTIC; cuDNN's backward recomputes each
// window's maximum from x and y, so no indices are stored on the GPU. Average
// pooling counts the zero padding in the divisor, as on the CPU. bfloat16 goes
// to our own kernels (pool_bf16_cuda.cu), which follow the CPU kernels exactly
// (first maximum on ties, argmax indices kept for backward). A shape's
// descriptors are made at its first call and cached per thread. An input with
// H or W 0 (padding makes the output non-empty: every window is padding) never
// reaches cuDNN, which rejects 0-sized descriptors: y is 0, as the CPU and
// bfloat16 kernels give, and dx is empty.
#include <map>
#include <memory>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/cuda/handles.h"
#include "nn/ops/internal/fill_kernels.h"
#include "nn/ops/internal/pool_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

using nn::internal::CudnnInt;
using nn::internal::CudnnTensor4d;
using nn::internal::ThreadCudnn;

std::string Describe(const Pool2dGeometry& g, const char* op) {
  return absl::StrCat(op, " x (", g.n, ", ", g.c, ", ", g.h, ", ", g.w, "), kernel (", g.kh, ", ",
                      g.kw, "), stride (", g.sh, ", ", g.sw, "), padding (", g.ph, ", ", g.pw, ")");
}

// Descriptors of one call: x, y and the pooling.
class PoolDescriptors {
 public:
  PoolDescriptors(const Pool2dGeometry& g, cudnnPoolingMode_t mode, DType dtype, Device device,
                  const char* op)
      : x_(dtype, g.n, g.c, g.h, g.w, device, op), y_(dtype, g.n, g.c, g.oh, g.ow, device, op) {
    const int window[6] = {CudnnInt(g.kh, op), CudnnInt(g.kw, op), CudnnInt(g.ph, op),
                           CudnnInt(g.pw, op), CudnnInt(g.sh, op), CudnnInt(g.sw, op)};
    cudnnPoolingDescriptor_t pool = nullptr;
    TANDEM_CHECK_CUDNN(cudnnCreatePoolingDescriptor(&pool), device, Describe(g, op));
    pool_.reset(pool);
    TANDEM_CHECK_CUDNN(cudnnSetPooling2dDescriptor(pool, mode, CUDNN_NOT_PROPAGATE_NAN, window[0],
                                                   window[1], window[2], window[3], window[4],
                                                   window[5]),
                       device, Describe(g, op));
  }
  cudnnTensorDescriptor_t x() const { return x_.get(); }
  cudnnTensorDescriptor_t y() const { return y_.get(); }
  cudnnPoolingDescriptor_t pool() const { return pool_.get(); }

 private:
  struct Deleter {
    void operator()(cudnnPoolingStruct* d) const { cudnnDestroyPoolingDescriptor(d); }
  };
  CudnnTensor4d x_, y_;
  std::unique_ptr<cudnnPoolingStruct, Deleter> pool_;
};

// The calling thread's descriptors for (mode, dtype, device, geometry).
const PoolDescriptors& DescriptorsFor(const Pool2dGeometry& g, cudnnPoolingMode_t mode,
                                      DType dtype, Device device, const char* op) {
  using Key = std::tuple<int, int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t>;
  thread_local std::map<Key, std::unique_ptr<PoolDescriptors>> cache;
  const Key key{static_cast<int>(mode), static_cast<int>(dtype), device.index, g.n, g.c, g.h, g.w,
                g.kh, g.kw, g.sh, g.sw, g.ph, g.pw};
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(key, std::make_unique<PoolDescriptors>(g, mode, dtype, device, op)).first;
  }
  return *it->second;
}

struct Scalars {
  explicit Scalars(DType dtype) : is_double(dtype == kFloat64) {}
  const void* one() const { return is_double ? static_cast<const void*>(&one_d) : &one_f; }
  const void* zero() const { return is_double ? static_cast<const void*>(&zero_d) : &zero_f; }
  bool is_double;
  double one_d = 1.0, zero_d = 0.0;
  float one_f = 1.0f, zero_f = 0.0f;
};

void Forward(cudnnPoolingMode_t mode, const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
             const char* op) {
  if (x.numel() == 0) {  // all-padding windows (see the file comment)
    FillCuda(y, 0.0);
    return;
  }
  const Device device = x.device();
  const PoolDescriptors& d = DescriptorsFor(g, mode, x.dtype(), device, op);
  const Scalars s(x.dtype());
  TANDEM_CHECK_CUDNN(cudnnPoolingForward(ThreadCudnn(device), d.pool(), s.one(), d.x(),
                                         x.data_ptr(), s.zero(), d.y(), y.data_ptr()),
                     device, Describe(g, op));
}

void Backward(cudnnPoolingMode_t mode, const Tensor& x, const Tensor& y, const Tensor& dy,
              const Pool2dGeometry& g, const Tensor& dx, const char* op) {
  if (dx.numel() == 0) return;  // x had H or W 0: nothing to route dy to
  const Device device = dy.device();
  const PoolDescriptors& d = DescriptorsFor(g, mode, dy.dtype(), device, op);
  const Scalars s(dy.dtype());
  // Average pooling reads neither x nor y; cuDNN still takes the pointers, and
  // the shapes (and dy / dx, which have them) serve.
  const void* x_ptr = x.defined() ? x.data_ptr() : dx.data_ptr();
  const void* y_ptr = y.defined() ? y.data_ptr() : dy.data_ptr();
  TANDEM_CHECK_CUDNN(cudnnPoolingBackward(ThreadCudnn(device), d.pool(), s.one(), d.y(), y_ptr,
                                          d.y(), dy.data_ptr(), d.x(), x_ptr, s.zero(), d.x(),
                                          dx.data_ptr()),
                     device, Describe(g, op));
}

}  // namespace

void MaxPool2dForwardCuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y,
                          const Tensor& indices) {
  if (x.dtype() == kBFloat16) return MaxPool2dForwardBFloat16Cuda(x, g, y, indices);
  Forward(CUDNN_POOLING_MAX_DETERMINISTIC, x, g, y, "max_pool2d");
}

void MaxPool2dBackwardCuda(const Tensor& x, const Tensor& y, const Tensor& indices,
                           const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  if (dy.dtype() == kBFloat16) return MaxPool2dBackwardBFloat16Cuda(indices, dy, g, dx);
  TANDEM_CHECK(x.defined() && y.defined(), "max_pool2d backward on CUDA needs the saved x and y");
  Backward(CUDNN_POOLING_MAX_DETERMINISTIC, x, y, dy, g, dx, "max_pool2d_backward");
}

void AvgPool2dForwardCuda(const Tensor& x, const Pool2dGeometry& g, const Tensor& y) {
  if (x.dtype() == kBFloat16) return AvgPool2dForwardBFloat16Cuda(x, g, y);
  Forward(CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING, x, g, y, "avg_pool2d");
}

void AvgPool2dBackwardCuda(const Tensor& dy, const Pool2dGeometry& g, const Tensor& dx) {
  if (dy.dtype() == kBFloat16) return AvgPool2dBackwardBFloat16Cuda(dy, g, dx);
  Backward(CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING, Tensor(), Tensor(), dy, g, dx,
           "avg_pool2d_backward");
}

}  // namespace tandem::nn::ops::internal
