// Kernel interface of batch_norm2d, shared by the CPU and CUDA files. x and dy
// are (N, C, HW) contiguous; per-channel tensors are (C), x's dtype.
#ifndef TANDEM_NN_OPS_INTERNAL_BATCH_NORM_KERNELS_H_
#define TANDEM_NN_OPS_INTERNAL_BATCH_NORM_KERNELS_H_

#include <cstdint>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

struct BatchNormShape {
  int64_t n = 0;
  int64_t c = 0;
  int64_t hw = 0;  // H * W
};

// mean[c] and biased var[c] over (N, HW), two passes (mean, then centred squares).
void BatchNormStatsCpu(const Tensor& x, const Tensor& mean, const Tensor& var, BatchNormShape s);
// y = (x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c]; weight/bias may be
// undefined (1 and 0).
void BatchNormForwardCpu(const Tensor& x, const Tensor& mean, const Tensor& var,
                         const Tensor& weight, const Tensor& bias, const Tensor& y, double eps,
                         BatchNormShape s);
// Per channel: sum_dy[c] = sum dy; sum_dy_xhat[c] = sum dy * xhat, with
// xhat = (x - mean[c]) / sqrt(var[c] + eps).
void BatchNormBackwardReduceCpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& sum_dy,
                                const Tensor& sum_dy_xhat, double eps, BatchNormShape s);
// dx. training (stats are the batch's, so they depend on x):
//   dx = w * invstd / M * (M dy - sum_dy - xhat * sum_dy_xhat), M = N * HW;
// otherwise (fixed running stats): dx = w * invstd * dy.
void BatchNormBackwardInputCpu(const Tensor& dy, const Tensor& x, const Tensor& mean,
                               const Tensor& var, const Tensor& weight, const Tensor& sum_dy,
                               const Tensor& sum_dy_xhat, const Tensor& dx, double eps,
                               bool training, BatchNormShape s);
#if TANDEM_WITH_CUDA
void BatchNormStatsCuda(const Tensor& x, const Tensor& mean, const Tensor& var, BatchNormShape s);
void BatchNormForwardCuda(const Tensor& x, const Tensor& mean, const Tensor& var,
                          const Tensor& weight, const Tensor& bias, const Tensor& y, double eps,
                          BatchNormShape s);
void BatchNormBackwardReduceCuda(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                 const Tensor& var, const Tensor& sum_dy,
                                 const Tensor& sum_dy_xhat, double eps, BatchNormShape s);
void BatchNormBackwardInputCuda(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                const Tensor& var, const Tensor& weight, const Tensor& sum_dy,
                                const Tensor& sum_dy_xhat, const Tensor& dx, double eps,
                                bool training, BatchNormShape s);
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_BATCH_NORM_KERNELS_H_
