// What fit, evaluate and predict do alike on one rank (internal/on_rank.h).
#include "hapi/internal/on_rank.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "nn/autocast.h"
#include "nn/ops/elementwise.h"
#include "nn/tensor.h"

namespace tandem::hapi::internal {

std::vector<std::unique_ptr<Callback>> MakeCallbacks(const std::vector<CallbackFactory>& factories,
                                                     int64_t log_freq) {
  std::vector<std::unique_ptr<Callback>> out;
  if (log_freq > 0) out.push_back(std::make_unique<ProgressLogger>(log_freq));
  for (const auto& make : factories) {
    TANDEM_CHECK(static_cast<bool>(make), "hapi: an empty CallbackFactory");
    out.push_back(make());
    TANDEM_CHECK(out.back() != nullptr, "hapi: a CallbackFactory returned no callback");
  }
  return out;
}

int LocalRank(const dist::Context& ctx) {
  return ctx.local_rank() < 0 ? ctx.rank() : ctx.local_rank();
}

data::DistributedOptions SamplerOptions(const dist::Context& ctx, int64_t size, int64_t batch) {
  data::DistributedOptions o;
  o.dataset_size = size;
  o.batch_size = batch;
  o.num_replicas = ctx.world_size();
  o.rank = ctx.rank();
  return o;
}

data::DataLoaderOptions LoaderOptions(const dist::Context& ctx, int num_workers,
                                      std::shared_ptr<const data::Transform> transform) {
  data::DataLoaderOptions o;
  o.num_workers = num_workers;
  o.prefetch = std::max(2, 2 * num_workers);
  o.device = ctx.device();
  o.pin_memory = ctx.device().is_cuda();
  o.batch_transform = std::move(transform);
  return o;
}

std::vector<double> SumOverRanks(dist::Context& ctx, const std::vector<double>& values) {
  nn::Tensor t = nn::from_vector(values, {static_cast<int64_t>(values.size())},
                                 {.dtype = nn::kFloat64})
                     .to(ctx.device());
  ctx.communicator().all_reduce(t, dist::ReduceOp::kSum);
  return t.to_vector<double>();
}

std::vector<double> MaxOverRanks(dist::Context& ctx, const std::vector<double>& values) {
  nn::Tensor t = nn::from_vector(values, {static_cast<int64_t>(values.size())},
                                 {.dtype = nn::kFloat64})
                     .to(ctx.device());
  ctx.communicator().all_reduce(t, dist::ReduceOp::kMax);
  return t.to_vector<double>();
}

double MaxOverRanks(dist::Context& ctx, double value) {
  return MaxOverRanks(ctx, std::vector<double>{value})[0];
}

EvalSums::EvalSums(dist::Context& ctx, const LossFunction& loss,
                   std::vector<std::unique_ptr<Metric>>& metrics)
    : ctx_(ctx), loss_(loss), metrics_(metrics), exact_(loss && loss.has_terms()) {
  const nn::TensorOptions f64{.dtype = nn::kFloat64, .device = ctx.device()};
  loss_sum_ = nn::zeros({}, f64);
  denominator_ = nn::zeros({}, f64);
  for (auto& m : metrics_) m->reset();
}

void EvalSums::Add(nn::Module& network, const nn::Tensor& data, const nn::Tensor& target,
                   bool bf16) {
  nn::Tensor out;
  nn::Tensor batch_loss;
  LossTerms terms;
  {
    std::optional<nn::AutocastGuard> autocast;
    if (bf16) autocast.emplace(nn::kBFloat16);
    out = network(data);
    if (exact_) {
      terms = loss_.terms(out, target);
    } else if (loss_) {
      batch_loss = loss_(out, target);
    }
  }
  const auto n = static_cast<double>(data.size(0));
  if (exact_) {
    loss_sum_ = loss_sum_ + terms.sum.detach().to(nn::kFloat64);
    if (terms.denominator.defined()) {
      denominator_ = denominator_ + terms.denominator.detach().to(nn::kFloat64);
      mean_batches_ += 1;
    }
  } else if (loss_) {
    loss_sum_ = loss_sum_ + batch_loss.detach().to(nn::kFloat64) * n;
  }
  rows_ += n;
  for (auto& m : metrics_) m->update(out, target);
}

Logs EvalSums::Reduce(const std::string& prefix) {
  std::vector<double> sums = {loss_sum_.item(), exact_ ? denominator_.item() : rows_,
                              mean_batches_, rows_};
  for (auto& m : metrics_) sums.insert(sums.end(), m->sums().begin(), m->sums().end());
  sums = SumOverRanks(ctx_, sums);
  total_rows_ = sums[3];
  Logs logs;
  // A mean over a set whose denominator is 0 (every label ignored) is NaN, as
  // PyTorch's mean of nothing; a loss that is a sum is the sum over the set.
  if (loss_) logs[prefix + "loss"] = !exact_ || sums[2] > 0 ? sums[0] / sums[1] : sums[0];
  size_t at = 4;
  for (auto& m : metrics_) {
    const size_t k = m->sums().size();
    m->set_sums(std::vector<double>(sums.begin() + at, sums.begin() + at + k));
    at += k;
    logs[prefix + m->name()] = m->value();
  }
  return logs;
}

Logs EvaluateOnRank(dist::Context& ctx, nn::Module& network, const LossFunction& loss,
                    std::vector<std::unique_ptr<Metric>>& metrics,
                    std::shared_ptr<const data::Dataset> dataset, int64_t batch_size,
                    int num_workers, bool bf16, std::shared_ptr<const data::Transform> transform) {
  data::DistributedOptions so = SamplerOptions(ctx, dataset->size(), batch_size);
  so.shuffle = false;
  so.tail = data::DistributedTail::kUneven;
  auto sampler = std::make_shared<data::DistributedBatchSampler>(so);
  data::DataLoader loader(std::move(dataset), sampler,
                          LoaderOptions(ctx, num_workers, std::move(transform)));
  const bool was_training = network.is_training();
  network.eval();
  nn::NoGradGuard no_grad;
  EvalSums sums(ctx, loss, metrics);
  while (auto batch = loader.next()) sums.Add(network, batch->data, batch->target, bf16);
  network.train(was_training);
  return sums.Reduce("eval_");
}

}  // namespace tandem::hapi::internal
