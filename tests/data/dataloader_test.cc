#include "data/dataloader.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <chrono>
#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "data/device_dataset.h"
#include "data/transforms.h"
#include "nn/error.h"

namespace tandem::data {
namespace {

// Example i: data (2) = {i, -i} float, target = i (0-dim int64). Optionally slow
// or failing at one index; counts calls to get().
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(int64_t n, int64_t fail_at = -1, int delay_us = 0)
      : n_(n), fail_at_(fail_at), delay_us_(delay_us) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    calls_.fetch_add(1);
    if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    TANDEM_CHECK(i != fail_at_, "broken record");
    return {nn::from_vector(std::vector<float>{static_cast<float>(i), static_cast<float>(-i)}, {2}),
            nn::full({}, static_cast<double>(i), {.dtype = nn::kInt64, .device = nn::Device::CPU()})};
  }
  int64_t calls() const { return calls_.load(); }

 private:
  int64_t n_, fail_at_;
  int delay_us_;
  mutable std::atomic<int64_t> calls_{0};
};

std::vector<int64_t> Targets(DataLoader& loader, std::vector<nn::Shape>* shapes = nullptr) {
  std::vector<int64_t> out;
  for (const Batch& batch : loader) {
    if (shapes != nullptr) shapes->push_back(batch.data.shape());
    for (int64_t t : batch.target.to_vector<int64_t>()) out.push_back(t);
    EXPECT_EQ(batch.data.to_vector<float>()[0], static_cast<float>(batch.indices[0]));
  }
  return out;
}

TEST(DataLoaderTest, OrderIsTheSamplersForAnyWorkerCount) {
  auto dataset = std::make_shared<CountingDataset>(103, -1, 50);
  std::vector<int64_t> expected;
  {
    auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<RandomSampler>(103, 1), 8, false);
    sampler->set_epoch(0);
    sampler->reset();
    while (auto b = sampler->next()) expected.insert(expected.end(), b->begin(), b->end());
  }
  for (int workers : {0, 1, 3, 8}) {
    for (int prefetch : {1, 2, 5}) {
      auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<RandomSampler>(103, 1), 8, false);
      DataLoader loader(dataset, sampler, {.num_workers = workers, .prefetch = prefetch});
      std::vector<nn::Shape> shapes;
      EXPECT_EQ(Targets(loader, &shapes), expected) << workers << " workers, prefetch " << prefetch;
      ASSERT_EQ(shapes.size(), 13u);
      EXPECT_EQ(shapes[0], (nn::Shape{8, 2}));
      EXPECT_EQ(shapes[12], (nn::Shape{7, 2}));
      // The second pass is the next epoch.
      EXPECT_NE(Targets(loader), expected);
      EXPECT_EQ(loader.get_state().epoch, 2);
    }
  }
}

TEST(DataLoaderTest, PrefetchIsBounded) {
  auto dataset = std::make_shared<CountingDataset>(1000);
  auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(1000), 10, false);
  DataLoader loader(dataset, sampler, {.num_workers = 2, .prefetch = 3});
  ASSERT_TRUE(loader.next().has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // One batch taken plus at most 3 in flight: at most 40 samples loaded.
  EXPECT_LE(dataset->calls(), 40);
  EXPECT_GE(dataset->calls(), 10);
}

TEST(DataLoaderTest, WorkerErrorNamesSampleAndMessage) {
  for (int workers : {0, 2}) {
    auto dataset = std::make_shared<CountingDataset>(50, /*fail_at=*/23);
    auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(50), 4, false);
    DataLoader loader(dataset, sampler, {.num_workers = workers});
    int good_batches = 0;
    try {
      while (loader.next()) ++good_batches;
      FAIL() << "no error surfaced";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("sample 23"), std::string::npos) << m;
      EXPECT_NE(m.find("broken record"), std::string::npos) << m;
    }
    EXPECT_EQ(good_batches, 5);  // batches 0..4 (samples 0..19) arrive first, in order
  }
}

TEST(DataLoaderTest, CollateMismatchNamesSample) {
  std::vector<Example> examples = {{nn::zeros({2}), nn::zeros({})}, {nn::zeros({3}), nn::zeros({})}};
  try {
    Collate(examples, {4, 9});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sample 9"), std::string::npos) << e.what();
  }
}

TEST(DataLoaderTest, DestructionMidEpochStopsWorkersPromptly) {
  auto dataset = std::make_shared<CountingDataset>(100000, -1, 200);
  auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(100000), 16, false);
  const auto start = std::chrono::steady_clock::now();
  {
    DataLoader loader(dataset, sampler, {.num_workers = 4, .prefetch = 8});
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(loader.next().has_value());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2.0);
  const int64_t calls = dataset->calls();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(dataset->calls(), calls);  // nothing runs after the destructor returned
}

#if defined(__has_feature)
#define TANDEM_TEST_CLANG_SANITIZER \
  (__has_feature(thread_sanitizer) || __has_feature(address_sanitizer))
#else
#define TANDEM_TEST_CLANG_SANITIZER 0
#endif

// In a child process: exits 0 when both calls fail naming the count.
[[noreturn]] void StartTooManyWorkersTwice() {
  alarm(10);  // a hang ends the child by SIGALRM, not with status 0
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0;
  statm >> pages;
  const rlim_t limit = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + (256 << 20);
  const rlimit cap{limit, limit};
  if (setrlimit(RLIMIT_AS, &cap) != 0) std::_Exit(3);
  auto dataset = std::make_shared<CountingDataset>(64);
  auto sampler = std::make_shared<SimpleBatchSampler>(
      std::make_shared<SequentialSampler>(64), 8, false);
  DataLoader loader(dataset, sampler, {.num_workers = 1000});
  const SamplerState before = loader.get_state();
  for (int call = 0; call < 2; ++call) {
    try {
      (void)loader.next();
      std::_Exit(4);  // 1000 stacks fit in 256 MiB more
    } catch (const Error& e) {
      if (std::string(e.what()).find("num_workers 1000: could not start worker thread") ==
          std::string::npos) {
        std::_Exit(5);
      }
    }
    // The pass that could not start is still the next one.
    const SamplerState after = loader.get_state();
    if (after.epoch != before.epoch || after.position != before.position) std::_Exit(6);
  }
  std::_Exit(0);
}

// Workers that cannot all start (here: address space for their stacks, capped
// by RLIMIT_AS in a child process): the error names the count, the threads
// already started are stopped, and a later next() tries again and fails the
// same way instead of waiting for batches no worker will build.
TEST(DataLoaderTest, WorkersThatCannotStartFailEachCallWithoutAHang) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__) || TANDEM_TEST_CLANG_SANITIZER
  GTEST_SKIP() << "an address-space limit and a sanitizer's shadow memory do not mix";
#else
  const std::string style = ::testing::FLAGS_gtest_death_test_style;
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";  // a child without the others' threads
  EXPECT_EXIT(StartTooManyWorkersTwice(), ::testing::ExitedWithCode(0), "");
  ::testing::FLAGS_gtest_death_test_style = style;
#endif
}

TEST(DataLoaderTest, StateResumesWhereTheCallerWas) {
  auto dataset = std::make_shared<CountingDataset>(60);
  auto make_sampler = [] {
    return std::make_shared<DistributedBatchSampler>(60, 4, 2, 0, true, false, 11);
  };
  DataLoader loader(dataset, make_sampler(), {.num_workers = 2, .prefetch = 4});
  loader.start_epoch();
  std::vector<int64_t> taken;
  for (int i = 0; i < 3; ++i) taken.push_back(loader.next()->indices[0]);
  const SamplerState state = loader.get_state();
  EXPECT_EQ(state.epoch, 0);
  EXPECT_EQ(state.position, 3);  // prefetched batches do not count
  std::vector<int64_t> rest;
  while (auto b = loader.next()) rest.push_back(b->indices[0]);
  EXPECT_EQ(loader.get_state().epoch, 1);
  EXPECT_EQ(loader.get_state().position, 0);

  DataLoader resumed(dataset, make_sampler(), {.num_workers = 1});
  resumed.set_state(state);
  std::vector<int64_t> resumed_rest;
  for (const Batch& b : resumed) resumed_rest.push_back(b.indices[0]);
  EXPECT_EQ(resumed_rest, rest);
}

TEST(DataLoaderTest, PinMemoryWithoutACudaDeviceIsANoOp) {
  auto dataset = std::make_shared<CountingDataset>(21);
  auto make_sampler = [] {
    return std::make_shared<SimpleBatchSampler>(std::make_shared<RandomSampler>(21, 4), 4, false);
  };
  DataLoader plain(dataset, make_sampler(), {.num_workers = 2});
  const std::vector<int64_t> expected = Targets(plain);
  ASSERT_EQ(expected.size(), 21u);
  for (std::optional<nn::Device> device : {std::optional<nn::Device>(), std::optional(nn::Device::CPU())}) {
    for (int workers : {0, 2}) {
      DataLoader pinned(dataset, make_sampler(),
                        {.num_workers = workers, .pin_memory = true, .device = device});
      EXPECT_EQ(Targets(pinned), expected) << workers << " workers";
      pinned.start_epoch();
      std::optional<Batch> batch = pinned.next();
      ASSERT_TRUE(batch.has_value());
      EXPECT_FALSE(batch->data.is_pinned());  // documented: nothing to pin for
      EXPECT_TRUE(batch->data.device().is_cpu());
    }
  }
}

TEST(DataLoaderTest, PinMemoryToCudaNeedsAVisibleGpu) {
  auto dataset = std::make_shared<CountingDataset>(4);
  auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(4), 2, false);
  if (nn::cuda_device_count() > 0) {
    EXPECT_NO_THROW(DataLoader(dataset, sampler, {.pin_memory = true, .device = nn::Device::CUDA(0)}));
    return;
  }
  try {
    DataLoader loader(dataset, sampler, {.pin_memory = true, .device = nn::Device::CUDA(0)});
    FAIL() << "pin_memory to cuda:0 without a GPU was accepted";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("pin_memory"), std::string::npos) << message;
    EXPECT_NE(message.find("cuda:0"), std::string::npos) << message;
    EXPECT_NE(message.find("pinned memory needs tandem built with CUDA and a visible GPU"),
              std::string::npos)
        << message;
  }
}

TEST(DataLoaderTest, CollateIntoPinnedMemoryNeedsAGpu) {
  std::vector<Example> examples = {CountingDataset(2).get(0), CountingDataset(2).get(1)};
  if (nn::cuda_device_count() == 0) {
    EXPECT_THROW(Collate(examples, {0, 1}, /*pinned=*/true), Error);
  } else {
    Batch batch = Collate(examples, {0, 1}, /*pinned=*/true);
    EXPECT_TRUE(batch.data.is_pinned());
    EXPECT_TRUE(batch.target.is_pinned());
    EXPECT_EQ(batch.data.to_vector<float>(), (std::vector<float>{0, -0.0f, 1, -1}));
  }
  EXPECT_FALSE(Collate(examples, {0, 1}).data.is_pinned());
}

// The fused per-batch conversion equals ToFloat then Normalize, per channel, on
// a sample (C, H, W) and a batch (B, C, H, W), and the loader applies it to each
// collated batch of a uint8 dataset.
TEST(TransformTest, FusedToFloatNormalizeMatchesTheTwoStepsOnBatches) {
  nn::Generator gen{};
  std::vector<uint8_t> pixels(3 * 2 * 2 * 2);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 37 % 256);
  const nn::Tensor batch = nn::from_vector(pixels, {3, 2, 2, 2});  // (B, C, H, W), C = 2
  const ToFloatNormalize fused(1.0 / 255, {0.25, 0.5}, {0.5, 0.125});
  const nn::Tensor y = fused(batch, gen);
  EXPECT_EQ(y.dtype(), nn::kFloat32);
  EXPECT_EQ(y.shape(), batch.shape());
  const std::vector<float> got = y.to_vector<float>();
  for (int64_t s = 0; s < 3; ++s) {
    const nn::Tensor two_steps =
        Normalize({0.25, 0.5}, {0.5, 0.125})(ToFloat(1.0 / 255)(batch[s], gen), gen);
    const std::vector<float> want = two_steps.to_vector<float>();
    const std::vector<float> sample = fused(batch[s], gen).to_vector<float>();
    for (int64_t i = 0; i < 8; ++i) {
      EXPECT_NEAR(got[s * 8 + i], want[i], 1e-5) << "batch " << s << " element " << i;
      EXPECT_EQ(sample[i], got[s * 8 + i]);
    }
  }
  // Channel 1 of sample 0, pixel 0 = byte 4 * 37 = 148: (148/255 - 0.5) / 0.125.
  EXPECT_FLOAT_EQ(got[4], static_cast<float>((148.0 / 255 - 0.5) / 0.125));
  EXPECT_THROW(fused(nn::from_vector(pixels, {1, 3, 2, 2, 2}), gen), Error);  // 5 dims
  EXPECT_THROW(fused(nn::from_vector(pixels, {4, 3, 2, 1}), gen), Error);     // C = 3
  EXPECT_THROW(ToFloatNormalize(1, {0.5}, {0.0}), Error);
  EXPECT_THROW(ToFloatNormalize(1, {0.5, 0.5}, {1}), Error);

  // Through the loader, with and without workers: uint8 rows in, float batches out.
  auto dataset = std::make_shared<TensorDataset>(
      batch, nn::from_vector(std::vector<int64_t>{0, 1, 2}, {3}, {.dtype = nn::kInt64}));
  for (int workers : {0, 2}) {
    auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(3), 2,
                                                        /*drop_last=*/false);
    DataLoader loader(dataset, sampler,
                      {.num_workers = workers,
                       .batch_transform = std::make_shared<ToFloatNormalize>(
                           1.0 / 255, std::vector<double>{0.25, 0.5},
                           std::vector<double>{0.5, 0.125})});
    std::vector<float> all;
    for (const Batch& b : loader) {
      EXPECT_EQ(b.data.dtype(), nn::kFloat32);
      const std::vector<float> v = b.data.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    EXPECT_EQ(all, got) << workers << " workers";
  }
}

TEST(TransformTest, ToFloatNormalizeCropFlip) {
  nn::Generator gen{.seed = 1};
  nn::Tensor bytes = nn::from_vector(std::vector<uint8_t>{0, 51, 102, 255}, {1, 2, 2});
  nn::Tensor f = ToFloat(1.0 / 255)(bytes, gen);
  EXPECT_EQ(f.dtype(), nn::kFloat32);
  EXPECT_FLOAT_EQ(f.to_vector<float>()[1], 0.2f);
  nn::Tensor n = Normalize({0.5}, {0.25})(f, gen);
  EXPECT_FLOAT_EQ(n.to_vector<float>()[3], 2.0f);
  EXPECT_THROW(Normalize({0.5, 0.5}, {1, 1})(f, gen), Error);
  EXPECT_THROW(Normalize({0.5}, {0.0}), Error);

  // Crop without padding at full size is the identity; with padding, every
  // output value is an input value or 0, and across seeds offsets vary.
  nn::Tensor img = nn::arange(2 * 4 * 4, {.dtype = nn::kFloat32}).reshape({2, 4, 4});
  EXPECT_EQ(RandomCrop(4)(img, gen).to_vector<float>(), img.to_vector<float>());
  std::set<std::vector<float>> distinct;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    nn::Generator g{.seed = seed};
    nn::Tensor c = RandomCrop(4, 2)(img, g);
    EXPECT_EQ(c.shape(), (nn::Shape{2, 4, 4}));
    distinct.insert(c.to_vector<float>());
    nn::Generator again{.seed = seed};
    EXPECT_EQ(RandomCrop(4, 2)(img, again).to_vector<float>(), c.to_vector<float>());
  }
  EXPECT_GT(distinct.size(), 3u);
  // Flip with p = 1 mirrors each row; p = 0 keeps it.
  nn::Tensor flipped = RandomHorizontalFlip(1.0)(img, gen);
  EXPECT_EQ(flipped.to_vector<float>()[0], 3.0f);
  EXPECT_EQ(flipped.to_vector<float>()[7], 4.0f);
  EXPECT_EQ(RandomHorizontalFlip(0.0)(img, gen).to_vector<float>(), img.to_vector<float>());
}

// Paddle's and torchvision's RandomCrop(size, padding): two numbers are a
// square size and the padding, not a height and a width (RandomCrop(32, 4),
// the CIFAR augmentation, cropped 32x4).
TEST(TransformTest, RandomCropTakesPaddlesSizeAndPadding) {
  nn::Tensor img = nn::arange(2 * 4 * 4, {.dtype = nn::kFloat32}).reshape({2, 4, 4});
  nn::Generator gen{.seed = 3};
  EXPECT_EQ(RandomCrop(4, 2)(img, gen).shape(), (nn::Shape{2, 4, 4}));
  EXPECT_EQ(RandomCrop(3)(img, gen).shape(), (nn::Shape{2, 3, 3}));
  EXPECT_EQ(RandomCrop({4, 3}, 1)(img, gen).shape(), (nn::Shape{2, 4, 3}));
}

TEST(TransformTest, TransformDatasetIsReproducibleAcrossWorkers) {
  nn::Tensor images = nn::arange(16 * 3 * 8 * 8, {.dtype = nn::kFloat32}).reshape({16, 3, 8, 8});
  auto base = std::make_shared<TensorDataset>(images, nn::arange(16, {.dtype = nn::kInt64}));
  auto transform = std::make_shared<Compose>(std::vector<std::shared_ptr<const Transform>>{
      std::make_shared<RandomCrop>(8, 2), std::make_shared<RandomHorizontalFlip>(),
      std::make_shared<Normalize>(std::vector<double>{1, 2, 3}, std::vector<double>{2, 2, 2})});
  auto dataset = std::make_shared<TransformDataset>(base, transform, 5);
  auto run = [&](int workers) {
    auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(16), 4, false);
    DataLoader loader(dataset, sampler, {.num_workers = workers});
    std::vector<float> all;
    for (const Batch& b : loader) {
      auto v = b.data.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  const auto serial = run(0);
  EXPECT_EQ(run(3), serial);
  dataset->set_epoch(1);
  EXPECT_NE(run(3), serial);
}

// The loader passes its pass's epoch (the sampler's) to the dataset, so a
// TransformDataset draws new crops and flips each epoch without set_epoch(),
// the same for any number of workers and for a sampler restored to that epoch.
TEST(TransformTest, TransformDatasetDrawsAnewInEachLoaderEpoch) {
  nn::Tensor images = nn::arange(8 * 1 * 6 * 6, {.dtype = nn::kFloat32}).reshape({8, 1, 6, 6});
  auto base = std::make_shared<TensorDataset>(images, nn::arange(8, {.dtype = nn::kInt64}));
  auto dataset = std::make_shared<TransformDataset>(base, std::make_shared<RandomCrop>(6, 2), 9);
  auto pass = [](DataLoader& loader) {
    std::vector<float> all;
    for (const Batch& b : loader) {
      auto v = b.data.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(8), 4, false);
  DataLoader loader(dataset, sampler, {.num_workers = 2});
  const auto epoch0 = pass(loader);
  const auto epoch1 = pass(loader);
  EXPECT_NE(epoch1, epoch0);
  auto at_epoch1 = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(8), 4, false);
  at_epoch1->set_epoch(1);
  DataLoader serial(dataset, at_epoch1, {.num_workers = 0});
  EXPECT_EQ(pass(serial), epoch1);
  // A TransformDataset over it passes the epoch on.
  auto outer = std::make_shared<TransformDataset>(
      dataset, std::make_shared<Normalize>(std::vector<double>{0}, std::vector<double>{1}), 3);
  at_epoch1->set_epoch(1);  // a finished pass moved it on
  DataLoader wrapped(outer, at_epoch1, {.num_workers = 2});
  EXPECT_EQ(pass(wrapped), epoch1);
  // set_epoch() on the dataset chooses the draws itself, whatever the loader's epoch.
  dataset->set_epoch(0);
  at_epoch1->set_epoch(1);
  DataLoader fixed(dataset, at_epoch1, {.num_workers = 2});
  EXPECT_EQ(pass(fixed), epoch0);
}

// Subset (paddle.io.Subset, torch.utils.data.Subset): example i is the base's
// indices[i], read in the loader's epoch; a bad index is named at construction.
TEST(SubsetTest, ExamplesAreTheBasesAtTheIndicesInTheLoadersEpoch) {
  auto base = std::make_shared<CountingDataset>(10);
  auto subset = std::make_shared<Subset>(base, std::vector<int64_t>{7, 2, 2, 9});
  ASSERT_EQ(subset->size(), 4);
  EXPECT_EQ(subset->get(0).data.to_vector<float>(), (std::vector<float>{7, -7}));
  EXPECT_EQ(subset->get(3).target.item(), 9);
  auto sampler = std::make_shared<SimpleBatchSampler>(std::make_shared<SequentialSampler>(4), 3, false);
  DataLoader loader(subset, sampler, {.num_workers = 2});
  std::vector<float> labels;
  for (const Batch& b : loader)
    for (float v : b.target.to(nn::kFloat32).to_vector<float>()) labels.push_back(v);
  EXPECT_EQ(labels, (std::vector<float>{7, 2, 2, 9}));
  // Random draws of a TransformDataset under it follow the pass's epoch.
  nn::Tensor images = nn::arange(8 * 1 * 6 * 6, {.dtype = nn::kFloat32}).reshape({8, 1, 6, 6});
  auto augmented = std::make_shared<TransformDataset>(
      std::make_shared<TensorDataset>(images, nn::arange(8, {.dtype = nn::kInt64})),
      std::make_shared<RandomCrop>(6, 2), 9);
  Subset crops(augmented, {5});
  EXPECT_EQ(crops.get_in_epoch(0, 3).data.to_vector<float>(),
            augmented->get_in_epoch(5, 3).data.to_vector<float>());
  EXPECT_NE(crops.get_in_epoch(0, 3).data.to_vector<float>(),
            crops.get_in_epoch(0, 4).data.to_vector<float>());

  auto error = [&](std::vector<int64_t> indices) {
    try {
      Subset bad(base, std::move(indices));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error({0, 10}), "Subset: index 10 (position 1) is outside [0, 10), the base dataset's size");
  EXPECT_EQ(error({-1}), "Subset: index -1 (position 0) is outside [0, 10), the base dataset's size");
  EXPECT_THROW(Subset(nullptr, {0}), Error);
  EXPECT_THROW(subset->get(4), Error);
}

// RandomSplit (paddle.io.random_split, torch.utils.data.random_split): disjoint
// subsets of the given lengths covering the base, the same for the same seed.
TEST(SubsetTest, RandomSplitCoversTheBaseOnceWithTheGivenLengths) {
  auto base = std::make_shared<CountingDataset>(10);
  std::vector<std::shared_ptr<Subset>> parts = RandomSplit(base, {6, 0, 4}, 5);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0]->size(), 6);
  EXPECT_EQ(parts[1]->size(), 0);
  EXPECT_EQ(parts[2]->size(), 4);
  std::set<int64_t> seen;
  for (const auto& part : parts) seen.insert(part->indices().begin(), part->indices().end());
  EXPECT_EQ(seen.size(), 10u);
  EXPECT_EQ(RandomSplit(base, {6, 0, 4}, 5)[2]->indices(), parts[2]->indices());
  EXPECT_NE(RandomSplit(base, {6, 0, 4}, 6)[0]->indices(), parts[0]->indices());
  try {
    RandomSplit(base, {6, 3}, 5);
    ADD_FAILURE() << "lengths 6 + 3 of 10 examples were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "RandomSplit: the lengths (6, 3) add up to 9, not the dataset's 10 examples");
  }
  EXPECT_THROW(RandomSplit(base, {11, -1}, 5), Error);
  // Lengths whose sum would overflow to the dataset's size are refused too.
  const int64_t huge = std::numeric_limits<int64_t>::max();
  try {
    RandomSplit(base, {huge, huge, 12}, 5);
    ADD_FAILURE() << "lengths that overflow were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              absl::StrCat("RandomSplit: length ", huge, " of (", huge, ", ", huge,
                           ", 12) is more than the dataset's 10 examples"));
  }
}

// RandomSplit by fractions: torch 1.13's lengths (random_split_reference.py
// printed them: floor(size * fraction), the remainder round-robin to the first
// parts, a part of 0 allowed), then the lengths' split of the same seed.
TEST(SubsetTest, RandomSplitByFractionsTakesTorchsLengths) {
  struct Case {
    int64_t size;
    std::vector<double> fractions;
    std::vector<int64_t> torch_lengths;
  };
  const std::vector<Case> cases = {
      {10, {0.5, 0.5}, {5, 5}},
      {10, {0.33, 0.33, 0.34}, {4, 3, 3}},
      {7, {0.1, 0.1, 0.8}, {1, 1, 5}},
      {3, {0.1, 0.1, 0.8}, {1, 0, 2}},
      {10, {1.0 / 3, 1.0 / 3, 1.0 / 3}, {4, 3, 3}},
      {5, {0.0, 1.0}, {0, 5}},
      {10, {0.3, 0.3, 0.3, 0.1}, {3, 3, 3, 1}},
      {10, {0.7, 0.2, 0.1}, {7, 2, 1}},
      {1, {0.5, 0.5}, {1, 0}},
      {0, {0.5, 0.5}, {0, 0}},
  };
  for (const Case& c : cases) {
    auto base = std::make_shared<CountingDataset>(c.size);
    std::vector<std::shared_ptr<Subset>> parts = RandomSplit(base, Fractions{c.fractions}, 9);
    std::vector<std::shared_ptr<Subset>> by_lengths = RandomSplit(base, c.torch_lengths, 9);
    ASSERT_EQ(parts.size(), c.torch_lengths.size()) << c.size;
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_EQ(parts[i]->size(), c.torch_lengths[i]) << c.size << " part " << i;
      // The same permutation: every rank and process splits alike.
      EXPECT_EQ(parts[i]->indices(), by_lengths[i]->indices()) << c.size << " part " << i;
    }
  }
  auto base = std::make_shared<CountingDataset>(10);
  auto error = [&](std::vector<double> fractions) {
    try {
      RandomSplit(base, Fractions{std::move(fractions)}, 5);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error({0.5, 0.6}), "RandomSplit: the fractions (0.5, 0.6) sum to 1.1, not 1 (within 1e-6)");
  EXPECT_EQ(error({0.5, 0.5 - 2e-6}),
            "RandomSplit: the fractions (0.5, 0.499998) sum to 0.999998, not 1 (within 1e-6)");
  EXPECT_EQ(error({-0.5, 1.5}), "RandomSplit: fraction -0.5 at index 0 of (-0.5, 1.5) is not in [0, 1]");
  EXPECT_EQ(error({0.5, std::nan("")}),
            "RandomSplit: fraction nan at index 1 of (0.5, nan) is not in [0, 1]");
  EXPECT_EQ(error({}), "RandomSplit: no fractions (an empty list)");
  // Within 1e-6 of 1 is a sum of 1.
  EXPECT_EQ(RandomSplit(base, Fractions{{0.5, 0.5 + 5e-7}}, 5)[1]->size(), 5);
  // Above 1 within the tolerance, on a dataset large enough for the floors to
  // pass its size: refused naming the sum and the count.
  auto large = std::make_shared<CountingDataset>(4000000);
  try {
    RandomSplit(large, Fractions{{0.5, 0.5 + 5e-7}}, 5);
    ADD_FAILURE() << "floors above the size were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("their parts of the dataset's 4000000 examples add up to "
                                         "4000001"),
              std::string::npos)
        << e.what();
  }
}

TEST(DeviceDatasetTest, GatherOnCpu) {
  nn::Tensor images = nn::arange(10 * 2, {.dtype = nn::kFloat32}).reshape({10, 2});
  TensorDataset dataset(images, nn::arange(10, {.dtype = nn::kInt64}));
  DeviceDataset on_device(dataset, nn::Device::CPU());
  Batch b = on_device.gather({7, 2, 3, 4, 0});
  EXPECT_EQ(b.target.to_vector<int64_t>(), (std::vector<int64_t>{7, 2, 3, 4, 0}));
  EXPECT_EQ(b.data.to_vector<float>(), (std::vector<float>{14, 15, 4, 5, 6, 7, 8, 9, 0, 1}));
  EXPECT_THROW(on_device.gather({10}), Error);
}

TEST(DeviceDatasetTest, GatherMatchesCollateAndNamesABadIndex) {
  nn::Tensor images = nn::arange(30 * 2 * 3, {.dtype = nn::kFloat32}).reshape({30, 2, 3});
  TensorDataset dataset(images, nn::arange(30, {.dtype = nn::kInt64}));
  DeviceDataset on_device(dataset, nn::Device::CPU());
  const std::vector<int64_t> indices = {29, 3, 3, 17, 0, 4, 5, 6, 12};
  std::vector<Example> examples;
  for (int64_t i : indices) examples.push_back(dataset.get(i));
  const Batch expected = Collate(examples, indices);
  const Batch b = on_device.gather(indices);
  EXPECT_EQ(b.data.shape(), expected.data.shape());
  EXPECT_EQ(b.data.to_vector<float>(), expected.data.to_vector<float>());
  EXPECT_EQ(b.target.to_vector<int64_t>(), expected.target.to_vector<int64_t>());
  EXPECT_EQ(b.indices, indices);
  try {
    on_device.gather({1, 2, -3});
    ADD_FAILURE() << "no error for index -3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("index -3 (position 2)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(on_device.gather({}), Error);
  EXPECT_THROW(IndexSelectRows(images, {30}), Error);
}

}  // namespace
}  // namespace tandem::data
