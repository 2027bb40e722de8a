// GPU checks of the data library: device gathers and loader copies match the
// host. Skipped (with the reason) when no CUDA device is visible.
#include <gtest/gtest.h>

#include <mutex>
#include <thread>
#include <vector>

#include "data/dataloader.h"
#include "data/device_dataset.h"
#include "nn/ops/matmul.h"
#include "tests/gpu_test_util.h"
#if TANDEM_WITH_CUDA
#include "nn/internal/cuda_runtime.h"
#endif

namespace tandem::data {
namespace {

class DataGpuTest : public ::tandem::testing::GpuTest {};

TensorDataset Sample() {
  nn::Tensor images = nn::arange(50 * 3 * 4 * 4, {.dtype = nn::kFloat32, .device = nn::Device::CPU()})
                          .reshape({50, 3, 4, 4});
  return TensorDataset(images, nn::arange(50, {.dtype = nn::kInt64, .device = nn::Device::CPU()}));
}

TEST_F(DataGpuTest, DeviceDatasetGatherMatchesHost) {
  TensorDataset host = Sample();
  DeviceDataset cpu(host, nn::Device::CPU());
  DeviceDataset gpu(host, nn::Device::CUDA(0));
  const std::vector<int64_t> indices = {49, 3, 4, 5, 0, 17, 17};
  Batch a = cpu.gather(indices);
  Batch b = gpu.gather(indices);
  EXPECT_TRUE(b.data.is_cuda());
  EXPECT_EQ(b.data.to_vector<float>(), a.data.to_vector<float>());
  EXPECT_EQ(b.target.to_vector<int64_t>(), a.target.to_vector<int64_t>());
}

TEST_F(DataGpuTest, LoaderCopiesBatchesToTheDevice) {
  auto dataset = std::make_shared<TensorDataset>(Sample());
  auto make_sampler = [] {
    return std::make_shared<SimpleBatchSampler>(std::make_shared<RandomSampler>(50, 3), 8, false);
  };
  DataLoader host(dataset, make_sampler(), {.num_workers = 2});
  DataLoader device(dataset, make_sampler(), {.num_workers = 2, .device = nn::Device::CUDA(0)});
  host.start_epoch();
  device.start_epoch();
  while (auto h = host.next()) {
    auto d = device.next();
    ASSERT_TRUE(d.has_value());
    EXPECT_TRUE(d->data.is_cuda());
    EXPECT_EQ(d->data.to_vector<float>(), h->data.to_vector<float>());
    EXPECT_EQ(d->target.to_vector<int64_t>(), h->target.to_vector<int64_t>());
  }
  EXPECT_FALSE(device.next().has_value());
}

TEST_F(DataGpuTest, PinnedLoaderMatchesThePlainOne) {
  nn::DeviceGuard guard(nn::Device::CUDA(0));
  auto dataset = std::make_shared<TensorDataset>(Sample());
  auto make_sampler = [] {
    return std::make_shared<SimpleBatchSampler>(std::make_shared<RandomSampler>(50, 7), 8, false);
  };
  for (int workers : {0, 2}) {
    DataLoader plain(dataset, make_sampler(), {.num_workers = workers, .device = nn::Device::CUDA(0)});
    DataLoader pinned(dataset, make_sampler(),
                      {.num_workers = workers, .pin_memory = true, .device = nn::Device::CUDA(0)});
    for (int epoch = 0; epoch < 2; ++epoch) {
      plain.start_epoch();
      pinned.start_epoch();
      int64_t batches = 0;
      while (auto a = plain.next()) {
        auto b = pinned.next();
        ASSERT_TRUE(b.has_value());
        EXPECT_TRUE(b->data.is_cuda());
        EXPECT_TRUE(b->target.is_cuda());
        EXPECT_EQ(b->indices, a->indices);
        // Read on the caller's stream: the asynchronous copy is ordered before it.
        EXPECT_EQ(b->data.to_vector<float>(), a->data.to_vector<float>()) << workers << " workers";
        EXPECT_EQ(b->target.to_vector<int64_t>(), a->target.to_vector<int64_t>());
        ++batches;
      }
      EXPECT_FALSE(pinned.next().has_value());
      EXPECT_EQ(batches, 7);
    }
  }
}

TEST_F(DataGpuTest, PinnedCollateGivesPinnedBatches) {
  TensorDataset dataset = Sample();
  std::vector<Example> examples = {dataset.get(3), dataset.get(9)};
  Batch batch = Collate(examples, {3, 9}, /*pinned=*/true);
  EXPECT_TRUE(batch.data.is_pinned());
  EXPECT_TRUE(batch.target.is_pinned());
  EXPECT_EQ(batch.target.to_vector<int64_t>(), (std::vector<int64_t>{3, 9}));
  EXPECT_EQ(batch.data.to_vector<float>(), Collate(examples, {3, 9}).data.to_vector<float>());
}

// The upload runs on the constructing thread's stream, queued here behind tens
// of milliseconds of matmuls; a gather from another thread must wait for it
//. Before the fix the other thread's kernels read the memory at once,
// and saw what an earlier tensor had left there.
TEST_F(DataGpuTest, GatherFromAnotherThreadSeesTheUpload) {
  const nn::Device gpu = nn::Device::CUDA(0);
  nn::DeviceGuard guard(gpu);
  const int64_t n = 4096, width = 256;
  TensorDataset host(nn::arange(n * width, {.dtype = nn::kFloat32, .device = nn::Device::CPU()})
                         .reshape({n, width}),
                     nn::arange(n, {.dtype = nn::kInt64, .device = nn::Device::CPU()}));
  {
    // A freed block of the dataset's size, full of 7s, for the upload to reuse.
    nn::Tensor junk = nn::full({n, width}, 7.0);
    (void)junk.to_vector<float>();
  }
  nn::Tensor burn = nn::full({4096, 4096}, 1e-4);
  for (int i = 0; i < 24; ++i) burn = nn::matmul(burn, burn);
  DeviceDataset on_gpu(host, gpu);
  std::vector<int64_t> all(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) all[static_cast<size_t>(i)] = n - 1 - i;
  const Batch want = DeviceDataset(host, nn::Device::CPU()).gather(all);
  std::vector<float> data;
  std::vector<int64_t> targets;
  std::thread([&] {
    nn::DeviceGuard guard(gpu);
    Batch got = on_gpu.gather(all);
    data = got.data.to_vector<float>();
    targets = got.target.to_vector<int64_t>();
  }).join();
  EXPECT_EQ(data, want.data.to_vector<float>());
  EXPECT_EQ(targets, want.target.to_vector<int64_t>());
}

#if TANDEM_WITH_CUDA
// Records the CUDA runtime device of the threads that call get().
class DeviceRecordingDataset : public Dataset {
 public:
  int64_t size() const override { return 16; }
  Example get(int64_t index) const override {
    const int device = nn::internal::CudaGetDevice();
    {
      std::lock_guard<std::mutex> lock(mu_);
      devices_.push_back(device);
    }
    return {nn::full({2}, static_cast<double>(index), {.device = nn::Device::CPU()}),
            nn::scalar_tensor(static_cast<double>(index), {.dtype = nn::kInt64,
                                                           .device = nn::Device::CPU()})};
  }
  std::vector<int> devices() const {
    std::lock_guard<std::mutex> lock(mu_);
    return devices_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::vector<int> devices_;
};

// Workers collating into pinned memory call the CUDA runtime (cudaHostAlloc,
// cudaEventQuery); they must do it on the loader's device, never on GPU 0 by
// default. Before the fix every worker reported device 0.
TEST_F(DataGpuTest, LoaderWorkersRunOnTheLoadersDevice) {
  TANDEM_REQUIRE_GPUS(2);
  const nn::Device gpu1 = nn::Device::CUDA(1);
  auto dataset = std::make_shared<DeviceRecordingDataset>();
  auto sampler =
      std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(16), 4, false);
  DataLoader loader(dataset, sampler, {.num_workers = 2, .pin_memory = true, .device = gpu1});
  int64_t batches = 0;
  for (const Batch& batch : loader) {
    EXPECT_EQ(batch.data.device(), gpu1);
    EXPECT_EQ(nn::current_device(), nn::Device::CPU());  // the caller's device is its own
    ++batches;
  }
  EXPECT_EQ(batches, 4);
  const std::vector<int> devices = dataset->devices();
  ASSERT_EQ(devices.size(), 16u);
  for (int d : devices) EXPECT_EQ(d, 1) << "a worker ran on GPU " << d;
}
#endif

}  // namespace
}  // namespace tandem::data
