#include "nn/tensor.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "nn/random.h"
#include "tests/test_util.h"

namespace tandem::nn {
using ::tandem::testing::ErrorOf;
namespace {

TEST(TensorTest, FactoriesShapeAndValues) {
  Tensor z = zeros({2, 3});
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.dtype(), kFloat32);
  EXPECT_EQ(z.device(), Device::CPU());
  EXPECT_EQ(z.to_vector<float>(), std::vector<float>(6, 0.f));
  EXPECT_EQ(full({2}, 2.5, {.dtype = kFloat64}).to_vector<double>(), (std::vector<double>{2.5, 2.5}));
  EXPECT_EQ(arange(4).to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(arange(4).dtype(), kInt64);
  EXPECT_DOUBLE_EQ(scalar_tensor(3.0).item(), 3.0);
}

TEST(TensorTest, FromVectorRejectsWrongCount) {
  EXPECT_THROW(from_vector(std::vector<float>{1, 2, 3}, {2, 2}), Error);
}

TEST(TensorTest, ReshapeAndSliceShareStorage) {
  Tensor t = from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {3, 2});
  Tensor r = t.reshape({2, -1});
  EXPECT_EQ(r.shape(), (Shape{2, 3}));
  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.to_vector<float>(), (std::vector<float>{2, 3, 4, 5}));
  s.fill_(7);
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, 1, 7, 7, 7, 7}));
  EXPECT_EQ(t[0].to_vector<float>(), (std::vector<float>{0, 1}));
  EXPECT_EQ(t.flatten().shape(), (Shape{6}));
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_THROW(t.slice(2, 4), Error);
}

TEST(TensorTest, DTypeConversionRoundTrips) {
  Tensor f = from_vector(std::vector<float>{1.5f, -2.25f, 3.0f, 1.0f / 3.0f}, {4});
  EXPECT_EQ(f.to(kFloat64).to_vector<double>()[1], -2.25);
  EXPECT_EQ(f.to(kInt64).to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 3, 0}));
  Tensor b = f.to(kBFloat16);
  EXPECT_EQ(b.dtype(), kBFloat16);
  std::vector<float> back = b.to(kFloat32).to_vector<float>();
  EXPECT_EQ(back[0], 1.5f);   // exactly representable
  EXPECT_EQ(back[1], -2.25f);
  EXPECT_NEAR(back[3], 1.0f / 3.0f, 1.0f / 256);  // 8 bits of mantissa
  EXPECT_EQ(from_vector(std::vector<uint8_t>{0, 255}, {2}).to(kFloat32).to_vector<float>(),
            (std::vector<float>{0.f, 255.f}));
}

TEST(TensorTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(BFloat16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even -> 1.
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
}

TEST(TensorTest, RandomIsSeededAndCounterBased) {
  manual_seed(42);
  Tensor a = randn({1000});
  manual_seed(42);
  Tensor b = randn({600});
  Tensor c = randn({400});
  std::vector<float> va = a.to_vector<float>(), vb = b.to_vector<float>(), vc = c.to_vector<float>();
  vb.insert(vb.end(), vc.begin(), vc.end());
  EXPECT_EQ(va, vb);  // one draw of 1000 == two draws of 600 + 400
  double mean = 0, var = 0;
  for (float v : va) mean += v;
  mean /= va.size();
  for (float v : va) var += (v - mean) * (v - mean);
  var /= va.size();
  EXPECT_NEAR(mean, 0.0, 0.1);
  EXPECT_NEAR(var, 1.0, 0.1);
  manual_seed(42, /*stream=*/1);
  EXPECT_NE(randn({1000}).to_vector<float>(), va);  // another rank's stream differs
  for (float u : rand({1000}).to_vector<float>()) {
    EXPECT_GE(u, 0.f);
    EXPECT_LT(u, 1.f);
  }
}

TEST(TensorTest, InPlaceOpsRefuseTensorsThatRequireGrad) {
  Tensor w = ones({2}, {.requires_grad = true});
  EXPECT_THROW(w.fill_(1), Error);
  NoGradGuard no_grad;
  w.mul_(3);
  w.add_(ones({2}), 2.0);
  EXPECT_EQ(w.to_vector<float>(), (std::vector<float>{5, 5}));
}

TEST(TensorTest, ErrorsNameTheValues) {
  try {
    zeros({2, 3}).reshape({4, 2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("(2, 3)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(zeros({2}).item(), Error);
  EXPECT_THROW(zeros({-1}), Error);
}

TEST(DeviceTest, ParseAndCount) {
  EXPECT_EQ(*ParseDevice("cpu"), Device::CPU());
  EXPECT_EQ(*ParseDevice("cuda:3"), Device::CUDA(3));
  EXPECT_FALSE(ParseDevice("gpu").ok());
  EXPECT_FALSE(ParseDevice("cuda:-1").ok());
  EXPECT_GE(cuda_device_count(), 0);  // no driver means 0, not a failure
  EXPECT_EQ(current_device(), Device::CPU());
}

// Runs `f` and returns the message of the tandem::Error it throws ("" if none).
TEST(PinnedTest, PinnedOnACudaDeviceIsAnErrorNamingTheDevice) {
  const std::string message =
      ErrorOf([] { empty({2}, {.device = Device::CUDA(0), .pinned = true}); });
  EXPECT_NE(message.find("pinned"), std::string::npos) << message;
  EXPECT_NE(message.find("cuda:0"), std::string::npos) << message;
  EXPECT_NE(ErrorOf([] { zeros({2}, {.device = Device::CUDA(3), .pinned = true}); }).find("cuda:3"),
            std::string::npos);
}

TEST(PinnedTest, OrdinaryTensorsAreNotPinned) {
  EXPECT_FALSE(zeros({3}).is_pinned());
  EXPECT_FALSE(zeros({3}).slice(1, 2).is_pinned());
  EXPECT_FALSE(zeros({0}).is_pinned());
  EXPECT_NE(ErrorOf([] { Tensor().is_pinned(); }).find("undefined"), std::string::npos);
  EXPECT_NE(ErrorOf([] { Tensor().pin_memory(); }).find("undefined"), std::string::npos);
}

// On a machine with no usable GPU pinned memory is refused with the documented
// message; with one, the same calls give pinned tensors with the right values.
TEST(PinnedTest, PinnedNeedsCudaAndAVisibleGpu) {
  const char* kNeeds = "pinned memory needs tandem built with CUDA and a visible GPU";
  if (cuda_device_count() == 0) {
    EXPECT_NE(ErrorOf([] { empty({4}, {.device = Device::CPU(), .pinned = true}); }).find(kNeeds),
              std::string::npos);
    EXPECT_NE(ErrorOf([] { full({2}, 1.0, {.device = Device::CPU(), .pinned = true}); }).find(kNeeds),
              std::string::npos);
    EXPECT_NE(ErrorOf([] { arange(5).pin_memory(); }).find(kNeeds), std::string::npos);
  } else {
    Tensor t = full({2}, 1.5, {.device = Device::CPU(), .pinned = true});
    EXPECT_TRUE(t.is_pinned());
    EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1.5f, 1.5f}));
    Tensor p = arange(5).pin_memory();
    EXPECT_TRUE(p.is_pinned());
    EXPECT_TRUE(p.pin_memory().is_same(p));
    EXPECT_EQ(p.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  }
}

TEST(SynchronizeTest, CpuIsANoOpAndAMissingGpuIsAnError) {
  EXPECT_NO_THROW(Synchronize(Device::CPU()));
  const int gpus = cuda_device_count();
  const Device missing = Device::CUDA(gpus);  // one past the last visible device
  const std::string message = ErrorOf([&] { Synchronize(missing); });
  EXPECT_NE(message.find("Synchronize"), std::string::npos) << message;
  EXPECT_NE(message.find(missing.ToString()), std::string::npos) << message;
}

}  // namespace
}  // namespace tandem::nn
