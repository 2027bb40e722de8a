// CPU loops of the optimizer updates and of gradient clipping.
#include <algorithm>
#include <cmath>

#include "nn/dtype.h"
#include "optim/internal/fused_kernels.h"

namespace tandem::optim::internal {

void FusedUpdateCpu(Algorithm algo, const std::vector<UpdateTensors>& tensors,
                    const UpdateScalars& scalars) {
  for (const UpdateTensors& t : tensors) {
    TANDEM_DISPATCH_FLOAT(t.param.dtype(), "optimizer step", [&]<typename T>() {
      T* p = t.param.data<T>();
      const T* g = t.grad.data<T>();
      T* s[3] = {};
      for (int k = 0; k < 3; ++k) s[k] = t.state[k].defined() ? t.state[k].data<T>() : nullptr;
      const int64_t n = t.param.numel();
      for (int64_t i = 0; i < n; ++i) {
        UpdateElement<T>(algo, scalars, p + i, g[i], s[0] ? s[0] + i : nullptr,
                         s[1] ? s[1] + i : nullptr, s[2] ? s[2] + i : nullptr);
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
      const T* d = g.data<T>();
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
      T* d = g.data<T>();
      const T c = static_cast<T>(coef);
      for (int64_t i = 0; i < g.numel(); ++i) d[i] *= c;
    });
  }
  return nn::scalar_tensor(total, {.dtype = dtype, .device = nn::Device::CPU()});
}

}  // namespace tandem::optim::internal
