// GPU checks of the data library: device gathers and loader copies match the
// host. Skipped (with the reason) when no CUDA device is visible.
#include <gtest/gtest.h>

#include "data/dataloader.h"
#include "data/device_dataset.h"

namespace tandem::data {
namespace {

// GTEST_SKIP returns from the enclosing function, so this is a macro.
#define REQUIRE_GPU()                                                                   \
  if (nn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible (or built " \
                                                    "without CUDA)"

TensorDataset Sample() {
  nn::Tensor images = nn::arange(50 * 3 * 4 * 4, {.dtype = nn::kFloat32, .device = nn::Device::CPU()})
                          .reshape({50, 3, 4, 4});
  return TensorDataset(images, nn::arange(50, {.dtype = nn::kInt64, .device = nn::Device::CPU()}));
}

TEST(DataGpuTest, DeviceDatasetGatherMatchesHost) {
  REQUIRE_GPU();
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

TEST(DataGpuTest, LoaderCopiesBatchesToTheDevice) {
  REQUIRE_GPU();
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

TEST(DataGpuTest, PinnedLoaderMatchesThePlainOne) {
  REQUIRE_GPU();
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

TEST(DataGpuTest, PinnedCollateGivesPinnedBatches) {
  REQUIRE_GPU();
  TensorDataset dataset = Sample();
  std::vector<Example> examples = {dataset.get(3), dataset.get(9)};
  Batch batch = Collate(examples, {3, 9}, /*pinned=*/true);
  EXPECT_TRUE(batch.data.is_pinned());
  EXPECT_TRUE(batch.target.is_pinned());
  EXPECT_EQ(batch.target.to_vector<int64_t>(), (std::vector<int64_t>{3, 9}));
  EXPECT_EQ(batch.data.to_vector<float>(), Collate(examples, {3, 9}).data.to_vector<float>());
}

}  // namespace
}  // namespace tandem::data
