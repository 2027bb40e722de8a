#include "spawn/context.h"

#include "absl/strings/str_cat.h"
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
