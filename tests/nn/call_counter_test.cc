// nn/cuda/internal/call_counter.h without a GPU: process and thread counts,
// differences, the allocation sum and the printed form.
#include "nn/cuda/internal/call_counter.h"

#include <gtest/gtest.h>

#include "tests/nn/cuda_call_budget.h"

#include <thread>

namespace tandem::nn::internal {
namespace {

TEST(CallCounterTest, CountsPerProcessAndPerThread) {
  const CudaCallCounts process_before = ProcessCudaCalls();
  const CudaCallCounts thread_before = ThreadCudaCalls();
  CountCudaCall(CudaCall::kMalloc);
  CountCudaCall(CudaCall::kKernelLaunch);
  CountCudaCall(CudaCall::kKernelLaunch);
  std::thread([] {
    CountCudaCall(CudaCall::kFreeHost);
    EXPECT_EQ(ThreadCudaCalls()[CudaCall::kFreeHost], 1);
    EXPECT_EQ(ThreadCudaCalls()[CudaCall::kKernelLaunch], 0);  // the other thread's
  }).join();
  const CudaCallCounts process = ProcessCudaCalls() - process_before;
  const CudaCallCounts thread = ThreadCudaCalls() - thread_before;
  EXPECT_EQ(process[CudaCall::kMalloc], 1);
  EXPECT_EQ(process[CudaCall::kKernelLaunch], 2);
  EXPECT_EQ(process[CudaCall::kFreeHost], 1);
  EXPECT_EQ(thread[CudaCall::kFreeHost], 0);
  EXPECT_EQ(process.Allocations(), 2);  // cudaMalloc and cudaFreeHost
  EXPECT_EQ(thread.Allocations(), 1);
  EXPECT_EQ(process.ToString(), "cudaMalloc 1, cudaFreeHost 1, kernel launch 2");
  EXPECT_EQ(CudaCallCounts().ToString(), "none");
}

TEST(CallCounterTest, StreamOrderedCallsAreNotAllocations) {
  CudaCallCounts counts;
  counts.n[static_cast<int>(CudaCall::kMallocAsync)] = 3;
  counts.n[static_cast<int>(CudaCall::kFreeAsync)] = 3;
  counts.n[static_cast<int>(CudaCall::kDeviceSynchronize)] = 1;
  EXPECT_EQ(counts.Allocations(), 0);
}

TEST(CallCounterTest, PrintedCountsParseBack) {
  CudaCallCounts counts;
  counts.n[static_cast<int>(CudaCall::kMallocAsync)] = 3;
  counts.n[static_cast<int>(CudaCall::kKernelLaunch)] = 12;
  counts.n[static_cast<int>(CudaCall::kCudnnCall)] = 40;
  const std::optional<CudaCallCounts> parsed = ParseCudaCallCounts(counts.ToString());
  ASSERT_TRUE(parsed.has_value()) << counts.ToString();
  EXPECT_EQ(parsed->n, counts.n);
  EXPECT_EQ(counts.Total(), 55);
  EXPECT_EQ(ParseCudaCallCounts("none")->Total(), 0);
  EXPECT_FALSE(ParseCudaCallCounts("cudaMallocAsync three").has_value());
  EXPECT_FALSE(ParseCudaCallCounts("cudaMagic 1").has_value());
  EXPECT_FALSE(ParseCudaCallCounts("kernel launch").has_value());
}

// The budget arithmetic of host_cost_gpu_test.cc, which only a GPU runs.
TEST(CallCounterTest, BudgetsRoundUpAndNameEveryKindAboveThem) {
  CudaCallCounts total;
  total.n[static_cast<int>(CudaCall::kKernelLaunch)] = 100;
  total.n[static_cast<int>(CudaCall::kCudnnCall)] = 101;
  const CudaCallCounts per = testing::PerIteration(total, 50);
  EXPECT_EQ(per.ToString(), "kernel launch 2, cuDNN call 3");
  EXPECT_EQ(testing::BudgetLine("conv", per), R"({"conv", "kernel launch 2, cuDNN call 3"},)");
  EXPECT_EQ(testing::OverBudget(per, *ParseCudaCallCounts("kernel launch 2, cuDNN call 3")), "");
  EXPECT_EQ(testing::OverBudget(per, *ParseCudaCallCounts("kernel launch 3, cuDNN call 3")), "");
  // A kind the budget leaves out is allowed 0.
  EXPECT_EQ(testing::OverBudget(per, *ParseCudaCallCounts("kernel launch 1")),
            "kernel launch 2 > 1, cuDNN call 3 > 0");
}

}  // namespace
}  // namespace tandem::nn::internal
