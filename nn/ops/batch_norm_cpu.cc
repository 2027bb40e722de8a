// CPU kernels of batch_norm2d. Per-channel sums in double, in index order.
#include <cmath>

#include "nn/ops/internal/batch_norm_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// Calls f(index) for every element of channel c, in (n, hw) order.
template <typename F>
void ForChannel(BatchNormShape s, int64_t c, F&& f) {
  for (int64_t n = 0; n < s.n; ++n) {
    const int64_t base = (n * s.c + c) * s.hw;
    for (int64_t j = 0; j < s.hw; ++j) f(base + j);
  }
}

}  // namespace

void BatchNormStatsCpu(const Tensor& x, const Tensor& mean, const Tensor& var, BatchNormShape s) {
  const double m = static_cast<double>(s.n * s.hw);
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    for (int64_t c = 0; c < s.c; ++c) {
      double total = 0;
      ForChannel(s, c, [&](int64_t k) { total += static_cast<double>(px[k]); });
      const double mu = total / m;
      double squares = 0;
      ForChannel(s, c, [&](int64_t k) {
        const double d = static_cast<double>(px[k]) - mu;
        squares += d * d;
      });
      mean.host_data<T>()[c] = static_cast<T>(mu);
      var.host_data<T>()[c] = static_cast<T>(squares / m);
    }
  });
}

void BatchNormForwardCpu(const Tensor& x, const Tensor& mean, const Tensor& var,
                         const Tensor& weight, const Tensor& bias, const Tensor& y, double eps,
                         BatchNormShape s) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    for (int64_t c = 0; c < s.c; ++c) {
      const T invstd = static_cast<T>(1.0 / std::sqrt(static_cast<double>(var.host_data<T>()[c]) + eps));
      const T w = weight.defined() ? weight.host_data<T>()[c] : T(1);
      const T b = bias.defined() ? bias.host_data<T>()[c] : T(0);
      const T mu = mean.host_data<T>()[c];
      ForChannel(s, c, [&](int64_t k) { py[k] = (px[k] - mu) * invstd * w + b; });
    }
  });
}

void BatchNormBackwardReduceCpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& sum_dy,
                                const Tensor& sum_dy_xhat, double eps, BatchNormShape s) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d_backward", [&]<typename T>() {
    const T* px = x.host_data<T>();
    const T* pg = dy.host_data<T>();
    for (int64_t c = 0; c < s.c; ++c) {
      const double invstd = 1.0 / std::sqrt(static_cast<double>(var.host_data<T>()[c]) + eps);
      const double mu = static_cast<double>(mean.host_data<T>()[c]);
      double a = 0, b = 0;
      ForChannel(s, c, [&](int64_t k) {
        const double g = static_cast<double>(pg[k]);
        a += g;
        b += g * (static_cast<double>(px[k]) - mu) * invstd;
      });
      sum_dy.host_data<T>()[c] = static_cast<T>(a);
      sum_dy_xhat.host_data<T>()[c] = static_cast<T>(b);
    }
  });
}

void BatchNormBackwardInputCpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& var, const Tensor& weight, const Tensor& sum_dy,
                               const Tensor& sum_dy_xhat, const Tensor& dx, double eps,
                               bool training, BatchNormShape s) {
  const double m = static_cast<double>(s.n * s.hw);
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d_backward", [&]<typename T>() {
    const T* px = x.host_data<T>();
    const T* pg = dy.host_data<T>();
    T* pdx = dx.host_data<T>();
    for (int64_t c = 0; c < s.c; ++c) {
      const T invstd = static_cast<T>(1.0 / std::sqrt(static_cast<double>(var.host_data<T>()[c]) + eps));
      const T w = weight.defined() ? weight.host_data<T>()[c] : T(1);
      const T mu = mean.host_data<T>()[c];
      if (!training) {
        const T scale = w * invstd;
        ForChannel(s, c, [&](int64_t k) { pdx[k] = pg[k] * scale; });
        continue;
      }
      const T a = sum_dy.host_data<T>()[c];
      const T b = sum_dy_xhat.host_data<T>()[c];
      const T scale = static_cast<T>(static_cast<double>(w * invstd) / m);
      const T mt = static_cast<T>(m);
      ForChannel(s, c, [&](int64_t k) {
        const T xhat = (px[k] - mu) * invstd;
        pdx[k] = scale * (mt * pg[k] - a - xhat * b);
      });
    }
  });
}

}  // namespace tandem::nn::ops::internal
