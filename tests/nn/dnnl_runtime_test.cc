// The oneDNN runtime's per-thread scratch buffers (nn/ops/internal/dnnl_runtime.h:
// reuse, nesting, bounds, threads), and that the oneDNN convolutions, which take
// their temporaries from them, give the same bits whatever the buffers held
// before: stale contents are never read, the padding of the blocked layouts
// included. Built only with oneDNN.
#include "nn/ops/internal/dnnl_runtime.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/autograd.h"
#include "nn/error.h"
#include "nn/ops/conv.h"
#include "nn/ops/internal/conv_kernels.h"  // CpuConvPath
#include "nn/ops/matmul.h"                 // set_cpu_blas_threads
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"

namespace tandem::nn {
namespace {

using ops::internal::CpuConvPath;
using ops::internal::DnnlScratch;

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

TEST(DnnlScratchTest, ReusesTheThreadsBuffersFromScopeToScope) {
  void* first = nullptr;
  {
    DnnlScratch scratch;
    EXPECT_EQ(scratch.Get(0), nullptr);
    first = scratch.Get(1000);
    ASSERT_NE(first, nullptr);
    EXPECT_TRUE(Aligned(first));
    std::memset(first, 1, 1000);
  }
  DnnlScratch again;
  EXPECT_EQ(again.Get(1000), first);  // the same buffer, not a new allocation
  EXPECT_EQ(again.Get(0), nullptr);   // 0 bytes take no buffer
}

TEST(DnnlScratchTest, NestedScopesGetOtherBuffersAndGiveThemBack) {
  DnnlScratch outer;
  void* a = outer.Get(4096);
  void* inner_first = nullptr;
  {
    DnnlScratch inner;
    inner_first = inner.Get(4096);
    EXPECT_NE(inner_first, a);
    // Only the innermost scope may hand out buffers.
    try {
      outer.Get(16);
      ADD_FAILURE() << "Get on an outer scope did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("innermost"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(outer.Get(4096), inner_first);  // the inner scope's buffer is free again
}

TEST(DnnlScratchTest, RequestsPastTheBoundsGetBuffersOfTheirOwn) {
  DnnlScratch scratch;
  std::set<void*> seen;
  // kKeptBuffers kept ones, then as many of their own; all distinct and usable.
  for (int i = 0; i < 2 * DnnlScratch::kKeptBuffers; ++i) {
    void* p = scratch.Get(256);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(Aligned(p));
    EXPECT_TRUE(seen.insert(p).second) << "buffer " << i << " handed out twice";
    std::memset(p, i, 256);
  }
  const size_t big = DnnlScratch::kKeptBytes + 1;
  void* p = scratch.Get(big);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(Aligned(p));
  EXPECT_TRUE(seen.insert(p).second);
  std::memset(p, 7, big);
}

TEST(DnnlScratchTest, EachThreadHasItsOwnBuffers) {
  DnnlScratch scratch;
  void* mine = scratch.Get(512);
  void* theirs = nullptr;
  std::thread([&] {
    DnnlScratch other;
    theirs = other.Get(512);
    std::memset(theirs, 3, 512);
  }).join();
  EXPECT_NE(mine, theirs);
}

// Fills every buffer the thread keeps, at the largest kept size, with `byte`.
void FillScratch(uint8_t byte) {
  DnnlScratch scratch;
  for (int i = 0; i < DnnlScratch::kKeptBuffers; ++i) {
    std::memset(scratch.Get(DnnlScratch::kKeptBytes), byte, DnnlScratch::kKeptBytes);
  }
}

std::vector<uint8_t> Bytes(const Tensor& t) {
  const Tensor c = t.detach().clone();
  const auto* p = static_cast<const uint8_t*>(c.host_ptr());
  return std::vector<uint8_t>(p, p + c.numel() * ElementSize(c.dtype()));
}

struct Case {
  Shape x, w;
  Conv2dParams p;
};

// Which of y, dx, dweight, dbias differ in bytes ("" when none).
std::string Differing(const std::vector<std::vector<uint8_t>>& a,
                      const std::vector<std::vector<uint8_t>>& b) {
  const char* names[] = {"y", "dx", "dweight", "dbias"};
  std::string out;
  for (size_t i = 0; i < 4; ++i) {
    if (a[i] != b[i]) absl::StrAppend(&out, out.empty() ? "" : ", ", names[i]);
  }
  return out;
}

// y, dx, dweight and dbias of conv2d (or conv2d_relu_max_pool2d when fused) as bytes.
std::vector<std::vector<uint8_t>> ConvBytes(const Case& c, DType dtype, bool fused) {
  manual_seed(5);
  Tensor x = randn(c.x).to(dtype).detach();
  Tensor w = randn(c.w).to(dtype).detach();
  Tensor b = randn({c.w[0]}).to(dtype).detach();
  for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
  const Tensor y = fused ? conv2d_relu_max_pool2d(x, w, b, c.p, {}) : conv2d(x, w, b, c.p);
  y.backward(randn(y.shape()).to(dtype));
  return {Bytes(y), Bytes(x.grad()), Bytes(w.grad()), Bytes(b.grad())};
}

TEST(DnnlScratchTest, ConvolutionsGiveTheSameBitsOverStaleScratch) {
  testing::RestoreCpuConv restore;
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "oneDNN convolutions are off";
  // Channel counts off the 16-channel block (padded blocked layouts), a first
  // conv, stride and padding, groups.
  const std::vector<Case> cases = {{{2, 4, 8, 8}, {8, 4, 3, 3}, {.padding = {1, 1}}},
                                   {{2, 20, 9, 9}, {20, 20, 3, 3}, {.padding = {1, 1}}},
                                   {{2, 1, 12, 12}, {6, 1, 5, 5}, {}},
                                   {{2, 16, 10, 10}, {32, 16, 3, 3}, {.stride = {2, 2}}},
                                   {{2, 8, 8, 8}, {12, 4, 3, 3}, {.groups = 2}}};
  for (CpuConvPath path : {CpuConvPath::kAuto, CpuConvPath::kDnnl, CpuConvPath::kDnnlBlocked,
                           CpuConvPath::kDnnlNhwc}) {
    ops::internal::SetCpuConvPath(path);
    for (int threads : {1, 2}) {
      set_cpu_blas_threads(threads);
      for (DType dtype : {kFloat32, kBFloat16}) {
        for (bool fused : {false, true}) {
          for (size_t i = 0; i < cases.size(); ++i) {
            SCOPED_TRACE(absl::StrCat("path ", static_cast<int>(path), " threads ", threads,
                                      " ", DTypeName(dtype), fused ? " fused" : "", " case ", i));
            // Zeros, NaN bytes (0xFF) and finite values (0x3F: 0.747 as float32,
            // 0.746 as bfloat16) left in the buffers: a read of stale scratch
            // would change the result between the three.
            FillScratch(0x00);
            const auto first = ConvBytes(cases[i], dtype, fused);
            FillScratch(0xFF);
            EXPECT_EQ(Differing(ConvBytes(cases[i], dtype, fused), first), "")
                << "after NaN bytes in the scratch buffers";
            // Another shape in between, then the same call again.
            ConvBytes(cases[(i + 1) % cases.size()], dtype, fused);
            FillScratch(0x3F);
            EXPECT_EQ(Differing(ConvBytes(cases[i], dtype, fused), first), "")
                << "after another shape and 0x3F bytes in the scratch buffers";
          }
        }
      }
    }
  }
}

// Rank threads running the same shapes at once: each thread's primitives, memory
// objects, reorders and scratch buffers are its own, so every thread gets the
// bits of a thread running alone (several rounds: the later ones on the cached
// entries and kept buffers).
TEST(DnnlScratchTest, ThreadsRunningTheSameShapesAtOnceGiveTheBitsOfOne) {
  testing::RestoreCpuConv restore;
  if (!ops::internal::CpuConvUsesDnnl()) GTEST_SKIP() << "oneDNN convolutions are off";
  const std::vector<Case> cases = {{{2, 20, 9, 9}, {20, 20, 3, 3}, {.padding = {1, 1}}},
                                   {{2, 1, 12, 12}, {6, 1, 5, 5}, {}},
                                   {{2, 16, 10, 10}, {32, 16, 3, 3}, {.stride = {2, 2}}}};
  // Two OpenMP threads per rank thread: the teams of several ranks at once.
  set_cpu_blas_threads(2);
  for (CpuConvPath path : {CpuConvPath::kAuto, CpuConvPath::kDnnlBlocked}) {
    ops::internal::SetCpuConvPath(path);
    for (DType dtype : {kFloat32, kBFloat16}) {
      SCOPED_TRACE(absl::StrCat("path ", static_cast<int>(path), " ", DTypeName(dtype)));
      std::vector<std::vector<std::vector<uint8_t>>> want;
      std::thread([&] {
        for (const Case& c : cases) want.push_back(ConvBytes(c, dtype, /*fused=*/true));
      }).join();
      constexpr int kThreads = 4, kRounds = 3;
      std::vector<std::string> differing(kThreads);
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          for (int round = 0; round < kRounds; ++round) {
            for (size_t i = 0; i < cases.size(); ++i) {
              // (ConvBytes seeds the calling thread's own generator.)
              const std::string d = Differing(ConvBytes(cases[i], dtype, true), want[i]);
              if (!d.empty() && differing[t].empty()) {
                differing[t] = absl::StrCat("round ", round, " case ", i, ": ", d);
              }
            }
          }
        });
      }
      for (std::thread& thread : threads) thread.join();
      for (int t = 0; t < kThreads; ++t) EXPECT_EQ(differing[t], "") << "thread " << t;
    }
  }
}

}  // namespace
}  // namespace tandem::nn
