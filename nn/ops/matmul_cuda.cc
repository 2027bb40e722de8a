// CUDA kernels of the matmul family through cuBLASLt, with the bias and
// bias+ReLU epilogues fused into linear / linear_relu. Everything is enqueued on
// the thread's stream; nothing synchronises the host.
//
// cuBLASLt is column-major; a row-major (r, c) matrix is the column-major (c, r)
// one, so row-major C = op(A) op(B) is computed as column-major C^T = op(B)^T op(A)^T.
//
// bfloat16: A, B, C, D are CUDA_R_16BF with CUBLAS_COMPUTE_32F and float alpha/beta
// (scale type CUDA_R_32F); the fused bias is bfloat16 too (cuBLASLt's default
// CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE of -1 means "the type of D"), added to the
// float32 accumulator before the one rounding to D. TF32 does not apply.
#include <map>
#include <memory>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "nn/cuda/context.h"
#include "nn/cuda/handles.h"
#include "nn/ops/internal/elementwise_kernels.h"
#include "nn/ops/internal/fill_kernels.h"
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

using nn::internal::CublasLt;
using nn::internal::ThreadCublasLt;
using nn::internal::ThreadStream;

// Row-major out (m, n) = op(a) op(b) [+ bias (n)] [then relu] [+ out when accumulate].
// a is stored (m, k) or, when trans_a, (k, m); likewise b. Rows are contiguous.
struct GemmCall {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  const void* bias = nullptr;  // fused CUBLASLT_EPILOGUE_BIAS / RELU_BIAS when set
  bool relu = false;
  bool accumulate = false;     // beta = 1
  DType dtype = kFloat32;      // of a and b (and out unless float_out)
  bool float_out = false;      // out is float32 (bfloat16 a and b only): no rounding to bf16
};

cudaDataType_t CudaType(DType dtype) {
  switch (dtype) {
    case kFloat32: return CUDA_R_32F;
    case kFloat64: return CUDA_R_64F;
    case kBFloat16: return CUDA_R_16BF;
    default: Fail("matmul: cuBLASLt has no ", DTypeName(dtype), " GEMM here");
  }
}

DType OutDType(const GemmCall& g) { return g.float_out ? kFloat32 : g.dtype; }

std::string Describe(const GemmCall& g, const char* op) {
  return absl::StrCat(op, " (m=", g.m, ", n=", g.n, ", k=", g.k, ", trans_a=", g.trans_a,
                      ", trans_b=", g.trans_b, ", ", DTypeName(g.dtype),
                      g.float_out ? " -> float32" : "",
                      g.bias != nullptr ? ", bias" : "", g.relu ? ", relu" : "", ")");
}

uint32_t PointerAlignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && v % alignment != 0) alignment /= 2;
  return alignment;
}

struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { CublasLt().MatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* d) const { CublasLt().MatrixLayoutDestroy(d); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* d) const {
    CublasLt().MatmulPreferenceDestroy(d);
  }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

Layout MakeLayout(cudaDataType_t type, int64_t rows, int64_t cols, Device device,
                  const GemmCall& g, const char* op) {
  cublasLtMatrixLayout_t layout = nullptr;
  // Column-major (rows, cols) with leading dimension rows (contiguous).
  TANDEM_CHECK_CUBLAS(CublasLt().MatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows),
                                                    static_cast<uint64_t>(cols), rows),
                      device, Describe(g, op));
  return Layout(layout);
}

// (device, compute type, a/b dtype, out dtype, epilogue, trans_a, trans_b, m, n, k,
// alignments of a, b, out and bias in bytes).
using AlgoKey = std::tuple<int, int, int, int, int, bool, bool, int64_t, int64_t, int64_t, uint32_t,
                           uint32_t, uint32_t, uint32_t>;

// cuBLASLt's first heuristic choice for this problem, or nullopt when a fused
// epilogue has no algorithm for it; other failures throw.
std::optional<cublasLtMatmulAlgo_t> ChooseAlgo(const GemmCall& g, cublasLtMatmulDesc_t desc,
                                               cublasLtMatrixLayout_t layout_a,
                                               cublasLtMatrixLayout_t layout_b,
                                               cublasLtMatrixLayout_t layout_c, Device device,
                                               const char* op) {
  const auto& lt = ThreadCublasLt(device);
  cublasLtMatmulPreference_t raw_pref = nullptr;
  TANDEM_CHECK_CUBLAS(CublasLt().MatmulPreferenceCreate(&raw_pref), device, Describe(g, op));
  Preference pref(raw_pref);
  const uint64_t workspace_bytes = lt.workspace_bytes;
  TANDEM_CHECK_CUBLAS(
      CublasLt().MatmulPreferenceSetAttribute(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &workspace_bytes, sizeof workspace_bytes),
      device, Describe(g, op));
  // Tell the heuristic the real alignments (views may start mid-allocation).
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> alignments[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, g.b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, g.a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, g.out},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, g.out}};
  for (const auto& [attribute, pointer] : alignments) {
    const uint32_t alignment = PointerAlignment(pointer);
    TANDEM_CHECK_CUBLAS(CublasLt().MatmulPreferenceSetAttribute(pref.get(), attribute, &alignment,
                                                                sizeof alignment),
                        device, Describe(g, op));
  }
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = CublasLt().MatmulAlgoGetHeuristic(
      lt.handle, desc, layout_a, layout_b, layout_c, layout_c, pref.get(), 1, &heuristic, &found);
  const bool fused = g.bias != nullptr || g.relu;
  // A fused epilogue the library rejects for this problem (NOT_SUPPORTED, no
  // algorithm, or INVALID_VALUE, which cuBLASLt returns for some epilogue shapes)
  // is not an error: the caller runs the unfused sequence, whose own failures throw.
  if (fused && (status != CUBLAS_STATUS_SUCCESS || found == 0)) return std::nullopt;
  TANDEM_CHECK_CUBLAS(status, device, Describe(g, op));
  TANDEM_CHECK(found > 0, op, ": cuBLASLt has no algorithm for ", Describe(g, op), " on ",
               device.ToString());
  return heuristic.algo;
}

// TryGemm's steps.

// cuBLASLt's compute type of `g`: float64 for float64, float32 for bfloat16,
// float32 or TF32 (set_allow_tf32) for float32.
cublasComputeType_t ComputeType(const GemmCall& g) {
  if (g.dtype == kFloat64) return CUBLAS_COMPUTE_64F;
  if (g.dtype == kBFloat16) return CUBLAS_COMPUTE_32F;
  return AllowTf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// The operation descriptor: transposes (column-major A' = b, B' = a) and the
// fused epilogue (bias, ReLU, both).
MatmulDesc MakeMatmulDesc(const GemmCall& g, cublasComputeType_t compute, Device device,
                          const char* op) {
  // alpha/beta (and the epilogue's arithmetic) are double for float64, else float.
  const cudaDataType_t scale_type = g.dtype == kFloat64 ? CUDA_R_64F : CUDA_R_32F;
  cublasLtMatmulDesc_t raw_desc = nullptr;
  TANDEM_CHECK_CUBLAS(CublasLt().MatmulDescCreate(&raw_desc, compute, scale_type), device,
                      Describe(g, op));
  MatmulDesc desc(raw_desc);
  auto set = [&](cublasLtMatmulDescAttributes_t attribute, const void* value, size_t size) {
    TANDEM_CHECK_CUBLAS(CublasLt().MatmulDescSetAttribute(desc.get(), attribute, value, size),
                        device, Describe(g, op));
  };
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set(CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a);
  set(CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b);
  if (g.bias != nullptr || g.relu) {
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_RELU;
    if (g.bias != nullptr) {
      epilogue = g.relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
      set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof g.bias);
    }
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
  }
  return desc;
}

// What a problem's calls reuse, made at its first call on a thread: the
// operation descriptor (which holds the bias pointer of the last call), the
// layouts of A', B' and C/D, and the algorithm (nullopt: the requested fused
// epilogue has none).
struct GemmPlan {
  MatmulDesc desc;
  const void* bias = nullptr;  // the bias pointer `desc` holds now
  Layout layout_a, layout_b, layout_c;
  std::optional<cublasLtMatmulAlgo_t> algo;
};

// What the chosen algorithm depends on: the problem, the epilogue and the
// operands' alignments.
AlgoKey AlgoKeyOf(const GemmCall& g, cublasComputeType_t compute, Device device) {
  const bool fused = g.bias != nullptr || g.relu;
  return AlgoKey{device.index,
                 static_cast<int>(compute),
                 static_cast<int>(g.dtype),
                 static_cast<int>(OutDType(g)),
                 static_cast<int>(fused ? (g.bias != nullptr ? 1 + g.relu : 3) : 0),
                 g.trans_a,
                 g.trans_b,
                 g.m,
                 g.n,
                 g.k,
                 PointerAlignment(g.a),
                 PointerAlignment(g.b),
                 PointerAlignment(g.out),
                 g.bias != nullptr ? PointerAlignment(g.bias) : 0u};
}

// Runs one cuBLASLt matmul. Returns false (having enqueued nothing) when the
// requested epilogue has no algorithm for this problem, so the caller can fall
// back to an unfused sequence; any other failure throws.
bool TryGemm(const GemmCall& g, Device device, const char* op) {
  const bool fused = g.bias != nullptr || g.relu;
  // Fused epilogues only where cuBLASLt is known to handle them: no dimension of
  // size 1 (PyTorch avoids those after INVALID_VALUE from the heuristic) and a
  // 16-byte aligned bias vector (a misaligned one, e.g. a view into a flat
  // parameter buffer, faults in the epilogue).
  if (fused && (g.m <= 1 || g.n <= 1 || g.k <= 1 ||
                (g.bias != nullptr && reinterpret_cast<uintptr_t>(g.bias) % 16 != 0))) {
    return false;
  }
  TANDEM_CHECK(!g.float_out || g.dtype == kBFloat16, op, ": float32 output only for bfloat16 ",
               "operands, got ", Describe(g, op));
  const cublasComputeType_t compute = ComputeType(g);
  // A problem's descriptor, layouts and algorithm are made once per thread: the
  // heuristic query costs more host time than a small matmul's launch, and the
  // descriptors cost ~10 cuBLASLt calls per matmul. Only the bias pointer is
  // set per call (when it changed).
  thread_local std::map<AlgoKey, std::unique_ptr<GemmPlan>> cache;
  const AlgoKey key = AlgoKeyOf(g, compute, device);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto plan = std::make_unique<GemmPlan>();
    plan->desc = MakeMatmulDesc(g, compute, device, op);
    plan->bias = g.bias;
    // Stored shapes, column-major: b row-major (rows_b, cols_b) is (cols_b, rows_b).
    const int64_t rows_b = g.trans_b ? g.n : g.k, cols_b = g.trans_b ? g.k : g.n;
    const int64_t rows_a = g.trans_a ? g.k : g.m, cols_a = g.trans_a ? g.m : g.k;
    plan->layout_a = MakeLayout(CudaType(g.dtype), cols_b, rows_b, device, g, op);
    plan->layout_b = MakeLayout(CudaType(g.dtype), cols_a, rows_a, device, g, op);
    plan->layout_c = MakeLayout(CudaType(OutDType(g)), g.n, g.m, device, g, op);
    plan->algo = ChooseAlgo(g, plan->desc.get(), plan->layout_a.get(), plan->layout_b.get(),
                            plan->layout_c.get(), device, op);
    it = cache.emplace(key, std::move(plan)).first;
  }
  GemmPlan& plan = *it->second;
  if (!plan.algo.has_value()) return false;  // no fused algorithm: caller falls back
  if (g.bias != nullptr && g.bias != plan.bias) {
    TANDEM_CHECK_CUBLAS(CublasLt().MatmulDescSetAttribute(plan.desc.get(),
                                                          CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                          &g.bias, sizeof g.bias),
                        device, Describe(g, op));
    plan.bias = g.bias;
  }

  const bool is_double = g.dtype == kFloat64;
  const double one_d = 1.0, beta_d = g.accumulate ? 1.0 : 0.0;
  const float one_f = 1.0f, beta_f = g.accumulate ? 1.0f : 0.0f;
  const void* alpha = is_double ? static_cast<const void*>(&one_d) : &one_f;
  const void* beta = is_double ? static_cast<const void*>(&beta_d) : &beta_f;
  const auto& lt = ThreadCublasLt(device);
  TANDEM_CHECK_CUBLAS(
      CublasLt().Matmul(lt.handle, plan.desc.get(), alpha, g.b, plan.layout_a.get(), g.a,
                        plan.layout_b.get(), beta, g.out, plan.layout_c.get(), g.out,
                        plan.layout_c.get(), &*plan.algo, lt.workspace, lt.workspace_bytes,
                        ThreadStream(device)),
      device, Describe(g, op));
  return true;
}

void Gemm(const GemmCall& g, Device device, const char* op) {
  TANDEM_CHECK(TryGemm(g, device, op), op, ": cuBLASLt has no algorithm for ", Describe(g, op));
}

}  // namespace

void GemmCuda(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& out) {
  CudaType(a.dtype());  // throws for a dtype without a GEMM
  GemmCall g{.trans_a = trans_a,
             .trans_b = trans_b,
             .m = out.size(0),
             .n = out.size(1),
             .k = trans_a ? a.size(0) : a.size(1),
             .a = a.data_ptr(),
             .b = b.data_ptr(),
             .out = out.data_ptr(),
             .dtype = a.dtype()};
  Gemm(g, a.device(), "matmul");
}

void LinearCuda(const Tensor& x, const Tensor& weight, const Tensor& bias, bool relu,
                const Tensor& out) {
  const char* op = relu ? "linear_relu" : "linear";
  CudaType(x.dtype());  // throws for a dtype without a GEMM
  // out (N, out) = x (N, in) W^T: W is stored (out, in), transposed.
  GemmCall g{.trans_a = false,
             .trans_b = true,
             .m = x.size(0),
             .n = weight.size(0),
             .k = x.size(1),
             .a = x.data_ptr(),
             .b = weight.data_ptr(),
             .out = out.data_ptr(),
             .bias = bias.defined() ? bias.data_ptr() : nullptr,
             .relu = relu,
             .dtype = x.dtype()};
  if (TryGemm(g, x.device(), op)) return;
  if (x.dtype() == kBFloat16) {
    // The same unfused sequence into a float32 accumulator, rounded to bfloat16 once
    // at the end (as the fused epilogue and the CPU kernel do): the product and the
    // rank-1 bias GEMM write float32 D from bfloat16 A/B, relu runs in float32.
    Tensor acc = empty({g.m, g.n}, {.dtype = kFloat32, .device = x.device()});
    GemmCall plain = g;
    plain.bias = nullptr;
    plain.relu = false;
    plain.out = acc.data_ptr();
    plain.float_out = true;
    Gemm(plain, x.device(), op);
    if (bias.defined()) {
      Tensor ones_column = ones({g.m, 1}, {.dtype = kBFloat16, .device = x.device()});
      Gemm({.m = g.m, .n = g.n, .k = 1, .a = ones_column.data_ptr(), .b = bias.data_ptr(),
            .out = acc.data_ptr(), .accumulate = true, .dtype = kBFloat16, .float_out = true},
           x.device(), op);
    }
    if (relu) UnaryCuda(UnaryOp::kRelu, acc, acc, 0.0, 0.0);
    ConvertCuda(acc, out);
    return;
  }
  // No fused algorithm (e.g. float64): the product, then out += ones (N, 1) bias (1, out)
  // as a rank-1 GEMM, then relu in place.
  GemmCall plain = g;
  plain.bias = nullptr;
  plain.relu = false;
  Gemm(plain, x.device(), op);
  if (bias.defined()) {
    Tensor ones_column = ones({g.m, 1}, {.dtype = x.dtype(), .device = x.device()});
    Gemm({.m = g.m, .n = g.n, .k = 1, .a = ones_column.data_ptr(), .b = bias.data_ptr(),
          .out = out.data_ptr(), .accumulate = true, .dtype = x.dtype()},
         x.device(), op);
  }
  if (relu) UnaryCuda(UnaryOp::kRelu, out, out, 0.0, 0.0);
}

void BiasGradCuda(const Tensor& dy, const Tensor& db) {
  CudaType(dy.dtype());  // throws for a dtype without a GEMM
  // db (1, out) = ones (1, N) dy (N, out): a GEMV through cuBLASLt. For bfloat16
  // the ones and dy are bfloat16 (exact), the sum accumulates in float32
  // (CUBLAS_COMPUTE_32F) and db is rounded to bfloat16 once.
  Tensor ones_row = ones({1, dy.size(0)}, {.dtype = dy.dtype(), .device = dy.device()});
  Gemm({.m = 1, .n = dy.size(1), .k = dy.size(0), .a = ones_row.data_ptr(), .b = dy.data_ptr(),
        .out = db.data_ptr(), .dtype = dy.dtype()},
       dy.device(), "linear_backward (bias)");
}

}  // namespace tandem::nn::ops::internal
