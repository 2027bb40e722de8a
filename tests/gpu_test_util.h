// The one "needs a GPU" check of the gpu-labelled tests. A test that cannot run
// here skips with GTEST_SKIP() and says why (how many CUDA devices it needs, how
// many are visible, whether this binary has the CUDA backend at all), so a CPU
// machine or a CPU-only build passes the gpu label with every reason printed.
//
//   class MyGpuTest : public tandem::testing::GpuTest {};  // needs one device
//   TEST(Foo, NeedsTwo) { TANDEM_REQUIRE_GPUS(2); ... }      // inside a test body
#ifndef TANDEM_TESTS_GPU_TEST_UTIL_H_
#define TANDEM_TESTS_GPU_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <string>

#include "nn/device.h"

namespace tandem::testing {

// Why a test that needs `needed` visible CUDA devices cannot run in this
// process, or "" when it can.
inline std::string MissingGpus(int needed) {
  const int visible = nn::cuda_device_count();
  if (visible >= needed) return "";
  return "needs " + std::to_string(needed) + " CUDA device" + (needed == 1 ? "" : "s") + ", " +
         std::to_string(visible) + " visible (this binary " +
         (nn::cuda_built() ? "has" : "was built without") + " the CUDA backend)";
}

}  // namespace tandem::testing

// Skips the calling test (GTEST_SKIP returns from the enclosing function, hence a
// macro) unless `n` CUDA devices are visible. The if/else shape keeps a
// following `else` from binding to it.
#define TANDEM_REQUIRE_GPUS(n)                                                             \
  if (const std::string tandem_missing_gpus = ::tandem::testing::MissingGpus(n);           \
      tandem_missing_gpus.empty()) {                                                       \
  } else                                                                                   \
    GTEST_SKIP() << tandem_missing_gpus

namespace tandem::testing {

// Fixture of the tests that need one CUDA device. A fixture that adds its own
// SetUp calls GpuTest::SetUp() first and returns when IsSkipped().
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override { TANDEM_REQUIRE_GPUS(1); }
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_GPU_TEST_UTIL_H_
