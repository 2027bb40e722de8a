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
  for (auto& m : metrics) m->reset();
  // The set's loss (model.h, LossFunction): with the loss's terms, the sum of
  // the batches' sums over the sum of their denominators (none: the loss is
  // a sum); else the sum of (batch loss * rows) over the rows. On the device
  // until the reduction.
  const bool exact = loss && loss.has_terms();
  const nn::TensorOptions f64{.dtype = nn::kFloat64, .device = ctx.device()};
  nn::Tensor loss_sum = nn::zeros({}, f64);
  nn::Tensor denominator = nn::zeros({}, f64);
  double rows = 0;
  double mean_batches = 0;  // batches whose terms have a denominator
  while (auto batch = loader.next()) {
    nn::Tensor out;
    nn::Tensor batch_loss;
    LossTerms terms;
    {
      std::optional<nn::AutocastGuard> autocast;
      if (bf16) autocast.emplace(nn::kBFloat16);
      out = network(batch->data);
      if (exact) {
        terms = loss.terms(out, batch->target);
      } else if (loss) {
        batch_loss = loss(out, batch->target);
      }
    }
    const auto n = static_cast<double>(batch->data.size(0));
    if (exact) {
      loss_sum = loss_sum + terms.sum.detach().to(nn::kFloat64);
      if (terms.denominator.defined()) {
        denominator = denominator + terms.denominator.detach().to(nn::kFloat64);
        mean_batches += 1;
      }
    } else if (loss) {
      loss_sum = loss_sum + batch_loss.detach().to(nn::kFloat64) * n;
    }
    rows += n;
    for (auto& m : metrics) m->update(out, batch->target);
  }
  network.train(was_training);
  std::vector<double> sums = {loss_sum.item(), exact ? denominator.item() : rows, mean_batches};
  for (auto& m : metrics) sums.insert(sums.end(), m->sums().begin(), m->sums().end());
  sums = SumOverRanks(ctx, sums);
  Logs logs;
  // A mean over a set whose denominator is 0 (every label ignored) is NaN, as
  // PyTorch's mean of nothing; a loss that is a sum is the sum over the set.
  if (loss) logs["eval_loss"] = !exact || sums[2] > 0 ? sums[0] / sums[1] : sums[0];
  size_t at = 3;
  for (auto& m : metrics) {
    const size_t k = m->sums().size();
    m->set_sums(std::vector<double>(sums.begin() + at, sums.begin() + at + k));
    at += k;
    logs["eval_" + m->name()] = m->value();
  }
  return logs;
}

}  // namespace tandem::hapi::internal
