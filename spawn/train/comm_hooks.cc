#include "spawn/train/comm_hooks.h"

#include <atomic>
#include <utility>

#include "nn/error.h"

namespace tandem::dist {
namespace {

// The Work DataParallel keeps for a hooked bucket: the hook's collective, then
// the copy of its result into the bucket and the division by the world size.
class HookedWork final : public Work {
 public:
  HookedWork(std::shared_ptr<Work> work, nn::Tensor target, nn::Tensor result, double scale)
      : work_(std::move(work)), target_(std::move(target)), result_(std::move(result)),
        scale_(scale) {}
  ~HookedWork() override {
    // Unwaited (a backward that threw): the hook's handle goes first, so the
    // tensors it reduces outlive its collective (Work's contract).
    work_.reset();
  }
  void wait() override {
    work_->wait();
    nn::NoGradGuard no_grad;
    if (result_.defined()) target_.copy_(result_);
    if (scale_ != 1.0) target_.mul_(scale_);
    waited_ = true;
  }
  std::optional<std::chrono::steady_clock::time_point> finished_at() const override {
    return work_ ? work_->finished_at() : std::nullopt;
  }
  // Work's contract: the result in place. A copy or a scaling left to wait()
  // makes that true only once wait() has run.
  bool is_completed() const override {
    if (waited_) return true;
    return work_ && work_->is_completed() && !result_.defined() && scale_ == 1.0;
  }
  uint64_t sequence() const override { return work_ ? work_->sequence() : 0; }

 private:
  std::shared_ptr<Work> work_;
  nn::Tensor target_;  // the bucket's range that receives the result
  nn::Tensor result_;  // undefined: reduced in place
  double scale_;       // 1 / world size for a sum, 1 for a mean
  std::atomic<bool> waited_{false};
};

}  // namespace

namespace internal {

BucketReduction AllReduceHookFn::operator()(GradBucket& bucket) const {
  return BucketReduction{.work = bucket.comm->all_reduce_async(bucket.buffer, ReduceOp::kAvg),
                         .averaged = true};
}

// The bucket cast to `wire`, summed over the ranks; DataParallel casts the sum
// back to the bucket's dtype and divides it.
BucketReduction CompressHookFn::operator()(GradBucket& bucket) const {
  nn::NoGradGuard no_grad;
  nn::Tensor half = bucket.buffer.to(wire);
  std::shared_ptr<Work> work = bucket.comm->all_reduce_async(half, ReduceOp::kSum);
  return BucketReduction{.work = std::move(work), .result = std::move(half)};
}

}  // namespace internal

CommHook AllReduceHook() { return internal::AllReduceHookFn{}; }

CommHook Bf16CompressHook() { return internal::CompressHookFn{nn::kBFloat16}; }

CommHook Fp16CompressHook() { return internal::CompressHookFn{nn::kFloat16}; }

namespace internal {

std::shared_ptr<Work> LaunchCommHook(const CommHook& hook, GradBucket& bucket,
                                     int64_t* wire_bytes) {
  BucketReduction r = hook(bucket);
  const int64_t numel = bucket.buffer.numel();
  TANDEM_CHECK(r.work != nullptr, "DataParallel comm_hook: bucket ", bucket.index,
               ": the hook returned no Work (start a collective and return its handle)");
  const int64_t end = r.end < 0 ? numel : r.end;
  TANDEM_CHECK(r.begin >= 0 && r.begin <= end && end <= numel, "DataParallel comm_hook: bucket ",
               bucket.index, ": result range [", r.begin, ", ", end,
               ") is outside the bucket's ", numel, " elements");
  if (r.result.defined()) {
    TANDEM_CHECK(r.result.numel() == end - r.begin, "DataParallel comm_hook: bucket ",
                 bucket.index, ": the hook's result ", r.result.ToString(), " has ",
                 r.result.numel(), " elements, the bucket range [", r.begin, ", ", end, ") ",
                 end - r.begin);
    // float16 (a storage dtype) counts: copy_ converts it.
    TANDEM_CHECK(nn::IsFloatingPoint(r.result.dtype()), "DataParallel comm_hook: bucket ",
                 bucket.index, ": the hook's result is ", nn::DTypeName(r.result.dtype()),
                 "; a gradient reduction must be floating (the bucket is ",
                 nn::DTypeName(bucket.buffer.dtype()), ")");
    TANDEM_CHECK(r.result.device() == bucket.buffer.device(), "DataParallel comm_hook: bucket ",
                 bucket.index, ": the hook's result is on ", r.result.device().ToString(),
                 ", the bucket on ", bucket.buffer.device().ToString());
  }
  nn::Tensor target = bucket.buffer.slice(r.begin, end);
  *wire_bytes = r.result.defined() ? r.result.nbytes() : target.nbytes();
  const double scale = r.averaged ? 1.0 : 1.0 / static_cast<double>(bucket.comm->world_size());
  return std::make_shared<HookedWork>(std::move(r.work), std::move(target), std::move(r.result),
                                      scale);
}

}  // namespace internal
}  // namespace tandem::dist
