// nn/cuda/internal/call_counter.h without a GPU: process and thread counts,
// differences, the allocation sum and the printed form.
#include "nn/cuda/internal/call_counter.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace tandem::nn::internal
