#include "spawn/train/sync_batch_norm.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/reduce.h"
#include "spawn/context.h"

namespace tandem::dist {

Communicator& SyncBatchNormReducer::comm() const {
  if (options_.communicator != nullptr) return *options_.communicator;
  Context* ctx = current_or_null();
  TANDEM_CHECK(ctx != nullptr,
               "SyncBatchNorm2d: no communicator: run the layer on a rank thread of "
               "dist::spawn or give SyncBatchNormOptions::communicator");
  return ctx->communicator();
}

bool SyncBatchNormReducer::Combines() { return comm().world_size() > 1; }

void SyncBatchNormReducer::CheckSameChannels(Communicator& comm, int64_t channels) {
  nn::NoGradGuard no_grad;
  const nn::Tensor mine =
      nn::from_vector(std::vector<int64_t>{channels}, {1}, {.device = nn::Device::CPU()})
          .to(comm.device());
  const std::vector<int64_t> all = comm.all_gather(mine).to_vector<int64_t>();
  if (Joining()) join_->Record(internal::JoinState::Kind::kAllGather, mine, /*once=*/true);
  for (size_t r = 1; r < all.size(); ++r) {
    TANDEM_CHECK(all[r] == all[0], "SyncBatchNorm2d: the channel counts differ across ranks: ",
                 absl::StrJoin(all, ", "), " on ranks 0..", all.size() - 1,
                 "; every rank must run the same layers in the same order");
  }
  checked_ = true;
}

nn::Tensor SyncBatchNormReducer::CombineStatistics(const nn::Tensor& stats) {
  Communicator& c = comm();
  if (!checked_) CheckSameChannels(c, stats.size(1));
  nn::NoGradGuard no_grad;
  // (world, 3, C): per rank count n_r, mean_r, M2_r. Chan's parallel formula over
  // k groups: n = sum n_r, mean = sum n_r mean_r / n,
  // M2 = sum M2_r + sum n_r (mean_r - mean)^2: sums of non-negative terms.
  const nn::Tensor all = c.all_gather(stats);
  if (Joining()) join_->Record(internal::JoinState::Kind::kAllGather, stats);
  const int64_t world = all.size(0);
  const int64_t channels = all.size(2);
  nn::Tensor n_r = nn::empty({world, channels}, {.dtype = nn::kFloat64, .device = all.device()});
  nn::Tensor mean_r = nn::empty_like(n_r);
  nn::Tensor m2_r = nn::empty_like(n_r);
  for (int64_t r = 0; r < world; ++r) {
    n_r[r].copy_(all[r][0]);
    mean_r[r].copy_(all[r][1]);
    m2_r[r].copy_(all[r][2]);
  }
  const nn::Tensor n = nn::sum(n_r, 0);
  const nn::Tensor mean = nn::div(nn::sum(nn::mul(n_r, mean_r), 0), n);
  const nn::Tensor deviation = nn::sub(mean_r, mean);
  const nn::Tensor m2 =
      nn::add(nn::sum(m2_r, 0), nn::sum(nn::mul(n_r, nn::mul(deviation, deviation)), 0));
  nn::Tensor out = nn::empty({3, channels}, {.dtype = nn::kFloat64, .device = all.device()});
  out[0].copy_(n);
  out[1].copy_(mean);
  out[2].copy_(m2);
  return out;
}

nn::Tensor SyncBatchNormReducer::ReduceGradientSums(const nn::Tensor& sums) {
  nn::NoGradGuard no_grad;
  nn::Tensor out = sums.clone();
  // Inside a join the loss is the mean over the step's samples, sum_r w_r L_r
  // (w_r = n_r / n): the sums over the ranks are weighted by w_r, and divided
  // by this rank's own w_r since DataParallel weighs this rank's gradients by it.
  // With DataParallelOptions::global_batch_size the same with w_r = n_r N / G
  // (proportional weights give the same result; 1 with even shares).
  const double weight = Joining()                ? join_->sample_weight()
                        : row_weight_ != nullptr ? *row_weight_
                                                 : 0.0;
  // A weight of 1 (even shares) changes nothing: no multiply.
  const bool weigh = weight > 0 && weight != 1.0;
  if (weigh) out.mul_(weight);
  comm().all_reduce(out, ReduceOp::kSum);
  if (Joining()) join_->Record(internal::JoinState::Kind::kAllReduce, out);
  if (weigh) out.mul_(1.0 / weight);
  return out;
}

SyncBatchNorm2dImpl::SyncBatchNorm2dImpl(int64_t num_features, double eps, double momentum,
                                         SyncBatchNormOptions options)
    : nn::BatchNorm2dImpl(num_features, eps, momentum) {
  reducer = std::make_shared<SyncBatchNormReducer>(options);
}

int ConvertSyncBatchNorm(nn::Module& module, SyncBatchNormOptions options) {
  int converted = 0;
  if (auto* bn = dynamic_cast<nn::BatchNorm2dImpl*>(&module)) {
    bn->reducer = std::make_shared<SyncBatchNormReducer>(options);
    ++converted;
  }
  for (const std::shared_ptr<nn::Module>& child : module.children()) {
    converted += ConvertSyncBatchNorm(*child, options);
  }
  return converted;
}

}  // namespace tandem::dist
