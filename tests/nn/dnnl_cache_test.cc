// The per-thread oneDNN primitive caches of the CPU convolutions, poolings and
// bfloat16 GEMMs (nn::set_cpu_primitive_cache_capacity, nn/ops/cpu_settings.h): each
// stays at its capacity over more shapes than that, a shape whose primitives
// were dropped and made again gives the same bits, a capacity of 1 works across
// alternating shapes (a backward runs two primitives, the second lookup dropping
// the first), and bad capacities are errors naming the value. Built only with
// oneDNN; each test runs on a thread of its own, whose caches start empty.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/autograd.h"
#include "nn/error.h"
#include "nn/ops/conv.h"
#include "nn/ops/internal/conv_kernels.h"    // CpuConvPath, Conv2dDnnlCacheSize
#include "nn/ops/internal/matmul_kernels.h"  // GemmBf16DnnlCacheSize
#include "nn/ops/internal/pool_kernels.h"    // CpuPoolPath, Pool2dDnnlCacheSize
#include "nn/ops/cpu_settings.h"
#include "nn/ops/matmul.h"
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"

namespace tandem::nn {
namespace {

using ops::internal::Conv2dDnnlCacheSize;
using ops::internal::CpuConvPath;
using ops::internal::CpuPoolPath;
using ops::internal::GemmBf16DnnlCacheSize;
using ops::internal::Pool2dDnnlCacheSize;

constexpr const char* kVariable = "TANDEM_CPU_PRIMITIVE_CACHE_CAPACITY";

// Puts back the capacity, the conv and pool paths and the thread count.
class RestoreCache {
 public:
  RestoreCache() = default;
  RestoreCache(const RestoreCache&) = delete;
  RestoreCache& operator=(const RestoreCache&) = delete;
  ~RestoreCache() {
    set_cpu_primitive_cache_capacity(capacity_);
    ops::internal::SetCpuPoolPath(CpuPoolPath::kAuto);
  }

 private:
  int64_t capacity_ = cpu_primitive_cache_capacity();
  testing::RestoreCpuConv conv_;
};

// Runs `body` on a new thread (empty caches) and rethrows what it threw.
void OnNewThread(const std::function<void()>& body) {
  std::exception_ptr error;
  std::thread([&] {
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
  }).join();
  if (error) std::rethrow_exception(error);
}

std::vector<uint8_t> Bytes(const Tensor& t) {
  const Tensor c = t.detach().clone();
  const auto* p = static_cast<const uint8_t*>(c.host_ptr());
  return std::vector<uint8_t>(p, p + c.numel() * ElementSize(c.dtype()));
}

using Results = std::vector<std::vector<uint8_t>>;

// y, dx, dweight and dbias of a convolution of batch n, channels c, image hw x
// hw (3x3, padding 1, 8 outputs), forward and backward (conv2d_relu_max_pool2d
// when fused), as bytes.
Results Conv(int64_t n, int64_t c, int64_t hw, DType dtype = kFloat32, bool fused = false) {
  manual_seed(11);
  Tensor x = randn({n, c, hw, hw}).to(dtype).detach();
  Tensor w = randn({8, c, 3, 3}).to(dtype).detach();
  Tensor b = randn({8}).to(dtype).detach();
  for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
  const Conv2dParams p{.padding = {1, 1}};
  const Tensor y = fused ? conv2d_relu_max_pool2d(x, w, b, p, {}) : conv2d(x, w, b, p);
  y.backward(randn(y.shape()).to(dtype));
  return {Bytes(y), Bytes(x.grad()), Bytes(w.grad()), Bytes(b.grad())};
}

// y and dx of max_pool2d (max) or avg_pool2d, 2x2, on (n, 16, hw, hw), as bytes.
Results Pool(int64_t n, int64_t hw, bool max) {
  manual_seed(12);
  Tensor x = randn({n, 16, hw, hw}).detach();
  x.set_requires_grad(true);
  const Tensor y = max ? max_pool2d(x) : avg_pool2d(x);
  y.backward(randn(y.shape()));
  return {Bytes(y), Bytes(x.grad())};
}

// a (m, 24) @ b (24, 16) in bfloat16, as bytes.
Results Gemm(int64_t m) {
  manual_seed(13);
  const Tensor a = randn({m, 24}).to(kBFloat16), b = randn({24, 16}).to(kBFloat16);
  return {Bytes(matmul(a, b))};
}

// Whether bfloat16 GEMMs and convolutions run on oneDNN's primitives here
// (elsewhere on OpenBLAS / im2col, which cache nothing).
bool GemmBf16OnDnnl() { return cpu_bf16_native(); }

// float32, and bfloat16 where its convolutions run on oneDNN.
std::vector<DType> DnnlDTypes() {
  if (cpu_bf16_native()) return {kFloat32, kBFloat16};
  return {kFloat32};
}

TEST(DnnlCacheTest, CapacityIsSetAndBadValuesAreErrorsNamingThem) {
  RestoreCache restore;
  set_cpu_primitive_cache_capacity(3);
  EXPECT_EQ(cpu_primitive_cache_capacity(), 3);
  for (int64_t bad : {int64_t{0}, int64_t{-7}}) {
    try {
      set_cpu_primitive_cache_capacity(bad);
      ADD_FAILURE() << "capacity " << bad << " did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(absl::StrCat("set_cpu_primitive_cache_capacity: ", bad)),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(cpu_primitive_cache_capacity(), 3);  // unchanged by the bad values
}

TEST(DnnlCacheTest, TheEnvironmentVariableIsReadAndBadValuesAreErrorsNamingThem) {
  const char* old = std::getenv(kVariable);
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  unsetenv(kVariable);
  EXPECT_EQ(ops::internal::CpuPrimitiveCacheCapacityFromEnvironment(), 256);  // the default
  setenv(kVariable, "7", 1);
  EXPECT_EQ(ops::internal::CpuPrimitiveCacheCapacityFromEnvironment(), 7);
  for (const char* bad : {"0", "-3", "-0", "abc", "12x", " 5", "5 ", "+5", "1e3", "0x10", "",
                          "99999999999999999999"}) {
    setenv(kVariable, bad, 1);
    try {
      ops::internal::CpuPrimitiveCacheCapacityFromEnvironment();
      ADD_FAILURE() << kVariable << "=\"" << bad << "\" did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(absl::StrCat(kVariable, "=\"", bad, "\"")),
                std::string::npos)
          << e.what();
    }
  }
  if (saved) {
    setenv(kVariable, saved->c_str(), 1);
  } else {
    unsetenv(kVariable);
  }
}

TEST(DnnlCacheTest, EachCacheStaysAtTheCapacityOverMoreShapes) {
  RestoreCache restore;
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "oneDNN convolutions are off";
  constexpr int64_t kCapacity = 5;
  set_cpu_primitive_cache_capacity(kCapacity);
  ops::internal::SetCpuPoolPath(CpuPoolPath::kDnnl);
  OnNewThread([&] {
    // Batch sizes 1..12 (a program's batch tails): 3 primitives each for the
    // convolution, 2 for the pooling, 1 for the GEMM.
    for (int64_t n = 1; n <= 12; ++n) {
      SCOPED_TRACE(absl::StrCat("batch ", n));  // on this thread, where the checks run
      Conv(n, 4, 6);
      EXPECT_LE(Conv2dDnnlCacheSize(), kCapacity);
      Pool(n, 6, /*max=*/false);
      EXPECT_LE(Pool2dDnnlCacheSize(), kCapacity);
      if (GemmBf16OnDnnl()) {
        Gemm(n);
        EXPECT_LE(GemmBf16DnnlCacheSize(), kCapacity);
      }
    }
    EXPECT_EQ(Conv2dDnnlCacheSize(), kCapacity);
    EXPECT_EQ(Pool2dDnnlCacheSize(), kCapacity);
    if (GemmBf16OnDnnl()) EXPECT_EQ(GemmBf16DnnlCacheSize(), kCapacity);
  });
}

TEST(DnnlCacheTest, AShapeMadeAgainAfterItsEvictionGivesTheSameBits) {
  RestoreCache restore;
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "oneDNN convolutions are off";
  set_cpu_blas_threads(2);
  for (CpuConvPath path : {CpuConvPath::kAuto, CpuConvPath::kDnnlBlocked}) {
    ops::internal::SetCpuConvPath(path);
    for (DType dtype : DnnlDTypes()) {
      for (bool fused : {false, true}) {
        OnNewThread([&] {
          SCOPED_TRACE(absl::StrCat("path ", static_cast<int>(path), " ", DTypeName(dtype),
                                    fused ? " fused" : ""));
          set_cpu_primitive_cache_capacity(256);
          const Results first = Conv(2, 20, 9, dtype, fused);
          // Forward and backward of three other shapes, 2 kept: the first
          // shape's primitives are gone.
          set_cpu_primitive_cache_capacity(2);
          for (int64_t hw : {5, 6, 7}) Conv(2, 20, hw, dtype, fused);
          EXPECT_LE(Conv2dDnnlCacheSize(), 2u);
          EXPECT_EQ(Conv(2, 20, 9, dtype, fused), first);
        });
      }
    }
  }
}

TEST(DnnlCacheTest, ACapacityOfOneWorksAcrossAlternatingShapes) {
  RestoreCache restore;
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "oneDNN convolutions are off";
  // A first convolution (one channel: bfloat16's backward weights may run the
  // widened float32 primitives, more lookups inside one backward) and a wider one.
  struct Shape2 {
    int64_t n, c, hw;
  };
  const std::vector<Shape2> shapes = {{2, 1, 12}, {3, 20, 9}};
  // kDnnlBlocked: the blocked layouts, where bfloat16's one-channel backward
  // weights widens to float32.
  for (CpuConvPath path : {CpuConvPath::kAuto, CpuConvPath::kDnnlBlocked}) {
    ops::internal::SetCpuConvPath(path);
    ops::internal::SetCpuPoolPath(CpuPoolPath::kDnnlBlocked);
    for (DType dtype : DnnlDTypes()) {
      for (bool fused : {false, true}) {
        const std::string trace = absl::StrCat("path ", static_cast<int>(path), " ",
                                               DTypeName(dtype), fused ? " fused" : "");
        // The bits of each shape on a thread of its own, then the shapes in
        // turn on another thread keeping 1 primitive: every call a miss.
        std::vector<Results> want;
        Results want_pool[2];
        OnNewThread([&] {
          set_cpu_primitive_cache_capacity(256);
          for (const Shape2& s : shapes) want.push_back(Conv(s.n, s.c, s.hw, dtype, fused));
          want_pool[0] = Pool(2, 8, true);
          want_pool[1] = Pool(3, 6, true);
        });
        set_cpu_primitive_cache_capacity(1);
        OnNewThread([&] {
          SCOPED_TRACE(trace);
          for (int round = 0; round < 2; ++round) {
            for (size_t i = 0; i < shapes.size(); ++i) {
              const Shape2& s = shapes[i];
              EXPECT_EQ(Conv(s.n, s.c, s.hw, dtype, fused), want[i])
                  << "round " << round << " shape " << i;
              EXPECT_EQ(Conv2dDnnlCacheSize(), 1u);
            }
            // Max pooling: backward reads the forward's workspace in its own entry.
            EXPECT_EQ(Pool(2, 8, true), want_pool[0]) << "round " << round;
            EXPECT_EQ(Pool(3, 6, true), want_pool[1]) << "round " << round;
            EXPECT_EQ(Pool2dDnnlCacheSize(), 1u);
          }
        });
      }
    }
  }
  if (!GemmBf16OnDnnl()) return;
  Results want[2];
  OnNewThread([&] {
    set_cpu_primitive_cache_capacity(256);
    want[0] = Gemm(3);
    want[1] = Gemm(5);
  });
  set_cpu_primitive_cache_capacity(1);
  OnNewThread([&] {
    for (int round = 0; round < 3; ++round) {
      EXPECT_EQ(Gemm(3), want[0]) << "round " << round;
      EXPECT_EQ(Gemm(5), want[1]) << "round " << round;
      EXPECT_EQ(GemmBf16DnnlCacheSize(), 1u);
    }
  });
}

}  // namespace
}  // namespace tandem::nn
