// Activations and losses against PyTorch 1.13 in float64: values and gradients from
// tests/nn/ops_torch.py (ops_torch_ref.inc), which uses the same inputs as below.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "nn/ops/elementwise.h"
#include "nn/ops/loss.h"
#include "nn/ops/reduce.h"
#include "nn/ops/softmax.h"

namespace tandem::nn {
namespace {

const std::map<std::string, std::vector<double>>& Torch() {
  static const auto* ref = new std::map<std::string, std::vector<double>>{
#include "tests/nn/ops_torch_ref.inc"
  };
  return *ref;
}

const std::vector<double> kX = {-3.0, -1.25, -0.5, -0.0625, 0.0, 0.25, 0.75, 1.5, 4.0};
const std::vector<double> kPred = {0.3, -1.2, 2.5, 0.0, -0.7, 1.1};
const std::vector<double> kTarget = {0.5, -1.0, 1.0, 0.05, 0.3, -0.2};
const std::vector<double> kLogits = {2.0, -3.0, 0.5, 0.0, -0.25, 40.0};
const std::vector<double> kLabels = {1.0, 0.0, 0.75, 1.0, 0.0, 0.0};
const std::vector<double> kPosWeight = {2.0, 0.5, 3.0};
const std::vector<double> kSqrt = {0.0, 0.0625, 0.25, 2.0, 9.0};
const std::vector<double> kSoftplus = {-100.0, -30.0, -3.0, -0.5, 0.0, 0.75, 5.0, 19.0, 20.0};
const std::vector<double> kGeluTails = {-10.0, -6.0, -5.0, -3.5, 6.0, 10.0};
const std::vector<double> kTies = {-1.25, 0.0, 0.25};  // against kX as (3, 3)
const std::vector<double> kLargeLogits = {100.0, -100.0, 100.0, -100.0, 0.0, 30.0};
const std::vector<double> kLargeLabels = {0.0, 1.0, 1.0, 0.0, 0.5, 0.25};
const std::vector<double> kLargePosWeight = {3.0, 0.5, 2.0};
const std::vector<double> kAtBetaPred = {0.5, -0.5, 1.0, 0.25, 0.0, -1.5};
const std::vector<double> kAtBetaTarget = {0.0, 0.0, 0.5, 0.75, 0.5, -1.0};
const std::vector<double> kClassLogits = {0.4, -1.3, 2.2, 0.1, -0.6, 1.7,
                                          -2.4, 0.9, 1.2, -0.3, 0.05, -1.1};  // (3, 4)

// Within 1e-12 of PyTorch's value, relative to 1 + |value|; with `relative`, to |value|
// alone (for tails far below 1, where an absolute bound would pass anything).
void ExpectNear(const std::vector<double>& got, const std::string& key, bool relative = false) {
  ASSERT_EQ(Torch().count(key), 1u) << key;
  const std::vector<double>& want = Torch().at(key);
  ASSERT_EQ(got.size(), want.size()) << key;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i])) {  // sqrt's gradient at 0
      EXPECT_EQ(got[i], want[i]) << key << " element " << i;
      continue;
    }
    EXPECT_NEAR(got[i], want[i], 1e-12 * ((relative ? 0 : 1) + std::abs(want[i])))
        << key << " element " << i;
  }
}

// Runs f on float64 leaves made from `values`, checks the output against `name` and
// the gradient of sum(out * w), w = 0.5 + 0.25 i, of the first `n_grads` inputs
// against "name gradK".
void Check(const std::string& name, const std::vector<std::vector<double>>& values,
           const std::vector<Shape>& shapes,
           const std::function<Tensor(const std::vector<Tensor>&)>& f, size_t n_grads,
           bool relative = false) {
  std::vector<Tensor> in;
  for (size_t k = 0; k < values.size(); ++k) {
    in.push_back(from_vector(values[k], shapes[k], {.requires_grad = k < n_grads}));
  }
  Tensor out = f(in).reshape({-1});
  std::vector<double> w(static_cast<size_t>(out.numel()));
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5 + 0.25 * static_cast<double>(i);
  sum(out * from_vector(w, out.shape())).backward();
  ExpectNear(out.to_vector<double>(), name, relative);
  for (size_t k = 0; k < n_grads; ++k) {
    ExpectNear(in[k].grad().to_vector<double>(), name + " grad" + std::to_string(k), relative);
  }
}

TEST(OpsTorchTest, Activations) {
  const Shape s = {9};
  Check("gelu", {kX}, {s}, [](const auto& in) { return gelu(in[0]); }, 1);
  Check("gelu_tanh", {kX}, {s},
        [](const auto& in) { return gelu(in[0], GeluApproximate::kTanh); }, 1);
  Check("silu", {kX}, {s}, [](const auto& in) { return silu(in[0]); }, 1);
  Check("leaky_relu_0.2", {kX}, {s}, [](const auto& in) { return leaky_relu(in[0], 0.2); }, 1);
}

// The kinks and tails: abs at 0 (gradient 0), sqrt at 0 (inf), clamp at its bounds
// (gradient passed), softplus far below 0 and up to PyTorch's threshold 20, gelu
// beyond +-3, maximum / minimum ties (half each) with a broadcast operand.
TEST(OpsTorchTest, EdgePoints) {
  const Shape s = {9};
  Check("abs", {kX}, {s}, [](const auto& in) { return abs(in[0]); }, 1);
  Check("sqrt", {kSqrt}, {{5}}, [](const auto& in) { return sqrt(in[0]); }, 1);
  Check("clamp_-1.25_0.75", {kX}, {s}, [](const auto& in) { return clamp(in[0], -1.25, 0.75); },
        1);
  Check("clamp_min_0", {kX}, {s}, [](const auto& in) { return clamp(in[0], 0.0, std::nullopt); },
        1);
  Check("clamp_max_-0.5", {kX}, {s},
        [](const auto& in) { return clamp(in[0], std::nullopt, -0.5); }, 1);
  // Relative: softplus(-100) = 3.7e-44 must not come out as 0 (log(1 + exp(x)) would).
  Check("softplus", {kSoftplus}, {{9}}, [](const auto& in) { return softplus(in[0]); }, 1,
        /*relative=*/true);
  Check("gelu_tails", {kGeluTails}, {{6}}, [](const auto& in) { return gelu(in[0]); }, 1);
  Check("gelu_tanh_tails", {kGeluTails}, {{6}},
        [](const auto& in) { return gelu(in[0], GeluApproximate::kTanh); }, 1);
  Check("maximum", {kX, kTies}, {{3, 3}, {3}},
        [](const auto& in) { return maximum(in[0], in[1]); }, 2);
  Check("minimum", {kX, kTies}, {{3, 3}, {3}},
        [](const auto& in) { return minimum(in[0], in[1]); }, 2);
  // Logits of +-100 with pos_weight; smooth_l1 where |pred - target| == beta.
  Check("bce_pw_large", {kLargeLogits, kLargeLabels, kLargePosWeight}, {{2, 3}, {2, 3}, {3}},
        [](const auto& in) {
          return binary_cross_entropy_with_logits(in[0], in[1], in[2], Reduction::kNone);
        }, 2);
  Check("smooth_l1_at_beta", {kAtBetaPred, kAtBetaTarget}, {{2, 3}, {2, 3}},
        [](const auto& in) { return smooth_l1_loss(in[0], in[1], Reduction::kNone, 0.5); }, 2);
}

TEST(OpsTorchTest, Losses) {
  const Shape s = {2, 3};
  const std::vector<std::pair<std::string, Reduction>> reductions = {
      {"none", Reduction::kNone}, {"mean", Reduction::kMean}, {"sum", Reduction::kSum}};
  for (const auto& [name, r] : reductions) {
    Check("l1_" + name, {kPred, kTarget}, {s, s},
          [r = r](const auto& in) { return l1_loss(in[0], in[1], r); }, 2);
    Check("smooth_l1_0.5_" + name, {kPred, kTarget}, {s, s},
          [r = r](const auto& in) { return smooth_l1_loss(in[0], in[1], r, 0.5); }, 2);
    Check("bce_" + name, {kLogits, kLabels}, {s, s},
          [r = r](const auto& in) {
            return binary_cross_entropy_with_logits(in[0], in[1], std::nullopt, r);
          }, 2);
    Check("bce_pw_" + name, {kLogits, kLabels, kPosWeight}, {s, s, {3}},
          [r = r](const auto& in) { return binary_cross_entropy_with_logits(in[0], in[1], in[2], r); },
          2);
    // log_softmax in tandem (checked against PyTorch's by the values of the leaf).
    const std::vector<double> log_probs =
        log_softmax(from_vector(kClassLogits, {3, 4}), 1).to_vector<double>();
    Check("nll_" + name, {log_probs}, {{3, 4}},
          [r = r](const auto& in) {
            return nll_loss(in[0], from_vector(std::vector<int64_t>{2, 0, 3}, {3}), r);
          }, 1);
  }
}

// cross_entropy and nll_loss with their options (ops_torch.py's CE_CASES): class
// weight, ignore_index (the default -100, and a class), label smoothing, all three.
TEST(OpsTorchTest, ClassificationLossOptions) {
  const std::vector<double> logits = {0.4,  -1.3, 2.2, 0.1,  -0.6, 1.7,  -2.4,
                                      0.9,  1.2,  -0.3, 0.05, -1.1, 3.0,  0.2,
                                      -0.8, 0.6,  -1.5, 0.35, 0.7,  -0.45};  // (5, 4)
  const std::vector<int64_t> labels = {2, -100, 0, 3, 1};
  const std::vector<int64_t> class_ignored = {2, 1, 0, 3, 1};
  const Tensor weight = from_vector(std::vector<double>{0.5, 2.0, 1.0, 3.0}, {4});
  const std::vector<std::pair<std::string, Reduction>> reductions = {
      {"none", Reduction::kNone}, {"mean", Reduction::kMean}, {"sum", Reduction::kSum}};
  for (const auto& [name, r] : reductions) {
    const auto ce = [&, r = r](std::vector<int64_t> y, CrossEntropyOptions options) {
      options.reduction = r;
      return [y, options](const auto& in) {
        return cross_entropy(in[0], from_vector(y, {5}), options);
      };
    };
    Check("ce_weight_" + name, {logits}, {{5, 4}}, ce(labels, {.weight = weight}), 1);
    Check("ce_ignore_" + name, {logits}, {{5, 4}}, ce(labels, {}), 1);
    Check("ce_smooth_" + name, {logits}, {{5, 4}}, ce(labels, {.label_smoothing = 0.2}), 1);
    Check("ce_all_" + name, {logits}, {{5, 4}},
          ce(class_ignored, {.weight = weight, .ignore_index = 1, .label_smoothing = 0.3}), 1);
    const std::vector<double> log_probs =
        log_softmax(from_vector(logits, {5, 4}), 1).to_vector<double>();
    for (const auto& [key, y, ignore] :
         {std::tuple{"nll_weight_", labels, int64_t{-100}},
          std::tuple{"nll_weight_ignore_1_", class_ignored, int64_t{1}}}) {
      Check(key + name, {log_probs}, {{5, 4}},
            [&, r = r, y = y, ignore = ignore](const auto& in) {
              return nll_loss(in[0], from_vector(y, {5}),
                              {.reduction = r, .weight = weight, .ignore_index = ignore});
            }, 1);
    }
  }
}

}  // namespace
}  // namespace tandem::nn
