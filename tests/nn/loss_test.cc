#include "nn/ops/loss.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/reduce.h"
#include "nn/ops/softmax.h"
#include "nn/random.h"
#include "tests/nn/gradcheck.h"
#include "tests/test_util.h"

namespace tandem::nn {
namespace {

using tandem::testing::ErrorOf;
using testing::GradCheck;
using testing::RandomInput;

TEST(LossTest, MseValue) {
  Tensor p = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor t = from_vector(std::vector<float>{0, 2, 5, 4}, {2, 2});
  EXPECT_FLOAT_EQ(mse_loss(p, t).item<float>(), 5.0f / 4.0f);
  EXPECT_EQ(mse_loss(p, t).dim(), 0);
}

// The three reductions against the closed form; kMean stays the default.
TEST(LossTest, MseReductions) {
  Tensor p = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor t = from_vector(std::vector<float>{0, 2, 5, 4}, {2, 2});
  Tensor none = mse_loss(p, t, Reduction::kNone);
  EXPECT_EQ(none.shape(), (Shape{2, 2}));
  EXPECT_EQ(none.to_vector<float>(), (std::vector<float>{1, 0, 4, 0}));
  Tensor total = mse_loss(p, t, Reduction::kSum);
  EXPECT_EQ(total.dim(), 0);
  EXPECT_FLOAT_EQ(total.item<float>(), 5.0f);
  EXPECT_EQ(mse_loss(p, t, Reduction::kMean).item<float>(), mse_loss(p, t).item<float>());
  EXPECT_EQ(MSELoss(Reduction::kSum)(p, t).item<float>(), 5.0f);
  EXPECT_EQ(MSELoss()(p, t).item<float>(), mse_loss(p, t).item<float>());
  EXPECT_EQ(ReductionName(Reduction::kSum), "sum");
  EXPECT_THROW(mse_loss(p, t, static_cast<Reduction>(7)), Error);
}

TEST(LossTest, MseRefusesDifferentShapes) {
  try {
    mse_loss(zeros({4, 1}), zeros({4}));
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("mse_loss"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 1)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4)"), std::string::npos) << m;
  }
}

TEST(LossTest, CrossEntropyOfUniformLogitsIsLogC) {
  for (int64_t c : {2, 10, 1000}) {
    Tensor logits = full({3, c}, 0.7);
    Tensor labels = from_vector(std::vector<int64_t>{0, c - 1, c / 2}, {3});
    EXPECT_NEAR(cross_entropy(logits, labels).item(), std::log(static_cast<double>(c)), 1e-5) << c;
  }
}

TEST(LossTest, CrossEntropyMatchesLogSoftmaxAndIsStable) {
  manual_seed(41);
  Tensor logits = randn({5, 7}, {.dtype = kFloat64});
  logits.mul_(100.0);  // large logits: the fused kernel subtracts the max
  Tensor labels = from_vector(std::vector<int64_t>{0, 6, 3, 3, 1}, {5});
  const std::vector<double> ls = log_softmax(logits, 1).to_vector<double>();
  const std::vector<int64_t> lv = labels.to_vector<int64_t>();
  double expected = 0;
  for (int64_t i = 0; i < 5; ++i) expected -= ls[i * 7 + lv[i]];
  const double loss = cross_entropy(logits, labels).item();
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, expected / 5, 1e-9);
}

// Per-sample losses against log_softmax; sum and mean are their sum and mean.
TEST(LossTest, CrossEntropyReductions) {
  const std::vector<double> lv = {1.0, 2.0, 0.5,     //
                                  -1.0, 0.0, 3.0,    //
                                  0.25, 0.25, 0.25,  //
                                  4.0, -2.0, 1.0};
  Tensor logits = from_vector(lv, {4, 3}, {.dtype = kFloat64});
  Tensor labels = from_vector(std::vector<int64_t>{1, 0, 2, 0}, {4});
  std::vector<double> expected(4);
  double expected_sum = 0;
  for (int i = 0; i < 4; ++i) {
    const double* row = &lv[static_cast<size_t>(3 * i)];
    const int64_t label = labels.to_vector<int64_t>()[static_cast<size_t>(i)];
    const double lse = std::log(std::exp(row[0]) + std::exp(row[1]) + std::exp(row[2]));
    expected[static_cast<size_t>(i)] = lse - row[label];
    expected_sum += expected[static_cast<size_t>(i)];
  }
  Tensor none = cross_entropy(logits, labels, Reduction::kNone);
  ASSERT_EQ(none.shape(), (Shape{4}));
  const std::vector<double> got = none.to_vector<double>();
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i], expected[i], 1e-12) << i;
  Tensor total = cross_entropy(logits, labels, Reduction::kSum);
  EXPECT_EQ(total.dim(), 0);
  EXPECT_NEAR(total.item(), expected_sum, 1e-12);
  EXPECT_NEAR(cross_entropy(logits, labels).item(), expected_sum / 4, 1e-12);
  EXPECT_EQ(cross_entropy(logits, labels, Reduction::kMean).item(),
            cross_entropy(logits, labels).item());
  EXPECT_EQ(CrossEntropyLoss(Reduction::kSum)(logits, labels).item(), total.item());
  EXPECT_EQ(CrossEntropyLoss(Reduction::kNone)(logits, labels).shape(), (Shape{4}));
  EXPECT_THROW(cross_entropy(logits, labels, static_cast<Reduction>(-1)), Error);
}

// The default (kMean) is bit for bit what it was before reductions existed: the
// float32 reference below is the kernel's algorithm as it stood (row sums in
// double, the mean rounded once; backward scaled by g / N in float).
TEST(LossTest, CrossEntropyMeanKeepsItsBits) {
  manual_seed(44);
  const int64_t n = 7, c = 5;
  Tensor logits = randn({n, c});
  logits.mul_(3.0);
  const std::vector<int64_t> lv = {0, 4, 1, 2, 3, 3, 0};
  Tensor labels = from_vector(lv, {n});
  const std::vector<float> x = logits.to_vector<float>();
  std::vector<float> lse(n);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = &x[static_cast<size_t>(i * c)];
    float m = row[0];
    for (int64_t j = 1; j < c; ++j) m = std::max(m, row[j]);
    double sum_exp = 0;
    for (int64_t j = 0; j < c; ++j) sum_exp += std::exp(static_cast<double>(row[j] - m));
    const double row_lse = static_cast<double>(m) + std::log(sum_exp);
    lse[i] = static_cast<float>(row_lse);
    total += row_lse - static_cast<double>(row[lv[i]]);
  }
  Tensor leaf = logits.clone().set_requires_grad(true);
  Tensor loss = cross_entropy(leaf, labels);
  EXPECT_EQ(loss.item<float>(), static_cast<float>(total / static_cast<double>(n)));
  const float g = 1.7f;
  loss.backward(scalar_tensor(g));
  const std::vector<float> grad = leaf.grad().to_vector<float>();
  const float scale = g / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < c; ++j) {
      const size_t k = static_cast<size_t>(i * c + j);
      const float p = static_cast<float>(std::exp(static_cast<double>(x[k] - lse[i])));
      EXPECT_EQ(grad[k], scale * (j == lv[i] ? p - 1.0f : p)) << i << "," << j;
    }
  }
  // mse_loss's default is mean() of the squared differences, as before.
  Tensor p = randn({5, 3}), t = randn({5, 3});
  Tensor d = p - t;
  EXPECT_EQ(mse_loss(p, t).item<float>(), mean(d * d).item<float>());
}

TEST(LossTest, CrossEntropyLabelOutOfRangeNamesItAndC) {
  Tensor logits = zeros({2, 4});
  for (int64_t bad : {4, -1}) {
    try {
      cross_entropy(logits, from_vector(std::vector<int64_t>{0, bad}, {2}));
      FAIL() << bad;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("cross_entropy"), std::string::npos) << m;
      EXPECT_NE(m.find("label " + std::to_string(bad)), std::string::npos) << m;
      EXPECT_NE(m.find("4 classes"), std::string::npos) << m;
    }
  }
  EXPECT_THROW(cross_entropy(logits, zeros({2})), Error);                       // not int64
  EXPECT_THROW(cross_entropy(logits, zeros({3}, {.dtype = kInt64})), Error);    // wrong N
}

TEST(LossTest, AccuracyCountsFirstArgmax) {
  Tensor logits = from_vector(std::vector<float>{0.1f, 0.9f, 0.0f,   // argmax 1
                                                 2.0f, 2.0f, 1.0f,   // tie: first max, 0
                                                 0.0f, 0.0f, 3.0f,   // argmax 2
                                                 5.0f, 1.0f, 1.0f},  // argmax 0
                              {4, 3});
  Tensor labels = from_vector(std::vector<int64_t>{1, 1, 2, 2}, {4});
  Tensor acc = accuracy(logits, labels);
  EXPECT_EQ(acc.dtype(), kFloat32);
  EXPECT_EQ(acc.dim(), 0);
  EXPECT_FLOAT_EQ(acc.item<float>(), 0.5f);
}

TEST(LossGradTest, Mse) {
  manual_seed(42);
  EXPECT_TRUE(GradCheck([](const auto& in) { return mse_loss(in[0], in[1]); },
                        {RandomInput({3, 4}), RandomInput({3, 4})}));
}

TEST(LossGradTest, CrossEntropy) {
  manual_seed(43);
  Tensor labels = from_vector(std::vector<int64_t>{2, 0, 4, 4, 1, 3}, {6});
  EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], labels); },
                        {RandomInput({6, 5}, 2.0)}));
  // Upstream gradient other than 1: the loss scaled inside the graph.
  EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], labels) * 3.0; },
                        {RandomInput({6, 5})}));
}

TEST(LossGradTest, MseReductions) {
  manual_seed(45);
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    EXPECT_TRUE(GradCheck([r](const auto& in) { return mse_loss(in[0], in[1], r); },
                          {RandomInput({3, 4}), RandomInput({3, 4})}))
        << ReductionName(r);
  }
}

TEST(LossGradTest, CrossEntropyReductions) {
  manual_seed(46);
  Tensor labels = from_vector(std::vector<int64_t>{2, 0, 4, 4, 1, 3}, {6});
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    // kNone: GradCheck weighs each sample's loss differently (a non-uniform g).
    EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], labels, r); },
                          {RandomInput({6, 5}, 2.0)}))
        << ReductionName(r);
    EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], labels, r) * 3.0; },
                          {RandomInput({6, 5})}))
        << ReductionName(r) << " scaled";
  }
}

// Closed forms in float32 for the reductions and the modules.
TEST(LossTest, L1SmoothL1AndBceValues) {
  Tensor p = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  Tensor t = from_vector(std::vector<float>{0, 2.25f, 5, 4}, {2, 2});
  EXPECT_EQ(l1_loss(p, t, Reduction::kNone).to_vector<float>(),
            (std::vector<float>{1, 0.25f, 2, 0}));
  EXPECT_FLOAT_EQ(l1_loss(p, t).item<float>(), 3.25f / 4);
  EXPECT_FLOAT_EQ(L1Loss(Reduction::kSum)(p, t).item<float>(), 3.25f);
  // beta 1: |d| = 1 and 2 are outside (|d| - 0.5), 0.25 inside (0.5 d^2).
  EXPECT_EQ(smooth_l1_loss(p, t, Reduction::kNone).to_vector<float>(),
            (std::vector<float>{0.5f, 0.03125f, 1.5f, 0}));
  EXPECT_FLOAT_EQ(SmoothL1Loss(Reduction::kSum, 4.0)(p, t).item<float>(),
                  (0.125f + 0.25f * 0.25f / 8 + 0.5f) );
  // beta 0 is l1_loss, as PyTorch.
  EXPECT_EQ(smooth_l1_loss(p, t, Reduction::kNone, 0.0).to_vector<float>(),
            l1_loss(p, t, Reduction::kNone).to_vector<float>());
  // bce: log(1 + exp(-x)) for target 1, log(1 + exp(x)) for 0; large logits stay finite.
  Tensor x = from_vector(std::vector<float>{0, 2, -100, 100}, {4});
  Tensor y = from_vector(std::vector<float>{1, 0, 1, 0}, {4});
  const std::vector<float> b = binary_cross_entropy_with_logits(x, y, std::nullopt,
                                                                Reduction::kNone).to_vector<float>();
  EXPECT_FLOAT_EQ(b[0], std::log(2.0f));
  EXPECT_FLOAT_EQ(b[1], std::log1p(std::exp(2.0f)));
  EXPECT_FLOAT_EQ(b[2], 100.0f);
  EXPECT_FLOAT_EQ(b[3], 100.0f);
  // pos_weight scales the positive term: 3 * log(2) at x = 0, target 1.
  Tensor pw = full({4}, 3.0);
  EXPECT_FLOAT_EQ(BCEWithLogitsLoss(Reduction::kNone, pw)(x, y).to_vector<float>()[0],
                  3 * std::log(2.0f));
  EXPECT_EQ(BCEWithLogitsLoss()->buffers().size(), 0u);
  // pos_weight is a buffer: in the state dict, converted by to(dtype) in place.
  BCEWithLogitsLoss module(Reduction::kNone, pw);
  ASSERT_EQ(module->named_buffers().size(), 1u);
  EXPECT_EQ(module->named_buffers()[0].first, "pos_weight");
  module->to(kFloat64);
  EXPECT_EQ(module->pos_weight.dtype(), kFloat64);
  EXPECT_DOUBLE_EQ(module(x.to(kFloat64), y.to(kFloat64)).to_vector<double>()[0],
                   3 * std::log(2.0));
}

TEST(LossTest, NllLossPicksTheLabelledLogProbability) {
  Tensor lp = from_vector(std::vector<float>{-1, -2, -3, -0.5f, -4, -6}, {2, 3});
  Tensor labels = from_vector(std::vector<int64_t>{2, 0}, {2});
  EXPECT_EQ(nll_loss(lp, labels, Reduction::kNone).to_vector<float>(),
            (std::vector<float>{3, 0.5f}));
  EXPECT_FLOAT_EQ(nll_loss(lp, labels).item<float>(), 1.75f);
  EXPECT_FLOAT_EQ(NLLLoss(Reduction::kSum)(lp, labels).item<float>(), 3.5f);
  // nll_loss(log_softmax(x)) is cross_entropy(x).
  manual_seed(11);
  Tensor logits = randn({5, 7});
  Tensor y = from_vector(std::vector<int64_t>{0, 6, 3, 3, 1}, {5});
  EXPECT_NEAR(nll_loss(log_softmax(logits, 1), y).item<float>(),
              cross_entropy(logits, y).item<float>(), 1e-6);
}

TEST(LossTest, NewLossesNameBadInputs) {
  const std::string l1 = ErrorOf([] { l1_loss(zeros({4, 1}), zeros({4})); });
  EXPECT_NE(l1.find("l1_loss: pred of shape (4, 1) and target of shape (4) differ"),
            std::string::npos) << l1;
  const std::string beta = ErrorOf([] { smooth_l1_loss(zeros({2}), zeros({2}),
                                                           Reduction::kMean, -0.5); });
  EXPECT_NE(beta.find("beta -0.5"), std::string::npos) << beta;
  EXPECT_NE(ErrorOf([] { SmoothL1Loss(Reduction::kMean, -1.0); }).find("beta -1"),
            std::string::npos);
  const std::string bce = ErrorOf([] {
    binary_cross_entropy_with_logits(zeros({2, 3}), zeros({2, 3}), zeros({2}));
  });
  EXPECT_NE(bce.find("pos_weight and target: shapes (2) and (2, 3) do not broadcast"),
            std::string::npos) << bce;
  // Broadcastable, but to a larger shape than target's.
  const std::string wider = ErrorOf([] {
    binary_cross_entropy_with_logits(zeros({2, 3}), zeros({2, 3}), zeros({4, 1, 3}));
  });
  EXPECT_NE(wider.find("pos_weight of shape (4, 1, 3) does not broadcast to target of shape (2, 3)"),
            std::string::npos) << wider;
  EXPECT_THROW(binary_cross_entropy_with_logits(zeros({2}), zeros({3})), Error);
  EXPECT_THROW(l1_loss(zeros({2}), zeros({2}), static_cast<Reduction>(9)), Error);
  const std::string label = ErrorOf([] {
    nll_loss(zeros({2, 3}), from_vector(std::vector<int64_t>{1, 3}, {2}));
  });
  EXPECT_NE(label.find("nll_loss: label 3 at row 1 is out of range for 3 classes"),
            std::string::npos) << label;
  const std::string dtype = ErrorOf([] {
    nll_loss(zeros({2, 3}), zeros({2}));
  });
  EXPECT_NE(dtype.find("labels must be int64, got float32(2) on cpu; pass the class indices in "
                       "[0, 3) as int64 (labels.to(kInt64))"),
            std::string::npos) << dtype;
  const std::string shape = ErrorOf([] {
    nll_loss(zeros({2, 3}), from_vector(std::vector<int64_t>{0, 1, 2}, {3}));
  });
  EXPECT_NE(shape.find("log_probs of shape (2, 3)"), std::string::npos) << shape;
  EXPECT_THROW(nll_loss(zeros({6}), from_vector(std::vector<int64_t>{0}, {1})), Error);
  // Operands of other dtypes are named by the loss, not by the elementwise op inside it.
  const std::string l1_dtypes = ErrorOf([] { l1_loss(zeros({2}), zeros({2}, {.dtype = kFloat64})); });
  EXPECT_NE(l1_dtypes.find("l1_loss: dtypes differ"), std::string::npos) << l1_dtypes;
  const std::string smooth_dtypes = ErrorOf([] {
    smooth_l1_loss(zeros({2}, {.dtype = kFloat64}), zeros({2}));
  });
  EXPECT_NE(smooth_dtypes.find("smooth_l1_loss: dtypes differ"), std::string::npos)
      << smooth_dtypes;
  const std::string bce_dtypes = ErrorOf([] {
    binary_cross_entropy_with_logits(zeros({2, 3}), zeros({2, 3}, {.dtype = kFloat64}));
  });
  EXPECT_NE(bce_dtypes.find("binary_cross_entropy_with_logits: dtypes differ"), std::string::npos)
      << bce_dtypes;
  const std::string pw_dtype = ErrorOf([] {
    binary_cross_entropy_with_logits(zeros({2, 3}), zeros({2, 3}), zeros({3}, {.dtype = kFloat64}));
  });
  EXPECT_NE(pw_dtype.find("binary_cross_entropy_with_logits: dtypes differ"), std::string::npos)
      << pw_dtype;
  EXPECT_NE(pw_dtype.find("float64"), std::string::npos) << pw_dtype;
}

TEST(LossGradTest, NewLosses) {
  manual_seed(12);
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    // Differences of order 1, so none sits within eps of 0 (l1) or of beta (smooth_l1).
    EXPECT_TRUE(GradCheck([r](const auto& in) { return l1_loss(in[0], in[1], r); },
                          {RandomInput({3, 4}), RandomInput({3, 4})}));
    EXPECT_TRUE(GradCheck([r](const auto& in) { return smooth_l1_loss(in[0], in[1], r, 0.7); },
                          {RandomInput({3, 4}), RandomInput({3, 4})}));
    Tensor target = rand({3, 4}, {.dtype = kFloat64}).set_requires_grad(true);
    EXPECT_TRUE(GradCheck(
        [r](const auto& in) { return binary_cross_entropy_with_logits(in[0], in[1], in[2], r); },
        {RandomInput({3, 4}, 3.0), target, rand({4}, {.dtype = kFloat64}).set_requires_grad(true)}));
    EXPECT_TRUE(GradCheck(
        [r](const auto& in) {
          return nll_loss(in[0], from_vector(std::vector<int64_t>{1, 0, 4}, {3}), r);
        },
        {RandomInput({3, 5})}));
  }
}

// Every option of cross_entropy and nll_loss, alone and together, under every
// reduction: float64 central differences against backward().
TEST(LossGradTest, ClassificationLossOptions) {
  manual_seed(47);
  const Tensor labels = from_vector(std::vector<int64_t>{2, -100, 4, 4, 1, 3}, {6});
  const Tensor class_ignored = from_vector(std::vector<int64_t>{2, 0, 4, 0, 1, 3}, {6});
  const Tensor weight = from_vector(std::vector<double>{0.5, 2.0, 1.0, 3.0, 0.25}, {5});
  const std::vector<std::pair<std::string, CrossEntropyOptions>> cases = {
      {"weight", {.weight = weight}},
      {"ignore -100", {}},
      {"ignore a class", {.ignore_index = 0}},
      {"smoothing", {.label_smoothing = 0.15}},
      {"smoothing 1", {.label_smoothing = 1.0}},
      {"weight + smoothing", {.weight = weight, .label_smoothing = 0.4}},
      {"all", {.weight = weight, .ignore_index = 0, .label_smoothing = 0.25}}};
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    for (const auto& [name, base] : cases) {
      CrossEntropyOptions options = base;
      options.reduction = r;
      const Tensor& y = options.ignore_index == 0 ? class_ignored : labels;
      EXPECT_TRUE(GradCheck([&](const auto& in) { return cross_entropy(in[0], y, options); },
                            {RandomInput({6, 5}, 2.0)}))
          << name << " " << ReductionName(r);
    }
    for (int64_t ignore : {int64_t{-100}, int64_t{0}}) {
      const NllLossOptions options{.reduction = r, .weight = weight, .ignore_index = ignore};
      const Tensor& y = ignore == 0 ? class_ignored : labels;
      EXPECT_TRUE(GradCheck([&](const auto& in) { return nll_loss(in[0], y, options); },
                            {RandomInput({6, 5})}))
          << "nll ignore " << ignore << " " << ReductionName(r);
    }
  }
}

// The closed forms: an ignored row is 0 and out of the mean, weight scales a row
// and the mean's denominator, smoothing mixes in the mean over the classes.
TEST(LossTest, ClassificationLossOptionValues) {
  const Tensor logits = from_vector(std::vector<double>{1, 2, 0, 0, 0, 3, 2, 1, 0}, {3, 3});
  const Tensor y = from_vector(std::vector<int64_t>{0, -100, 2}, {3});
  const std::vector<double> base = cross_entropy(logits, y, Reduction::kNone).to_vector<double>();
  const double lse0 = std::log(std::exp(1.0) + std::exp(2.0) + 1.0);
  const double lse2 = std::log(std::exp(2.0) + std::exp(1.0) + 1.0);
  EXPECT_NEAR(base[0], lse0 - 1, 1e-12);
  EXPECT_EQ(base[1], 0.0);
  EXPECT_NEAR(base[2], lse2 - 0, 1e-12);
  EXPECT_NEAR(cross_entropy(logits, y).item(), (base[0] + base[2]) / 2, 1e-12);
  const Tensor w = from_vector(std::vector<double>{2, 5, 0.5}, {3});
  EXPECT_NEAR(cross_entropy(logits, y, {.weight = w}).item(),
              (2 * base[0] + 0.5 * base[2]) / 2.5, 1e-12);
  EXPECT_NEAR(cross_entropy(logits, y, {.reduction = Reduction::kSum, .weight = w}).item(),
              2 * base[0] + 0.5 * base[2], 1e-12);
  const double eps = 0.3;
  const double uniform0 = lse0 - 1.0, uniform2 = lse2 - 1.0;  // mean over c of lse - x_c
  const std::vector<double> smooth =
      cross_entropy(logits, y, {.reduction = Reduction::kNone, .label_smoothing = eps})
          .to_vector<double>();
  EXPECT_NEAR(smooth[0], (1 - eps) * base[0] + eps * uniform0, 1e-12);
  EXPECT_EQ(smooth[1], 0.0);
  EXPECT_NEAR(smooth[2], (1 - eps) * base[2] + eps * uniform2, 1e-12);
  // ignore_index may name a class; -100 is then a bad label (below).
  EXPECT_NEAR(cross_entropy(logits, from_vector(std::vector<int64_t>{0, 1, 2}, {3}),
                            {.ignore_index = 1}).item(),
              (base[0] + base[2]) / 2, 1e-12);
  EXPECT_NEAR(nll_loss(log_softmax(logits, 1), y, {.weight = w}).item(),
              (2 * base[0] + 0.5 * base[2]) / 2.5, 1e-12);
}

// Every sample ignored: kMean is 0 / 0 = NaN with a zero gradient, kSum 0, as
// PyTorch 1.13 (F.cross_entropy / F.nll_loss with every target -100).
TEST(LossTest, AllIgnoredMeanIsNanWithZeroGradient) {
  const Tensor y = from_vector(std::vector<int64_t>{-100, -100}, {2});
  for (double eps : {0.0, 0.2}) {
    Tensor x = randn({2, 3}).set_requires_grad(true);
    Tensor loss = cross_entropy(x, y, {.label_smoothing = eps});
    EXPECT_TRUE(std::isnan(loss.item<float>())) << eps;
    loss.backward();
    EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(6, 0.0f)) << eps;
    EXPECT_EQ(cross_entropy(x, y, {.reduction = Reduction::kSum, .label_smoothing = eps})
                  .item<float>(),
              0.0f);
  }
  Tensor lp = randn({2, 3}).set_requires_grad(true);
  Tensor loss = nll_loss(lp, y);
  EXPECT_TRUE(std::isnan(loss.item<float>()));
  loss.backward();
  EXPECT_EQ(lp.grad().to_vector<float>(), std::vector<float>(6, 0.0f));
}

// Bad options are errors naming the bad value.
TEST(LossTest, ClassificationLossOptionErrors) {
  const Tensor x = zeros({2, 3});
  const Tensor y = from_vector(std::vector<int64_t>{0, 2}, {2});
  const auto error_has = [](const std::string& m, const std::string& want) {
    EXPECT_NE(m.find(want), std::string::npos) << "'" << want << "' not in: " << m;
  };
  error_has(ErrorOf([&] { cross_entropy(x, y, {.weight = ones({4})}); }),
            "cross_entropy: weight of shape (4) must be (3), one per class");
  error_has(ErrorOf([&] { nll_loss(x, y, {.weight = ones({3, 1})}); }),
            "nll_loss: weight of shape (3, 1) must be (3)");
  error_has(ErrorOf([&] { cross_entropy(x, y, {.weight = ones({3}, {.dtype = kFloat64})}); }),
            "cross_entropy: weight of dtype float64 does not match the input's float32");
  error_has(ErrorOf([&] { cross_entropy(x, y, {.weight = ones({3}).set_requires_grad(true)}); }),
            "cross_entropy: weight requires grad");
  for (const auto& [eps, text] : {std::pair{-0.1, "-0.1"}, std::pair{1.5, "1.5"},
                                   std::pair{std::nan(""), "nan"}}) {
    error_has(ErrorOf([&] { cross_entropy(x, y, {.label_smoothing = eps}); }),
              std::string("cross_entropy: label_smoothing ") + text + " is outside [0, 1]");
  }
  // With ignore_index a class, the default -100 is an out-of-range label.
  const Tensor minus_100 = from_vector(std::vector<int64_t>{-100, 2}, {2});
  error_has(ErrorOf([&] { cross_entropy(x, minus_100, {.ignore_index = 1}); }),
            "cross_entropy: label -100 at row 0 is out of range for 3 classes");
  error_has(ErrorOf([&] { nll_loss(x, minus_100, {.ignore_index = 1}); }),
            "nll_loss: label -100 at row 0 is out of range for 3 classes");
  error_has(ErrorOf([&] { cross_entropy(x, from_vector(std::vector<int64_t>{3, 0}, {2}), {}); }),
            "ignore_index -100");
}

// The modules carry the options; the weight is a buffer ("weight"), as PyTorch's.
TEST(LossTest, ClassificationLossModulesTakeOptions) {
  manual_seed(48);
  const Tensor x = randn({4, 3});
  const Tensor y = from_vector(std::vector<int64_t>{0, 2, -1, 1}, {4});
  const Tensor w = from_vector(std::vector<float>{1, 2, 3}, {3});
  const CrossEntropyOptions options{.weight = w, .ignore_index = -1, .label_smoothing = 0.1};
  CrossEntropyLoss ce(options);
  EXPECT_EQ(ce(x, y).item<float>(), cross_entropy(x, y, options).item<float>());
  ASSERT_EQ(ce->named_buffers().size(), 1u);
  EXPECT_EQ(ce->named_buffers()[0].first, "weight");
  const Tensor in_range = from_vector(std::vector<int64_t>{0, 2, 1, 1}, {4});
  EXPECT_EQ(CrossEntropyLoss(Reduction::kSum)(x, in_range).item<float>(),
            cross_entropy(x, in_range, Reduction::kSum).item<float>());
  EXPECT_TRUE(CrossEntropyLoss()->named_buffers().empty());
  NLLLoss nll(NllLossOptions{.reduction = Reduction::kSum, .weight = w, .ignore_index = -1});
  EXPECT_EQ(nll(x, y).item<float>(),
            nll_loss(x, y, {.reduction = Reduction::kSum, .weight = w, .ignore_index = -1})
                .item<float>());
  EXPECT_EQ(nll->named_buffers().size(), 1u);
  // A bad option fails at construction, naming it.
  EXPECT_NE(ErrorOf([] { CrossEntropyLoss{CrossEntropyOptions{.label_smoothing = 2.0}}; })
                .find("CrossEntropyLoss: label_smoothing 2 is outside [0, 1]"),
            std::string::npos);
  Tensor trainable = from_vector(std::vector<float>{1, 2, 3}, {3});
  trainable.set_requires_grad(true);
  EXPECT_NE(ErrorOf([&] { CrossEntropyLoss{CrossEntropyOptions{.weight = trainable}}; })
                .find("CrossEntropyLoss: weight requires grad"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] { NLLLoss{NllLossOptions{.weight = trainable}}; })
                .find("NLLLoss: weight requires grad"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem::nn
