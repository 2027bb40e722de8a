// CPU kernels of batch_norm2d. Per-channel sums in double, in 8 lanes (lane t
// takes the elements at t mod 8 within each row; the lanes added in a fixed
// order at the end), so that the sums are not one long chain of dependent adds
// and vectorise; the channels split over the kernel threads (ParallelFor), each
// channel whole on one thread, so the bits do not depend on the thread count.
#include <algorithm>
#include <cmath>

#include "nn/ops/internal/batch_norm_kernels.h"
#include "nn/ops/internal/cpu_parallel.h"

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

// Calls f(index, lane) for every element of channel c, in (n, hw) order; lane
// (0..7) is the element's place within its row modulo 8.
template <typename F>
void ForChannelLanes(BatchNormShape s, int64_t c, F&& f) {
  for (int64_t n = 0; n < s.n; ++n) {
    const int64_t base = (n * s.c + c) * s.hw;
    int64_t j = 0;
    for (; j + 8 <= s.hw; j += 8) {
      for (int t = 0; t < 8; ++t) f(base + j + t, t);
    }
    for (int t = 0; j < s.hw; ++j, ++t) f(base + j, t);
  }
}

double LaneTotal(const double (&lanes)[8]) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// Calls f(c) for every channel, channels split over the kernel threads in
// ranges of at least ~32K elements.
template <typename F>
void ForChannels(BatchNormShape s, F&& f) {
  const int64_t per_channel = std::max<int64_t>(1, s.n * s.hw);
  ParallelFor(s.c, std::max<int64_t>(1, (int64_t{1} << 15) / per_channel),
              [&](int64_t begin, int64_t end) {
                for (int64_t c = begin; c < end; ++c) f(c);
              });
}

}  // namespace

void BatchNormStatsCpu(const Tensor& x, const Tensor& mean, const Tensor& var, BatchNormShape s) {
  const double m = static_cast<double>(s.n * s.hw);
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* pmean = mean.host_data<T>();
    T* pvar = var.host_data<T>();
    ForChannels(s, [&](int64_t c) {
      double total[8] = {};
      ForChannelLanes(s, c, [&](int64_t k, int t) { total[t] += static_cast<double>(px[k]); });
      const double mu = LaneTotal(total) / m;
      double squares[8] = {};
      ForChannelLanes(s, c, [&](int64_t k, int t) {
        const double d = static_cast<double>(px[k]) - mu;
        squares[t] += d * d;
      });
      pmean[c] = static_cast<T>(mu);
      pvar[c] = static_cast<T>(LaneTotal(squares) / m);
    });
  });
}

void BatchNormForwardCpu(const Tensor& x, const Tensor& mean, const Tensor& var,
                         const Tensor& weight, const Tensor& bias, const Tensor& y, double eps,
                         BatchNormShape s) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d", [&]<typename T>() {
    const T* px = x.host_data<T>();
    T* py = y.host_data<T>();
    const T* pvar = var.host_data<T>();
    const T* pmean = mean.host_data<T>();
    const T* pw = weight.defined() ? weight.host_data<T>() : nullptr;
    const T* pb = bias.defined() ? bias.host_data<T>() : nullptr;
    ForChannels(s, [&](int64_t c) {
      const T invstd = static_cast<T>(1.0 / std::sqrt(static_cast<double>(pvar[c]) + eps));
      const T w = pw ? pw[c] : T(1);
      const T b = pb ? pb[c] : T(0);
      const T mu = pmean[c];
      ForChannel(s, c, [&](int64_t k) { py[k] = (px[k] - mu) * invstd * w + b; });
    });
  });
}

void BatchNormBackwardReduceCpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& sum_dy,
                                const Tensor& sum_dy_xhat, double eps, BatchNormShape s) {
  TANDEM_DISPATCH_FLOAT(x.dtype(), "batch_norm2d_backward", [&]<typename T>() {
    const T* px = x.host_data<T>();
    const T* pg = dy.host_data<T>();
    const T* pvar = var.host_data<T>();
    const T* pmean = mean.host_data<T>();
    T* psum = sum_dy.host_data<T>();
    T* psum_xhat = sum_dy_xhat.host_data<T>();
    ForChannels(s, [&](int64_t c) {
      const double invstd = 1.0 / std::sqrt(static_cast<double>(pvar[c]) + eps);
      const double mu = static_cast<double>(pmean[c]);
      double a[8] = {}, b[8] = {};
      ForChannelLanes(s, c, [&](int64_t k, int t) {
        const double g = static_cast<double>(pg[k]);
        a[t] += g;
        b[t] += g * (static_cast<double>(px[k]) - mu) * invstd;
      });
      psum[c] = static_cast<T>(LaneTotal(a));
      psum_xhat[c] = static_cast<T>(LaneTotal(b));
    });
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
    const T* pvar = var.host_data<T>();
    const T* pmean = mean.host_data<T>();
    const T* pw = weight.defined() ? weight.host_data<T>() : nullptr;
    const T* psum = training ? sum_dy.host_data<T>() : nullptr;
    const T* psum_xhat = training ? sum_dy_xhat.host_data<T>() : nullptr;
    ForChannels(s, [&](int64_t c) {
      const T invstd = static_cast<T>(1.0 / std::sqrt(static_cast<double>(pvar[c]) + eps));
      const T w = pw ? pw[c] : T(1);
      const T mu = pmean[c];
      if (!training) {
        const T scale = w * invstd;
        ForChannel(s, c, [&](int64_t k) { pdx[k] = pg[k] * scale; });
        return;
      }
      const T a = psum[c];
      const T b = psum_xhat[c];
      const T scale = static_cast<T>(static_cast<double>(w * invstd) / m);
      const T mt = static_cast<T>(m);
      ForChannel(s, c, [&](int64_t k) {
        const T xhat = (px[k] - mu) * invstd;
        pdx[k] = scale * (mt * pg[k] - a - xhat * b);
      });
    });
  });
}

}  // namespace tandem::nn::ops::internal
