#include "nn/ops/conv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/autograd.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/conv_kernels.h"  // CpuConvPath
#include "nn/ops/matmul.h"  // set_cpu_blas_threads
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"
#include "tests/nn/gradcheck.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

// Direct 7-deep loop, the definition of conv2d.
std::vector<double> NaiveConv2d(const Tensor& x, const Tensor& w, const Tensor& b,
                                const Conv2dParams& p) {
  const auto xv = x.to_vector<double>(), wv = w.to_vector<double>();
  const std::vector<double> bv = b.defined() ? b.to_vector<double>() : std::vector<double>();
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t o = w.size(0), kh = w.size(2), kw = w.size(3);
  const int64_t oh = (h + 2 * p.padding[0] - p.dilation[0] * (kh - 1) - 1) / p.stride[0] + 1;
  const int64_t ow = (wd + 2 * p.padding[1] - p.dilation[1] * (kw - 1) - 1) / p.stride[1] + 1;
  std::vector<double> y;
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t oc = 0; oc < o; ++oc) {
      for (int64_t oy = 0; oy < oh; ++oy) {
        for (int64_t ox = 0; ox < ow; ++ox) {
          double sum = bv.empty() ? 0.0 : bv[oc];
          for (int64_t ci = 0; ci < c; ++ci) {
            for (int64_t i = 0; i < kh; ++i) {
              for (int64_t j = 0; j < kw; ++j) {
                const int64_t iy = oy * p.stride[0] - p.padding[0] + i * p.dilation[0];
                const int64_t ix = ox * p.stride[1] - p.padding[1] + j * p.dilation[1];
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                sum += xv[((s * c + ci) * h + iy) * wd + ix] * wv[((oc * c + ci) * kh + i) * kw + j];
              }
            }
          }
          y.push_back(sum);
        }
      }
    }
  }
  return y;
}

std::vector<Conv2dParams> Variants() {
  return {
      {},                                                   // plain
      {.stride = {2, 2}},                                   // stride
      {.padding = {1, 2}},                                  // asymmetric padding
      {.dilation = {2, 1}},                                 // dilation
      {.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}},  // all at once
  };
}

TEST(ConvTest, MatchesNaiveLoopAcrossStridePaddingDilation) {
  manual_seed(11);
  for (const Conv2dParams& p : Variants()) {
    Tensor x = randn({2, 3, 7, 6}, {.dtype = kFloat64});
    Tensor w = randn({4, 3, 3, 2}, {.dtype = kFloat64});
    Tensor b = randn({4}, {.dtype = kFloat64});
    for (bool with_bias : {true, false}) {
      Tensor y = conv2d(x, w, with_bias ? b : Tensor(), p);
      const auto want = NaiveConv2d(x, w, with_bias ? b : Tensor(), p);
      const auto got = y.to_vector<double>();
      ASSERT_EQ(got.size(), want.size()) << ShapeToString(y.shape());
      for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << i;
    }
  }
}

// Stride 1 with as many output as input columns: the CPU im2col copies each
// tap's rows as one span and zeroes the columns in the padding.
TEST(ConvTest, SamePaddingStrideOneMatchesNaiveLoop) {
  manual_seed(15);
  const std::vector<std::pair<std::vector<int64_t>, Conv2dParams>> cases = {
      {{4, 2, 3, 5}, {.padding = {1, 2}}},                          // 7x6 out
      {{4, 2, 3, 5}, {.padding = {2, 4}, .dilation = {2, 2}}},      // 7x6 out
      {{4, 2, 1, 3}, {.padding = {3, 1}}},                          // 13x6 out, rows padded
  };
  for (const auto& [w_shape, p] : cases) {
    Tensor x = randn({3, 2, 7, 6}, {.dtype = kFloat64});
    Tensor w = randn(Shape(w_shape.begin(), w_shape.end()), {.dtype = kFloat64});
    Tensor b = randn({4}, {.dtype = kFloat64});
    for (bool with_bias : {true, false}) {
      Tensor y = conv2d(x, w, with_bias ? b : Tensor(), p);
      EXPECT_EQ(y.size(3), x.size(3));
      const auto want = NaiveConv2d(x, w, with_bias ? b : Tensor(), p);
      const auto got = y.to_vector<double>();
      ASSERT_EQ(got.size(), want.size()) << ShapeToString(y.shape());
      for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-12) << i;
    }
    // p by name: clang before 16 cannot capture a structured binding.
    EXPECT_TRUE(GradCheck([&, &params = p](const auto& in) {
                  return conv2d(in[0], in[1], in[2], params);
                },
                          {RandomInput({2, 2, 7, 6}), RandomInput(Shape(w_shape.begin(), w_shape.end())),
                           RandomInput({4})}))
        << "padding " << p.padding[0] << "," << p.padding[1];
  }
}

// A batch of 41 images (100 KiB of float64 im2col columns each) spans several
// of the CPU kernels' chunks of images, the last one a single image: output and
// every gradient must match the same conv run one image at a time, and repeat
// bit for bit. The chunk is 512 KiB of columns per OpenBLAS thread, so the test
// pins OpenBLAS to one thread (at 8+ threads the whole batch would be one chunk).
TEST(ConvTest, BatchAcrossChunksMatchesOneImageAtATime) {
  const int threads = cpu_blas_threads();
  set_cpu_blas_threads(1);
  struct Restore {
    int threads;
    ~Restore() { set_cpu_blas_threads(threads); }
  } restore{threads};
  manual_seed(16);
  for (DType dtype : {kFloat64, kFloat32}) {
    const double tol = dtype == kFloat64 ? 1e-11 : 2e-4;
    for (const Conv2dParams& p : {Conv2dParams{}, Conv2dParams{.padding = {1, 1}}}) {
      const int64_t n = 41;
      Tensor x = randn({n, 2, 28, 30}, {.dtype = dtype}).set_requires_grad(true);
      Tensor w = randn({5, 2, 3, 3}, {.dtype = dtype}).set_requires_grad(true);
      Tensor b = randn({5}, {.dtype = dtype}).set_requires_grad(true);
      Tensor y = conv2d(x, w, b, p);
      Tensor dy = randn(y.shape(), {.dtype = dtype});
      y.backward(dy);
      const auto ys = y.to_vector<double>(), dxs = x.grad().to_vector<double>();
      const auto dws = w.grad().to_vector<double>(), dbs = b.grad().to_vector<double>();

      // The same again: bit-identical.
      Tensor x2 = x.detach().clone().set_requires_grad(true);
      Tensor w2 = w.detach().clone().set_requires_grad(true);
      Tensor b2 = b.detach().clone().set_requires_grad(true);
      Tensor y2 = conv2d(x2, w2, b2, p);
      y2.backward(dy);
      EXPECT_EQ(y2.to_vector<double>(), ys);
      EXPECT_EQ(x2.grad().to_vector<double>(), dxs);
      EXPECT_EQ(w2.grad().to_vector<double>(), dws);
      EXPECT_EQ(b2.grad().to_vector<double>(), dbs);

      std::vector<double> dw_sum(dws.size(), 0.0), db_sum(dbs.size(), 0.0);
      const int64_t y_per = static_cast<int64_t>(ys.size()) / n;
      const int64_t x_per = static_cast<int64_t>(dxs.size()) / n;
      for (int64_t i = 0; i < n; ++i) {
        Tensor xi = x.detach().slice(i, i + 1).clone().set_requires_grad(true);
        Tensor wi = w.detach().clone().set_requires_grad(true);
        Tensor bi = b.detach().clone().set_requires_grad(true);
        Tensor yi = conv2d(xi, wi, bi, p);
        yi.backward(dy.slice(i, i + 1).clone());
        const auto yv = yi.to_vector<double>(), dxv = xi.grad().to_vector<double>();
        for (int64_t k = 0; k < y_per; ++k) {
          ASSERT_NEAR(ys[i * y_per + k], yv[k], tol) << "image " << i << " y " << k;
        }
        for (int64_t k = 0; k < x_per; ++k) {
          ASSERT_NEAR(dxs[i * x_per + k], dxv[k], tol) << "image " << i << " dx " << k;
        }
        const auto dwv = wi.grad().to_vector<double>(), dbv = bi.grad().to_vector<double>();
        for (size_t k = 0; k < dw_sum.size(); ++k) dw_sum[k] += dwv[k];
        for (size_t k = 0; k < db_sum.size(); ++k) db_sum[k] += dbv[k];
      }
      // Sums over 41 * 728 or more products: relative tolerance.
      for (size_t k = 0; k < dws.size(); ++k) {
        ASSERT_NEAR(dws[k], dw_sum[k], tol * (1.0 + std::abs(dw_sum[k])) * 10) << "dw " << k;
      }
      for (size_t k = 0; k < dbs.size(); ++k) {
        ASSERT_NEAR(dbs[k], db_sum[k], tol * (1.0 + std::abs(db_sum[k])) * 10) << "db " << k;
      }
    }
  }
}

TEST(ConvTest, Float32MatchesFloat64) {
  manual_seed(12);
  Tensor x = randn({2, 2, 5, 5}, {.dtype = kFloat64});
  Tensor w = randn({3, 2, 3, 3}, {.dtype = kFloat64});
  const Conv2dParams p{.padding = {1, 1}};
  const auto want = conv2d(x, w, Tensor(), p).to_vector<double>();
  const auto got = conv2d(x.to(kFloat32), w.to(kFloat32), Tensor(), p).to_vector<double>();
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << i;
}

// float32 on each CPU path (oneDNN where built, im2col + OpenBLAS) against the
// float64 result, for output and every gradient, across stride / padding /
// dilation and the models' shapes; at 1 and 2 threads each path repeats its
// own bits exactly.
TEST(ConvTest, EachFloat32CpuPathMatchesFloat64AndRepeatsBitForBit) {
  using ops::internal::CpuConvPath;
  const testing::RestoreCpuConv restore;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare();
  struct Case {
    Shape x, w;
    Conv2dParams p;
  };
  std::vector<Case> shapes = {{{3, 20, 14, 14}, {20, 20, 5, 5}, {.padding = {2, 2}}},
                               {{5, 1, 28, 28}, {20, 1, 5, 5}, {.padding = {2, 2}}},
                               {{4, 32, 15, 15}, {64, 32, 3, 3}, {}}};
  for (const Conv2dParams& p : Variants()) shapes.push_back({{2, 3, 7, 6}, {4, 3, 3, 2}, p});
  manual_seed(21);
  for (const Case& shape : shapes) {
    Tensor x = randn(shape.x, {.dtype = kFloat64}).set_requires_grad(true);
    Tensor w = randn(shape.w, {.dtype = kFloat64}).set_requires_grad(true);
    Tensor b = randn({shape.w[0]}, {.dtype = kFloat64}).set_requires_grad(true);
    Tensor y = conv2d(x, w, b, shape.p);
    Tensor dy = randn(y.shape(), {.dtype = kFloat64});
    y.backward(dy);
    const std::vector<std::vector<double>> want = {
        y.to_vector<double>(), x.grad().to_vector<double>(), w.grad().to_vector<double>(),
        b.grad().to_vector<double>()};
    for (CpuConvPath path : paths) {
      ops::internal::SetCpuConvPath(path);
      for (int t : {1, 2}) {
        set_cpu_blas_threads(t);
        std::vector<std::vector<float>> first;
        for (int run = 0; run < 2; ++run) {
          Tensor x32 = x.detach().to(kFloat32).set_requires_grad(true);
          Tensor w32 = w.detach().to(kFloat32).set_requires_grad(true);
          Tensor b32 = b.detach().to(kFloat32).set_requires_grad(true);
          Tensor y32 = conv2d(x32, w32, b32, shape.p);
          y32.backward(dy.to(kFloat32));
          std::vector<std::vector<float>> got = {
              y32.to_vector<float>(), x32.grad().to_vector<float>(),
              w32.grad().to_vector<float>(), b32.grad().to_vector<float>()};
          const std::string where = absl::StrCat(
              "path ", static_cast<int>(path),
              " (1 im2col, 2 oneDNN, 3 oneDNN blocked, 4 oneDNN nhwc, 5 Winograd), ", t,
              " thread(s), x ", ShapeToString(shape.x), ", weight ", ShapeToString(shape.w));
          if (run == 1) {
            for (size_t k = 0; k < got.size(); ++k) {
              EXPECT_EQ(got[k], first[k]) << "output/gradient " << k << " not repeated, " << where;
            }
            continue;
          }
          for (size_t k = 0; k < got.size(); ++k) {
            ASSERT_EQ(got[k].size(), want[k].size());
            // Winograd's transforms mix the values of a tile, so its error scales
            // with the tensor's largest magnitude rather than each element's
            // (conv_winograd_test bounds it at 2e-5 of that).
            double largest = 0;
            for (double v : want[k]) largest = std::max(largest, std::abs(v));
            for (size_t i = 0; i < got[k].size(); ++i) {
              const double scale = testing::TakesWinograd(shape.x, shape.w, shape.p)
                                       ? largest
                                       : std::abs(want[k][i]);
              ASSERT_NEAR(got[k][i], want[k][i], 2e-4 * (1 + scale))
                  << "output/gradient " << k << " element " << i << ", " << where;
            }
          }
          first = std::move(got);
        }
      }
    }
  }
}

TEST(ConvTest, OutputShapeFollowsTheFormula) {
  Tensor y = conv2d(zeros({1, 1, 28, 28}), zeros({20, 1, 5, 5}), zeros({20}),
                    {.padding = {2, 2}});
  EXPECT_EQ(y.shape(), (Shape{1, 20, 28, 28}));
  y = conv2d(zeros({3, 2, 10, 9}), zeros({4, 2, 3, 3}), Tensor(),
             {.stride = {3, 2}, .padding = {0, 1}, .dilation = {2, 2}});
  // OH = (10 - 2*2 - 1) / 3 + 1 = 2; OW = (9 + 2 - 4 - 1) / 2 + 1 = 4.
  EXPECT_EQ(y.shape(), (Shape{3, 4, 2, 4}));
}

TEST(ConvTest, ShapeErrorsNameOpAndShapes) {
  try {
    conv2d(zeros({2, 3, 8, 8}), zeros({4, 2, 3, 3}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("conv2d"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3, 8, 8)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 2, 3, 3)"), std::string::npos) << m;
  }
  try {
    conv2d(zeros({1, 1, 2, 2}), zeros({1, 1, 3, 3}));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("conv2d"), std::string::npos) << m;
    EXPECT_NE(m.find("(1, 1, 2, 2)"), std::string::npos) << m;
  }
  try {
    conv2d(zeros({1, 1, 4, 4}), zeros({2, 1, 3, 3}), zeros({3}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bias"), std::string::npos) << e.what();
  }
  EXPECT_THROW(conv2d(zeros({1, 4, 4}), zeros({2, 1, 3, 3})), Error);
  EXPECT_THROW(conv2d(zeros({1, 1, 4, 4}), zeros({2, 1, 3, 3}), Tensor(), {.stride = {0, 1}}),
               Error);
  EXPECT_THROW(conv2d(zeros({1, 1, 4, 4}), zeros({2, 1, 3, 3}, {.dtype = kFloat64})), Error);
}

TEST(ConvGradTest, EveryInputAcrossVariants) {
  manual_seed(13);
  for (const Conv2dParams& p : Variants()) {
    // p by name: clang before 16 cannot capture a structured binding.
    EXPECT_TRUE(GradCheck([&, &params = p](const auto& in) {
                  return conv2d(in[0], in[1], in[2], params);
                },
                          {RandomInput({2, 2, 6, 5}), RandomInput({3, 2, 3, 2}), RandomInput({3})}))
        << "stride " << p.stride[0] << "," << p.stride[1] << " padding " << p.padding[0] << ","
        << p.padding[1] << " dilation " << p.dilation[0] << "," << p.dilation[1];
  }
}

TEST(ConvGradTest, WithoutBiasAndOneByOneKernel) {
  manual_seed(14);
  EXPECT_TRUE(GradCheck([](const auto& in) { return conv2d(in[0], in[1]); },
                        {RandomInput({2, 3, 4, 4}), RandomInput({2, 3, 1, 1})}));
  // Only the weight requires grad (x is data).
  EXPECT_TRUE(GradCheck([](const auto& in) { return conv2d(in[0], in[1], in[2], {.padding = {1, 1}}); },
                        {RandomInput({1, 2, 5, 5}, 1.0, false), RandomInput({2, 2, 3, 3}),
                         RandomInput({2})}));
}

// conv2d_relu is relu(conv2d(...)) bit for bit, values and gradients, on every
// CPU path and dtype (the oneDNN post-op included: negative -> +0, never -0).
TEST(ConvReluTest, FusedEqualsReluOfConvBitForBit) {
  using ops::internal::CpuConvPath;
  const testing::RestoreCpuConv restore;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare(/*with_auto=*/true);
  struct Case {
    Shape x, w;
    Conv2dParams p;
  };
  const std::vector<Case> cases = {{{3, 20, 14, 14}, {20, 20, 5, 5}, {.padding = {2, 2}}},
                                   {{5, 1, 28, 28}, {20, 1, 5, 5}, {.padding = {2, 2}}},
                                   {{2, 8, 9, 9}, {16, 4, 3, 3}, {.stride = {2, 2}, .groups = 2}}};
  manual_seed(23);
  for (const Case& c : cases) {
    for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
      const Tensor x0 = randn(c.x).to(dtype);
      Tensor w0 = randn(c.w).to(dtype);
      // A zero output channel with a negative bias: exact zeros and negatives at once.
      Tensor b0 = randn({c.w[0]}).to(dtype);
      const Tensor dy0 = randn(conv2d(x0, w0, b0, c.p).shape()).to(dtype);
      for (CpuConvPath path : paths) {
        ops::internal::SetCpuConvPath(path);
        auto run = [&](bool fused) {
          Tensor x = x0.detach().set_requires_grad(true);
          Tensor w = w0.detach().set_requires_grad(true);
          Tensor b = b0.detach().set_requires_grad(true);
          Tensor y = fused ? conv2d_relu(x, w, b, c.p) : relu(conv2d(x, w, b, c.p));
          y.backward(dy0);
          return std::vector<Tensor>{y, x.grad(), w.grad(), b.grad()};
        };
        const std::vector<Tensor> fused = run(true), plain = run(false);
        for (size_t k = 0; k < fused.size(); ++k) {
          const Tensor& f = fused[k];
          const Tensor& u = plain[k];
          ASSERT_EQ(f.shape(), u.shape());
          EXPECT_EQ(std::memcmp(f.data_ptr(), u.data_ptr(), f.numel() * ElementSize(dtype)), 0)
              << "output/gradient " << k << " differs: path " << static_cast<int>(path) << ", "
              << DTypeName(dtype) << ", x " << ShapeToString(c.x) << ", weight "
              << ShapeToString(c.w);
        }
        // The ReLU did something: some outputs are zero, some positive.
        const std::vector<double> y = fused[0].to(kFloat64).to_vector<double>();
        EXPECT_GT(std::count(y.begin(), y.end(), 0.0), 0);
        EXPECT_GT(std::count_if(y.begin(), y.end(), [](double v) { return v > 0; }), 0);
      }
    }
  }
}

// H == 0 with padding: every window is padding, so y is the bias, dweight 0 and
// dbias the sum of dy, on every CPU path.
TEST(ConvTest, EmptyInputWithPaddingGivesTheBiasOnEveryPath) {
  using ops::internal::CpuConvPath;
  const testing::RestoreCpuConv restore;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare(/*with_auto=*/true);
  for (CpuConvPath path : paths) {
    ops::internal::SetCpuConvPath(path);
    for (bool fused : {false, true}) {
      Tensor x = zeros({2, 3, 0, 4}).set_requires_grad(true);
      Tensor w = ones({5, 3, 1, 1}).set_requires_grad(true);
      Tensor b = from_vector<float>({1, -2, 3, -4, 5}, {5}).set_requires_grad(true);
      Tensor y = fused ? conv2d_relu(x, w, b, {.padding = {1, 1}})
                       : conv2d(x, w, b, {.padding = {1, 1}});
      ASSERT_EQ(y.shape(), (Shape{2, 5, 2, 6})) << "path " << static_cast<int>(path);
      const std::vector<float> v = y.to_vector<float>();
      for (int64_t i = 0; i < y.numel(); ++i) {
        const float bias = b.to_vector<float>()[(i / 12) % 5];
        ASSERT_EQ(v[i], fused ? std::max(bias, 0.0f) : bias) << "element " << i;
      }
      y.backward(ones(y.shape()));
      EXPECT_EQ(w.grad().to_vector<float>(), std::vector<float>(15, 0.0f));
      const std::vector<float> db = b.grad().to_vector<float>();
      for (int k = 0; k < 5; ++k) {
        const bool masked = fused && b.to_vector<float>()[k] <= 0;
        EXPECT_EQ(db[k], masked ? 0.0f : 24.0f) << "channel " << k << ", path "
                                                << static_cast<int>(path);
      }
    }
  }
}

TEST(ConvReluTest, GradCheck) {
  manual_seed(15);
  for (const Conv2dParams& p : Variants()) {
    EXPECT_TRUE(GradCheck([&](const auto& in) { return conv2d_relu(in[0], in[1], in[2], p); },
                          {RandomInput({2, 2, 6, 5}), RandomInput({3, 2, 3, 2}), RandomInput({3})}))
        << "stride " << p.stride[0] << "," << p.stride[1] << " padding " << p.padding[0] << ","
        << p.padding[1];
  }
}

using ::tandem::testing::CountOps;
using ::tandem::testing::RunWholeAndOneByOne;

// Sequential runs Conv2d + ReLU as conv2d_relu: the same bits as the modules
// one by one, forward and backward. The autograd graphs tell that the first
// ran fused (two conv2d_relu, no separate relu) and the second did not, so the
// comparison is between the two. (Conv2d, ReLU, MaxPool2d: conv_relu_pool_test.)
TEST(ConvReluTest, SequentialFusesConvThenReluWithTheSameBits) {
  manual_seed(16);
  Sequential net({Conv2d(1, 20, 5, {.padding = {2, 2}}), ReLU(), AvgPool2d(2),
                  Conv2d(20, 20, 5, {.padding = {2, 2}}), ReLU(), Flatten(),
                  Linear(20 * 14 * 14, 10)});
  const ::tandem::testing::WholeAndOneByOne r = RunWholeAndOneByOne(net, randn({6, 1, 28, 28}));
  EXPECT_EQ(CountOps(r.whole, "conv2d_relu"), 2);
  EXPECT_EQ(CountOps(r.whole, "conv2d"), 0);
  EXPECT_EQ(CountOps(r.whole, "relu"), 0);
  EXPECT_EQ(CountOps(r.one_by_one, "conv2d_relu"), 0);
  EXPECT_EQ(CountOps(r.one_by_one, "conv2d"), 2);
  EXPECT_EQ(CountOps(r.one_by_one, "relu"), 2);
  EXPECT_EQ(r.whole.to_vector<float>(), r.one_by_one.to_vector<float>());
  EXPECT_EQ(r.whole_grads, r.one_by_one_grads);
}

}  // namespace
}  // namespace tandem::nn
