// CPU kernels of the matmul family: float32 GEMMs on oneDNN's dnnl_sgemm where
// tandem is built with it (one OpenMP thread team per rank, the same runtime as
// the oneDNN convolutions, so no second pool spins beside it), else OpenBLAS
// cblas_sgemm; float64 on OpenBLAS cblas_dgemm.
// bfloat16: where CpuBf16Native() (avx512_bf16 or AMX, oneDNN), oneDNN's bfloat16
// matmul primitive (matmul_dnnl.cc) with a float32 result; elsewhere the operands
// (bf16-exact values) are widened to float32 buffers and multiplied with sgemm.
// Either way float32 accumulation, bias and relu applied in float32, and each
// result rounded to bfloat16 once.
#include <cblas.h>

#include <atomic>
#include <limits>
#include <vector>

#include "nn/ops/internal/conv_kernels.h"  // CpuBf16Native
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/ops/matmul.h"

namespace tandem::nn::ops::internal {
namespace {

blasint ToBlasInt(int64_t v, const char* what) {
  TANDEM_CHECK(v >= 0 && v <= std::numeric_limits<blasint>::max(), "gemm: ", what, " = ", v,
               " does not fit the BLAS integer type");
  return static_cast<blasint>(v);
}

// A float32 host copy of a contiguous bfloat16 tensor (exact: bf16 widens losslessly).
Tensor WidenBFloat16(const Tensor& t) { return t.detach().to(kFloat32); }

// dst[i] = src[i] rounded to bfloat16 (nearest, ties to even).
void RoundToBFloat16(const float* src, BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16(src[i]);
}

}  // namespace

namespace {
std::atomic<CpuGemmPath> cpu_gemm_path{CpuGemmPath::kAuto};
}  // namespace

void SetCpuGemmPath(CpuGemmPath path) { cpu_gemm_path.store(path, std::memory_order_relaxed); }

bool CpuGemmUsesDnnl() {
  const CpuGemmPath path = cpu_gemm_path.load(std::memory_order_relaxed);
#if TANDEM_WITH_DNNL
  return path != CpuGemmPath::kOpenBlas;
#else
  TANDEM_CHECK(path != CpuGemmPath::kDnnl,
               "gemm: the oneDNN path was asked for but tandem was built without oneDNN");
  return false;
#endif
}

template <>
void GemmRaw<float>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  if (m == 0 || n == 0) return;
#if TANDEM_WITH_DNNL
  if (k > 0 && CpuGemmUsesDnnl()) {
    return SgemmDnnl(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
#endif
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, ToBlasInt(m, "m"), ToBlasInt(n, "n"),
              ToBlasInt(k, "k"), alpha, a, ToBlasInt(lda, "lda"), b, ToBlasInt(ldb, "ldb"), beta,
              c, ToBlasInt(ldc, "ldc"));
}

template <>
void GemmRaw<double>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                     const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                     double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, ToBlasInt(m, "m"), ToBlasInt(n, "n"),
              ToBlasInt(k, "k"), alpha, a, ToBlasInt(lda, "lda"), b, ToBlasInt(ldb, "ldb"), beta,
              c, ToBlasInt(ldc, "ldc"));
}

namespace {

// acc (float32, m x n) = op(a) op(b) for contiguous bfloat16 a and b: oneDNN's
// bfloat16 matmul where CpuBf16Native(), else sgemm on widened copies.
void GemmBf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const Tensor& a,
              const Tensor& b, float* acc) {
#if TANDEM_WITH_DNNL
  if (m > 0 && n > 0 && k > 0 && CpuBf16Native()) {
    return GemmBf16Dnnl(trans_a, trans_b, m, n, k, a.host_data<BFloat16>(), a.size(1),
                        b.host_data<BFloat16>(), b.size(1), acc, n);
  }
#endif
  const Tensor af = WidenBFloat16(a), bf = WidenBFloat16(b);
  GemmRaw<float>(trans_a, trans_b, m, n, k, 1.0f, af.host_data<float>(), a.size(1),
                 bf.host_data<float>(), b.size(1), 0.0f, acc, n);
}

}  // namespace

void GemmCpu(bool trans_a, bool trans_b, const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t m = out.size(0), n = out.size(1);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  if (a.dtype() == kBFloat16) {
    Tensor acc = empty({m, n}, {.dtype = kFloat32});
    GemmBf16(trans_a, trans_b, m, n, k, a, b, acc.host_data<float>());
    RoundToBFloat16(acc.host_data<float>(), out.host_data<BFloat16>(), m * n);
    return;
  }
  TANDEM_DISPATCH_FLOAT(a.dtype(), "matmul", [&]<typename T>() {
    GemmRaw<T>(trans_a, trans_b, m, n, k, T(1), a.host_data<T>(), a.size(1), b.host_data<T>(), b.size(1),
               T(0), out.host_data<T>(), n);
  });
}

void LinearCpu(const Tensor& x, const Tensor& weight, const Tensor& bias, bool relu,
               const Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  if (x.dtype() == kBFloat16) {
    Tensor acc = empty({rows, outs}, {.dtype = kFloat32});
    float* y = acc.host_data<float>();
    GemmBf16(false, true, rows, outs, in, x, weight, y);
    const BFloat16* b = bias.defined() ? bias.host_data<BFloat16>() : nullptr;
    BFloat16* o = out.host_data<BFloat16>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = y + r * outs;
      BFloat16* out_row = o + r * outs;
      for (int64_t j = 0; j < outs; ++j) {
        const float v = b != nullptr ? row[j] + static_cast<float>(b[j]) : row[j];
        out_row[j] = BFloat16(relu && !(v > 0.0f) ? 0.0f : v);
      }
    }
    return;
  }
  TANDEM_DISPATCH_FLOAT(x.dtype(), "linear", [&]<typename T>() {
    T* y = out.host_data<T>();
    GemmRaw<T>(false, true, rows, outs, in, T(1), x.host_data<T>(), in, weight.host_data<T>(), in, T(0), y,
               outs);
    const T* b = bias.defined() ? bias.host_data<T>() : nullptr;
    if (b == nullptr && !relu) return;
    for (int64_t r = 0; r < rows; ++r) {
      T* row = y + r * outs;
      for (int64_t j = 0; j < outs; ++j) {
        T v = b != nullptr ? row[j] + b[j] : row[j];
        row[j] = relu && !(v > T(0)) ? T(0) : v;
      }
    }
  });
}

void BiasGradCpu(const Tensor& dy, const Tensor& db) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  if (dy.dtype() == kBFloat16) {
    // Accumulate in float32, round once.
    const BFloat16* g = dy.host_data<BFloat16>();
    std::vector<float> acc(static_cast<size_t>(cols), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j) acc[j] += static_cast<float>(g[r * cols + j]);
    }
    RoundToBFloat16(acc.data(), db.host_data<BFloat16>(), cols);
    return;
  }
  TANDEM_DISPATCH_FLOAT(dy.dtype(), "linear_backward", [&]<typename T>() {
    const T* g = dy.host_data<T>();
    T* out = db.host_data<T>();
    for (int64_t j = 0; j < cols; ++j) out[j] = T(0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < cols; ++j) out[j] += g[r * cols + j];
    }
  });
}

}  // namespace tandem::nn::ops::internal
