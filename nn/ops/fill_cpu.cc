// CPU kernels of the core's in-place methods and random factories, and the
// device dispatch for them.
#include <type_traits>

#include "nn/ops/internal/fill_kernels.h"
#include "nn/random.h"

namespace tandem::nn::ops::internal {

void Fill(const Tensor& t, double value) {
  if (t.is_cuda()) {
#if TANDEM_WITH_CUDA
    return FillCuda(t, value);
#endif
  }
  const int64_t n = t.numel();
  TANDEM_DISPATCH_ALL(t.dtype(), [&]<typename T>() {
    T* p = t.host_data<T>();
    T v;
    if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>) {
      v = T(static_cast<float>(value));
    } else {
      v = static_cast<T>(value);
    }
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  });
}

void Axpy(const Tensor& y, const Tensor& x, double alpha) {
  if (y.is_cuda()) {
#if TANDEM_WITH_CUDA
    return AxpyCuda(y, x, alpha);
#endif
  }
  const int64_t n = y.numel();
  if (y.dtype() == kInt64) {  // counters (BatchNorm2d's num_batches_tracked)
    int64_t* py = y.host_data<int64_t>();
    const int64_t* px = x.host_data<int64_t>();
    const auto a = static_cast<int64_t>(alpha);
    for (int64_t i = 0; i < n; ++i) py[i] += a * px[i];
    return;
  }
  TANDEM_DISPATCH_FLOATING(y.dtype(), "add_", [&]<typename T>() {
    T* py = y.host_data<T>();
    const T* px = x.host_data<T>();
    if constexpr (std::is_same_v<T, BFloat16>) {
      // float arithmetic, one rounding per element (gradient accumulation in bf16).
      const float a = static_cast<float>(alpha);
      for (int64_t i = 0; i < n; ++i) {
        py[i] = BFloat16(static_cast<float>(py[i]) + a * static_cast<float>(px[i]));
      }
    } else {
      const T a = static_cast<T>(alpha);
      for (int64_t i = 0; i < n; ++i) py[i] += a * px[i];
    }
  });
}

void Scale(const Tensor& t, double value) {
  if (t.is_cuda()) {
#if TANDEM_WITH_CUDA
    return ScaleCuda(t, value);
#endif
  }
  const int64_t n = t.numel();
  TANDEM_DISPATCH_FLOATING(t.dtype(), "mul_", [&]<typename T>() {
    T* p = t.host_data<T>();
    if constexpr (std::is_same_v<T, BFloat16>) {
      const float v = static_cast<float>(value);
      for (int64_t i = 0; i < n; ++i) p[i] = BFloat16(static_cast<float>(p[i]) * v);
    } else {
      const T v = static_cast<T>(value);
      for (int64_t i = 0; i < n; ++i) p[i] *= v;
    }
  });
}

void FillRandom(const Tensor& t, uint64_t seed, uint64_t stream, uint64_t offset, bool normal) {
  if (t.is_cuda()) {
#if TANDEM_WITH_CUDA
    return FillRandomCuda(t, seed, stream, offset, normal);
#endif
  }
  const int64_t n = t.numel();
  TANDEM_DISPATCH_FLOAT(t.dtype(), normal ? "randn" : "rand", [&]<typename T>() {
    T* p = t.host_data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const Philox4x32 r = PhiloxAt(seed, stream, offset, static_cast<uint64_t>(i));
      p[i] = normal ? static_cast<T>(NormalFromBits(r.out[0], r.out[1]))
                    : static_cast<T>(UniformFromBits(r.out[0]));
    }
  });
}

}  // namespace tandem::nn::ops::internal
