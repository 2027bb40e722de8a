// Mixed precision for a region of code, in the manner of torch.autocast.
//
//   {
//     nn::AutocastGuard autocast(nn::kBFloat16);
//     Tensor loss = nn::cross_entropy(model->forward(x), y);   // GEMMs/convs in bfloat16
//   }
//   loss.backward();   // backward follows the dtypes the forward recorded
//
// While a guard lives on a thread, ops on that thread treat float32 inputs so:
//  - matmul, linear, linear_relu, conv2d cast their float32 operands to bfloat16
//    (a differentiable cast) and return bfloat16; products accumulate in float32.
//    On CUDA this is cuBLASLt / cuDNN with bfloat16 data and float32 compute. On the
//    CPU, conv2d (with relu and max pooling fused where nn::Sequential has them in
//    a row), matmul and linear run on oneDNN's bfloat16 primitives where the CPU
//    has bfloat16 instructions (avx512_bf16 or AMX: nn::cpu_bf16_native(),
//    nn/ops/conv.h); elsewhere they compute the same contract in float32 on the
//    bfloat16-rounded operands and round the result to bfloat16.
//  - ops with bfloat16 kernels (relu and the other unary ops, elementwise binary ops
//    on equal dtypes, max/avg pool, dropout, views) run in the dtype they are given:
//    bfloat16 in, bfloat16 out, arithmetic in float32. So does PyTorch 1.13's CPU
//    autocast; its CUDA autocast runs exp, log, pow and softplus in float32 instead,
//    which this one does on no device.
//  - cross_entropy, nll_loss, mse_loss, l1_loss, smooth_l1_loss,
//    binary_cross_entropy_with_logits, softmax, log_softmax, batch_norm2d (not its
//    running statistics, which it updates in place), sum, mean, argmax and accuracy cast
//    bfloat16 inputs to float32 and compute in float32 (precision-sensitive
//    reductions).
// Parameters stay float32: the casts' backward converts gradients back to
// float32, so optimizers and gradient all-reduce see float32 as without autocast.
// A float32 weight is cast again by every op call that uses it (no cast cache).
// Outside a guard nothing changes: ops take their operands' dtypes as given, and
// an op without bfloat16 kernels rejects bfloat16 with an error naming it.
//
// Thread-local, like NoGradGuard: in dist::spawn each rank's thread makes its own.
// Guards nest; AutocastGuard(kFloat32) switches autocast off inside another guard.
#ifndef TANDEM_NN_AUTOCAST_H_
#define TANDEM_NN_AUTOCAST_H_

#include "nn/dtype.h"

namespace tandem::nn {

class AutocastGuard {
 public:
  // dtype: kBFloat16 (autocast on) or kFloat32 (autocast off inside the guard).
  // Any other dtype throws tandem::Error naming it.
  explicit AutocastGuard(DType dtype = kBFloat16);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  DType previous_;
};

// True while an AutocastGuard(kBFloat16) is the innermost guard on this thread.
bool autocast_enabled();

}  // namespace tandem::nn

#endif  // TANDEM_NN_AUTOCAST_H_
