// Central-difference gradient checks in float64 (flashlight's AutogradTestUtils,
// Caffe's GradientChecker). Used by every op's test.
#ifndef TANDEM_TESTS_NN_GRADCHECK_H_
#define TANDEM_TESTS_NN_GRADCHECK_H_

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "nn/tensor.h"

namespace tandem::nn::testing {

// f maps the inputs to a tensor of any shape; the check uses the scalar
// L = sum(f(inputs) * w) with a fixed random w, so every output element counts.
// Every input that requires grad is perturbed element by element by +-eps; the
// analytic gradient from backward() must match (L(x+eps) - L(x-eps)) / 2eps
// within atol + rtol * |numeric|. Inputs must be float64 on the CPU.
// Callers keep inputs away from kinks (relu at 0, max-pool ties) by more than
// eps, so the finite difference never straddles one.
inline ::testing::AssertionResult GradCheck(
    const std::function<Tensor(const std::vector<Tensor>&)>& f, std::vector<Tensor> inputs,
    double eps = 1e-6, double atol = 1e-7, double rtol = 1e-5) {
  for (const Tensor& x : inputs) {
    if (x.dtype() != kFloat64) return ::testing::AssertionFailure() << "inputs must be float64";
  }
  Tensor y0;
  {
    NoGradGuard g;
    y0 = f(inputs);
  }
  std::vector<double> w(static_cast<size_t>(y0.numel()));
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5 + 0.37 * static_cast<double>((i * 7919) % 13);
  auto loss = [&](const std::vector<Tensor>& in) {
    NoGradGuard g;
    std::vector<double> y = f(in).to_vector<double>();
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * w[i];
    return s;
  };
  for (Tensor& x : inputs) {
    if (x.requires_grad()) x.set_grad(Tensor());
  }
  Tensor y = f(inputs);
  y.backward(from_vector(w, y.shape(), {.dtype = kFloat64}));
  for (size_t k = 0; k < inputs.size(); ++k) {
    Tensor& x = inputs[k];
    if (!x.requires_grad()) continue;
    std::vector<double> analytic = x.grad().defined() ? x.grad().to_vector<double>()
                                                       : std::vector<double>(x.numel(), 0.0);
    double* p = x.data<double>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double saved = p[i];
      p[i] = saved + eps;
      const double lp = loss(inputs);
      p[i] = saved - eps;
      const double lm = loss(inputs);
      p[i] = saved;
      const double numeric = (lp - lm) / (2 * eps);
      if (std::abs(analytic[i] - numeric) > atol + rtol * std::abs(numeric)) {
        return ::testing::AssertionFailure()
               << "input " << k << " element " << i << ": analytic " << analytic[i]
               << " vs numeric " << numeric;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// A float64 tensor of `shape` with values from the thread's generator, scaled,
// requiring grad.
inline Tensor RandomInput(const Shape& shape, double scale = 1.0, bool requires_grad = true) {
  Tensor t = randn(shape, {.dtype = kFloat64});
  t.mul_(scale);
  t.set_requires_grad(requires_grad);
  return t;
}

}  // namespace tandem::nn::testing

#endif  // TANDEM_TESTS_NN_GRADCHECK_H_
