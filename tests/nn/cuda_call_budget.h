// Budgets of CUDA calls per iteration (nn/cuda/internal/call_counter.h) for
// host_cost_gpu_test.cc, kept apart so that their arithmetic is tested without
// a GPU (call_counter_test.cc). A budget is the text CudaCallCounts::ToString
// prints, recorded from a GPU run in cuda_call_budgets.inc; a kind the text
// leaves out has a budget of 0.
#ifndef TANDEM_TESTS_NN_CUDA_CALL_BUDGET_H_
#define TANDEM_TESTS_NN_CUDA_CALL_BUDGET_H_

#include <cstdint>
#include <string>

#include "nn/cuda/internal/call_counter.h"

namespace tandem::testing {

struct CudaCallBudget {
  const char* name;    // the case
  const char* counts;  // per iteration, as CudaCallCounts::ToString prints them
};

// Calls per iteration of `total` made over `iterations` iterations, rounded up
// (a steady loop makes a whole number; a fraction means some iterations differ).
inline nn::internal::CudaCallCounts PerIteration(const nn::internal::CudaCallCounts& total,
                                                 int64_t iterations) {
  nn::internal::CudaCallCounts per;
  for (int i = 0; i < nn::internal::kNumCudaCalls; ++i) {
    per.n[i] = (total.n[i] + iterations - 1) / iterations;
  }
  return per;
}

// "" when every kind of `measured` is within `budget`, else the kinds above it:
// "kernel launch 5 > 4, cuDNN call 3 > 0".
inline std::string OverBudget(const nn::internal::CudaCallCounts& measured,
                              const nn::internal::CudaCallCounts& budget) {
  std::string out;
  for (int i = 0; i < nn::internal::kNumCudaCalls; ++i) {
    if (measured.n[i] <= budget.n[i]) continue;
    if (!out.empty()) out += ", ";
    out += std::string(nn::internal::CudaCallName(static_cast<nn::internal::CudaCall>(i))) + " " +
           std::to_string(measured.n[i]) + " > " + std::to_string(budget.n[i]);
  }
  return out;
}

// The line of cuda_call_budgets.inc that records `per_iteration` for case `name`.
inline std::string BudgetLine(const std::string& name,
                              const nn::internal::CudaCallCounts& per_iteration) {
  return "{\"" + name + "\", \"" + per_iteration.ToString() + "\"},";
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_NN_CUDA_CALL_BUDGET_H_
