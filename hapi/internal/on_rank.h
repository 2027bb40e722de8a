// Internal to hapi (model.cc, fit_loop.cc): what fit, evaluate and predict do
// alike on one rank: the rank's network, optimizer and metrics for one call,
// callbacks, the samplers' and loaders' options, sums over the ranks and the
// evaluation. Not installed for other folders' use.
#ifndef TANDEM_HAPI_INTERNAL_ON_RANK_H_
#define TANDEM_HAPI_INTERNAL_ON_RANK_H_

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/dataloader.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "data/transforms.h"
#include "hapi/callbacks.h"
#include "hapi/metrics.h"
#include "hapi/model.h"
#include "nn/error.h"
#include "nn/graph.h"
#include "nn/module.h"
#include "optim/optimizer.h"
#include "spawn/comm/communicator.h"
#include "spawn/context.h"
#include "spawn/train/data_parallel.h"
#include "spawn/train/zero_redundancy_optimizer.h"

namespace tandem::hapi {

struct Model::RankRun {
  std::shared_ptr<nn::Module> network;
  std::unique_ptr<dist::DataParallel> dp;
  // FitOptions::zero: the sharded optimizer (optimizer stays null).
  std::unique_ptr<dist::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::vector<std::unique_ptr<Metric>> metrics;
  // Every rank took rank 0's weights at Build (some rank's Model had none of
  // its own, or only its own draw): evaluate and predict keep them.
  bool took_rank_zeros_weights = false;
  // With zero: the unsharded state gathered on every rank at the end of fit
  // (a collective), for Keep.
  std::optional<optim::StateDict> gathered_state;
  // FitOptions::cuda_graph: the captured step, its static input and target and
  // the loss each replay rewrites. Last: the graph goes before what it replays.
  nn::Tensor static_data, static_target, graph_loss;
  std::unique_ptr<nn::CudaGraph> graph;
};

namespace internal {

// The labels (dist::Communicator::Label) of the batch calls' collectives, so
// that a rank that calls one alone fails naming it.
inline constexpr char kTrainBatchLabel[] =
    "hapi::Model::train_batch (a collective: call it on every rank, with the same number of "
    "calls, not under `if (rank == 0)`)";
inline constexpr char kEvalBatchLabel[] =
    "hapi::Model::eval_batch (a collective: call it on every rank, with the same number of "
    "calls, not under `if (rank == 0)`)";

// Runs one hook of every callback; an exception names the callback and the hook
// (a cancellation, another rank's failure reaching this one, passes unchanged).
template <typename Hook>
void CallEach(std::vector<std::unique_ptr<Callback>>& callbacks, const char* hook, Hook&& call) {
  for (auto& cb : callbacks) {
    try {
      call(*cb);
    } catch (const dist::CancelledError&) {
      throw;
    } catch (const std::exception& e) {
      Fail("callback ", cb->name(), " failed in ", hook, ": ", e.what());
    }
  }
}

// A ProgressLogger every log_freq steps (0: none), then one callback per factory.
std::vector<std::unique_ptr<Callback>> MakeCallbacks(const std::vector<CallbackFactory>& factories,
                                                     int64_t log_freq);

// The rank's index in its process (its global rank when the run has one process).
int LocalRank(const dist::Context& ctx);

// This rank's sampler over `size` examples with `batch` rows per rank.
data::DistributedOptions SamplerOptions(const dist::Context& ctx, int64_t size, int64_t batch);

// A loader onto the rank's device (pinned memory for a CUDA rank).
data::DataLoaderOptions LoaderOptions(const dist::Context& ctx, int num_workers,
                                      std::shared_ptr<const data::Transform> transform);

// Sums every rank's `values` (one float64 all_reduce on the rank's device).
std::vector<double> SumOverRanks(dist::Context& ctx, const std::vector<double>& values);

// The largest of every rank's `value` (of each of `values`: one all_reduce).
double MaxOverRanks(dist::Context& ctx, double value);
std::vector<double> MaxOverRanks(dist::Context& ctx, const std::vector<double>& values);

// What an evaluation adds up on one rank, batch by batch, and reduces over
// the ranks: the loss's sums (model.h, LossFunction: with the loss's terms,
// the batches' sums and denominators; else each batch's loss times its rows)
// and each metric's. evaluate's and Model::eval_batch's (one code path).
class EvalSums {
 public:
  // Resets `metrics`, which must outlive this.
  EvalSums(dist::Context& ctx, const LossFunction& loss,
           std::vector<std::unique_ptr<Metric>>& metrics);
  // One batch through `network` as it is (the caller sets eval mode and no
  // grad), forward and loss under bf16's autocast.
  void Add(nn::Module& network, const nn::Tensor& data, const nn::Tensor& target, bool bf16);
  // Every rank's sums added (one float64 all_reduce: a collective): the
  // "<prefix>loss" (with a loss) and "<prefix><metric>" of every rank's batches.
  Logs Reduce(const std::string& prefix);
  // Every rank's rows added, after Reduce.
  double total_rows() const { return total_rows_; }

 private:
  dist::Context& ctx_;
  const LossFunction& loss_;
  std::vector<std::unique_ptr<Metric>>& metrics_;
  const bool exact_;  // the loss has its terms
  nn::Tensor loss_sum_, denominator_;  // float64, on the device until Reduce
  double rows_ = 0;
  double mean_batches_ = 0;  // batches whose terms have a denominator
  double total_rows_ = 0;
};

// Evaluation on this rank's kUneven share, reduced over the ranks: "eval_loss"
// (with a loss) and "eval_<metric>".
Logs EvaluateOnRank(dist::Context& ctx, nn::Module& network, const LossFunction& loss,
                    std::vector<std::unique_ptr<Metric>>& metrics,
                    std::shared_ptr<const data::Dataset> dataset, int64_t batch_size,
                    int num_workers, bool bf16, std::shared_ptr<const data::Transform> transform);

}  // namespace internal
}  // namespace tandem::hapi

#endif  // TANDEM_HAPI_INTERNAL_ON_RANK_H_
