#include "spawn/context.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/ops/index.h"
#include "spawn/signals.h"

namespace tandem::dist {
namespace {
thread_local Context* t_current = nullptr;
}  // namespace

Context::Context(int rank, int world_size, nn::Device device, Communicator* communicator,
                 RankLogger logger, std::stop_token stop, Placement placement,
                 internal::StepAgreement* agreement)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      communicator_(communicator),
      logger_(logger),
      stop_(std::move(stop)),
      placement_(std::move(placement)),
      agreement_(agreement) {
  if (placement_.local_rank < 0) placement_.local_rank = rank;
}

StepDecision Context::AtStepBoundary(int64_t step, bool propose_save) {
  if (agreement_ == nullptr) return {};
  // The agreement is per process: its ranks are this process's local ranks.
  const internal::StepAgreement::Decision d =
      agreement_->AtBoundary(placement_.local_rank, step, propose_save, stop_);
  return {.stop = d.stop, .save = d.save};
}

void Context::check_stop() const {
  if (stop_.stop_requested()) {
    throw CancelledError(absl::StrCat("rank ", rank_, ": stopped at a step boundary"));
  }
}

nn::Tensor Context::split(const nn::Tensor& x, int64_t dim) const {
  TANDEM_CHECK(x.defined(), "Context::split: the tensor is undefined");
  const int64_t ndim = x.dim();
  TANDEM_CHECK(ndim >= 1, "Context::split: a 0-dim tensor has no dim to split (dim ", dim, ")");
  TANDEM_CHECK(dim >= -ndim && dim < ndim, "Context::split: dim ", dim,
               " is out of range for a tensor of shape ", nn::ShapeToString(x.shape()),
               " (expected ", -ndim, "..", ndim - 1, ")");
  if (dim < 0) dim += ndim;
  const int64_t n = x.size(dim);
  if (n == 0) return x;  // nothing to share out: every rank gets the empty x
  // DistributedBatchSampler(n, per_rank, N, rank, no shuffle).Batch(0): positions
  // (rank * per_rank + j) mod n.
  const int64_t per_rank = (n + world_size_ - 1) / world_size_;
  const int64_t first = rank_ * per_rank;
  if (dim == 0 && first + per_rank <= n) return x.slice(first, first + per_rank);
  nn::Shape out_shape = x.shape();
  out_shape[dim] = per_rank;
  int64_t outer = 1, inner = 1;  // x as (outer, n, inner)
  for (int64_t d = 0; d < dim; ++d) outer *= x.size(d);
  for (int64_t d = dim + 1; d < ndim; ++d) inner *= x.size(d);
  if (outer == 0 || inner == 0) return nn::empty(out_shape, {.dtype = x.dtype(), .device = x.device()});
  // Rows of the (outer * n, inner) view, outer block by outer block.
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(outer * per_rank));
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < per_rank; ++j) rows.push_back(o * n + (first + j) % n);
  }
  const nn::Tensor indices =
      nn::from_vector(rows, {outer * per_rank}, {.dtype = nn::kInt64, .device = x.device()});
  return nn::index_select(x.reshape({outer * n, inner}), indices).reshape(out_shape);
}

Context& current() {
  TANDEM_CHECK(t_current != nullptr,
               "dist::current(): this thread is not a rank thread started by dist::spawn");
  return *t_current;
}

Context* current_or_null() { return t_current; }

namespace internal {
CurrentContextGuard::CurrentContextGuard(Context* ctx) : previous_(t_current) { t_current = ctx; }
CurrentContextGuard::~CurrentContextGuard() { t_current = previous_; }
}  // namespace internal

}  // namespace tandem::dist
