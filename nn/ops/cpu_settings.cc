// The CPU kernels' process-wide settings (nn/ops/cpu_settings.h).
#include "nn/ops/cpu_settings.h"

#include <cblas.h>

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>

#include "nn/error.h"
#include "nn/ops/internal/matmul_kernels.h"  // CpuPrimitiveCacheCapacityFromEnvironment

namespace tandem::nn {

void set_cpu_blas_threads(int n) {
  TANDEM_CHECK(n >= 1, "set_cpu_blas_threads: ", n, " threads; need at least 1");
  openblas_set_num_threads(n);
}

int cpu_blas_threads() { return openblas_get_num_threads(); }

namespace {

// The default capacity of each per-thread oneDNN primitive cache. Measured
// (float32 convolutions, forward and backward, 3x3 at 16 -> 32 and 128 -> 128
// channels, hundreds of image sizes, oneDNN's own cache off): an entry
// (primitive, memory objects, reorders) keeps ~0.07 MB resident. The apps'
// models use per training step 20 (ResNet-18), 56 (ResNet-50) and 59
// (MobileNetV2) convolution entries (Winograd and the depthwise kernels take
// the rest), twice that with a batch tail of another size; evaluation reuses
// the forward ones. 256 holds twice the largest of those, at most ~18 MB per
// cache and thread. oneDNN's own default, 1024, is one cache per process; ours
// are per thread (a CPU run has a rank thread per core) and per op family:
// 1024 would let a 16-rank run keep ~3.4 GB in its three caches.
constexpr int64_t kDefaultCpuPrimitiveCacheCapacity = 256;
constexpr const char* kCapacityVariable = "TANDEM_CPU_PRIMITIVE_CACHE_CAPACITY";

// 0 until set, or read from the environment on first use.
std::atomic<int64_t> cpu_primitive_cache_capacity_value{0};

}  // namespace

namespace ops::internal {

int64_t CpuPrimitiveCacheCapacityFromEnvironment() {
  const char* text = std::getenv(kCapacityVariable);
  if (text == nullptr) return kDefaultCpuPrimitiveCacheCapacity;
  const std::string_view view(text);
  int64_t n = 0;
  const auto [end, error] = std::from_chars(view.data(), view.data() + view.size(), n);
  TANDEM_CHECK(!view.empty() && error == std::errc() && end == view.data() + view.size() && n >= 1,
               kCapacityVariable, "=\"", text,
               "\": not a whole number >= 1 (oneDNN primitives kept per thread and cache)");
  return n;
}

}  // namespace ops::internal

void set_cpu_primitive_cache_capacity(int64_t n) {
  TANDEM_CHECK(n >= 1, "set_cpu_primitive_cache_capacity: ", n,
               " primitives per thread and cache; need at least 1");
  cpu_primitive_cache_capacity_value.store(n, std::memory_order_relaxed);
}

int64_t cpu_primitive_cache_capacity() {
  const int64_t n = cpu_primitive_cache_capacity_value.load(std::memory_order_relaxed);
  if (n > 0) return n;
  // A set_cpu_primitive_cache_capacity meanwhile wins over the environment.
  int64_t expected = 0;
  const int64_t from_environment = ops::internal::CpuPrimitiveCacheCapacityFromEnvironment();
  cpu_primitive_cache_capacity_value.compare_exchange_strong(expected, from_environment,
                                                             std::memory_order_relaxed);
  return cpu_primitive_cache_capacity_value.load(std::memory_order_relaxed);
}

}  // namespace tandem::nn
