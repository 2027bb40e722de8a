// CUDA calls per op of the eager path, counted (nn/cuda/internal/call_counter.h),
// no timing: a guard on the host's cost that a loaded machine cannot make flaky.
// Cases: one elementwise op, linear and conv2d forward + backward, and a small
// network's training step (conv2d, relu, linear, cross_entropy, backward, Adam,
// zero_grad). Each case runs kWarmup iterations, then kIterations counted ones
// on the calling thread with no host read between them.
//
// Fixed invariants, from the code (docs/gpu.md, "CUDA calls per op"): after
// warm-up an iteration makes no cudaMalloc / cudaFree / cudaHostAlloc /
// cudaFreeHost, no cudaDeviceSynchronize, creates no event and waits on the host
// for nothing; every stream-ordered allocation it makes it also frees; it makes
// some counted call (the counting works). Budgets per iteration, per kind of
// call, are recorded from a GPU run in cuda_call_budgets.inc: a case with a line
// there fails when a kind grows beyond it; a case without one prints "NOT
// RECORDED" and its measured line. TANDEM_CUDA_CALL_BUDGETS_OUT=FILE writes every
// case's measured line to FILE, ready to become cuda_call_budgets.inc.
// Label gpu; skipped with the reason where no CUDA device is visible.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "nn/cuda/internal/call_counter.h"
#include "nn/nn.h"
#include "optim/adam.h"
#include "tests/gpu_test_util.h"
#include "tests/nn/cuda_call_budget.h"

namespace tandem::nn {
namespace {

using internal::CudaCall;
using internal::CudaCallCounts;
using testing::CudaCallBudget;

const std::vector<CudaCallBudget> kBudgets = {
#include "tests/nn/cuda_call_budgets.inc"
};

constexpr int kWarmup = 5;
constexpr int kIterations = 50;

using StepFn = std::function<void()>;

// Leaves x, w, b without gradients (as zero_grad(set_to_none) does).
void ResetGrads(const Tensor& x, const Tensor& w, const Tensor& b) {
  x.set_grad(Tensor());
  w.set_grad(Tensor());
  b.set_grad(Tensor());
}

StepFn Add(Device device) {
  const Tensor a = randn({8, 8}, {.device = device}), b = randn({8, 8}, {.device = device});
  return [a, b] { Tensor y = a + b; };
}

StepFn LinearForwardBackward(Device device) {
  const Tensor x = randn({8, 32}, {.device = device, .requires_grad = true});
  const Tensor w = randn({16, 32}, {.device = device, .requires_grad = true});
  const Tensor b = randn({16}, {.device = device, .requires_grad = true});
  const Tensor dy = ones({8, 16}, {.device = device});
  return [x, w, b, dy] {
    linear(x, w, b).backward(dy);
    ResetGrads(x, w, b);
  };
}

StepFn ConvForwardBackward(Device device) {
  const Tensor x = randn({1, 4, 8, 8}, {.device = device, .requires_grad = true});
  const Tensor w = randn({8, 4, 3, 3}, {.device = device, .requires_grad = true});
  const Tensor b = randn({8}, {.device = device, .requires_grad = true});
  const Tensor dy = ones({1, 8, 8, 8}, {.device = device});
  return [x, w, b, dy] {
    conv2d(x, w, b, {.padding = {1, 1}}).backward(dy);
    ResetGrads(x, w, b);
  };
}

// x: (4, 1, 8, 8) -> conv 1->4 3x3 padding 1 -> relu -> flatten -> linear 256->10.
struct SmallNet : Module {
  SmallNet()
      : conv(register_module("conv", Conv2d(1, 4, 3, {.padding = {1, 1}}))),
        fc(register_module("fc", Linear(256, 10))) {}
  Tensor forward(const Tensor& x) override { return fc(relu(conv(x)).flatten(1)); }
  Conv2d conv;
  Linear fc;
};

StepFn TrainingStep(Device device) {
  auto net = std::make_shared<SmallNet>();
  net->to(device);
  auto adam = std::make_shared<optim::Adam>(net->parameters(), optim::AdamOptions{.lr = 1e-3});
  const Tensor x = randn({4, 1, 8, 8}, {.device = device});
  const Tensor labels =
      from_vector(std::vector<int64_t>{1, 3, 5, 7}, {4}, {.dtype = kInt64, .device = device});
  return [net, adam, x, labels] {
    cross_entropy(net->forward(x), labels).backward();
    adam->step();
    adam->zero_grad();
  };
}

struct Case {
  const char* name;
  StepFn (*make)(Device);
};

const Case kCases[] = {
    {"add", Add},
    {"linear_fwd_bwd", LinearForwardBackward},
    {"conv2d_fwd_bwd", ConvForwardBackward},
    {"small_net_adam_step", TrainingStep},
};

// The calling thread's calls over kIterations iterations after kWarmup.
CudaCallCounts Count(const StepFn& step, Device device) {
  for (int i = 0; i < kWarmup; ++i) step();
  Synchronize(device);
  const CudaCallCounts before = internal::ThreadCudaCalls();
  for (int i = 0; i < kIterations; ++i) step();
  const CudaCallCounts made = internal::ThreadCudaCalls() - before;
  Synchronize(device);
  return made;
}

const CudaCallBudget* RecordedBudget(const std::string& name) {
  for (const CudaCallBudget& b : kBudgets) {
    if (name == b.name) return &b;
  }
  return nullptr;
}

class HostCostGpuTest : public tandem::testing::GpuTest {};

TEST_F(HostCostGpuTest, CudaCallsPerIterationStayWithinInvariantsAndBudgets) {
  const Device device = Device::CUDA(0);
  DeviceGuard guard(device);
  std::vector<std::string> lines;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    manual_seed(1);
    const CudaCallCounts total = Count(c.make(device), device);
    const CudaCallCounts per = testing::PerIteration(total, kIterations);
    std::printf("%s: %d iterations: %s\n  per iteration: %s\n", c.name, kIterations,
                total.ToString().c_str(), per.ToString().c_str());
    lines.push_back(testing::BudgetLine(c.name, per));

    EXPECT_EQ(total.Allocations(), 0) << total.ToString();
    EXPECT_EQ(total[CudaCall::kDeviceSynchronize], 0) << total.ToString();
    EXPECT_EQ(total[CudaCall::kEventCreate], 0) << total.ToString();
    EXPECT_EQ(total[CudaCall::kHostWait], 0) << total.ToString();
    EXPECT_EQ(total[CudaCall::kMallocAsync], total[CudaCall::kFreeAsync]) << total.ToString();
    EXPECT_GT(total.Total(), 0) << "nothing counted: is the counter wired in?";

    const CudaCallBudget* budget = RecordedBudget(c.name);
    if (budget == nullptr) {
      std::printf("  budget: NOT RECORDED (tests/nn/cuda_call_budgets.inc has no line for %s; "
                  "docs/gpu.md says how to record one)\n", c.name);
      continue;
    }
    const std::optional<CudaCallCounts> allowed = internal::ParseCudaCallCounts(budget->counts);
    ASSERT_TRUE(allowed.has_value()) << "unreadable budget \"" << budget->counts << "\"";
    EXPECT_EQ(testing::OverBudget(per, *allowed), "")
        << "per iteration: " << per.ToString() << "; budget: " << budget->counts;
    if (per.n != allowed->n) {
      std::printf("  below budget in some kind: lower the line to %s\n", lines.back().c_str());
    }
  }
  std::printf("budget lines (cuda_call_budgets.inc):\n");
  for (const std::string& line : lines) std::printf("%s\n", line.c_str());
  if (const char* out = std::getenv("TANDEM_CUDA_CALL_BUDGETS_OUT"); out != nullptr && *out) {
    std::ofstream file(out);
    for (const std::string& line : lines) file << line << "\n";
    EXPECT_TRUE(file.good()) << "cannot write " << out;
  }
}

}  // namespace
}  // namespace tandem::nn
