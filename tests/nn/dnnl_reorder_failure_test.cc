// A oneDNN convolution whose reorder fails to be made in the middle of a call
// (an allocation throwing inside oneDNN) throws, and leaves the cached primitive
// as it was: the next call makes the reorder again and gives the bits of a
// primitive that never failed. Replaces the global operator new (to make one
// allocation throw), hence an executable of its own. Built only with oneDNN.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "nn/ops/cpu_settings.h"  // set_cpu_blas_threads
#include "nn/ops/internal/conv_kernels.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"

namespace {
// >= 0: the allocation that brings it to -1 throws std::bad_alloc.
thread_local int fail_countdown = -1;
}  // namespace

void* operator new(size_t bytes) {
  if (fail_countdown >= 0 && fail_countdown-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace tandem::nn {
namespace {

using ops::internal::Conv2dGeometry;
using ops::internal::CpuConvPath;

std::vector<uint8_t> Bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.host_ptr());
  return std::vector<uint8_t>(p, p + t.numel() * ElementSize(t.dtype()));
}

TEST(DnnlReorderFailureTest, AFailedReorderLeavesTheCachedPrimitiveUsable) {
  testing::RestoreCpuConv restore;
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "oneDNN convolutions are off";
  // Channels-last: x (NCHW) is reordered to NHWC inside each call.
  ops::internal::SetCpuConvPath(CpuConvPath::kDnnlNhwc);
  set_cpu_blas_threads(1);
  manual_seed(3);
  const Tensor x = randn({2, 20, 9, 9}), w = randn({20, 20, 3, 3}), b = randn({20});
  const Conv2dGeometry g = ops::internal::Conv2dGeometryOf(x.shape(), w.shape(), {});
  // y made before the call: the call's first allocation is then oneDNN's.
  auto forward_into = [&](const Tensor& y) {
    ops::internal::Conv2dForwardDnnl(x, w, b, g, y, /*relu=*/true);
  };
  auto forward = [&] {
    const Tensor y = empty({g.n, g.o, g.oh, g.ow});
    forward_into(y);
    return Bytes(y);
  };
  // The bits of a thread whose primitive never failed (its own cache).
  std::vector<uint8_t> want;
  std::thread([&] {
    set_cpu_blas_threads(1);
    want = forward();
  }).join();
  // The primitive cached (the fused path's layout query makes it), its reorders
  // not yet: the call's first allocation is in the making of x's reorder.
  ops::internal::Conv2dReluMaxPoolLayoutDnnl(kFloat32, g, /*bias=*/true);
  const Tensor y = empty({g.n, g.o, g.oh, g.ow});
  fail_countdown = 0;
  EXPECT_THROW(forward_into(y), std::bad_alloc);
  ASSERT_EQ(fail_countdown, -1) << "the allocation did not fail";
  // The same call again: the reorder made now, the bits of the other thread.
  EXPECT_EQ(forward(), want);
  EXPECT_EQ(forward(), want);
}

}  // namespace
}  // namespace tandem::nn
