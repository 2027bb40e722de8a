// evaluate()'s "eval_loss" is the loss of the whole evaluation set, as one
// rank computes it in one batch: with CrossEntropy's class weight and an
// ignore_index that labels meet, the same on batch sizes 1, 7 and the whole
// set, on 1 and 3 ranks, and in fit's per-epoch evaluation, equal to
// nn::cross_entropy over the set; batches whose labels are all ignored add
// nothing (no NaN); kSum gives the set's sum; a set of ignored labels only
// is NaN; label_smoothing with and without a weight, (N, 1) labels and bf16
// autocast alike. A loss function of the user's own (a lambda) weighs each batch's
// loss by its rows, as it always did; one with LossTerms evaluates exactly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/nn.h"
#include "optim/sgd.h"
#include "testing/run.h"
#include "tests/hapi/classification.h"

namespace tandem::hapi {
namespace {

using Net = ::tandem::testing::TwoLayerNet;

constexpr int64_t kExamples = 37;  // not a multiple of 3 ranks or of batch 7
constexpr int64_t kIgnored = 1;    // a class that labels meet

LaunchOptions Cpu(int ranks) {
  return {.gpus = "cpu", .nprocs = ranks, .spawn = testing::DefaultTestSpawnOptions()};
}

OptimizerFactory FrozenSgd() {  // lr 0: a fit leaves the weights as they were
  return [](std::vector<nn::Tensor> params) {
    return std::make_unique<optim::SGD>(std::move(params), optim::SGDOptions{.lr = 0.0});
  };
}

// 37 examples of 4 features; labels 0, 1, 2 by a rule on the features, the
// first 8 all kIgnored (batch 7's first batch, and batch 1's first 8, are
// all ignored).
struct Set {
  nn::Tensor x, labels;
  std::shared_ptr<const data::Dataset> data;
};

Set MakeSet(bool all_ignored = false) {
  nn::manual_seed(5);
  Set s;
  s.x = nn::randn({kExamples, 4});
  const std::vector<float> xs = s.x.to_vector<float>();
  std::vector<int64_t> labels(kExamples);
  for (int64_t i = 0; i < kExamples; ++i) {
    const float v = xs[i * 4] - xs[i * 4 + 2];
    labels[i] = all_ignored || i < 8 ? kIgnored : (v < -0.3f ? 0 : (v < 0.3f ? 1 : 2));
  }
  s.labels = nn::from_vector(labels, {kExamples}, {.dtype = nn::kInt64});
  s.data = std::make_shared<data::TensorDataset>(s.x, s.labels);
  return s;
}

nn::CrossEntropyOptions Options(nn::Reduction reduction = nn::Reduction::kMean) {
  return {.reduction = reduction,
          .weight = nn::from_vector(std::vector<float>{0.5f, 2.0f, 3.0f}, {3}),
          .ignore_index = kIgnored};
}

// The weights every Model here starts from.
nn::StateDict InitialWeights() {
  nn::manual_seed(9);
  Net net;
  nn::StateDict weights;
  for (const auto& [name, t] : net.state_dict()) weights.emplace_back(name, t.detach().clone());
  return weights;
}

// The network's outputs over the whole set, in one batch on this thread.
nn::Tensor Logits(const nn::Tensor& x) {
  Net net;
  EXPECT_TRUE(net.load_state_dict(InitialWeights()).ok());
  net.eval();
  nn::NoGradGuard no_grad;
  return net(x);
}

std::unique_ptr<Model> Prepared(int ranks, LossFunction loss) {
  auto model = std::make_unique<Model>([] { return std::make_shared<Net>(); }, Cpu(ranks));
  model->prepare(FrozenSgd(), std::move(loss));
  // Every Model starts from InitialWeights(): a state_dict() from main keeps
  // the factory's first draw, on the seed InitialWeights() draws from.
  nn::manual_seed(9);
  EXPECT_TRUE(model->state_dict().ok());
  return model;
}

double EvalLoss(int ranks, int64_t batch, LossFunction loss, const Set& set) {
  auto model = Prepared(ranks, std::move(loss));
  absl::StatusOr<Logs> logs = model->evaluate(set.data, {.batch_size = batch});
  EXPECT_TRUE(logs.ok()) << logs.status();
  return logs.ok() ? logs->at("eval_loss") : std::nan("");
}

void ExpectRelativelyNear(double got, double want, const std::string& where) {
  EXPECT_TRUE(std::isfinite(got)) << where << ": " << got;
  EXPECT_NEAR(got, want, 1e-6 * std::abs(want)) << where;
}

// The weighted mean with ignore_index, on every batch size and number of
// ranks, and in fit's evaluation: nn::cross_entropy's over the whole set.
TEST(EvalLossTest, WeightedAndIgnoredIsTheSetsLossOnAnyBatchSizeAndRanks) {
  const Set set = MakeSet();
  const double want = nn::cross_entropy(Logits(set.x), set.labels, Options()).item<double>();
  ASSERT_TRUE(std::isfinite(want));
  for (int ranks : {1, 3}) {
    for (int64_t batch : {int64_t{1}, int64_t{7}, kExamples}) {
      ExpectRelativelyNear(EvalLoss(ranks, batch, CrossEntropy(Options()), set), want,
                           absl::StrCat(ranks, " rank(s), batch ", batch));
    }
  }
  // Paddle's (N, 1) labels evaluate alike.
  auto column = std::make_shared<data::TensorDataset>(set.x, set.labels.reshape({kExamples, 1}));
  auto model = Prepared(3, CrossEntropy(Options()));
  absl::StatusOr<Logs> logs = model->evaluate(column, {.batch_size = 7});
  ASSERT_TRUE(logs.ok()) << logs.status();
  ExpectRelativelyNear(logs->at("eval_loss"), want, "(N, 1) labels");
  // fit's per-epoch evaluation (lr 0: the weights stay the initial ones).
  auto train = Prepared(3, CrossEntropy(Options()));
  absl::StatusOr<History> h = train->fit(
      set.data, {.epochs = 1, .batch_size = 4, .eval_data = set.data, .eval_batch_size = 7});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_EQ(h->epochs.size(), 1u);
  ExpectRelativelyNear(h->epochs[0].at("eval_loss"), want, "fit's evaluation");
}

// Without a weight, ignore_index alone: the mean over the labels not ignored.
// kSum: the set's sum. MeanSquaredError: the mean over every element.
TEST(EvalLossTest, UnweightedSumAndMeanSquaredErrorAreTheSetsLoss) {
  const Set set = MakeSet();
  const nn::Tensor logits = Logits(set.x);
  const nn::CrossEntropyOptions ignore{.ignore_index = kIgnored};
  const double mean = nn::cross_entropy(logits, set.labels, ignore).item<double>();
  const double sum = nn::cross_entropy(logits, set.labels, Options(nn::Reduction::kSum))
                         .item<double>();
  for (int ranks : {1, 3}) {
    for (int64_t batch : {int64_t{1}, int64_t{7}}) {
      const std::string where = absl::StrCat(ranks, " rank(s), batch ", batch);
      ExpectRelativelyNear(EvalLoss(ranks, batch, CrossEntropy(ignore), set), mean, where);
      ExpectRelativelyNear(EvalLoss(ranks, batch, CrossEntropy(Options(nn::Reduction::kSum)), set),
                           sum, where + ", kSum");
    }
  }
  // Regression targets: the network's 3 outputs against the first 3 features.
  const std::vector<float> xs = set.x.to_vector<float>();
  std::vector<float> three;
  for (int64_t i = 0; i < kExamples; ++i)
    for (int64_t j = 0; j < 3; ++j) three.push_back(xs[i * 4 + j]);
  const nn::Tensor y = nn::from_vector(three, {kExamples, 3});
  const double mse = nn::mse_loss(logits, y).item<double>();
  Set regression{set.x, y, std::make_shared<data::TensorDataset>(set.x, y)};
  ExpectRelativelyNear(EvalLoss(3, 7, MeanSquaredError(), regression), mse, "MeanSquaredError");
}

// label_smoothing, with and without a class weight, beside ignore_index, in
// kMean and kSum, with (N) and (N, 1) labels, on 3 ranks of batch 7, and the
// same under bf16 autocast (the logits bfloat16, the loss and its
// denominator computed in float32): nn::cross_entropy's over the whole set,
// from the logits computed alike in one batch.
TEST(EvalLossTest, LabelSmoothingAndBf16AreTheSetsLoss) {
  const Set set = MakeSet();
  const auto column =
      std::make_shared<data::TensorDataset>(set.x, set.labels.reshape({kExamples, 1}));
  for (bool bf16 : {false, true}) {
    nn::Tensor logits;
    {
      std::optional<nn::AutocastGuard> autocast;
      if (bf16) autocast.emplace(nn::kBFloat16);
      logits = Logits(set.x);
    }
    for (bool weighted : {false, true}) {
      for (nn::Reduction reduction : {nn::Reduction::kMean, nn::Reduction::kSum}) {
        nn::CrossEntropyOptions options = Options(reduction);
        options.label_smoothing = 0.2;
        if (!weighted) options.weight.reset();
        double want = 0;
        {
          std::optional<nn::AutocastGuard> autocast;
          if (bf16) autocast.emplace(nn::kBFloat16);
          want = nn::cross_entropy(logits, set.labels, options).item<double>();
        }
        for (bool by_column : {false, true}) {
          const std::string where =
              absl::StrCat(bf16 ? "bf16" : "float32", weighted ? ", weighted" : "",
                           reduction == nn::Reduction::kSum ? ", kSum" : ", kMean",
                           by_column ? ", (N, 1) labels" : "");
          auto model = Prepared(3, CrossEntropy(options));
          absl::StatusOr<Logs> logs = model->evaluate(
              by_column ? std::shared_ptr<const data::Dataset>(column) : set.data,
              {.batch_size = 7, .bf16 = bf16});
          ASSERT_TRUE(logs.ok()) << where << ": " << logs.status();
          ExpectRelativelyNear(logs->at("eval_loss"), want, where);
        }
      }
    }
  }
}

// A set whose labels are all ignored: the mean of nothing is NaN (PyTorch's
// 0 / 0), the sum 0; a batch of them alone no longer decides (see above).
TEST(EvalLossTest, ASetOfIgnoredLabelsOnlyIsNanAsAMeanAndZeroAsASum) {
  const Set set = MakeSet(/*all_ignored=*/true);
  EXPECT_TRUE(std::isnan(EvalLoss(3, 7, CrossEntropy(Options()), set)));
  EXPECT_EQ(EvalLoss(3, 7, CrossEntropy(Options(nn::Reduction::kSum)), set), 0.0);
}

// A lambda (and a std::function) is a LossFunction as before: evaluated by
// rows, the sum of each batch's loss times its rows over the rows. With a
// class weight (no ignore_index here: no batch is NaN) that is not the set's
// weighted mean, so the lambda's eval_loss is computed here batch by batch:
// batch 7 on one rank, 5 batches of 7 and one of 2.
TEST(EvalLossTest, AUserLambdaIsWeighedByRowsAsBefore) {
  const Set set = MakeSet();
  const nn::Tensor logits = Logits(set.x);
  const nn::Tensor& labels = set.labels;
  const int64_t n = kExamples;
  nn::CrossEntropyOptions options = Options();
  options.ignore_index = -100;
  auto lambda = [options](const nn::Tensor& output, const nn::Tensor& target) {
    return nn::cross_entropy(output, target, options);
  };
  double by_rows = 0;
  for (int64_t begin = 0; begin < n; begin += 7) {
    const int64_t end = std::min(begin + 7, n);
    by_rows += nn::cross_entropy(logits.slice(begin, end), labels.slice(begin, end), options)
                   .item<double>() *
               static_cast<double>(end - begin);
  }
  const double want = by_rows / static_cast<double>(n);
  LossFunction from_lambda = lambda;
  EXPECT_FALSE(from_lambda.has_terms());
  ExpectRelativelyNear(EvalLoss(1, 7, from_lambda, set), want, "lambda");
  const LossFunction::Function function = lambda;
  ExpectRelativelyNear(EvalLoss(1, 7, function, set), want, "std::function");
  // Not the set's weighted mean: the exact form differs here.
  const double exact = nn::cross_entropy(logits, labels, options).item<double>();
  EXPECT_GT(std::abs(want - exact), 1e-3 * std::abs(exact));
  ExpectRelativelyNear(EvalLoss(1, 7, CrossEntropy(options), set), exact, "CrossEntropy");
  // The user's own exact form: LossFunction(loss, terms), its denominator the
  // weights of the labels not ignored (nll_loss's sum over log-probabilities of -1).
  LossFunction with_terms(lambda, [options](const nn::Tensor& output, const nn::Tensor& target) {
    LossTerms t;
    nn::CrossEntropyOptions sum = options;
    sum.reduction = nn::Reduction::kSum;
    t.sum = nn::cross_entropy(output, target, sum);
    t.denominator = nn::nll_loss(nn::full(output.shape(), -1.0), target,
                                 {.reduction = nn::Reduction::kSum,
                                  .weight = options.weight,
                                  .ignore_index = options.ignore_index});
    return t;
  });
  EXPECT_TRUE(with_terms.has_terms());
  ExpectRelativelyNear(EvalLoss(3, 7, with_terms, set), exact, "LossFunction(loss, terms)");
  // An empty one is refused at prepare, as an empty std::function was.
  LossFunction empty = nullptr;
  EXPECT_FALSE(static_cast<bool>(empty));
  EXPECT_TRUE(empty == nullptr);  // compared as a std::function was
  EXPECT_TRUE(from_lambda != nullptr);
  Model model([] { return std::make_shared<Net>(); }, Cpu(1));
  EXPECT_THROW(model.prepare(FrozenSgd(), empty), Error);
}

// CrossEntropy's terms are its loss: sum / denominator is the batch's mean.
TEST(EvalLossTest, CrossEntropysTermsAreItsMean) {
  const Set set = MakeSet();
  const nn::Tensor logits = Logits(set.x).slice(4, 20);
  const nn::Tensor labels = set.labels.slice(4, 20);
  const LossFunction loss = CrossEntropy(Options());
  ASSERT_TRUE(loss.has_terms());
  const LossTerms t = loss.terms(logits, labels);
  ASSERT_TRUE(t.denominator.defined());
  // Rows 4..7 are ignored: the denominator is the weights of rows 8..19's labels.
  const std::vector<int64_t> l = labels.to_vector<int64_t>();
  const std::vector<float> w = {0.5f, 2.0f, 3.0f};
  double weights = 0;
  for (int64_t y : l) weights += y == kIgnored ? 0.0 : w[static_cast<size_t>(y)];
  EXPECT_NEAR(t.denominator.item<double>(), weights, 1e-6 * weights);
  EXPECT_NEAR(t.sum.item<double>() / t.denominator.item<double>(),
              loss(logits, labels).item<double>(), 1e-6);
  const LossTerms s = CrossEntropy(Options(nn::Reduction::kSum)).terms(logits, labels);
  EXPECT_FALSE(s.denominator.defined());
}

}  // namespace
}  // namespace tandem::hapi
