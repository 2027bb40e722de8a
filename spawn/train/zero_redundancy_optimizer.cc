#include "spawn/train/zero_redundancy_optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nn/error.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/reduce.h"

namespace tandem::dist {
namespace {

// The optimizer's state keys (optim/optimizer.h's StateDict).
std::string StateKey(int64_t index, const std::string& name) {
  return absl::StrCat("state.0.", index, ".", name);
}

// The buffer names of parameter `index` in `dict`, in the dict's order.
std::vector<std::string> BufferNames(const optim::StateDict& dict, int64_t index) {
  const std::string prefix = absl::StrCat("state.0.", index, ".");
  std::vector<std::string> names;
  for (const auto& [key, tensor] : dict.tensors) {
    if (absl::StartsWith(key, prefix)) names.push_back(key.substr(prefix.size()));
  }
  return names;
}

const nn::Tensor* FindTensor(const optim::StateDict& dict, const std::string& key) {
  for (const auto& [name, tensor] : dict.tensors) {
    if (name == key) return &tensor;
  }
  return nullptr;
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(DataParallel& dp, OptimizerFactory make_optimizer)
    : dp_(dp),
      comm_([&]() -> Communicator& {
        TANDEM_CHECK(dp.num_buckets() > 0,
                     "ZeroRedundancyOptimizer: the model has no trainable parameter to shard");
        return *dp.bucket(0).comm;
      }()),
      make_optimizer_(std::move(make_optimizer)) {
  TANDEM_CHECK(make_optimizer_ != nullptr, "ZeroRedundancyOptimizer: no optimizer factory");
  if (dp.has_comm_hook()) {
    // A built-in hook's compression carries over to the reduce-scatter; any
    // other hook reduces whole buckets, which the shards cannot use.
    if (const auto* compress = dp.comm_hook().target<internal::CompressHookFn>()) {
      wire_ = compress->wire;
    } else {
      TANDEM_CHECK(dp.comm_hook().target<internal::AllReduceHookFn>() != nullptr,
                   "ZeroRedundancyOptimizer: the DataParallel's comm hook is neither "
                   "AllReduceHook, Bf16CompressHook nor Fp16CompressHook; the sharded optimizer "
                   "reduce-scatters each bucket itself and can only carry a built-in hook's "
                   "compression over (and a ZeroRedundancyOptimizer per DataParallel)");
    }
  }
  TANDEM_CHECK(!dp.join_state().joining(), "ZeroRedundancyOptimizer: made inside "
               "DataParallel::join(); make it before the join guard, so that it outlives the "
               "guard, whose end steps it on a rank whose data ran out");
  CheckSameBucketsOnEveryRank();
  for (const nn::Tensor& p : dp.parameters()) {
    if (p.requires_grad()) trainable_.push_back(p);
  }
  const int world = comm_.world_size();
  const int rank = comm_.rank();
  std::vector<nn::Tensor> shard_params;
  for (int b = 0; b < dp.num_buckets(); ++b) {
    Shard s;
    s.bucket = dp.bucket(b);
    s.block = s.bucket.buffer.numel() / world;
    s.grad = s.bucket.buffer.slice(rank * s.block, (rank + 1) * s.block);
    s.param = nn::zeros({s.block}, {.dtype = s.bucket.buffer.dtype(),
                                    .device = s.bucket.buffer.device()});
    s.param.set_grad(s.grad);
    for (const nn::Tensor& p : s.bucket.params) {
      const auto it = std::find_if(trainable_.begin(), trainable_.end(),
                                   [&](const nn::Tensor& t) { return t.data_ptr() == p.data_ptr(); });
      TANDEM_CHECK(it != trainable_.end(), "ZeroRedundancyOptimizer: a bucket parameter ",
                   p.ToString(), " is not a trainable parameter of the model");
      s.index.push_back(static_cast<int>(it - trainable_.begin()));
    }
    shard_params.push_back(s.param);
    shards_.push_back(std::move(s));
  }
  RefreshShards();
  optimizer_ = make_optimizer_(shard_params);
  TANDEM_CHECK(optimizer_ != nullptr, "ZeroRedundancyOptimizer: the factory returned no optimizer");
  bool same = optimizer_->num_groups() == 1 &&
              optimizer_->params(0).size() == shard_params.size();
  for (size_t b = 0; same && b < shard_params.size(); ++b) {
    same = optimizer_->params(0)[b].data_ptr() == shard_params[b].data_ptr();
  }
  TANDEM_CHECK(same, "ZeroRedundancyOptimizer: the factory's optimizer must have one group "
               "holding exactly the ", shard_params.size(), " shard tensors it was given (it has ",
               optimizer_->num_groups(), " group(s))");
  dp.register_comm_hook([this](GradBucket& bucket) { return ReduceScatter(bucket); });
}

void ZeroRedundancyOptimizer::CheckSameBucketsOnEveryRank() {
  std::vector<int64_t> mine = {dp_.num_buckets()};
  for (int b = 0; b < dp_.num_buckets(); ++b) mine.push_back(dp_.bucket(b).buffer.numel());
  nn::Tensor length = nn::from_vector<int64_t>({static_cast<int64_t>(mine.size())}, {1},
                                               {.device = nn::Device::CPU()})
                          .to(comm_.device());
  comm_.all_reduce(length, ReduceOp::kMax);
  const int64_t longest = length.to(nn::Device::CPU()).item<int64_t>();
  mine.resize(static_cast<size_t>(longest), -1);
  const std::vector<int64_t> all =
      comm_.all_gather(nn::from_vector<int64_t>(mine, {longest}, {.device = nn::Device::CPU()})
                           .to(comm_.device()))
          .to(nn::Device::CPU())
          .to_vector<int64_t>();
  for (int r = 1; r < comm_.world_size(); ++r) {
    TANDEM_CHECK(all[r * longest] == all[0], "ZeroRedundancyOptimizer: rank 0 has ", all[0],
                 " gradient buckets, rank ", r, " has ", all[r * longest],
                 " (give every rank the same DataParallelOptions bucket sizes)");
    for (int64_t b = 1; b < longest; ++b) {
      TANDEM_CHECK(all[r * longest + b] == all[b], "ZeroRedundancyOptimizer: bucket ", b - 1,
                   " has ", all[b], " elements on rank 0 but ", all[r * longest + b], " on rank ",
                   r, " (the parameters or bucket sizes differ between the ranks)");
    }
  }
}

BucketReduction ZeroRedundancyOptimizer::ReduceScatter(GradBucket& bucket) {
  Shard& s = shards_.at(static_cast<size_t>(bucket.index));
  const int64_t lo = comm_.rank() * s.block;
  if (wire_.has_value() && *wire_ != bucket.buffer.dtype()) {
    // Bf16CompressHook / Fp16CompressHook's reduction, scattered: the bucket
    // cast to the wire dtype, this rank's block of the sum cast back into its
    // gradient and divided by the world size (by DataParallel).
    nn::NoGradGuard no_grad;
    const nn::Tensor wire = bucket.buffer.to(*wire_);
    nn::Tensor block = nn::empty({s.block}, {.dtype = *wire_, .device = wire.device()});
    std::shared_ptr<Work> work = comm_.reduce_scatter_async(wire, block, ReduceOp::kSum);
    return BucketReduction{.work = std::move(work), .result = std::move(block), .begin = lo,
                           .end = lo + s.block};
  }
  return BucketReduction{.work = comm_.reduce_scatter_async(bucket.buffer, s.grad, ReduceOp::kAvg),
                         .begin = lo,
                         .end = lo + s.block,
                         .averaged = true};
}

void ZeroRedundancyOptimizer::CopyBlockFromParams(Shard& s, nn::Tensor& flat_block,
                                                  int64_t lo) const {
  const int64_t hi = lo + flat_block.numel();
  for (size_t j = 0; j < s.bucket.params.size(); ++j) {
    const nn::Tensor& p = s.bucket.params[j];
    const int64_t begin = std::max(lo, s.bucket.offsets[j]);
    const int64_t end = std::min(hi, s.bucket.offsets[j] + p.numel());
    if (begin >= end) continue;
    flat_block.slice(begin - lo, end - lo)
        .copy_(p.reshape({p.numel()}).slice(begin - s.bucket.offsets[j], end - s.bucket.offsets[j]));
  }
}

void ZeroRedundancyOptimizer::RefreshShards() {
  nn::NoGradGuard no_grad;
  for (Shard& s : shards_) {
    s.param.zero_();  // the padding past the last parameter stays zero
    CopyBlockFromParams(s, s.param, comm_.rank() * s.block);
  }
}

void ZeroRedundancyOptimizer::step() {
  const uint64_t before = comm_.collectives_entered();
  StepShards();
  // A joined rank owns its shard too: it steps it with the reduced gradient (its
  // reduce-scatter replay put it in the shard's gradient) and gathers with the rest.
  dp_.join_state().RecordReplay(before, [this] { StepShards(); });
}

void ZeroRedundancyOptimizer::StepShards() {
  optimizer_->step();
  nn::NoGradGuard no_grad;
  for (Shard& s : shards_) {
    // Into the bucket's gradient buffer, which the update no longer needs (no
    // buffer of the bucket's size per step): rank r's block lands at block r,
    // so the buffer then holds the bucket's parameters in bucket order.
    nn::Tensor& all = s.bucket.buffer;
    comm_.all_gather_into(s.param, all);
    for (size_t j = 0; j < s.bucket.params.size(); ++j) {
      nn::Tensor p = s.bucket.params[j];
      const int64_t off = s.bucket.offsets[j];
      p.copy_(all.slice(off, off + p.numel()).reshape(p.shape()));
    }
    all.zero_();
  }
}

void ZeroRedundancyOptimizer::zero_grad() {
  nn::NoGradGuard no_grad;
  for (Shard& s : shards_) s.bucket.buffer.zero_();
}

double ZeroRedundancyOptimizer::clip_grad_norm_(double max_norm) {
  const uint64_t before = comm_.collectives_entered();
  const double norm = ClipShards(max_norm);
  // A joined rank's shard of the reduced gradient counts in the norm and is clipped.
  dp_.join_state().RecordReplay(before, [this, max_norm] { ClipShards(max_norm); });
  return norm;
}

double ZeroRedundancyOptimizer::ClipShards(double max_norm) {
  nn::NoGradGuard no_grad;
  nn::Tensor squares = nn::zeros({1}, {.dtype = nn::kFloat64, .device = comm_.device()});
  for (Shard& s : shards_) {
    const nn::Tensor g = s.grad.to(nn::kFloat64);
    squares.add_(nn::sum(g * g).reshape({1}));
  }
  comm_.all_reduce(squares, ReduceOp::kSum);
  const double norm = std::sqrt(squares.to(nn::Device::CPU()).item<double>());
  const double scale = std::min(1.0, max_norm / (norm + 1e-6));
  if (scale < 1.0) {
    for (Shard& s : shards_) s.grad.mul_(scale);
  }
  return norm;
}

optim::StateDict ZeroRedundancyOptimizer::state_dict() {
  const optim::StateDict sharded = optimizer_->state_dict();
  optim::StateDict out;
  out.scalars["num_groups"] = 1;
  for (const auto& [key, value] : sharded.scalars) {
    if (absl::StartsWith(key, "group.0.")) out.scalars[key] = value;
  }
  out.scalars["group.0.num_params"] = static_cast<double>(trainable_.size());
  nn::NoGradGuard no_grad;
  for (size_t b = 0; b < shards_.size(); ++b) {
    const Shard& s = shards_[b];
    const auto step = sharded.scalars.find(StateKey(static_cast<int64_t>(b), "step"));
    if (step != sharded.scalars.end()) {
      for (int index : s.index) out.scalars[StateKey(index, "step")] = step->second;
    }
    // The same names, in the same order, on every rank: the same gathers.
    for (const std::string& name : BufferNames(sharded, static_cast<int64_t>(b))) {
      const nn::Tensor* block = FindTensor(sharded, StateKey(static_cast<int64_t>(b), name));
      const nn::Tensor all = comm_.all_gather(*block).reshape({s.bucket.buffer.numel()});
      for (size_t j = 0; j < s.bucket.params.size(); ++j) {
        const nn::Tensor& p = s.bucket.params[j];
        const int64_t off = s.bucket.offsets[j];
        out.tensors.emplace_back(StateKey(s.index[j], name),
                                 all.slice(off, off + p.numel()).reshape(p.shape()).clone());
      }
    }
  }
  return out;
}

absl::Status ZeroRedundancyOptimizer::load_state_dict(const optim::StateDict& dict) {
  const auto np = dict.scalars.find("group.0.num_params");
  if (np == dict.scalars.end() || np->second != static_cast<double>(trainable_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ZeroRedundancyOptimizer load_state_dict: 'group.0.num_params' is ",
        np == dict.scalars.end() ? "missing" : absl::StrCat(np->second), " but the model has ",
        trainable_.size(), " trainable parameters"));
  }
  optim::StateDict sharded;
  for (const auto& [key, value] : dict.scalars) {
    if (key == "num_groups" || absl::StartsWith(key, "group.")) sharded.scalars[key] = value;
  }
  sharded.scalars["group.0.num_params"] = static_cast<double>(shards_.size());
  nn::NoGradGuard no_grad;
  const int64_t lo_rank = comm_.rank();
  for (size_t b = 0; b < shards_.size(); ++b) {
    const Shard& s = shards_[b];
    const std::string first_step = StateKey(s.index[0], "step");
    const auto step = dict.scalars.find(first_step);
    for (int index : s.index) {
      const auto other = dict.scalars.find(StateKey(index, "step"));
      if ((other == dict.scalars.end()) != (step == dict.scalars.end()) ||
          (step != dict.scalars.end() && other->second != step->second)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ZeroRedundancyOptimizer load_state_dict: '", StateKey(index, "step"), "' and '",
            first_step, "' differ; the parameters of one bucket share one shard and one step"));
      }
    }
    if (step != dict.scalars.end()) {
      sharded.scalars[StateKey(static_cast<int64_t>(b), "step")] = step->second;
    }
    for (const std::string& name : BufferNames(dict, s.index[0])) {
      nn::Tensor flat = nn::zeros({s.bucket.buffer.numel()}, {.dtype = s.param.dtype(),
                                                              .device = s.param.device()});
      for (size_t j = 0; j < s.bucket.params.size(); ++j) {
        const std::string key = StateKey(s.index[j], name);
        const nn::Tensor* t = FindTensor(dict, key);
        const nn::Tensor& p = s.bucket.params[j];
        if (t == nullptr || t->numel() != p.numel()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "ZeroRedundancyOptimizer load_state_dict: '", key, "' is ",
              t == nullptr ? "missing" : t->ToString(), " but the parameter is ", p.ToString()));
        }
        const int64_t off = s.bucket.offsets[j];
        flat.slice(off, off + p.numel()).copy_(t->reshape({p.numel()}));
      }
      sharded.tensors.emplace_back(
          StateKey(static_cast<int64_t>(b), name),
          flat.slice(lo_rank * s.block, (lo_rank + 1) * s.block).clone());
    }
  }
  return optimizer_->load_state_dict(sharded);
}

std::unique_ptr<optim::Optimizer> ZeroRedundancyOptimizer::MakeUnsharded() const {
  std::unique_ptr<optim::Optimizer> unsharded = make_optimizer_(trainable_);
  TANDEM_CHECK(unsharded != nullptr, "ZeroRedundancyOptimizer: the factory returned no optimizer");
  return unsharded;
}

std::unique_ptr<optim::Optimizer> ZeroRedundancyOptimizer::Consolidated() {
  std::unique_ptr<optim::Optimizer> unsharded = MakeUnsharded();
  ThrowIfError(unsharded->load_state_dict(state_dict()), "ZeroRedundancyOptimizer: ");
  return unsharded;
}

absl::Status ZeroRedundancyOptimizer::LoadFrom(const optim::Optimizer& unsharded) {
  const absl::Status loaded = load_state_dict(unsharded.state_dict());
  if (loaded.ok()) RefreshShards();
  return loaded;
}

int64_t ZeroRedundancyOptimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [key, tensor] : optimizer_->state_dict().tensors) bytes += tensor.nbytes();
  return bytes;
}

}  // namespace tandem::dist
