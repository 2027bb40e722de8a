// hapi metrics: values that are right across ranks.
//
// A metric accumulates sums on each rank (update() per batch) and is reduced
// once per evaluation: hapi::Model sums every rank's sums() with one all_reduce
// and computes the value from the totals. So with uneven shards (the kUneven
// sampler, data/sampler.h) every sample counts exactly once, and the value on N
// ranks equals the value on one rank over the same samples (sums of float64
// counts: exact for counts below 2^53).
//
// A user metric derives from Metric, names its sums in the constructor, adds to
// them in update() and turns the totals into a value in Compute():
//
//   class MeanAbsoluteError : public hapi::Metric {
//    public:
//     MeanAbsoluteError() : Metric("mae", /*num_sums=*/2) {}
//     void update(const nn::Tensor& output, const nn::Tensor& target) override {
//       auto o = output.to_vector<double>(), t = target.to_vector<double>();
//       for (size_t i = 0; i < o.size(); ++i) add(0, std::abs(o[i] - t[i]));
//       add(1, static_cast<double>(o.size()));
//     }
//     double Compute(const std::vector<double>& s) const override { return s[0] / s[1]; }
//   };
//
// update() reads the batch on the host (a host wait on a GPU), as Paddle's
// metrics do; it runs in evaluation, not in the training step (fit's own
// training loss is accumulated on the device).
//
// Thread-safety: a metric belongs to one rank's thread; Model makes one per rank
// from the MetricFactory given to prepare().
#ifndef TANDEM_HAPI_METRICS_H_
#define TANDEM_HAPI_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/tensor.h"

namespace tandem::hapi {

class Metric {
 public:
  Metric(std::string name, int num_sums);
  virtual ~Metric() = default;
  Metric(const Metric&) = delete;
  Metric& operator=(const Metric&) = delete;

  // The key of the metric's value in Logs ("acc", "acc_top5", "precision").
  const std::string& name() const { return name_; }
  // output: the model's output for a batch (N, ...); target: its targets (N, ...).
  // Throws tandem::Error naming the metric and the shapes when they do not fit.
  virtual void update(const nn::Tensor& output, const nn::Tensor& target) = 0;
  // The value from (reduced) sums; NaN where it is undefined (no samples).
  virtual double Compute(const std::vector<double>& sums) const = 0;

  void reset();
  const std::vector<double>& sums() const { return sums_; }
  void set_sums(std::vector<double> sums);  // the reduced totals; sizes must match
  // The value of this metric's current sums.
  double value() const { return Compute(sums_); }

 protected:
  void add(int i, double v) { sums_[static_cast<size_t>(i)] += v; }

 private:
  std::string name_;
  std::vector<double> sums_;
};

using MetricFactory = std::function<std::unique_ptr<Metric>()>;

// Fraction of samples whose label is among the k largest outputs.
// output: (N, C) float scores; target: (N) or (N, 1) int64 labels in [0, C).
// A NaN score ranks above every number, and a sample whose label's score is NaN
// is wrong: a diverged model scores 0, not 1.
// Name "acc" for k = 1, "acc_top<k>" otherwise (Paddle's names).
class Accuracy : public Metric {
 public:
  explicit Accuracy(int k = 1);
  void update(const nn::Tensor& output, const nn::Tensor& target) override;
  double Compute(const std::vector<double>& sums) const override;

 private:
  int k_;
};

// Binary precision and recall (Paddle's paddle.metric.Precision / Recall): a
// sample is predicted positive when its output is > threshold. output: (N) or
// (N, 1) probabilities (or scores with a matching threshold); target: (N) or
// (N, 1) labels 0 or 1 (any dtype). Precision = tp / (tp + fp), recall =
// tp / (tp + fn); 0 when the denominator is 0 (Paddle's convention).
class Precision;
class Recall;

// tp / (tp + other), other = fp (precision) or fn (recall).
class BinaryRatio : public Metric {
 public:
  void update(const nn::Tensor& output, const nn::Tensor& target) override;
  double Compute(const std::vector<double>& sums) const override;

 private:
  friend class Precision;
  friend class Recall;
  BinaryRatio(std::string name, double threshold, bool other_is_fp);
  double threshold_;
  bool other_is_fp_;
};

class Precision : public BinaryRatio {
 public:
  explicit Precision(double threshold = 0.5) : BinaryRatio("precision", threshold, true) {}
};

class Recall : public BinaryRatio {
 public:
  explicit Recall(double threshold = 0.5) : BinaryRatio("recall", threshold, false) {}
};

// The mean of every element of `output` over all batches (target unused): e.g.
// the mean of a per-sample quantity the model outputs.
class Mean : public Metric {
 public:
  explicit Mean(std::string name = "mean");
  void update(const nn::Tensor& output, const nn::Tensor& target) override;
  double Compute(const std::vector<double>& sums) const override;
};

// Factories for prepare(): hapi::MakeMetric<hapi::Accuracy>(5) makes Accuracy(5) per rank.
template <typename M, typename... Args>
MetricFactory MakeMetric(Args... args) {
  return [=] { return std::unique_ptr<Metric>(new M(args...)); };
}

}  // namespace tandem::hapi

#endif  // TANDEM_HAPI_METRICS_H_
