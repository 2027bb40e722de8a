// CPU loops of the optimizer updates and of gradient clipping.
#include <algorithm>
#include <cmath>

#include "nn/dtype.h"
#include "optim/internal/fused_kernels.h"

namespace tandem::optim::internal {

namespace {

// One tensor's update with the algorithm a compile-time constant and the
// scalars a local copy (so no store through p can alias them), which lets the
// compiler hoist every per-step branch of UpdateElement out of the loop and
// vectorise it. The arithmetic is UpdateElement's, element for element.
template <Algorithm kAlgo, typename T>
void UpdateLoop(const UpdateScalars& scalars, T* __restrict p, const T* __restrict g,
                T* __restrict s0, T* __restrict s1, T* __restrict s2, int64_t n) {
  const UpdateScalars u = scalars;
  if (kAlgo == Algorithm::kAdam && !u.amsgrad) {
    for (int64_t i = 0; i < n; ++i) UpdateElement<T>(kAlgo, u, p + i, g[i], s0 + i, s1 + i, nullptr);
  } else if (kAlgo == Algorithm::kAdam) {
    for (int64_t i = 0; i < n; ++i) UpdateElement<T>(kAlgo, u, p + i, g[i], s0 + i, s1 + i, s2 + i);
  } else if (s0 != nullptr) {
    for (int64_t i = 0; i < n; ++i) UpdateElement<T>(kAlgo, u, p + i, g[i], s0 + i, nullptr, nullptr);
  } else {  // SGD without momentum
    for (int64_t i = 0; i < n; ++i) UpdateElement<T>(kAlgo, u, p + i, g[i], nullptr, nullptr, nullptr);
  }
}

}  // namespace

void FusedUpdateCpu(Algorithm algo, const std::vector<UpdateTensors>& tensors,
                    const UpdateScalars& scalars) {
  for (const UpdateTensors& t : tensors) {
    TANDEM_DISPATCH_FLOAT(t.param.dtype(), "optimizer step", [&]<typename T>() {
      T* p = t.param.host_data<T>();
      const T* g = t.grad.host_data<T>();
      T* s[3] = {};
      for (int k = 0; k < 3; ++k) s[k] = t.state[k].defined() ? t.state[k].host_data<T>() : nullptr;
      const int64_t n = t.param.numel();
      switch (algo) {
        case Algorithm::kSgd:
          UpdateLoop<Algorithm::kSgd, T>(scalars, p, g, s[0], s[1], s[2], n);
          break;
        case Algorithm::kAdagrad:
          UpdateLoop<Algorithm::kAdagrad, T>(scalars, p, g, s[0], s[1], s[2], n);
          break;
        case Algorithm::kAdam:
          UpdateLoop<Algorithm::kAdam, T>(scalars, p, g, s[0], s[1], s[2], n);
          break;
      }
    });
  }
}

nn::Tensor ClipGradNormCpu(const std::vector<nn::Tensor>& grads, double max_norm) {
  const nn::DType dtype = grads.front().dtype();
  // Accumulate in double whatever the dtype (float32 grads of a large model
  // would lose the small terms otherwise).
  double sum_sq = 0;
  for (const nn::Tensor& g : grads) {
    TANDEM_DISPATCH_FLOAT(g.dtype(), "clip_grad_norm_", [&]<typename T>() {
      const T* d = g.host_data<T>();
      for (int64_t i = 0; i < g.numel(); ++i) sum_sq += static_cast<double>(d[i]) * d[i];
    });
  }
  // In the grads' dtype, as PyTorch computes it.
  const double total = TANDEM_DISPATCH_FLOAT(dtype, "clip_grad_norm_", [&]<typename T>() {
    return static_cast<double>(static_cast<T>(std::sqrt(sum_sq)));
  });
  const double coef = std::min(1.0, max_norm / (total + 1e-6));
  for (const nn::Tensor& g : grads) {
    TANDEM_DISPATCH_FLOAT(g.dtype(), "clip_grad_norm_", [&]<typename T>() {
      T* d = g.host_data<T>();
      const T c = static_cast<T>(coef);
      for (int64_t i = 0; i < g.numel(); ++i) d[i] *= c;
    });
  }
  return nn::scalar_tensor(total, {.dtype = dtype, .device = nn::Device::CPU()});
}

}  // namespace tandem::optim::internal
