// The convolutions through cuDNN's graph (backend) API with an execution plan
// built once per (thread, shape, direction) and kept: a call past the first is
// a variant pack (the pointers) and cudnnBackendExecute, as PyTorch's cuDNN v8
// path does. On an H200 a small forward took 15 us of host time this way
// against 41-69 us through cuDNN 9's legacy cudnnConvolutionForward (and
// PyTorch's 21-29 us); MobileNetV2's eager step went from 19-22 ms to 9-10 ms
// (docs/gpu.md, "CUDA calls and host time per op"). On by default
// (nn::set_cudnn_graph; TANDEM_CUDNN_GRAPH=0 starts a process without it).
//
// Engines are taken in cuDNN's heuristic order (mode A), skipping those that
// convert inputs down or reduce in reduced precision, need more than 1 GiB of
// workspace, or, for float32 without TF32 (set_allow_tf32), use tensor cores
// (TF32): the engines the legacy path's Pick() allows. A shape with no such
// engine, or whose plan fails to build, is remembered and runs on the legacy API.
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/cuda/handles.h"
#include "nn/graph.h"
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

using nn::internal::ThreadCudnn;

constexpr int64_t kMaxWorkspaceBytes = int64_t{1} << 30;
constexpr int64_t kAlignment = 16;  // bytes; calls with less aligned pointers go legacy
constexpr int64_t kUidX = 1, kUidW = 2, kUidY = 3;

// Owns one backend descriptor.
class Desc {
 public:
  Desc() = default;
  explicit Desc(cudnnBackendDescriptorType_t type) {
    ok_ = cudnnBackendCreateDescriptor(type, &d_) == CUDNN_STATUS_SUCCESS;
    if (!ok_) d_ = nullptr;
  }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : d_(o.d_), ok_(o.ok_) { o.d_ = nullptr; }
  Desc& operator=(Desc&& o) noexcept {
    std::swap(d_, o.d_);
    std::swap(ok_, o.ok_);
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  // Each returns false once anything failed; the descriptor is then unusable.
  bool Set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values) {
    ok_ = ok_ && cudnnBackendSetAttribute(d_, name, type, count, values) == CUDNN_STATUS_SUCCESS;
    return ok_;
  }
  bool Finalize() {
    ok_ = ok_ && cudnnBackendFinalize(d_) == CUDNN_STATUS_SUCCESS;
    return ok_;
  }
  bool ok() const { return ok_; }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  bool ok_ = false;
};

// A 4-D tensor, contiguous, 16-byte aligned.
Desc TensorDesc(cudnnDataType_t type, int64_t uid, int64_t n, int64_t c, int64_t h, int64_t w) {
  Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t dims[4] = {n, c, h, w};
  const int64_t strides[4] = {c * h * w, h * w, w, 1};
  t.Set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  t.Set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  t.Set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides);
  t.Set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  t.Set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &kAlignment);
  t.Finalize();
  return t;
}

cudnnDataType_t DataType(DType dtype) {
  switch (dtype) {
    case kFloat32: return CUDNN_DATA_FLOAT;
    case kFloat64: return CUDNN_DATA_DOUBLE;
    default: return CUDNN_DATA_BFLOAT16;  // the only other dtype CudnnGraphConv takes
  }
}

// Whether an engine configuration's engine may run `dtype` here.
bool EngineAllowed(cudnnBackendDescriptor_t config, DType dtype, bool tf32) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  if (!engine.ok()) return false;
  cudnnBackendDescriptor_t engine_raw = engine.get();
  int64_t got = 0;
  if (cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                               1, &got, &engine_raw) != CUDNN_STATUS_SUCCESS) {
    return false;
  }
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  int64_t count = 0;
  if (cudnnBackendGetAttribute(engine_raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                               CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count,
                               notes) != CUDNN_STATUS_SUCCESS) {
    return false;
  }
  for (int64_t i = 0; i < count; ++i) {
    if (notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS ||
        notes[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION) {
      return false;
    }
    if (notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE && dtype == kFloat32 && !tf32) return false;
  }
  return true;
}

// Each direction's operation descriptor and the attribute names of its x-, w-
// and y-shaped tensors (x, w, y; dx, w, dy; x, dw, dy), convolution and scalars,
// in ConvDirection's order.
struct OpAttributes {
  cudnnBackendDescriptorType_t type;
  cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
};
constexpr OpAttributes kOpAttributes[] = {
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
};

// One shape and direction's finalized execution plan and its workspace size.
struct GraphPlan {
  Desc plan;
  int64_t workspace_bytes = 0;
};

// Builds the plan of one direction; null when cuDNN offers no usable engine.
std::unique_ptr<GraphPlan> BuildPlan(ConvDirection direction, const Conv2dGeometry& g,
                                     DType dtype, bool tf32, cudnnHandle_t handle) {
  const auto& p = g.params;
  const cudnnDataType_t type = DataType(dtype);
  Desc x = TensorDesc(type, kUidX, g.n, g.c, g.h, g.w);
  Desc w = TensorDesc(type, kUidW, g.o, g.c / p.groups, g.kh, g.kw);
  Desc y = TensorDesc(type, kUidY, g.n, g.o, g.oh, g.ow);
  if (!x.ok() || !w.ok() || !y.ok()) return nullptr;

  Desc conv(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t compute = dtype == kFloat64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t spatial = 2;
  const int64_t dilation[2] = {p.dilation[0], p.dilation[1]};
  const int64_t stride[2] = {p.stride[0], p.stride[1]};
  const int64_t padding[2] = {p.padding[0], p.padding[1]};
  conv.Set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
  conv.Set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  conv.Set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &spatial);
  conv.Set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dilation);
  conv.Set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride);
  conv.Set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, padding);
  conv.Set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, padding);
  if (!conv.Finalize()) return nullptr;

  // y = conv(x, w); dx = conv_transpose(dy, w); dw = correlation of x and dy.
  const double alpha_d = 1.0, beta_d = 0.0;
  const float alpha_f = 1.0f, beta_f = 0.0f;
  const bool is_double = dtype == kFloat64;
  const cudnnBackendAttributeType_t scalar = is_double ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
  const void* alpha = is_double ? static_cast<const void*>(&alpha_d) : &alpha_f;
  const void* beta = is_double ? static_cast<const void*>(&beta_d) : &beta_f;
  cudnnBackendDescriptor_t xd = x.get(), wd = w.get(), yd = y.get(), cd = conv.get();
  const OpAttributes& a = kOpAttributes[static_cast<int>(direction)];
  Desc op(a.type);
  op.Set(a.x, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &xd);
  op.Set(a.w, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &wd);
  op.Set(a.y, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &yd);
  op.Set(a.conv, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cd);
  op.Set(a.alpha, scalar, 1, alpha);
  op.Set(a.beta, scalar, 1, beta);
  if (!op.Finalize()) return nullptr;

  Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  cudnnBackendDescriptor_t opd = op.get();
  graph.Set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &opd);
  graph.Set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  if (!graph.Finalize()) return nullptr;

  Desc heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  cudnnBackendDescriptor_t gd = graph.get();
  const cudnnBackendHeurMode_t heur_mode = CUDNN_HEUR_MODE_A;
  heuristics.Set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &gd);
  heuristics.Set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &heur_mode);
  if (!heuristics.Finalize()) return nullptr;
  int64_t available = 0;
  if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &available,
                               nullptr) != CUDNN_STATUS_SUCCESS ||
      available <= 0) {
    return nullptr;
  }
  std::vector<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < available; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    if (!configs.back().ok()) return nullptr;
    raw.push_back(configs.back().get());
  }
  int64_t returned = 0;
  if (cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, available, &returned,
                               raw.data()) != CUDNN_STATUS_SUCCESS) {
    return nullptr;
  }
  for (int64_t i = 0; i < returned; ++i) {
    if (!EngineAllowed(raw[i], dtype, tf32)) continue;
    auto result = std::make_unique<GraphPlan>();
    result->plan = Desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    result->plan.Set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    result->plan.Set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                     &raw[i]);
    if (!result->plan.Finalize()) continue;
    int64_t got = 0;
    if (cudnnBackendGetAttribute(result->plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                 CUDNN_TYPE_INT64, 1, &got,
                                 &result->workspace_bytes) != CUDNN_STATUS_SUCCESS ||
        result->workspace_bytes < 0 || result->workspace_bytes > kMaxWorkspaceBytes) {
      continue;
    }
    return result;
  }
  return nullptr;
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlignment == 0; }

}  // namespace

bool CudnnGraphConv(ConvDirection direction, const Conv2dGeometry& g, DType dtype, Device device,
                    const void* x, const void* w, const void* y) {
  if (!cudnn_graph()) return false;
  if (dtype != kFloat32 && dtype != kFloat64 && dtype != kBFloat16) return false;
  if (!Aligned(x) || !Aligned(w) || !Aligned(y)) return false;
  cudnnHandle_t handle = ThreadCudnn(device);  // before the cache: destroyed after it
  const std::pair<ConvDirection, ConvCacheKey> key{
      direction, {g, dtype, device.index, dtype == kFloat32 && AllowTf32()}};
  // Null entries: shapes cuDNN's graph API could not plan (they run legacy).
  thread_local std::map<std::pair<ConvDirection, ConvCacheKey>, std::unique_ptr<GraphPlan>> plans;
  auto it = plans.find(key);
  if (it == plans.end()) {
    // Building a plan may allocate or compile, which a CUDA graph capture
    // forbids: a shape first met inside a capture runs legacy (uncached).
    if (CudaGraph::IsCapturing()) return false;
    it = plans.emplace(key, BuildPlan(direction, g, dtype, key.second.tf32, handle)).first;
  }
  if (it->second == nullptr) return false;
  const GraphPlan& plan = *it->second;

  Tensor workspace;
  if (plan.workspace_bytes > 0) {
    workspace = empty({plan.workspace_bytes}, {.dtype = kUInt8, .device = device});
  }
  void* pointers[3] = {const_cast<void*>(x), const_cast<void*>(w), const_cast<void*>(y)};
  const int64_t uids[3] = {kUidX, kUidW, kUidY};
  void* workspace_ptr = workspace.defined() ? workspace.data_ptr() : nullptr;
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.Set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 3, pointers);
  pack.Set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 3, uids);
  pack.Set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace_ptr);
  nn::internal::CountCudaCall(nn::internal::CudaCall::kCudnnCall);  // the pack, as one
  TANDEM_CHECK(pack.Finalize(), "conv2d: cuDNN could not build the variant pack of a ",
               "convolution on ", device.ToString());
  TANDEM_CHECK_CUDNN(cudnnBackendExecute(handle, plan.plan.get(), pack.get()), device,
                     absl::StrCat("conv2d (cuDNN graph API, direction ",
                                  static_cast<int>(direction), ", x (", g.n, ", ", g.c, ", ", g.h,
                                  ", ", g.w, "), ", g.o, " outputs)"));
  return true;
}

}  // namespace tandem::nn::ops::internal
