// CUDA kernels of the conv family through cuDNN 9's legacy convolution API.
// Each direction first tries cuDNN's graph API with a cached execution plan
// (conv_cudnn_graph.cc; nn::set_cudnn_graph, on by default); a shape it cannot
// plan, or nn::set_cudnn_graph(false), runs here on the legacy API. There a
// shape's descriptors and algorithms (cudnnGet*Algorithm_v7 heuristics, no host
// sync) are made once and cached per thread (ConvPlan), so a call past the
// first makes one cuDNN call; workspaces are tensors from the stream-ordered
// pool; everything runs on the thread's stream.
// bfloat16 is cuDNN's PSEUDO_BFLOAT16_CONFIG (its only bfloat16 convolution
// configuration): x, w, y bfloat16, convolution compute type float32, alpha and
// beta float; tensor-op math allowed. The bias add and bias gradient of every
// dtype are our own kernels (conv_bias_cuda.cu).
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/cuda/handles.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/fill_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

using nn::internal::CudnnDataType;
using nn::internal::CudnnInt;
using nn::internal::CudnnTensor4d;
using nn::internal::ThreadCudnn;

// Workspaces above this are not considered (the pool would keep them cached).
constexpr size_t kMaxWorkspaceBytes = size_t{1} << 30;

std::string Describe(const Conv2dGeometry& g, DType dtype) {
  const auto& p = g.params;
  return absl::StrCat("conv2d x (", g.n, ", ", g.c, ", ", g.h, ", ", g.w, "), weight (", g.o, ", ",
                      g.c / p.groups, ", ", g.kh, ", ", g.kw, "), stride (", p.stride[0], ", ",
                      p.stride[1], "), padding (", p.padding[0], ", ", p.padding[1],
                      "), dilation (", p.dilation[0], ", ", p.dilation[1], "), groups ", p.groups,
                      ", ", DTypeName(dtype));
}

// The math type the heuristics are asked under: float32 without TF32 is limited
// to FMA kernels (CUDNN_DEFAULT_MATH lets Ampere and later use TF32); bfloat16
// may use tensor cores (no down-conversion is involved: the data is bfloat16
// already); otherwise the default, as PyTorch does.
cudnnMathType_t BaseMathType(DType dtype, bool tf32) {
  if (dtype == kBFloat16) return CUDNN_TENSOR_OP_MATH;
  return dtype == kFloat32 && !tf32 ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH;
}

// Whether the algorithms of `dtype` may run with tensor-op math.
bool TensorOpsAllowed(DType dtype, bool tf32) { return dtype == kBFloat16 || tf32; }

// The convolution's compute (accumulation) type: float32 for bfloat16 data.
cudnnDataType_t ComputeType(DType dtype) {
  return dtype == kBFloat16 ? CUDNN_DATA_FLOAT : CudnnDataType(dtype, "conv2d");
}

// Descriptors of one call: x, y, weight, convolution.
class ConvDescriptors {
 public:
  ConvDescriptors(const Conv2dGeometry& g, DType dtype, Device device)
      : g_(g),
        dtype_(dtype),
        x_(dtype, g.n, g.c, g.h, g.w, device, "conv2d"),
        y_(dtype, g.n, g.o, g.oh, g.ow, device, "conv2d") {
    const cudnnDataType_t type = CudnnDataType(dtype, "conv2d");
    const auto& p = g.params;
    // The filter is (O, C / groups, KH, KW); the group count is the convolution's.
    const int filter[4] = {CudnnInt(g.o, "conv2d"), CudnnInt(g.c / p.groups, "conv2d"),
                           CudnnInt(g.kh, "conv2d"), CudnnInt(g.kw, "conv2d")};
    const int conv[6] = {CudnnInt(p.padding[0], "conv2d"),  CudnnInt(p.padding[1], "conv2d"),
                         CudnnInt(p.stride[0], "conv2d"),   CudnnInt(p.stride[1], "conv2d"),
                         CudnnInt(p.dilation[0], "conv2d"), CudnnInt(p.dilation[1], "conv2d")};
    // Error messages name the call (Describe), built only on a failure.
    cudnnFilterDescriptor_t w = nullptr;
    TANDEM_CHECK_CUDNN(cudnnCreateFilterDescriptor(&w), device, Describe(g, dtype));
    w_.reset(w);
    cudnnConvolutionDescriptor_t conv_desc = nullptr;
    TANDEM_CHECK_CUDNN(cudnnCreateConvolutionDescriptor(&conv_desc), device, Describe(g, dtype));
    conv_.reset(conv_desc);
    TANDEM_CHECK_CUDNN(cudnnSetFilter4dDescriptor(w_.get(), type, CUDNN_TENSOR_NCHW, filter[0],
                                                  filter[1], filter[2], filter[3]),
                       device, Describe(g, dtype));
    TANDEM_CHECK_CUDNN(cudnnSetConvolution2dDescriptor(conv_.get(), conv[0], conv[1], conv[2], conv[3],
                                                       conv[4], conv[5], CUDNN_CROSS_CORRELATION,
                                                       ComputeType(dtype)),
                       device, Describe(g, dtype));
    if (p.groups != 1) {
      TANDEM_CHECK_CUDNN(cudnnSetConvolutionGroupCount(conv_.get(), CudnnInt(p.groups, "conv2d")),
                         device, Describe(g, dtype));
    }
    // TF32 only when allowed (set_allow_tf32); FMA math keeps float32 exact-ish.
    // Each call then sets the math type of the algorithm it runs (SetMathType).
    const bool tf32 = dtype == kFloat32 && AllowTf32();
    SetMathType(BaseMathType(dtype, tf32), device);
  }
  // cuDNN (7.4 and later) picks tensor-core kernels from the algorithm *and* the
  // descriptor's math type, so the math type a heuristic result reports must be
  // set before its workspace is sized and before it runs.
  void SetMathType(cudnnMathType_t math, Device device) const {
    if (math_ == math) return;  // a cached descriptor keeps its math type
    TANDEM_CHECK_CUDNN(cudnnSetConvolutionMathType(conv_.get(), math), device,
                       Describe(g_, dtype_));
    math_ = math;
  }
  ConvDescriptors(const ConvDescriptors&) = delete;
  ConvDescriptors& operator=(const ConvDescriptors&) = delete;

  cudnnTensorDescriptor_t x() const { return x_.get(); }
  cudnnTensorDescriptor_t y() const { return y_.get(); }
  cudnnFilterDescriptor_t w() const { return w_.get(); }
  cudnnConvolutionDescriptor_t conv() const { return conv_.get(); }

 private:
  struct Deleter {
    void operator()(cudnnFilterStruct* d) const { cudnnDestroyFilterDescriptor(d); }
    void operator()(cudnnConvolutionStruct* d) const { cudnnDestroyConvolutionDescriptor(d); }
  };
  Conv2dGeometry g_;  // for error messages
  DType dtype_;
  CudnnTensor4d x_, y_;
  std::unique_ptr<cudnnFilterStruct, Deleter> w_;
  std::unique_ptr<cudnnConvolutionStruct, Deleter> conv_;
  mutable std::optional<cudnnMathType_t> math_;  // conv_'s math type, once set
};

// The chosen algorithms of one shape, and the workspace each needs.
struct ConvAlgos {
  cudnnConvolutionFwdAlgo_t forward;
  cudnnConvolutionBwdDataAlgo_t backward_data;
  cudnnConvolutionBwdFilterAlgo_t backward_filter;
  cudnnMathType_t forward_math = CUDNN_DEFAULT_MATH, backward_data_math = CUDNN_DEFAULT_MATH,
                  backward_filter_math = CUDNN_DEFAULT_MATH;
  size_t forward_bytes = 0, backward_data_bytes = 0, backward_filter_bytes = 0;
};

// The first heuristic result that succeeded, fits the workspace limit, never
// converts down to half (TENSOR_OP_MATH_ALLOW_CONVERSION) and, unless tensor
// ops are allowed (TF32 on, or bfloat16), does not use tensor-op math.
template <typename Perf>
const Perf* Pick(const std::vector<Perf>& perfs, int count, bool tensor_ops) {
  for (int i = 0; i < count; ++i) {
    const Perf& perf = perfs[i];
    if (perf.status != CUDNN_STATUS_SUCCESS || perf.memory > kMaxWorkspaceBytes) continue;
    if (perf.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (!tensor_ops && perf.mathType != CUDNN_DEFAULT_MATH && perf.mathType != CUDNN_FMA_MATH) {
      continue;
    }
    return &perf;
  }
  return nullptr;
}

// The math type to run a picked algorithm with: the one its heuristic result
// reports, except that float32 without TF32 stays on FMA (DEFAULT would allow TF32).
cudnnMathType_t RunMathType(cudnnMathType_t reported, DType dtype, bool tf32) {
  return dtype == kFloat32 && !tf32 ? CUDNN_FMA_MATH : reported;
}

ConvAlgos ChooseAlgos(const Conv2dGeometry& g, DType dtype, Device device,
                      const ConvDescriptors& d, bool tf32) {
  cudnnHandle_t handle = ThreadCudnn(device);
  const bool tensor_ops = TensorOpsAllowed(dtype, tf32);
  const std::string what = Describe(g, dtype);
  const cudnnMathType_t base_math = BaseMathType(dtype, tf32);
  ConvAlgos algos;
  {
    d.SetMathType(base_math, device);
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perfs(CUDNN_CONVOLUTION_FWD_ALGO_COUNT);
    int count = 0;
    TANDEM_CHECK_CUDNN(cudnnGetConvolutionForwardAlgorithm_v7(handle, d.x(), d.w(), d.conv(), d.y(),
                                                              static_cast<int>(perfs.size()), &count,
                                                              perfs.data()),
                       device, what);
    const auto* best = Pick(perfs, count, tensor_ops);
    TANDEM_CHECK(best != nullptr, "conv2d: cuDNN has no forward algorithm for ", what);
    algos.forward = best->algo;
    algos.forward_math = RunMathType(best->mathType, dtype, tf32);
    d.SetMathType(algos.forward_math, device);
    TANDEM_CHECK_CUDNN(cudnnGetConvolutionForwardWorkspaceSize(handle, d.x(), d.w(), d.conv(), d.y(),
                                                               algos.forward, &algos.forward_bytes),
                       device, what);
  }
  {
    d.SetMathType(base_math, device);
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perfs(CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT);
    int count = 0;
    TANDEM_CHECK_CUDNN(cudnnGetConvolutionBackwardDataAlgorithm_v7(
                           handle, d.w(), d.y(), d.conv(), d.x(), static_cast<int>(perfs.size()),
                           &count, perfs.data()),
                       device, what);
    const auto* best = Pick(perfs, count, tensor_ops);
    TANDEM_CHECK(best != nullptr, "conv2d: cuDNN has no backward-data algorithm for ", what);
    algos.backward_data = best->algo;
    algos.backward_data_math = RunMathType(best->mathType, dtype, tf32);
    d.SetMathType(algos.backward_data_math, device);
    TANDEM_CHECK_CUDNN(cudnnGetConvolutionBackwardDataWorkspaceSize(
                           handle, d.w(), d.y(), d.conv(), d.x(), algos.backward_data,
                           &algos.backward_data_bytes),
                       device, what);
  }
  {
    d.SetMathType(base_math, device);
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perfs(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT);
    int count = 0;
    TANDEM_CHECK_CUDNN(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
                           handle, d.x(), d.y(), d.conv(), d.w(), static_cast<int>(perfs.size()),
                           &count, perfs.data()),
                       device, what);
    const auto* best = Pick(perfs, count, tensor_ops);
    TANDEM_CHECK(best != nullptr, "conv2d: cuDNN has no backward-filter algorithm for ", what);
    algos.backward_filter = best->algo;
    algos.backward_filter_math = RunMathType(best->mathType, dtype, tf32);
    d.SetMathType(algos.backward_filter_math, device);
    TANDEM_CHECK_CUDNN(cudnnGetConvolutionBackwardFilterWorkspaceSize(
                           handle, d.x(), d.y(), d.conv(), d.w(), algos.backward_filter,
                           &algos.backward_filter_bytes),
                       device, what);
  }
  return algos;
}

// Everything the convolutions of one shape need, made at its first call on a
// thread: the descriptors and the algorithms.
struct ConvPlan {
  ConvPlan(const Conv2dGeometry& g, DType dtype, Device device, bool tf32)
      : d(g, dtype, device), algos(ChooseAlgos(g, dtype, device, d, tf32)) {}
  ConvDescriptors d;
  ConvAlgos algos;
};

// The calling thread's plan for a shape. The cache holds a thread's distinct
// shapes (a network's layers, a partial last batch): it is not bounded, as
// cuDNN's own plan caches are not.
const ConvPlan& PlanFor(const Conv2dGeometry& g, DType dtype, Device device) {
  thread_local std::map<ConvCacheKey, std::unique_ptr<ConvPlan>> cache;
  const ConvCacheKey key{g, dtype, device.index, dtype == kFloat32 && AllowTf32()};
  auto it = cache.find(key);
  if (it == cache.end()) {
    it = cache.emplace(key, std::make_unique<ConvPlan>(g, dtype, device, key.tf32)).first;
  }
  return *it->second;
}

// A workspace tensor from the pool (undefined when none is needed).
Tensor Workspace(size_t bytes, Device device) {
  if (bytes == 0) return Tensor();
  return empty({static_cast<int64_t>(bytes)}, {.dtype = kUInt8, .device = device});
}

void* WorkspacePtr(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// alpha = 1 and beta = 0 or 1 in the tensors' type (cuDNN reads double for float64).
struct Scalars {
  explicit Scalars(DType dtype) : is_double(dtype == kFloat64) {}
  const void* one() const { return is_double ? static_cast<const void*>(&one_d) : &one_f; }
  const void* zero() const { return is_double ? static_cast<const void*>(&zero_d) : &zero_f; }
  bool is_double;
  double one_d = 1.0, zero_d = 0.0;
  float one_f = 1.0f, zero_f = 0.0f;
};

}  // namespace

namespace {

void ConvBiasForwardCuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                         const Conv2dGeometry& g, const Tensor& y) {
  const Device device = x.device();
  cudnnHandle_t handle = ThreadCudnn(device);
  const Scalars s(x.dtype());
  if (x.numel() == 0) {
    // H or W is 0 but the padding makes a non-empty output: every window holds
    // only padding (cuDNN rejects 0-sized descriptors), so y is the bias alone.
    FillCuda(y, 0.0);
  } else if (!CudnnGraphConv(ConvDirection::kForward, g, x.dtype(), device, x.data_ptr(),
                             weight.data_ptr(), y.data_ptr())) {
    const ConvPlan& plan = PlanFor(g, x.dtype(), device);
    const ConvDescriptors& d = plan.d;
    const ConvAlgos& algos = plan.algos;
    d.SetMathType(algos.forward_math, device);
    Tensor workspace = Workspace(algos.forward_bytes, device);
    TANDEM_CHECK_CUDNN(cudnnConvolutionForward(handle, s.one(), d.x(), x.data_ptr(), d.w(),
                                               weight.data_ptr(), d.conv(), algos.forward,
                                               WorkspacePtr(workspace), algos.forward_bytes,
                                               s.zero(), d.y(), y.data_ptr()),
                       device, Describe(g, x.dtype()));
  }
  if (bias.defined()) ConvBiasAddCuda(bias, g, y);
}

}  // namespace

// relu: relu's own kernel in place after the convolution and the bias, on the
// same stream (cuDNN's fused conv + bias + activation takes only the
// IMPLICIT_PRECOMP_GEMM algorithm for float32; not used).
void Conv2dForwardCuda(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Conv2dGeometry& g, const Tensor& y, bool relu) {
  ConvBiasForwardCuda(x, weight, bias, g, y);
  if (relu) UnaryCuda(UnaryOp::kRelu, y, y, 0, 0);
}

void Conv2dBackwardDataCuda(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                            const Tensor& dx) {
  const Device device = dy.device();
  if (dx.numel() == 0) return;  // H or W is 0 (see Conv2dForwardCuda)
  if (CudnnGraphConv(ConvDirection::kBackwardData, g, dy.dtype(), device, dx.data_ptr(),
                     weight.data_ptr(), dy.data_ptr())) {
    return;
  }
  const ConvPlan& plan = PlanFor(g, dy.dtype(), device);
  const ConvDescriptors& d = plan.d;
  const ConvAlgos& algos = plan.algos;
  d.SetMathType(algos.backward_data_math, device);
  Tensor workspace = Workspace(algos.backward_data_bytes, device);
  const Scalars s(dy.dtype());
  TANDEM_CHECK_CUDNN(cudnnConvolutionBackwardData(
                         ThreadCudnn(device), s.one(), d.w(), weight.data_ptr(), d.y(),
                         dy.data_ptr(), d.conv(), algos.backward_data, WorkspacePtr(workspace),
                         algos.backward_data_bytes, s.zero(), d.x(), dx.data_ptr()),
                     device, Describe(g, dy.dtype()) + " (backward data)");
}

void Conv2dBackwardFilterCuda(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                              const Tensor& dweight) {
  const Device device = dy.device();
  if (x.numel() == 0) {  // H or W is 0: the weight only ever met padding
    FillCuda(dweight, 0.0);
    return;
  }
  if (CudnnGraphConv(ConvDirection::kBackwardFilter, g, dy.dtype(), device, x.data_ptr(),
                     dweight.data_ptr(), dy.data_ptr())) {
    return;
  }
  const ConvPlan& plan = PlanFor(g, dy.dtype(), device);
  const ConvDescriptors& d = plan.d;
  const ConvAlgos& algos = plan.algos;
  d.SetMathType(algos.backward_filter_math, device);
  Tensor workspace = Workspace(algos.backward_filter_bytes, device);
  const Scalars s(dy.dtype());
  TANDEM_CHECK_CUDNN(cudnnConvolutionBackwardFilter(
                         ThreadCudnn(device), s.one(), d.x(), x.data_ptr(), d.y(), dy.data_ptr(),
                         d.conv(), algos.backward_filter, WorkspacePtr(workspace),
                         algos.backward_filter_bytes, s.zero(), d.w(), dweight.data_ptr()),
                     device, Describe(g, dy.dtype()) + " (backward filter)");
}

void Conv2dBackwardCuda(const Tensor& dy, const Tensor& x, const Tensor& weight,
                        const Conv2dGeometry& g, const Tensor& dx, const Tensor& dweight,
                        const Tensor& dbias) {
  if (dx.defined()) Conv2dBackwardDataCuda(dy, weight, g, dx);
  if (dweight.defined()) Conv2dBackwardFilterCuda(dy, x, g, dweight);
  if (dbias.defined()) Conv2dBackwardBiasCuda(dy, dbias);
}

}  // namespace tandem::nn::ops::internal
