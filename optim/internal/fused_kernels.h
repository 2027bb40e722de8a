// Kernel interface of the optimizer updates and gradient clipping, shared by the
// CPU loops (fused_cpu.cc) and the multi-tensor CUDA kernels (fused_cuda.cu).
// Internal to optim.
#ifndef TANDEM_OPTIM_INTERNAL_FUSED_KERNELS_H_
#define TANDEM_OPTIM_INTERNAL_FUSED_KERNELS_H_

#include <cmath>
#include <memory>
#include <vector>

#include "nn/random.h"  // TANDEM_HOST_DEVICE
#include "nn/tensor.h"

namespace tandem::optim::internal {

enum class Algorithm { kSgd, kAdagrad, kAdam };

// Per-launch scalars, computed on the host from the group's hyper-parameters and
// the (common) step count of the tensors in the launch.
struct UpdateScalars {
  double lr = 0;
  double weight_decay = 0;      // L2 term added to the gradient (all but AdamW)
  double decay_factor = 1;      // p *= decay_factor before the update (AdamW: 1 - lr*wd)
  // SGD.
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  bool first_step = false;      // momentum buffer := gradient
  // Adagrad: clr = lr / (1 + (step - 1) * lr_decay).
  double clr = 0;
  // Adam.
  double beta1 = 0, beta2 = 0, eps = 0;
  double step_size = 0;         // lr / (1 - beta1^step)
  double bias_correction2_sqrt = 1;  // sqrt(1 - beta2^step)
  bool amsgrad = false;
};

// One parameter of a launch: its gradient and up to three state buffers, all
// of the parameter's shape, dtype and device. Unused states are undefined.
//   SGD: state[0] momentum buffer (if momentum != 0).
//   Adagrad: state[0] sum of squares.
//   Adam: state[0] exp_avg, state[1] exp_avg_sq, state[2] max_exp_avg_sq (amsgrad).
struct UpdateTensors {
  nn::Tensor param, grad;
  nn::Tensor state[3];
};

template <typename T> TANDEM_HOST_DEVICE T MathSqrt(T x) {
  if constexpr (sizeof(T) == 4) { return ::sqrtf(x); } else { return ::sqrt(x); }
}

// The update of one element: PyTorch's documented algorithms (foreach=False).
// s0..s2 may be null where the algorithm does not use them.
template <typename T>
TANDEM_HOST_DEVICE void UpdateElement(Algorithm algo, const UpdateScalars& u, T* p, T g, T* s0,
                                      T* s1, T* s2) {
  T w = *p;
  if (u.decay_factor != 1) w *= static_cast<T>(u.decay_factor);
  if (u.weight_decay != 0) g += static_cast<T>(u.weight_decay) * w;
  switch (algo) {
    case Algorithm::kSgd: {
      if (u.momentum != 0) {
        T buf = u.first_step ? g
                             : static_cast<T>(u.momentum) * *s0 +
                                   static_cast<T>(1 - u.dampening) * g;
        *s0 = buf;
        g = u.nesterov ? g + static_cast<T>(u.momentum) * buf : buf;
      }
      w -= static_cast<T>(u.lr) * g;
      break;
    }
    case Algorithm::kAdagrad: {
      const T sum = *s0 + g * g;
      *s0 = sum;
      w -= static_cast<T>(u.clr) * g / (MathSqrt(sum) + static_cast<T>(u.eps));
      break;
    }
    case Algorithm::kAdam: {
      const T m = static_cast<T>(u.beta1) * *s0 + static_cast<T>(1 - u.beta1) * g;
      const T v = static_cast<T>(u.beta2) * *s1 + static_cast<T>(1 - u.beta2) * g * g;
      *s0 = m;
      *s1 = v;
      T v_hat = v;
      if (u.amsgrad) {
        v_hat = *s2 > v ? *s2 : v;
        *s2 = v_hat;
      }
      const T denom = MathSqrt(v_hat) / static_cast<T>(u.bias_correction2_sqrt) +
                      static_cast<T>(u.eps);
      w -= static_cast<T>(u.step_size) * m / denom;
      break;
    }
  }
  *p = w;
}

// Device-side pointer tables of one parameter group, kept between steps so that
// a step whose tensors did not move uploads nothing (CUDA only; defined in
// fused_cuda.cu). Not thread-safe: one per group, used by that group's step().
class DeviceTables;
std::shared_ptr<DeviceTables> MakeDeviceTables();

// Applies one step to every tensor of `tensors` (same dtype and device). CPU:
// plain loops. CUDA: one kernel launch on the calling thread's stream, no host
// synchronisation; `tables` caches the pointer table in device memory.
void FusedUpdateCpu(Algorithm algo, const std::vector<UpdateTensors>& tensors,
                    const UpdateScalars& scalars);
// Sum of squares of all elements of `grads`, then grads *= min(1, max_norm /
// (norm + 1e-6)). Returns the 2-norm as a 0-dim tensor of the grads' dtype.
nn::Tensor ClipGradNormCpu(const std::vector<nn::Tensor>& grads, double max_norm);
// clip_grad_norm_ over gradients grouped by device (by_device: one non-empty
// group per device, one dtype throughout): one group is ClipGradNorm on its
// device; several take each device's norm on its device, the total (float64)
// on the first group's device, and scale each group on its own. Returns the
// total on the first group's device, in the gradients' dtype.
nn::Tensor ClipGradNormByDevice(const std::vector<std::vector<nn::Tensor>>& by_device,
                                double max_norm);
#if TANDEM_WITH_CUDA
// `device_scalars`: null in an eager step (the kernel takes `scalars` by value);
// under CUDA graph capture, the device copy the kernel reads instead, rewritten
// before every replay by WriteUpdateScalarsCuda (so a replay does not reuse the
// captured lr and step forever). Under capture (nn::CudaGraph::IsCapturing())
// the pointer table must already be cached (uploaded by an eager step): the
// table is then kept for the graph (never evicted), and nothing is uploaded.
void FusedUpdateCuda(Algorithm algo, const std::vector<UpdateTensors>& tensors,
                     const UpdateScalars& scalars, const UpdateScalars* device_scalars,
                     DeviceTables& tables);
// Writes `scalars` to device memory `dst` on the calling thread's stream for
// `device` (a one-thread kernel that takes them by value: no host buffer to
// keep alive, no host wait). Not to be called under capture.
void WriteUpdateScalarsCuda(const UpdateScalars& scalars, UpdateScalars* dst, nn::Device device);
nn::Tensor ClipGradNormCuda(const std::vector<nn::Tensor>& grads, double max_norm);
#endif

}  // namespace tandem::optim::internal

#endif  // TANDEM_OPTIM_INTERNAL_FUSED_KERNELS_H_
