// adaptive_avg_pool2d and the AdaptiveAvgPool2d module: the global average
// (1, 1), general output sizes against a naive loop and against PyTorch's values,
// float64 gradient checks, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

// PyTorch's definition, written with floating floor / ceil: output o of `out`
// reads inputs [floor(o in / out), ceil((o + 1) in / out)).
std::vector<double> NaiveAdaptiveAvg(const Tensor& x, int64_t oh, int64_t ow) {
  const auto v = x.to_vector<double>();
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  std::vector<double> y;
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t oy = 0; oy < oh; ++oy) {
      const auto y0 = static_cast<int64_t>(std::floor(static_cast<double>(oy * h) / oh));
      const auto y1 = static_cast<int64_t>(std::ceil(static_cast<double>((oy + 1) * h) / oh));
      for (int64_t ox = 0; ox < ow; ++ox) {
        const auto x0 = static_cast<int64_t>(std::floor(static_cast<double>(ox * w) / ow));
        const auto x1 = static_cast<int64_t>(std::ceil(static_cast<double>((ox + 1) * w) / ow));
        double sum = 0;
        for (int64_t iy = y0; iy < y1; ++iy) {
          for (int64_t ix = x0; ix < x1; ++ix) sum += v[(p * h + iy) * w + ix];
        }
        y.push_back(sum / static_cast<double>((y1 - y0) * (x1 - x0)));
      }
    }
  }
  return y;
}

void ExpectNear(const std::vector<double>& got, const std::vector<double>& want, double tol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
  }
}

TEST(AdaptivePoolTest, OneByOneIsThePlaneMean) {
  manual_seed(61);
  Tensor x = randn({3, 5, 4, 7}, {.dtype = kFloat64});
  Tensor y = adaptive_avg_pool2d(x, {1, 1});
  EXPECT_EQ(y.shape(), (Shape{3, 5, 1, 1}));
  const auto v = x.to_vector<double>(), got = y.to_vector<double>();
  for (int64_t p = 0; p < 15; ++p) {
    double sum = 0;
    for (int64_t i = 0; i < 28; ++i) sum += v[p * 28 + i];
    EXPECT_NEAR(got[p], sum / 28, 1e-14) << "plane " << p;
  }
  // A 1x1 plane (MobileNetV2's last feature map at 32x32 input) passes through.
  Tensor one = randn({2, 8, 1, 1}, {.dtype = kFloat64});
  EXPECT_EQ(adaptive_avg_pool2d(one, {1, 1}).to_vector<double>(), one.to_vector<double>());
  // The module, float32 and bfloat16.
  AdaptiveAvgPool2d pool({1, 1});
  for (DType dtype : {kFloat32, kBFloat16}) {
    Tensor xd = x.to(dtype);
    Tensor yd = pool(xd);
    EXPECT_EQ(yd.dtype(), dtype);
    EXPECT_EQ(yd.shape(), (Shape{3, 5, 1, 1}));
    ExpectNear(yd.to_vector<double>(), NaiveAdaptiveAvg(xd, 1, 1),
               dtype == kFloat32 ? 1e-6 : 1e-2, DTypeName(dtype));
  }
}

TEST(AdaptivePoolTest, GeneralSizesMatchNaiveLoop) {
  manual_seed(62);
  struct Case {
    Shape x;
    int64_t oh, ow;
  };
  const std::vector<Case> cases = {
      {{2, 3, 7, 5}, 3, 2},   // uneven windows
      {{1, 2, 6, 6}, 4, 4},   // overlapping windows
      {{2, 2, 5, 5}, 5, 5},   // identity
      {{1, 3, 3, 4}, 5, 6},   // more outputs than inputs
      {{2, 1, 9, 1}, 2, 1},   // one column
  };
  for (const Case& c : cases) {
    Tensor x = randn(c.x, {.dtype = kFloat64});
    const std::string what = ShapeToString(c.x) + " -> " + std::to_string(c.oh) + "x" +
                             std::to_string(c.ow);
    Tensor y = adaptive_avg_pool2d(x, {c.oh, c.ow});
    EXPECT_EQ(y.shape(), (Shape{c.x[0], c.x[1], c.oh, c.ow})) << what;
    ExpectNear(y.to_vector<double>(), NaiveAdaptiveAvg(x, c.oh, c.ow), 1e-14, what);
  }
  // Divisible sizes are avg_pool2d with kernel = stride = H / OH.
  Tensor x = randn({2, 3, 8, 6}, {.dtype = kFloat64});
  ExpectNear(adaptive_avg_pool2d(x, {2, 3}).to_vector<double>(),
             avg_pool2d(x, {.kernel = {4, 2}}).to_vector<double>(), 1e-14, "divisible");
}

// Values PyTorch 1.13 gives (Debian python3-torch), from
//   /usr/bin/python3 -c "import torch, torch.nn.functional as F;
//     x = torch.arange(35, dtype=torch.float64).reshape(1,1,7,5); x = x*x/10;
//     print(F.adaptive_avg_pool2d(x,(3,2)).flatten().tolist());
//     x = torch.arange(12, dtype=torch.float64).reshape(1,1,3,4);
//     print(F.adaptive_avg_pool2d(x,(5,6)).flatten().tolist())"
TEST(AdaptivePoolTest, MatchesPyTorchValues) {
  std::vector<double> sq(35);
  for (int i = 0; i < 35; ++i) sq[i] = static_cast<double>(i * i) / 10;
  Tensor x = from_vector(sq, {1, 1, 7, 5}, {.dtype = kFloat64});
  ExpectNear(adaptive_avg_pool2d(x, {3, 2}).to_vector<double>(),
             {5.333333333333333, 8.133333333333335, 27.333333333333332, 34.13333333333333,
              69.33333333333333, 80.13333333333334},
             1e-14, "7x5 -> 3x2");
  Tensor small = arange(12, {.dtype = kFloat64}).reshape({1, 1, 3, 4});
  ExpectNear(adaptive_avg_pool2d(small, {5, 6}).to_vector<double>(),
             {0.0, 0.5, 1.0, 2.0, 2.5, 3.0, 2.0, 2.5, 3.0, 4.0, 4.5, 5.0, 4.0, 4.5, 5.0,
              6.0, 6.5, 7.0, 6.0, 6.5, 7.0, 8.0, 8.5, 9.0, 8.0, 8.5, 9.0, 10.0, 10.5, 11.0},
             1e-14, "3x4 -> 5x6");
}

TEST(AdaptivePoolGradTest, OneByOneAndGeneralSizes) {
  manual_seed(63);
  EXPECT_TRUE(GradCheck([](const auto& in) { return adaptive_avg_pool2d(in[0], {1, 1}); },
                        {RandomInput({2, 3, 4, 5})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return adaptive_avg_pool2d(in[0], {1, 1}); },
                        {RandomInput({2, 3, 1, 1})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return adaptive_avg_pool2d(in[0], {3, 2}); },
                        {RandomInput({2, 2, 7, 5})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return adaptive_avg_pool2d(in[0], {4, 4}); },
                        {RandomInput({1, 2, 6, 6})}));
  EXPECT_TRUE(GradCheck([](const auto& in) { return adaptive_avg_pool2d(in[0], {5, 6}); },
                        {RandomInput({1, 2, 3, 4})}));
}

TEST(AdaptivePoolTest, ErrorsNameTheValues) {
  try {
    adaptive_avg_pool2d(zeros({1, 2, 4, 4}), {0, 1});
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("adaptive_avg_pool2d"), std::string::npos) << m;
    EXPECT_NE(m.find("(0, 1)"), std::string::npos) << m;
  }
  EXPECT_THROW(adaptive_avg_pool2d(zeros({2, 4, 4}), {1, 1}), Error);
  EXPECT_THROW(adaptive_avg_pool2d(zeros({1, 2, 0, 4}), {1, 1}), Error);
  EXPECT_THROW(adaptive_avg_pool2d(zeros({1, 2, 4, 4}, {.dtype = kInt64}), {1, 1}), Error);
  EXPECT_THROW(AdaptiveAvgPool2d({1, -1}), Error);
}

}  // namespace
}  // namespace tandem::nn
