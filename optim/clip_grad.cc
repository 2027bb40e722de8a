// clip_grad_norm_: collects the gradients, groups them by device and dispatches
// each group to its device's kernels.
#include "optim/clip_grad.h"

#include <algorithm>
#include <limits>

#include "nn/device.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/dispatch.h"
#include "optim/internal/device_scope.h"
#include "optim/internal/fused_kernels.h"

namespace tandem::optim {
namespace internal {
namespace {

// Runs fn with `device` current (the CUDA launches and their stream belong to it).
template <typename Fn>
auto OnDevice(nn::Device device, Fn&& fn) {
  const DeviceScope on_device(device);
  return fn();
}

nn::Tensor ClipGradNormOneDevice(const std::vector<nn::Tensor>& grads, double max_norm) {
  return OnDevice(grads.front().device(), [&] {
    return TANDEM_ON_DEVICE(grads.front(), ClipGradNorm, grads, max_norm);
  });
}

}  // namespace

nn::Tensor ClipGradNormByDevice(const std::vector<std::vector<nn::Tensor>>& by_device,
                                double max_norm) {
  if (by_device.size() == 1) return ClipGradNormOneDevice(by_device.front(), max_norm);
  // As PyTorch's foreach path: each device's norm on its device (an infinite
  // max_norm scales by exactly 1), the total from them on the first device,
  // then each device's gradients scaled by the coefficient moved there. No host
  // synchronisation; float64 for the combination.
  const nn::Device first = by_device.front().front().device();
  const nn::DType dtype = by_device.front().front().dtype();
  std::vector<nn::Tensor> norms;
  for (const std::vector<nn::Tensor>& grads : by_device) {
    norms.push_back(ClipGradNormOneDevice(grads, std::numeric_limits<double>::infinity()));
  }
  // The combination's kernels (the casts, products and sums of the norms moved
  // to `first`) run with `first` current, whichever device the caller's is.
  nn::Tensor total, coef;
  OnDevice(first, [&] {
    nn::Tensor sum_squares;
    for (const nn::Tensor& device_norm : norms) {
      const nn::Tensor norm = device_norm.to(first).to(nn::kFloat64);
      sum_squares = sum_squares.defined() ? sum_squares + norm * norm : norm * norm;
    }
    total = nn::pow_scalar(sum_squares, 0.5);
    // min(1, max_norm / (total + 1e-6)) = 1 - relu(1 - ratio): exactly 1 when clipping is off.
    coef = nn::rsub_scalar(
        nn::relu(nn::rsub_scalar(nn::rdiv_scalar(total + 1e-6, max_norm), 1.0)), 1.0);
    return 0;
  });
  for (const std::vector<nn::Tensor>& grads : by_device) {
    const nn::Device device = grads.front().device();
    OnDevice(device, [&] {
      const nn::Tensor c = coef.to(device).to(dtype);
      for (const nn::Tensor& g : grads) {
        nn::Tensor target = g;
        target.copy_(nn::mul(g, c));
      }
      return 0;
    });
  }
  return OnDevice(first, [&] { return total.to(dtype); });
}

}  // namespace internal

nn::Tensor clip_grad_norm_(const std::vector<nn::Tensor>& params, double max_norm) {
  std::vector<std::vector<nn::Tensor>> by_device;  // in the order devices first appear
  for (const nn::Tensor& p : params) {
    if (!p.defined()) continue;
    nn::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (!by_device.empty()) {
      TANDEM_CHECK(g.dtype() == by_device.front().front().dtype(), "clip_grad_norm_: gradient ",
                   g.ToString(), " differs in dtype from ", by_device.front().front().ToString());
    }
    auto same = std::find_if(by_device.begin(), by_device.end(), [&](const auto& grads) {
      return grads.front().device() == g.device();
    });
    if (same == by_device.end()) {
      by_device.push_back({std::move(g)});
    } else {
      same->push_back(std::move(g));
    }
  }
  if (by_device.empty()) return nn::scalar_tensor(0.0, {.device = nn::Device::CPU()});
  nn::NoGradGuard no_grad;
  return internal::ClipGradNormByDevice(by_device, max_norm);
}

}  // namespace tandem::optim
