#include "nn/ops/dropout.h"

#include <gtest/gtest.h>

#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

// The documented mask: element i keeps iff uniform(counter offset + i) >= p.
std::vector<bool> ExpectedMask(uint64_t seed, uint64_t offset, int64_t n, double p) {
  std::vector<bool> keep(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Philox4x32 r = PhiloxAt(seed, 0, offset, static_cast<uint64_t>(i));
    keep[i] = UniformFromBits(r.out[0]) >= static_cast<float>(p);
  }
  return keep;
}

TEST(DropoutTest, TrainingZeroesAndScalesByTheDocumentedMask) {
  const int64_t n = 4000;
  const double p = 0.3;
  manual_seed(7);
  Tensor x = arange(1.0, static_cast<double>(n) + 1.0, 1.0, {.dtype = kFloat64});
  const uint64_t offset = thread_generator().offset;
  const std::vector<double> y = dropout(x, p, /*training=*/true).to_vector<double>();
  EXPECT_EQ(thread_generator().offset, offset + n);  // the draw reserved numel counters
  const std::vector<bool> keep = ExpectedMask(7, offset, n, p);
  int64_t dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double expected = keep[i] ? static_cast<double>(i + 1) / (1.0 - p) : 0.0;
    ASSERT_DOUBLE_EQ(y[i], expected) << i;
    dropped += keep[i] ? 0 : 1;
  }
  // 4000 Bernoulli(0.3) draws: the standard deviation of the fraction is ~0.007.
  EXPECT_NEAR(static_cast<double>(dropped) / n, p, 0.04);
}

TEST(DropoutTest, EvalAndZeroPLeaveXUnchanged) {
  manual_seed(8);
  Tensor x = randn({3, 5});
  const uint64_t offset = thread_generator().offset;
  EXPECT_TRUE(dropout(x, 0.5, /*training=*/false).is_same(x));
  EXPECT_TRUE(dropout(x, 0.0, /*training=*/true).is_same(x));
  EXPECT_EQ(thread_generator().offset, offset);  // nothing drawn
}

TEST(DropoutTest, SuccessiveCallsDrawNewMasksAndSeedsRepeat) {
  Tensor x = ones({256});
  manual_seed(9);
  const std::vector<float> a = dropout(x, 0.5, true).to_vector<float>();
  const std::vector<float> b = dropout(x, 0.5, true).to_vector<float>();
  manual_seed(9);
  const std::vector<float> c = dropout(x, 0.5, true).to_vector<float>();
  EXPECT_NE(a, b);
  EXPECT_EQ(a, c);
}

TEST(DropoutTest, RejectsBadP) {
  try {
    dropout(ones({2}), 1.0, true);
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("dropout"), std::string::npos) << m;
    EXPECT_NE(m.find("1"), std::string::npos) << m;
  }
  EXPECT_THROW(dropout(ones({2}), -0.1, true), Error);
}

TEST(DropoutGradTest, GradientIsMaskOverKeepTimesUpstream) {
  const double p = 0.4;
  // Reseeding inside f gives every evaluation the same mask.
  auto f = [p](const std::vector<Tensor>& in) {
    manual_seed(13);
    return dropout(in[0], p, true);
  };
  manual_seed(14);
  EXPECT_TRUE(GradCheck(f, {RandomInput({4, 6})}));

  manual_seed(15);
  Tensor x = RandomInput({50});
  Tensor upstream = randn({50}, {.dtype = kFloat64});
  manual_seed(13);
  const uint64_t offset = thread_generator().offset;
  dropout(x, p, true).backward(upstream);
  const std::vector<bool> keep = ExpectedMask(13, offset, 50, p);
  const std::vector<double> g = x.grad().to_vector<double>();
  const std::vector<double> u = upstream.to_vector<double>();
  for (int64_t i = 0; i < 50; ++i) {
    EXPECT_DOUBLE_EQ(g[i], keep[i] ? u[i] / (1.0 - p) : 0.0) << i;
  }
}

}  // namespace
}  // namespace tandem::nn
