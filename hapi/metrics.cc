#include "hapi/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nn/error.h"

namespace tandem::hapi {
namespace {

// Rows of a (N) or (N, 1) tensor; throws naming the metric otherwise.
int64_t ColumnRows(const std::string& metric, const char* what, const nn::Tensor& t) {
  const nn::Shape& s = t.shape();
  if (s.size() == 1) return s[0];
  if (s.size() == 2 && s[1] == 1) return s[0];
  Fail("metric ", metric, ": ", what, " must be (N) or (N, 1), got ", nn::ShapeToString(s));
}

// tp, fp, fn of a binary batch.
void CountBinary(const std::string& metric, double threshold, const nn::Tensor& output,
                 const nn::Tensor& target, double& tp, double& fp, double& fn) {
  const int64_t n = ColumnRows(metric, "output", output);
  const int64_t m = ColumnRows(metric, "target", target);
  TANDEM_CHECK(n == m, "metric ", metric, ": output has ", n, " rows but target has ", m);
  const std::vector<double> o = output.to_vector<double>();
  const std::vector<double> t = target.to_vector<double>();
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_CHECK(t[i] == 0 || t[i] == 1, "metric ", metric, ": target[", i, "] is ", t[i],
                 ", not a binary label 0 or 1");
    const bool predicted = o[i] > threshold;
    const bool positive = t[i] == 1;
    tp += predicted && positive;
    fp += predicted && !positive;
    fn += !predicted && positive;
  }
}

}  // namespace

Metric::Metric(std::string name, int num_sums)
    : name_(std::move(name)), sums_(static_cast<size_t>(num_sums), 0.0) {
  TANDEM_CHECK(num_sums >= 1, "metric ", name_, ": needs at least one sum, got ", num_sums);
}

void Metric::reset() { std::fill(sums_.begin(), sums_.end(), 0.0); }

void Metric::set_sums(std::vector<double> sums) {
  TANDEM_CHECK(sums.size() == sums_.size(), "metric ", name_, ": ", sums.size(),
               " sums given, it keeps ", sums_.size());
  sums_ = std::move(sums);
}

Accuracy::Accuracy(int k) : Metric(k == 1 ? "acc" : absl::StrCat("acc_top", k), 2), k_(k) {
  TANDEM_CHECK(k >= 1, "metric Accuracy: k must be >= 1, got ", k);
}

void Accuracy::update(const nn::Tensor& output, const nn::Tensor& target) {
  const nn::Shape& os = output.shape();
  TANDEM_CHECK(os.size() == 2, "metric ", name(), ": output must be (N, C) scores, got ",
               nn::ShapeToString(os));
  TANDEM_CHECK(target.dtype() == nn::kInt64, "metric ", name(),
               ": target must hold int64 class labels, got dtype ", nn::DTypeName(target.dtype()));
  const int64_t n = os[0], classes = os[1];
  const int64_t rows = ColumnRows(name(), "target", target);
  TANDEM_CHECK(rows == n, "metric ", name(), ": output ", nn::ShapeToString(os), " has ", n,
               " rows but target ", nn::ShapeToString(target.shape()), " has ", rows);
  TANDEM_CHECK(k_ <= classes, "metric ", name(), ": top-", k_, " of ", classes, " classes");
  const std::vector<double> scores = output.to_vector<double>();
  const std::vector<int64_t> labels = target.to_vector<int64_t>();
  double correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = labels[i];
    TANDEM_CHECK(label >= 0 && label < classes, "metric ", name(), ": label ", label,
                 " at row ", i, " is outside [0, ", classes, ")");
    // The label is in the top k when fewer than k scores beat it (ties: the
    // lower index wins, as argmax's first maximum does). NaN scores (a diverged
    // model) are never right: a NaN label score is wrong, and a NaN elsewhere
    // beats it (torch's topk orders NaN above every number); compared as
    // numbers only, every score would tie with nothing and count as correct.
    const double* row = scores.data() + i * classes;
    if (std::isnan(row[label])) continue;
    int64_t better = 0;
    for (int64_t c = 0; c < classes; ++c)
      better += std::isnan(row[c]) || row[c] > row[label] || (row[c] == row[label] && c < label);
    correct += better < k_;
  }
  add(0, correct);
  add(1, static_cast<double>(n));
}

double Accuracy::Compute(const std::vector<double>& s) const {
  return s[1] > 0 ? s[0] / s[1] : std::numeric_limits<double>::quiet_NaN();
}

BinaryRatio::BinaryRatio(std::string name, double threshold, bool other_is_fp)
    : Metric(std::move(name), 2), threshold_(threshold), other_is_fp_(other_is_fp) {}

void BinaryRatio::update(const nn::Tensor& output, const nn::Tensor& target) {
  double tp = 0, fp = 0, fn = 0;
  CountBinary(name(), threshold_, output, target, tp, fp, fn);
  add(0, tp);
  add(1, other_is_fp_ ? fp : fn);
}

double BinaryRatio::Compute(const std::vector<double>& s) const {
  return s[0] + s[1] > 0 ? s[0] / (s[0] + s[1]) : 0.0;
}

Mean::Mean(std::string name) : Metric(std::move(name), 2) {}

void Mean::update(const nn::Tensor& output, const nn::Tensor& /*target*/) {
  double sum = 0;
  for (double v : output.to_vector<double>()) sum += v;
  add(0, sum);
  add(1, static_cast<double>(output.numel()));
}

double Mean::Compute(const std::vector<double>& s) const {
  return s[1] > 0 ? s[0] / s[1] : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace tandem::hapi
