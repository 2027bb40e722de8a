#include "nn/ops/matmul.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "nn/ops/elementwise.h"
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

// Direct triple loop: c (m, n) = a (m, k) b (k, n).
std::vector<double> NaiveMatmul(const std::vector<double>& a, const std::vector<double>& b,
                                int64_t m, int64_t k, int64_t n) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += a[i * k + p] * b[p * n + j];
      c[i * n + j] = s;
    }
  }
  return c;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

TEST(MatmulTest, MatchesNaiveLoop) {
  manual_seed(3);
  for (DType dtype : {kFloat32, kFloat64}) {
    Tensor a = randn({5, 7}, {.dtype = dtype});
    Tensor b = randn({7, 3}, {.dtype = dtype});
    const double tol = dtype == kFloat32 ? 1e-5 : 1e-12;
    ExpectNear(matmul(a, b).to_vector<double>(),
               NaiveMatmul(a.to_vector<double>(), b.to_vector<double>(), 5, 7, 3), tol);
  }
}

TEST(MatmulTest, LinearAndLinearReluMatchNaiveLoop) {
  manual_seed(4);
  Tensor x = randn({4, 6}, {.dtype = kFloat64});
  Tensor w = randn({5, 6}, {.dtype = kFloat64});
  Tensor b = randn({5}, {.dtype = kFloat64});
  const auto xv = x.to_vector<double>(), wv = w.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> want(20), want_relu(20);
  for (int i = 0; i < 4; ++i) {
    for (int o = 0; o < 5; ++o) {
      double s = bv[o];
      for (int p = 0; p < 6; ++p) s += xv[i * 6 + p] * wv[o * 6 + p];
      want[i * 5 + o] = s;
      want_relu[i * 5 + o] = s > 0 ? s : 0;
    }
  }
  ExpectNear(linear(x, w, b).to_vector<double>(), want, 1e-12);
  ExpectNear(linear_relu(x, w, b).to_vector<double>(), want_relu, 1e-12);
  // Without bias.
  Tensor y = linear(x, w);
  for (int i = 0; i < 4; ++i) {
    for (int o = 0; o < 5; ++o) {
      EXPECT_NEAR(y.to_vector<double>()[i * 5 + o], want[i * 5 + o] - bv[o], 1e-12);
    }
  }
}

TEST(MatmulTest, EmptyInnerDimensionGivesZerosPlusBias) {
  Tensor a = zeros({3, 0});
  Tensor b = zeros({0, 2});
  EXPECT_EQ(matmul(a, b).to_vector<float>(), std::vector<float>(6, 0.0f));
  Tensor bias = from_vector(std::vector<float>{1.5f, -2.0f}, {2});
  EXPECT_EQ(linear_relu(a, zeros({2, 0}), bias).to_vector<float>(),
            (std::vector<float>{1.5f, 0, 1.5f, 0, 1.5f, 0}));
}

TEST(MatmulTest, ShapeErrorsNameOpAndShapes) {
  try {
    matmul(zeros({2, 3}), zeros({4, 5}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("matmul"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 5)"), std::string::npos) << m;
  }
  try {
    linear(zeros({2, 3}), zeros({4, 5}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("linear"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 5)"), std::string::npos) << m;
  }
  try {
    linear(zeros({2, 3}), zeros({4, 3}), zeros({3}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("bias"), std::string::npos) << m;
    EXPECT_NE(m.find("(3)"), std::string::npos) << m;
  }
  EXPECT_THROW(matmul(zeros({2, 3, 1}), zeros({3, 1})), Error);
  EXPECT_THROW(matmul(zeros({2, 3}), zeros({3, 1}, {.dtype = kFloat64})), Error);
  EXPECT_THROW(matmul(zeros({2, 3}, {.dtype = kInt64}), zeros({3, 1}, {.dtype = kInt64})), Error);
}

TEST(MatmulGradTest, Matmul) {
  manual_seed(5);
  EXPECT_TRUE(GradCheck([](const auto& in) { return matmul(in[0], in[1]); },
                        {RandomInput({3, 4}), RandomInput({4, 5})}));
  // Only one side requiring grad.
  EXPECT_TRUE(GradCheck([](const auto& in) { return matmul(in[0], in[1]); },
                        {RandomInput({2, 3}, 1.0, false), RandomInput({3, 2})}));
}

TEST(MatmulGradTest, LinearWithAndWithoutBias) {
  manual_seed(6);
  EXPECT_TRUE(GradCheck([](const auto& in) { return linear(in[0], in[1], in[2]); },
                        {RandomInput({4, 3}), RandomInput({5, 3}), RandomInput({5})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return linear(in[0], in[1]); },
                        {RandomInput({4, 3}), RandomInput({2, 3})}));
}

TEST(MatmulGradTest, LinearReluAwayFromTheKink) {
  // Pre-activations are bounded away from 0 by construction: x is one-hot rows, so
  // x W^T + b picks single weights; weights and bias are kept at |value| >= 0.2
  // with margins, so +-eps never flips the relu.
  Tensor x = from_vector(std::vector<double>{1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0}, {4, 3},
                         {.requires_grad = true});
  Tensor w = from_vector(std::vector<double>{0.9, -0.8, 0.7, -0.6, 0.5, 1.1}, {2, 3},
                         {.requires_grad = true});
  Tensor b = from_vector(std::vector<double>{0.3, -0.2}, {2}, {.requires_grad = true});
  // Pre-activations: rows pick w[:, j] + b, all at least 0.1 from 0.
  Tensor pre = linear(x.detach(), w.detach(), b.detach());
  for (double v : pre.to_vector<double>()) ASSERT_GT(std::abs(v), 0.09) << v;
  EXPECT_TRUE(GradCheck([](const auto& in) { return linear_relu(in[0], in[1], in[2]); },
                        {x, w, b}));
  // Matches relu(linear(...)) on random data (values, and gradients at once).
  manual_seed(7);
  Tensor xr = RandomInput({6, 4}), wr = RandomInput({3, 4}), br = RandomInput({3});
  linear_relu(xr, wr, br).backward(ones({6, 3}, {.dtype = kFloat64}));
  const auto gx = xr.grad().to_vector<double>(), gw = wr.grad().to_vector<double>();
  const auto gb = br.grad().to_vector<double>();
  xr.set_grad(Tensor());
  wr.set_grad(Tensor());
  br.set_grad(Tensor());
  relu(linear(xr, wr, br)).backward(ones({6, 3}, {.dtype = kFloat64}));
  ExpectNear(gx, xr.grad().to_vector<double>(), 1e-12);
  ExpectNear(gw, wr.grad().to_vector<double>(), 1e-12);
  ExpectNear(gb, br.grad().to_vector<double>(), 1e-12);
}

// OpenBLAS called from several threads at once (one per rank on a CPU run) must
// give the same results as one thread alone.
TEST(BlasThreadsTest, ConcurrentSgemmMatchesSingleThread) {
  constexpr int kThreads = 4;
  constexpr int64_t kM = 96, kK = 80, kN = 112;
  std::vector<std::vector<float>> a(kThreads), b(kThreads), want(kThreads), got(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    a[t].resize(kM * kK);
    b[t].resize(kK * kN);
    for (size_t i = 0; i < a[t].size(); ++i) a[t][i] = static_cast<float>((i * 31 + t * 7) % 17) / 8.0f - 1.0f;
    for (size_t i = 0; i < b[t].size(); ++i) b[t][i] = static_cast<float>((i * 13 + t * 5) % 19) / 9.0f - 1.0f;
    want[t].assign(kM * kN, 0.0f);
    ops::internal::GemmRaw<float>(false, false, kM, kN, kK, 1.0f, a[t].data(), kK, b[t].data(), kN,
                                  0.0f, want[t].data(), kN);
  }
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      got[t].assign(kM * kN, -1.0f);
      threads.emplace_back([&, t] {
        ops::internal::GemmRaw<float>(false, false, kM, kN, kK, 1.0f, a[t].data(), kK,
                                      b[t].data(), kN, 0.0f, got[t].data(), kN);
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) ASSERT_EQ(got[t], want[t]) << "thread " << t << " rep " << rep;
  }
  // Results are right, not only repeatable.
  std::vector<double> ad(a[0].begin(), a[0].end()), bd(b[0].begin(), b[0].end());
  const auto exact = NaiveMatmul(ad, bd, kM, kK, kN);
  for (size_t i = 0; i < exact.size(); ++i) ASSERT_NEAR(want[0][i], exact[i], 1e-4) << i;
}

}  // namespace
}  // namespace tandem::nn
