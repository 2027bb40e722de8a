// GPU checks of the device and stream rules at spawn's level: spawn leaves the calling thread on
// the device it had (NCCL communicator creation selects each rank's GPU in
// turn), and a CUDA tensor returned from spawn is safe to read and to drop on
// the calling thread although its owning stream belongs to a rank thread that
// has ended. Label gpu; skipped with a reason where too few GPUs are visible.
#include <cuda_runtime_api.h>

#include <vector>

#include "gtest/gtest.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/matmul.h"
#include "spawn/spawn.h"
#include "tests/gpu_test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

constexpr int64_t kElements = int64_t{1} << 22;

SpawnOptions Quiet() {
  SpawnOptions options;
  options.handle_sigint = false;
  return options;
}

// Rank body: tens of milliseconds of matmuls, then the returned tensor's fill,
// which therefore is still queued when the rank thread ends.
Tensor LateTensor(Context& ctx) {
  Tensor a = nn::full({4096, 4096}, 1e-4, {.device = ctx.device()});
  for (int i = 0; i < 24; ++i) a = nn::matmul(a, a);
  return nn::full({kElements}, 3.0, {.device = ctx.device()});
}

int64_t Mismatches(const Tensor& t, float want) {
  int64_t bad = 0;
  for (float v : t.to_vector<float>()) bad += v != want;
  return bad;
}

TEST(SpawnStreamsGpuTest, TensorReturnedFromSpawnIsReadAfterTheRanksKernels) {
  TANDEM_REQUIRE_GPUS(1);
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  nn::internal::CudaThreadStream(nn::Device::CUDA(0));  // this thread's own stream first
  absl::StatusOr<std::vector<Tensor>> got = spawn(LateTensor, 1, "0", Quiet());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(Mismatches((*got)[0], 3.0f), 0);
}

TEST(SpawnStreamsGpuTest, TensorReturnedFromSpawnIsFreedAfterTheRanksKernels) {
  TANDEM_REQUIRE_GPUS(1);
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  nn::internal::CudaThreadStream(nn::Device::CUDA(0));
  absl::StatusOr<std::vector<Tensor>> got = spawn(LateTensor, 1, "0", Quiet());
  ASSERT_TRUE(got.ok()) << got.status();
  got = std::vector<Tensor>();                 // dropped here while the rank's fill is queued
  Tensor mine = nn::full({kElements}, 7.0);    // same size, on this thread's stream
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(Mismatches(mine, 7.0f), 0) << "the rank's kernel wrote into reused memory";
}

// Needs the CudaDeviceScope in CreateNcclCommunicators (spawn/comm/nccl/nccl_communicator.cc).
TEST(SpawnStreamsGpuTest, SpawnLeavesTheCallersDevice) {
  TANDEM_REQUIRE_GPUS(2);
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  absl::Status status =
      spawn([](Context&) { (void)nn::ones({4}).to_vector<float>(); }, 2, "0,1", Quiet());
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(nn::internal::CudaGetDevice(), 0);
  EXPECT_EQ(nn::current_device(), nn::Device::CUDA(0));
  // An op of this thread on cuda:0 still runs (a launch with cuda:1 current fails).
  EXPECT_EQ((nn::ones({4}) * 2.0).to_vector<float>(), std::vector<float>(4, 2.0f));
}

}  // namespace
}  // namespace tandem::dist
