// Model::train_batch / eval_batch / predict_batch (model.h says the contract):
// the batch run kept in the Model between them, and the step, which is fit's
// own (internal/fit_loop.h: ForwardBackward, OptimizerStep).
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "hapi/internal/fit_loop.h"
#include "hapi/internal/fit_state.h"
#include "hapi/internal/on_rank.h"
#include "hapi/model.h"
#include "nn/autocast.h"
#include "nn/error.h"
#include "nn/status_macros.h"
#include "spawn/comm/communicator.h"
#include "spawn/context.h"

namespace tandem::hapi {
namespace {

// InvalidArgument for a batch the calls cannot take; labels may be null
// (predict_batch). `empty_ok`: 0 rows are a rank's empty share (eval_batch).
absl::Status CheckBatch(const char* call, const nn::Tensor& inputs, const nn::Tensor* labels,
                        bool empty_ok = false) {
  if (!inputs.defined())
    return absl::InvalidArgumentError(absl::StrCat("hapi::Model::", call, ": inputs is undefined"));
  if (inputs.dim() < 1 || inputs.size(0) < (empty_ok ? 0 : 1))
    return absl::InvalidArgumentError(
        absl::StrCat("hapi::Model::", call, ": inputs of shape ", nn::ShapeToString(inputs.shape()),
                     empty_ok ? ": a batch needs dim 0 (its rows; 0 for a rank with none)"
                              : ": a batch needs dim 0 with at least one row"));
  if (labels == nullptr) return absl::OkStatus();
  if (!labels->defined())
    return absl::InvalidArgumentError(absl::StrCat("hapi::Model::", call, ": labels is undefined"));
  if (labels->dim() < 1 || labels->size(0) != inputs.size(0))
    return absl::InvalidArgumentError(absl::StrCat(
        "hapi::Model::", call, ": inputs of shape ", nn::ShapeToString(inputs.shape()),
        " and labels of shape ", nn::ShapeToString(labels->shape()),
        ": dim 0 (the batch's rows) must be the same"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<dist::Context*> Model::BatchContext(const char* call) const {
  dist::Context* ctx = dist::current_or_null();
  if (ctx == nullptr)
    return absl::FailedPreconditionError(absl::StrCat(
        "hapi::Model::", call, ": called from main (outside dist::spawn); the batch calls run "
        "one batch on the calling rank: call them inside the function that dist::spawn runs, "
        "each rank with its own Model (train_batch and eval_batch on every rank together), or "
        "use fit / evaluate / predict from main"));
  return ctx;
}

bool Model::BatchRunIsOf(const dist::Context& ctx) const {
  return batch_run_ != nullptr && batch_ctx_ == &ctx && batch_spawn_ == ctx.stop_token();
}

void Model::AdoptBatchRun(std::unique_ptr<RankRun> run, const dist::Context& ctx, bool training,
                          bool agreed) {
  batch_run_ = std::move(run);
  batch_training_ = training;
  batch_agreed_ = agreed;
  batch_ctx_ = &ctx;
  batch_spawn_ = ctx.stop_token();
}

void Model::FoldBatchRun() {
  if (batch_run_ == nullptr) return;
  if (batch_training_) KeepRun(*batch_run_);
  batch_run_.reset();
  batch_ctx_ = nullptr;
  batch_spawn_ = {};
  batch_training_ = false;
  batch_agreed_ = false;
}

void Model::CopyBatchRun() {
  const dist::Context* ctx = dist::current_or_null();
  if (ctx == nullptr || !BatchRunIsOf(*ctx)) {
    FoldBatchRun();  // an earlier spawn's: nothing else holds it
  } else if (batch_training_) {
    KeepRun(*batch_run_);
  }
}

absl::Status Model::EnsureTrainingRun(dist::Context& ctx, int64_t rows) {
  if (batch_training_ && BatchRunIsOf(ctx)) return absl::OkStatus();
  FoldBatchRun();
  spawned_ = false;
  RETURN_IF_ERROR(CheckPendingOptimizerState());
  // As fit's first step: the agreed weights, DataParallel, the optimizer with
  // the kept (or loaded) state. fit's defaults otherwise (model.h, train_batch).
  std::unique_ptr<RankRun> run = Build(ctx, "train_batch", /*wrapped_by_data_parallel=*/true);
  const FitOptions defaults;
  const internal::RankBatch rank_batch{.global = rows * ctx.world_size(), .rows = rows};
  internal::PrepareForTraining(ctx, *run, defaults, rank_batch, optimizer_,
                               kept_.have_optimizer_state ? &kept_.optimizer_state : nullptr);
  AdoptBatchRun(std::move(run), ctx, /*training=*/true, /*agreed=*/true);
  return absl::OkStatus();
}

absl::StatusOr<nn::Tensor> Model::train_batch(const nn::Tensor& inputs, const nn::Tensor& labels,
                                              BatchOptions options) {
  ASSIGN_OR_RETURN(dist::Context * ctx, BatchContext("train_batch"));
  RETURN_IF_ERROR(CheckPrepared("train_batch"));
  RETURN_IF_ERROR(CheckBatch("train_batch", inputs, &labels));
  dist::Communicator::Label label(ctx->communicator(), internal::kTrainBatchLabel);
  RETURN_IF_ERROR(EnsureTrainingRun(*ctx, inputs.size(0)));
  RankRun& run = *batch_run_;
  run.network->train();  // eval_batch / predict_batch put it back, but a throw there may not
  nn::Tensor loss;
  {
    // update = false: the gradients accumulate locally, as fit's micro-batches
    // before the last; the next synchronised backward reduces their sum.
    std::optional<dist::DataParallel::NoSyncGuard> no_sync;
    if (!options.update) no_sync.emplace(run.dp.get());
    loss = internal::ForwardBackward(*ctx, *run.dp, loss_, inputs.to(ctx->device()),
                                     labels.to(ctx->device()), 1, options.bf16, "train_batch");
  }
  if (options.update) internal::OptimizerStep(*ctx, run, /*clip_grad_norm=*/0);
  return loss;
}

absl::StatusOr<Logs> Model::eval_batch(const nn::Tensor& inputs, const nn::Tensor& labels,
                                       BatchOptions options) {
  ASSIGN_OR_RETURN(dist::Context * ctx, BatchContext("eval_batch"));
  RETURN_IF_ERROR(CheckPrepared("eval_batch"));
  RETURN_IF_ERROR(CheckBatch("eval_batch", inputs, &labels, /*empty_ok=*/true));
  dist::Communicator::Label label(ctx->communicator(), internal::kEvalBatchLabel);
  if (!(batch_agreed_ && BatchRunIsOf(*ctx))) {
    // As evaluate: the weights agreed over the ranks, kept when they became rank 0's.
    FoldBatchRun();
    spawned_ = false;
    std::unique_ptr<RankRun> run = Build(*ctx, "eval_batch", /*wrapped_by_data_parallel=*/false);
    if (run->took_rank_zeros_weights) KeepRun(*run);
    AdoptBatchRun(std::move(run), *ctx, /*training=*/false, /*agreed=*/true);
  }
  nn::Module& network = *batch_run_->network;
  const bool was_training = network.is_training();
  network.eval();
  nn::NoGradGuard no_grad;
  internal::EvalSums sums(*ctx, loss_, batch_run_->metrics);
  // A rank with no rows (its share of a kUneven tail) adds nothing to the sums
  // but still takes part in their reduction.
  if (inputs.size(0) > 0)
    sums.Add(network, inputs.to(ctx->device()), labels.to(ctx->device()), options.bf16);
  network.train(was_training);
  Logs logs = sums.Reduce("");
  if (sums.total_rows() == 0)
    return absl::InvalidArgumentError(
        "hapi::Model::eval_batch: every rank passed 0 rows: there is nothing to evaluate "
        "(0 rows are for a rank whose share is empty while another rank has rows)");
  return logs;
}

absl::StatusOr<nn::Tensor> Model::predict_batch(const nn::Tensor& inputs, BatchOptions options) {
  ASSIGN_OR_RETURN(dist::Context * ctx, BatchContext("predict_batch"));
  RETURN_IF_ERROR(CheckBatch("predict_batch", inputs, nullptr));
  if (!BatchRunIsOf(*ctx)) {
    // No collective: the kept weights (this rank's own draw when none are kept).
    FoldBatchRun();
    RETURN_IF_ERROR(Materialize());
    auto run = std::make_unique<RankRun>();
    run->network = network_();
    if (run->network == nullptr)
      return absl::InternalError("hapi::Model: the network factory returned null");
    run->network->to(ctx->device());
    RETURN_IF_ERROR(run->network->load_state_dict(kept_.weights));
    AdoptBatchRun(std::move(run), *ctx, /*training=*/false, /*agreed=*/false);
  }
  nn::Module& network = *batch_run_->network;
  const bool was_training = network.is_training();
  network.eval();
  nn::NoGradGuard no_grad;
  nn::Tensor out;
  {
    std::optional<nn::AutocastGuard> autocast;
    if (options.bf16) autocast.emplace(nn::kBFloat16);
    out = network(inputs.to(ctx->device()));
  }
  network.train(was_training);
  return options.bf16 ? out.to(nn::kFloat32) : out.detach();
}

}  // namespace tandem::hapi
