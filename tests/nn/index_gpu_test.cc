// CPU/CUDA parity of index_select: values for every dtype and for row sizes
// and base addresses that pick each word width of the kernel (16, 8, 4, 2, 1
// bytes), and the index_add gradient (with repeated indices). Skips (with the
// reason) where no GPU is visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "nn/device.h"
#include "nn/ops/index.h"
#include "nn/random.h"
#include "nn/tensor.h"
#include "tests/gpu_test_util.h"

namespace tandem::nn {
namespace {

class IndexGpuTest : public tandem::testing::GpuTest {};

const Device kGpu = Device::CUDA(0);

Tensor Indices(const std::vector<int64_t>& values, Device device) {
  return from_vector<int64_t>(values, {static_cast<int64_t>(values.size())},
                              {.dtype = kInt64, .device = device});
}

// Pseudo-random indices in [0, n) with repeats.
std::vector<int64_t> Scrambled(int64_t count, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t b = 0; b < count; ++b) out.push_back((b * 7919 + 13) % n);
  return out;
}

// The same gather on the CPU and on the GPU must give the same bytes.
void ExpectSameGather(const Tensor& cpu_source, const std::vector<int64_t>& idx,
                      const std::string& what) {
  Tensor a = index_select(cpu_source, Indices(idx, Device::CPU()));
  Tensor b = index_select(cpu_source.to(kGpu), Indices(idx, kGpu));
  EXPECT_TRUE(b.is_cuda()) << what;
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  Tensor back = b.to(Device::CPU());
  ASSERT_EQ(0, std::memcmp(a.data_ptr(), back.data_ptr(), static_cast<size_t>(a.nbytes()))) << what;
}

TEST_F(IndexGpuTest, EveryDtypeMatchesTheCpu) {
  manual_seed(1);
  const std::vector<int64_t> idx = Scrambled(300, 97);
  Tensor f32 = randn({97, 3, 5});
  ExpectSameGather(f32, idx, "float32");
  ExpectSameGather(f32.to(kFloat64), idx, "float64");
  ExpectSameGather(f32.to(kBFloat16), idx, "bfloat16");
  ExpectSameGather(arange(97 * 6, {.dtype = kInt64}).reshape({97, 6}), idx, "int64");
  ExpectSameGather(arange(97 * 7, {.dtype = kFloat32}).reshape({97, 7}).to(kUInt8), idx, "uint8");
}

TEST_F(IndexGpuTest, EveryWordWidthAndMisalignedViews) {
  manual_seed(2);
  // uint8 rows of 32, 24, 12, 6, 5 and 1 bytes pick the 16-, 8-, 4-, 2- and
  // 1-byte words; views starting 1 or 3 rows in move the base address by as
  // many rows (e.g. 5 or 15 bytes), which narrows the word again.
  for (int64_t row : {32, 24, 12, 6, 5, 1}) {
    Tensor source = arange(50 * row, {.dtype = kFloat32}).reshape({50, row}).to(kUInt8);
    ExpectSameGather(source, Scrambled(123, 50), "uint8 row " + std::to_string(row));
    ExpectSameGather(source.slice(1, 50), Scrambled(77, 49), "uint8 view row " + std::to_string(row));
    ExpectSameGather(source.slice(3, 50), Scrambled(77, 47), "uint8 view+3 row " + std::to_string(row));
  }
  Tensor wide = randn({40, 1000});
  ExpectSameGather(wide, Scrambled(500, 40), "float32 wide rows");
  ExpectSameGather(wide.slice(1, 40), Scrambled(64, 39), "float32 view of wide rows");
  ExpectSameGather(randn({40}), Scrambled(10, 40), "one element per row");
}

TEST_F(IndexGpuTest, EmptyIndicesAndEmptyRows) {
  Tensor out = index_select(randn({4, 3}, {.device = kGpu}), Indices({}, kGpu));
  EXPECT_EQ(out.shape(), (Shape{0, 3}));
  EXPECT_EQ(index_select(zeros({4, 0}, {.device = kGpu}), Indices({1, 3}, kGpu)).shape(),
            (Shape{2, 0}));
}

TEST_F(IndexGpuTest, GradientMatchesTheCpu) {
  manual_seed(3);
  const std::vector<int64_t> idx = Scrambled(257, 31);  // many repeats
  for (DType dtype : {kFloat64, kFloat32}) {
    Tensor source = randn({31, 4, 3}).to(dtype);
    Tensor cpu = source.clone().detach().set_requires_grad(true);
    Tensor gpu = source.to(kGpu).detach().set_requires_grad(true);
    Tensor yc = index_select(cpu, Indices(idx, Device::CPU()));
    Tensor yg = index_select(gpu, Indices(idx, kGpu));
    Tensor upstream = randn(yc.shape()).to(dtype);
    yc.backward(upstream);
    yg.backward(upstream.to(kGpu));
    const std::vector<double> a = cpu.grad().to_vector<double>();
    const std::vector<double> b = gpu.grad().to_vector<double>();
    ASSERT_EQ(a.size(), b.size());
    // atomicAdd order differs from the CPU's in-order sum: close, not equal.
    const double tol = dtype == kFloat64 ? 1e-12 : 1e-5;
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_NEAR(a[i], b[i], tol * (1.0 + std::abs(a[i]))) << DTypeName(dtype) << " element " << i;
    }
  }
}

TEST_F(IndexGpuTest, MixedDevicesAreRejected) {
  EXPECT_THROW(index_select(randn({4, 3}, {.device = kGpu}), Indices({0}, Device::CPU())), Error);
}

}  // namespace
}  // namespace tandem::nn
