// CPU kernels of dropout. bfloat16: float arithmetic, one rounding per element.
#include "nn/ops/internal/dropout_kernels.h"
#include "nn/ops/internal/elementwise_kernels.h"  // Compute, Load, Store (bfloat16)

namespace tandem::nn::ops::internal {

void DropoutForwardCpu(const Tensor& x, const Tensor& y, const Tensor& mask, float p,
                       double scale, uint64_t seed, uint64_t stream, uint64_t offset) {
  const int64_t n = x.numel();
  TANDEM_DISPATCH_FLOATING(x.dtype(), "dropout", [&]<typename T>() {
    using C = Compute<T>;
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    uint8_t* pm = mask.host_data<uint8_t>();
    const C s = static_cast<C>(scale);
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = DropoutKeeps(seed, stream, offset, static_cast<uint64_t>(i), p);
      pm[i] = keep ? 1 : 0;
      py[i] = Store<T>(keep ? Load(px[i]) * s : C(0));
    }
  });
}

void DropoutBackwardCpu(const Tensor& gy, const Tensor& mask, const Tensor& gx, double scale) {
  const int64_t n = gy.numel();
  TANDEM_DISPATCH_FLOATING(gy.dtype(), "dropout_backward", [&]<typename T>() {
    using C = Compute<T>;
    const T* pg = gy.host_data<T>();
    const uint8_t* pm = mask.host_data<uint8_t>();
    T* po = gx.host_data<T>();
    const C s = static_cast<C>(scale);
    for (int64_t i = 0; i < n; ++i) po[i] = Store<T>(pm[i] ? Load(pg[i]) * s : C(0));
  });
}

}  // namespace tandem::nn::ops::internal
