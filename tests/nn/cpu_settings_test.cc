// The CPU kernels' process-wide settings (nn/ops/cpu_settings.h), reached
// through their own header: each reads back what was set, and a bad value is an
// error naming it and leaves the setting as it was.
#include "nn/ops/cpu_settings.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "nn/error.h"

namespace tandem::nn {
namespace {

template <typename Setter>
void ExpectErrorNaming(Setter set, const std::string& text) {
  try {
    set();
    FAIL() << "no error; expected one naming " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(CpuSettings, PrimitiveCacheCapacityReadsBackAndRefusesBadValues) {
  const int64_t before = cpu_primitive_cache_capacity();
  set_cpu_primitive_cache_capacity(before + 5);
  EXPECT_EQ(cpu_primitive_cache_capacity(), before + 5);
  ExpectErrorNaming([] { set_cpu_primitive_cache_capacity(0); },
                    "set_cpu_primitive_cache_capacity: 0 primitives");
  ExpectErrorNaming([] { set_cpu_primitive_cache_capacity(-7); },
                    "set_cpu_primitive_cache_capacity: -7 primitives");
  EXPECT_EQ(cpu_primitive_cache_capacity(), before + 5);
  set_cpu_primitive_cache_capacity(before);
}

TEST(CpuSettings, BlasThreadsReadBackAndRefuseBadValues) {
  const int before = cpu_blas_threads();
  set_cpu_blas_threads(1);
  EXPECT_EQ(cpu_blas_threads(), 1);
  ExpectErrorNaming([] { set_cpu_blas_threads(0); }, "set_cpu_blas_threads: 0 threads");
  EXPECT_EQ(cpu_blas_threads(), 1);
  set_cpu_blas_threads(before);
}

}  // namespace
}  // namespace tandem::nn
