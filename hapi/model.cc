#include "hapi/model.h"

#include <algorithm>
#include <cstddef>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/dataloader.h"
#include "data/sampler.h"
#include "hapi/internal/fit_loop.h"
#include "hapi/internal/fit_state.h"
#include "hapi/internal/host_state.h"
#include "hapi/internal/on_rank.h"
#include "nn/autocast.h"
#include "nn/error.h"
#include "nn/ops/loss.h"
#include "nn/random.h"
#include "nn/status_macros.h"
#include "spawn/comm/communicator.h"

namespace tandem::hapi {

using internal::CallEach;
using internal::CheckRestartOptions;
using internal::EvaluateOnRank;
using internal::HostCopy;
using internal::HostState;
using internal::LoaderOptions;
using internal::LocalRank;
using internal::MakeCallbacks;
using internal::RankBatch;
using internal::RankBatchOf;
using internal::SamplerOptions;

namespace {

absl::Status CheckDataset(const char* call, const std::shared_ptr<const data::Dataset>& d,
                          const char* what) {
  if (d == nullptr) return absl::InvalidArgumentError(absl::StrCat(call, ": ", what, " is null"));
  if (d->size() == 0)
    return absl::InvalidArgumentError(absl::StrCat(call, ": ", what, " is empty (0 examples)"));
  return absl::OkStatus();
}

absl::Status CheckFitOptions(const FitOptions& o) {
  auto bad = [](const char* name, auto value, const char* why) {
    return absl::InvalidArgumentError(absl::StrCat("fit: ", name, " = ", value, ": ", why));
  };
  if (o.epochs < 0) return bad("epochs", o.epochs, "must be >= 0");
  if (o.batch_size < 1) return bad("batch_size", o.batch_size, "must be >= 1");
  if (o.eval_batch_size < 0) return bad("eval_batch_size", o.eval_batch_size, "must be >= 0");
  if (o.eval_freq < 1) return bad("eval_freq", o.eval_freq, "must be >= 1");
  if (o.grad_accum_steps < 1) return bad("grad_accum_steps", o.grad_accum_steps, "must be >= 1");
  if (o.num_workers < 0) return bad("num_workers", o.num_workers, "must be >= 0");
  if (o.log_freq < 0) return bad("log_freq", o.log_freq, "must be >= 0");
  if (o.max_steps_per_epoch < 0)
    return bad("max_steps_per_epoch", o.max_steps_per_epoch, "must be >= 0");
  if (o.snapshot_every_steps < 0)
    return bad("snapshot_every_steps", o.snapshot_every_steps, "must be >= 0");
  if (!(o.clip_grad_norm >= 0))
    return bad("clip_grad_norm", o.clip_grad_norm, "must be >= 0 (0: no clipping)");
  if (o.uneven && o.drop_last)
    return absl::InvalidArgumentError(
        "fit: uneven = true with drop_last = true: uneven data keeps every sample");
  if (o.cuda_graph && (o.grad_accum_steps > 1 || o.zero || o.uneven))
    return absl::InvalidArgumentError(
        "fit: cuda_graph with grad_accum_steps > 1, zero or uneven: the captured step holds "
        "one synchronised micro-batch and the unsharded optimizer");
  if (o.cuda_graph && o.clip_grad_norm > 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "fit: cuda_graph with clip_grad_norm = ", o.clip_grad_norm,
        ": the captured step does not clip"));
  if (o.uneven && !o.checkpoint.dir.empty())
    return absl::InvalidArgumentError(
        "fit: uneven = true with checkpoint.dir: a rank that has joined cannot take part in "
        "a checkpoint's step agreement");
  if (o.resume && o.checkpoint.dir.empty())
    return absl::InvalidArgumentError("fit: resume needs checkpoint.dir");
  if (!o.checkpoint.dir.empty()) {
    absl::Status st = dist::CheckpointManager::Validate(o.checkpoint);
    if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("fit: checkpoint: ", st.message()));
  }
  if (o.eval_data != nullptr) return CheckDataset("fit", o.eval_data, "eval_data");
  return absl::OkStatus();
}

absl::Status CheckEvalOptions(const char* call, const EvalOptions& o) {
  if (o.batch_size < 1)
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": batch_size = ", o.batch_size, ": must be >= 1"));
  if (o.num_workers < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": num_workers = ", o.num_workers, ": must be >= 0"));
  return absl::OkStatus();
}

// Every rank's dataset indices under `so` (rank r's sampler, its rank
// replaced), from the samplers' host-only plans; max_rows: the most any rank has.
std::vector<std::vector<int64_t>> EveryRanksIndices(const data::DistributedOptions& so, int world,
                                                    int64_t& max_rows) {
  std::vector<std::vector<int64_t>> indices(static_cast<size_t>(world));
  max_rows = 0;
  for (int r = 0; r < world; ++r) {
    data::DistributedOptions other = so;
    other.rank = r;
    data::DistributedBatchSampler plan(other);
    while (auto b = plan.next()) indices[r].insert(indices[r].end(), b->begin(), b->end());
    max_rows = std::max<int64_t>(max_rows, static_cast<int64_t>(indices[r].size()));
  }
  return indices;
}

// The shape of one example of the outputs (all but dim 0), from rank 0's
// (kUneven gives rank 0 the most rows): one broadcast.
nn::Shape ExampleShapeOfRankZero(dist::Context& ctx, const std::vector<nn::Tensor>& outputs) {
  std::vector<int64_t> shape_code(9, 0);
  if (!outputs.empty()) {
    const nn::Shape& s = outputs.front().shape();
    TANDEM_CHECK(s.size() >= 1 && s.size() <= 8, "hapi::Model::predict: output shape ",
                 nn::ShapeToString(s), " has ", s.size(), " dims; 1 to 8 are supported");
    shape_code[0] = static_cast<int64_t>(s.size());
    for (size_t d = 1; d < s.size(); ++d) shape_code[d] = s[d];
  }
  nn::Tensor code = nn::from_vector(shape_code, {9}, {.dtype = nn::kInt64}).to(ctx.device());
  ctx.communicator().broadcast(code, 0);
  shape_code = code.to_vector<int64_t>();
  nn::Shape example_shape;
  for (int64_t d = 1; d < shape_code[0]; ++d) example_shape.push_back(shape_code[d]);
  return example_shape;
}

}  // namespace

namespace internal {

nn::Tensor HostCopy(const nn::Tensor& t) {
  nn::NoGradGuard no_grad;
  return t.device().is_cpu() ? t.detach().clone() : t.to(nn::Device::CPU());
}

// Host copies of the module's parameters and buffers.
nn::StateDict HostState(const nn::Module& module) {
  nn::StateDict host;
  for (const auto& [name, t] : module.state_dict()) host.emplace_back(name, HostCopy(t));
  return host;
}

}  // namespace internal

LossFunction CrossEntropy() { return CrossEntropy(nn::CrossEntropyOptions{}); }

namespace {

// CrossEntropy's class weight on each rank's device: the given tensor where the
// output lives on its device, else one copy per (device, rank thread), made at the
// thread's first call on its own stream, so that a rank's reads wait on no other
// stream (Tensor::data_ptr would order them if they did). The copies live as long
// as the LossFunction: each later fit's threads add theirs, and a thread id that
// the system reuses finds an ended thread's copy, which data_ptr orders as above.
class ClassWeightPlacement {
 public:
  explicit ClassWeightPlacement(nn::Tensor weight) : weight_(std::move(weight)) {}
  nn::Tensor On(nn::Device device) {
    if (weight_.device() == device) return weight_;
    const std::thread::id thread = std::this_thread::get_id();
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, copy] : copies_) {
      if (key.first == device && key.second == thread) return copy;
    }
    nn::NoGradGuard no_grad;
    copies_.push_back({{device, thread}, weight_.to(device)});
    return copies_.back().second;
  }

 private:
  const nn::Tensor weight_;
  std::mutex mu_;
  std::vector<std::pair<std::pair<nn::Device, std::thread::id>, nn::Tensor>> copies_;
};

}  // namespace

LossFunction CrossEntropy(nn::CrossEntropyOptions options) {
  TANDEM_CHECK(options.reduction != nn::Reduction::kNone,
               "hapi::CrossEntropy: reduction none gives one loss per sample; the loss must be "
               "0-dim (mean or sum)");
  TANDEM_CHECK(options.label_smoothing >= 0 && options.label_smoothing <= 1,
               "hapi::CrossEntropy: label_smoothing ", options.label_smoothing,
               " is outside [0, 1]");
  std::shared_ptr<ClassWeightPlacement> weight;
  if (options.weight.has_value()) {
    // Checked here, once: a rank's copy on another device does not require grad, so
    // nn::cross_entropy there would take a weight that it refuses on the CPU.
    const nn::Tensor& w = *options.weight;
    TANDEM_CHECK(w.defined(), "hapi::CrossEntropy: weight is undefined");
    TANDEM_CHECK(w.dim() == 1, "hapi::CrossEntropy: weight of shape ",
                 nn::ShapeToString(w.shape()), " must be 1-D, one weight per class");
    TANDEM_CHECK(!w.requires_grad(),
                 "hapi::CrossEntropy: weight requires grad; class weights are constants "
                 "(detach it)");
    weight = std::make_shared<ClassWeightPlacement>(w);
  }
  // Paddle's labels of shape (N, 1), as Accuracy takes them. Labels of another
  // N or dtype stay as they are, so that the error names the shape they came in.
  auto labels_of = [](const nn::Tensor& output, const nn::Tensor& target) {
    if (output.dim() == 2 && target.dim() == 2 && target.size(1) == 1 &&
        target.size(0) == output.size(0) && target.dtype() == nn::kInt64) {
      return target.reshape({target.size(0)});
    }
    return target;
  };
  auto options_on = [options, weight](const nn::Tensor& output) {
    nn::CrossEntropyOptions call = options;
    if (weight != nullptr) call.weight = weight->On(output.device());
    return call;
  };
  auto loss = [labels_of, options_on](const nn::Tensor& output, const nn::Tensor& target) {
    return nn::cross_entropy(output, labels_of(output, target), options_on(output));
  };
  auto terms = [labels_of, options_on](const nn::Tensor& output, const nn::Tensor& target) {
    const nn::Tensor labels = labels_of(output, target);
    nn::CrossEntropyOptions call = options_on(output);
    const nn::Reduction reduction = call.reduction;
    call.reduction = nn::Reduction::kSum;
    LossTerms t;
    t.sum = nn::cross_entropy(output, labels, call);
    if (reduction == nn::Reduction::kMean) {
      // kMean's denominator, sum over the labels not ignored of weight[label]:
      // nll_loss (kSum) of log-probabilities that are all -1, on the device.
      // Under autocast nll_loss computes in float32: the -1s are float32 at
      // once, not bfloat16 logits' dtype that it would cast.
      const nn::DType dtype = nn::autocast_enabled() && output.dtype() == nn::kBFloat16
                                  ? nn::kFloat32
                                  : output.dtype();
      const nn::Tensor minus_one =
          nn::full(output.shape(), -1.0, {.dtype = dtype, .device = output.device()});
      t.denominator = nn::nll_loss(
          minus_one, labels,
          nn::NllLossOptions{.reduction = nn::Reduction::kSum,
                             .weight = call.weight,
                             .ignore_index = call.ignore_index});
    }
    return t;
  };
  return LossFunction(std::move(loss), std::move(terms));
}

LossFunction MeanSquaredError() {
  return LossFunction(
      [](const nn::Tensor& output, const nn::Tensor& target) {
        return nn::mse_loss(output, target);
      },
      [](const nn::Tensor& output, const nn::Tensor& target) {
        LossTerms t;
        t.sum = nn::mse_loss(output, target, nn::Reduction::kSum);
        t.denominator = nn::full({}, static_cast<double>(output.numel()),
                                 {.dtype = nn::kFloat64, .device = output.device()});
        return t;
      });
}

Model::Model(NetworkFactory network, LaunchOptions launch)
    : network_(std::move(network)), launch_(std::move(launch)) {
  TANDEM_CHECK(static_cast<bool>(network_), "hapi::Model: the network factory is empty");
}

Model::~Model() = default;

void Model::prepare(OptimizerFactory optimizer, LossFunction loss,
                    std::vector<MetricFactory> metrics) {
  TANDEM_CHECK(static_cast<bool>(optimizer), "hapi::Model::prepare: the optimizer factory is empty");
  TANDEM_CHECK(static_cast<bool>(loss), "hapi::Model::prepare: the loss function is empty");
  for (const auto& m : metrics)
    TANDEM_CHECK(static_cast<bool>(m), "hapi::Model::prepare: an empty metric factory");
  FoldBatchRun();
  optimizer_ = std::move(optimizer);
  loss_ = std::move(loss);
  metrics_ = std::move(metrics);
  // A new optimizer starts fresh, except with the state load() read before any
  // prepare(): the next fit checks it against this optimizer.
  if (kept_.unchecked_optimizer_file.empty()) kept_.have_optimizer_state = false;
}

absl::Status Model::CheckPrepared(const char* call) const {
  if (!optimizer_ || !loss_)
    return absl::FailedPreconditionError(
        absl::StrCat("hapi::Model::", call, ": call prepare(optimizer, loss, metrics) first"));
  return absl::OkStatus();
}

absl::Status Model::RunOnRanks(const std::function<absl::Status(dist::Context&)>& body) {
  if (dist::Context* ctx = dist::current_or_null()) {
    spawned_ = false;
    return body(*ctx);
  }
  spawned_ = true;
  return dist::spawn([&](dist::Context& ctx) { return body(ctx); }, launch_.nprocs, launch_.gpus,
                     launch_.spawn);
}

namespace {

// The calls whose Build agrees over the ranks, and the label of its
// collectives (dist::Communicator::Label), so that a rank calling one alone
// fails naming it.
struct AgreedCall {
  const char* name;
  const char* label;
};
constexpr AgreedCall kAgreedCalls[] = {
    {"evaluate",
     "hapi::Model::evaluate (inside a rank's function a collective: call it on every rank, not "
     "under `if (rank == 0)`)"},
    {"predict",
     "hapi::Model::predict (inside a rank's function a collective: call it on every rank, not "
     "under `if (rank == 0)`)"},
    {"fit",
     "hapi::Model::fit (inside a rank's function a collective: call it on every rank, not "
     "under `if (rank == 0)`)"},
    {"train_batch", internal::kTrainBatchLabel},
    {"eval_batch", internal::kEvalBatchLabel},
};

size_t AgreedCallIndex(const char* call) {
  for (size_t i = 0; i < std::size(kAgreedCalls); ++i) {
    if (std::string_view(kAgreedCalls[i].name) == call) return i;
  }
  TANDEM_CHECK(false, "hapi::Model: no agreement for the call ", call);
  return 0;
}

}  // namespace

bool Model::AgreeToTakeRankZerosWeights(dist::Context& ctx, const char* call, bool training) {
  const bool needs = !kept_.have_weights || kept_.weights_of_this_rank;
  // From main every rank reads this one Model (under mpirun each process its
  // own, from the same script): the same answer everywhere, no collective.
  if (spawned_) return needs;
  // Inside a rank's function each rank has its own Model, which a call on one
  // rank alone sets apart (`if (rank == 0) model.load(path)`, before or after
  // an earlier call): one all_reduce agrees, so that every rank enters the
  // same broadcasts, and names a rank that made another call.
  const size_t index = AgreedCallIndex(call);
  const double rank = ctx.rank();
  const bool zero = ctx.rank() == 0;
  const bool has_state = kept_.have_optimizer_state;
  const bool loaded = kept_.loaded_since_agreed;
  // One MAX over the ranks: flags (1: some rank), ranks (the highest such
  // rank; -1: none) and the call's index both ways (max and -min).
  enum Slot {
    kSomeNeeds,         // a rank without weights of its own
    kZeroNeeds,         // rank 0 without weights of its own
    kWeightsHolder,     // a rank with weights of its own
    kStateHolder,       // a rank with an optimizer state
    kStateLacker,       // a rank without one
    kSomeLoaded,        // a rank that loaded since the last agreement
    kNotLoaded,         // a rank that did not
    kZeroLoaded,        // rank 0 loaded
    kOtherLoaded,       // a rank other than 0 that loaded
    kCallMax,
    kCallMinNegated,
  };
  const std::vector<double> any = internal::MaxOverRanks(
      ctx, {needs ? 1.0 : 0.0, zero && needs ? 1.0 : 0.0, needs ? -1.0 : rank,
            has_state ? rank : -1.0, has_state ? -1.0 : rank, loaded ? 1.0 : 0.0,
            loaded ? -1.0 : rank, zero && loaded ? 1.0 : 0.0, !zero && loaded ? rank : -1.0,
            static_cast<double>(index), -static_cast<double>(index)});
  TANDEM_CHECK(any[kCallMax] == -any[kCallMinNegated], "hapi::Model::", call,
               ": some rank called hapi::Model::",
               kAgreedCalls[static_cast<size_t>(any[kCallMax])].name, " while another called ",
               "hapi::Model::", kAgreedCalls[static_cast<size_t>(-any[kCallMinNegated])].name,
               "; inside a rank's function call each on every rank, in the same order");
  const auto holder = static_cast<int64_t>(any[kWeightsHolder]);
  TANDEM_CHECK(!(any[kZeroNeeds] > 0 && holder > 0), "hapi::Model::", call, ": rank ", holder,
               " holds weights of its own (a load() there, or an earlier call's), while rank 0's "
               "Model has none: every rank would take rank 0's fresh weights and drop rank ",
               holder, "'s; call load() on rank 0 (its weights go to every rank) or on every rank");
  TANDEM_CHECK(!(any[kZeroLoaded] == 0 && any[kOtherLoaded] > 0), "hapi::Model::", call,
               ": rank ", static_cast<int64_t>(any[kOtherLoaded]),
               " loaded weights (a load() there alone) that rank 0 did not load: every rank "
               "would keep rank 0's and drop them; call load() on rank 0 (its weights go to "
               "every rank) or on every rank");
  // Some ranks loaded since the last agreement, others not: rank 0's go to all.
  const bool loads_differ = any[kSomeLoaded] > 0 && any[kNotLoaded] >= 0;
  if (training) {
    TANDEM_CHECK(!(any[kStateHolder] >= 0 && any[kStateLacker] >= 0), "hapi::Model::", call,
                 ": rank ", static_cast<int64_t>(any[kStateHolder]),
                 " holds an optimizer state (from load() or an earlier fit) that rank ",
                 static_cast<int64_t>(any[kStateLacker]),
                 " lacks, so their optimizers would step apart; call load() on every rank "
                 "(each then holds the file's optimizer state, or none with reset_optimizer), "
                 "or, when the state came from a load() on rank 0 alone, load there with "
                 "reset_optimizer (rank 0's weights go to every rank, the optimizer starts "
                 "fresh)");
    TANDEM_CHECK(!(loads_differ && any[kStateHolder] >= 0), "hapi::Model::", call,
                 ": rank 0 loaded an optimizer state (a load() there alone) while rank ",
                 static_cast<int64_t>(any[kNotLoaded]),
                 " keeps its own (from an earlier fit or load), so their optimizers would step "
                 "apart; call load() on every rank");
  }
  // Only a training call's agreement clears the mark (as save's keeps it): an
  // evaluate or predict gives every rank rank 0's loaded weights but not its
  // loaded optimizer state, which the next fit or train_batch must still refuse.
  if (training) kept_.loaded_since_agreed = false;
  return any[kSomeNeeds] > 0 || loads_differ;
}

std::unique_ptr<Model::RankRun> Model::Build(dist::Context& ctx, const char* call,
                                             bool wrapped_by_data_parallel) {
  // Inside a rank's function, the agreement and the broadcasts below name
  // the call where a rank made it alone.
  std::optional<dist::Communicator::Label> label;
  if (!spawned_) label.emplace(ctx.communicator(), kAgreedCalls[AgreedCallIndex(call)].label);
  const bool take_rank_zeros = AgreeToTakeRankZerosWeights(ctx, call, wrapped_by_data_parallel);
  auto run = std::make_unique<RankRun>();
  run->network = network_();
  TANDEM_CHECK(run->network != nullptr, "hapi::Model: the network factory returned null");
  run->network->to(ctx.device());
  if (kept_.have_weights) {
    absl::Status st = run->network->load_state_dict(kept_.weights);
    TANDEM_CHECK(st.ok(), "hapi::Model: the kept weights do not fit the network: ", st.message());
  }
  run->took_rank_zeros_weights = take_rank_zeros;
  if (take_rank_zeros && !wrapped_by_data_parallel) {
    // A fresh network (or one that state_dict() built on this rank alone) on
    // some rank: every rank takes rank 0's weights, as DataParallel's
    // construction does for fit, so evaluate() and predict() before any fit
    // agree too, and a load() on rank 0 alone reaches every rank.
    nn::NoGradGuard no_grad;
    for (auto& [name, t] : run->network->state_dict()) {
      nn::Tensor data = t.detach();
      ctx.communicator().broadcast(data, 0);
    }
  }
  for (const auto& make : metrics_) {
    run->metrics.push_back(make());
    TANDEM_CHECK(run->metrics.back() != nullptr, "hapi::Model: a metric factory returned null");
  }
  return run;
}

void Model::Keep(dist::Context& ctx, RankRun& run) {
  // Spawned from main, every rank thread gets here: local rank 0 keeps
  // (DataParallel holds every rank's weights equal). Inside a rank's function
  // the Model is that rank's own.
  if (spawned_ && LocalRank(ctx) != 0) return;
  KeepRun(run);
}

void Model::KeepRun(RankRun& run) {
  kept_.weights = HostState(*run.network);
  kept_.have_weights = true;
  kept_.weights_of_this_rank = false;
  if (run.gathered_state.has_value() || run.optimizer != nullptr) {
    optim::StateDict st = run.gathered_state.has_value() ? std::move(*run.gathered_state)
                                                          : run.optimizer->state_dict();
    for (auto& [name, t] : st.tensors) t = HostCopy(t);
    kept_.optimizer_state = std::move(st);
    kept_.have_optimizer_state = true;
    kept_.optimizer_type = run.zero != nullptr ? run.zero->optimizer().name() : run.optimizer->name();
  }
}

absl::StatusOr<History> Model::fit(std::shared_ptr<const data::Dataset> train,
                                   FitOptions options) {
  RETURN_IF_ERROR(CheckPrepared("fit"));
  FoldBatchRun();
  RETURN_IF_ERROR(CheckDataset("fit", train, "the training data"));
  RETURN_IF_ERROR(CheckFitOptions(options));
  if (dist::current_or_null() == nullptr) RETURN_IF_ERROR(CheckRestartOptions(options, launch_));
  // A fit that fails changes nothing the Model keeps: from main, local rank 0
  // may have kept its weights and optimizer state before another rank failed,
  // and the check below passes a state that load() read before prepare(). Both
  // are put back, so that the next prepare() and fit() start as they would
  // have without the failed fit (the host copies are handles: no tensor is copied).
  const Kept before = kept_;
  RETURN_IF_ERROR(CheckPendingOptimizerState());
  History history;
  absl::Status status;
  try {
    status = RunOnRanks([&](dist::Context& ctx) -> absl::Status {
      History h = FitOnRank(ctx, train, options);
      if (!spawned_ || LocalRank(ctx) == 0) history = std::move(h);
      return absl::OkStatus();
    });
  } catch (...) {  // inside a rank's function: this rank's fit failed
    kept_ = before;
    throw;
  }
  if (!status.ok()) {
    kept_ = before;
    return status;
  }
  return history;
}

History Model::FitOnRank(dist::Context& ctx, const std::shared_ptr<const data::Dataset>& train,
                         const FitOptions& options) {
  const bool snapshots_on = internal::SnapshotsOn(ctx, options);
  const RankBatch rank_batch = RankBatchOf(ctx, options);
  std::unique_ptr<RankRun> run = Build(ctx, "fit", /*wrapped_by_data_parallel=*/true);
  internal::PrepareForTraining(ctx, *run, options, rank_batch, optimizer_,
                               kept_.have_optimizer_state ? &kept_.optimizer_state : nullptr);
  History history =
      internal::FitLoop(ctx, *run, loss_, train, options, rank_batch, snapshots_on).Run();
  Keep(ctx, *run);
  return history;
}

absl::StatusOr<Logs> Model::evaluate(std::shared_ptr<const data::Dataset> data,
                                     EvalOptions options) {
  RETURN_IF_ERROR(CheckPrepared("evaluate"));
  FoldBatchRun();
  RETURN_IF_ERROR(CheckDataset("evaluate", data, "the data"));
  RETURN_IF_ERROR(CheckEvalOptions("evaluate", options));
  Logs result;
  absl::Status status = RunOnRanks([&](dist::Context& ctx) -> absl::Status {
    // Build reads what the Model keeps; from main, local rank 0's Keep writes
    // it after the evaluation's all_reduce, which every rank has entered.
    std::unique_ptr<RankRun> run = Build(ctx, "evaluate", /*wrapped_by_data_parallel=*/false);
    std::vector<std::unique_ptr<Callback>> callbacks = MakeCallbacks(options.callbacks, 0);
    RunState state;
    state.ctx = &ctx;
    state.network = run->network.get();
    CallEach(callbacks, "on_eval_begin", [&](Callback& c) { c.on_eval_begin(state); });
    Logs logs = EvaluateOnRank(ctx, *run->network, loss_, run->metrics, data, options.batch_size,
                               options.num_workers, options.bf16, options.batch_transform);
    CallEach(callbacks, "on_eval_end", [&](Callback& c) { c.on_eval_end(state, logs); });
    if (run->took_rank_zeros_weights) Keep(ctx, *run);
    if (!spawned_ || LocalRank(ctx) == 0) result = std::move(logs);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

absl::StatusOr<nn::Tensor> Model::predict(std::shared_ptr<const data::Dataset> data,
                                          EvalOptions options) {
  RETURN_IF_ERROR(CheckDataset("predict", data, "the data"));
  RETURN_IF_ERROR(CheckEvalOptions("predict", options));
  FoldBatchRun();
  nn::Tensor result;
  absl::Status status = RunOnRanks([&](dist::Context& ctx) -> absl::Status {
    nn::Tensor all = PredictOnRank(ctx, data, options);
    if (!spawned_ || LocalRank(ctx) == 0) result = std::move(all);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  return result;
}

nn::Tensor Model::PredictOnRank(dist::Context& ctx,
                                const std::shared_ptr<const data::Dataset>& dataset,
                                const EvalOptions& options) {
  // As evaluate(): the network built for the first call is the one every
  // later call starts from; kept after the all_gather below (from main, local
  // rank 0's Keep writes what every rank reads in Build).
  std::unique_ptr<RankRun> run = Build(ctx, "predict", /*wrapped_by_data_parallel=*/false);
  nn::Module& network = *run->network;
  network.eval();
  nn::NoGradGuard no_grad;
  const int world = ctx.world_size();
  data::DistributedOptions so = SamplerOptions(ctx, dataset->size(), options.batch_size);
  so.shuffle = false;
  so.tail = data::DistributedTail::kUneven;
  int64_t max_rows = 0;
  const std::vector<std::vector<int64_t>> indices = EveryRanksIndices(so, world, max_rows);
  data::DataLoader loader(dataset, std::make_shared<data::DistributedBatchSampler>(so),
                          LoaderOptions(ctx, options.num_workers, options.batch_transform));
  std::vector<nn::Tensor> outputs;
  while (auto batch = loader.next()) {
    std::optional<nn::AutocastGuard> autocast;
    if (options.bf16) autocast.emplace(nn::kBFloat16);
    outputs.push_back(network(batch->data).to(nn::kFloat32).to(nn::Device::CPU()));
  }
  const nn::Shape example_shape = ExampleShapeOfRankZero(ctx, outputs);
  int64_t per_example = 1;
  for (int64_t d : example_shape) per_example *= d;
  // This rank's rows, padded to max_rows, gathered from every rank.
  std::vector<float> mine(static_cast<size_t>(max_rows * per_example), 0.0f);
  size_t at = 0;
  for (const nn::Tensor& o : outputs) {
    TANDEM_CHECK(o.numel() == o.size(0) * per_example, "hapi::Model::predict: output shape ",
                 nn::ShapeToString(o.shape()), " differs between batches or ranks");
    const std::vector<float> v = o.to_vector<float>();
    std::copy(v.begin(), v.end(), mine.begin() + static_cast<std::ptrdiff_t>(at));
    at += v.size();
  }
  nn::Tensor gathered = ctx.communicator().all_gather(
      nn::from_vector(mine, {static_cast<int64_t>(mine.size())}, {.dtype = nn::kFloat32})
          .to(ctx.device()));
  if (run->took_rank_zeros_weights) Keep(ctx, *run);
  const std::vector<float> all = gathered.to_vector<float>();
  const int64_t n = dataset->size();
  std::vector<float> ordered(static_cast<size_t>(n * per_example));
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < indices[r].size(); ++i) {
      const auto src = all.begin() + (static_cast<int64_t>(r) * max_rows + static_cast<int64_t>(i)) *
                                         per_example;
      std::copy(src, src + per_example,
                ordered.begin() + indices[r][i] * per_example);
    }
  }
  nn::Shape shape = {n};
  shape.insert(shape.end(), example_shape.begin(), example_shape.end());
  return nn::from_vector(ordered, shape, {.dtype = nn::kFloat32});
}

absl::Status Model::Materialize() {
  if (kept_.have_weights) return absl::OkStatus();
  std::shared_ptr<nn::Module> net = network_();
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  kept_.weights = HostState(*net);
  kept_.have_weights = true;
  kept_.weights_of_this_rank = dist::current_or_null() != nullptr;
  return absl::OkStatus();
}

absl::StatusOr<nn::StateDict> Model::state_dict() {
  // A rank's own read (no collective, maybe on one rank alone): it copies the
  // batch run's weights and leaves the run, which the other ranks still hold.
  CopyBatchRun();
  RETURN_IF_ERROR(Materialize());
  return kept_.weights;
}

absl::StatusOr<ModelSummary> Model::summary(const nn::Shape& input_shape) {
  // A fresh network from the factory: the batch run stays (see state_dict).
  const nn::Generator generator = nn::thread_generator();
  std::shared_ptr<nn::Module> net;
  try {
    net = network_();
  } catch (const std::exception& e) {
    nn::thread_generator() = generator;
    return absl::InvalidArgumentError(
        absl::StrCat("hapi::Model::summary: the network factory threw: ", e.what()));
  }
  nn::thread_generator() = generator;
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  return Summary(*net, input_shape);
}

}  // namespace tandem::hapi
