// Learning-rate schedules: closed forms and the shared epoch bookkeeping.
#include "optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace tandem::optim {

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer) {
  for (int64_t g = 0; g < optimizer.num_groups(); ++g) base_lrs_.push_back(optimizer.lr(g));
}

// Every group's lr at `epoch`, computed before any is set: a schedule that
// throws (LambdaLR's bad factor) leaves the optimizer and last_epoch as they were.
static std::vector<double> LrsAt(const LRScheduler& scheduler, int64_t epoch,
                                 const std::vector<double>& base_lrs) {
  std::vector<double> lrs;
  lrs.reserve(base_lrs.size());
  for (double base : base_lrs) lrs.push_back(scheduler.LrAt(epoch, base));
  return lrs;
}

void LRScheduler::Apply() {
  const std::vector<double> lrs = LrsAt(*this, last_epoch_, base_lrs_);
  for (int64_t g = 0; g < optimizer_.num_groups(); ++g) optimizer_.set_lr(g, lrs[g]);
}

void LRScheduler::step() {
  const std::vector<double> lrs = LrsAt(*this, last_epoch_ + 1, base_lrs_);
  ++last_epoch_;
  for (int64_t g = 0; g < optimizer_.num_groups(); ++g) optimizer_.set_lr(g, lrs[g]);
}

std::vector<double> LRScheduler::get_lr() const { return LrsAt(*this, last_epoch_, base_lrs_); }

std::map<std::string, double> LRScheduler::state_dict() const {
  std::map<std::string, double> state{{"last_epoch", static_cast<double>(last_epoch_)}};
  for (size_t g = 0; g < base_lrs_.size(); ++g) state[absl::StrCat("base_lr.", g)] = base_lrs_[g];
  return state;
}

absl::Status LRScheduler::load_state_dict(const std::map<std::string, double>& state) {
  auto it = state.find("last_epoch");
  if (it == state.end()) {
    return absl::InvalidArgumentError("LRScheduler load_state_dict: 'last_epoch' missing");
  }
  // An epoch is a whole number the int64 counter holds exactly (NaN fails too).
  if (!(it->second >= 0 && it->second <= 9007199254740992.0) ||
      it->second != std::floor(it->second)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LRScheduler load_state_dict: 'last_epoch' is ", it->second,
        "; it must be a whole number >= 0 (at most 2^53)"));
  }
  if (state.size() != base_lrs_.size() + 1) {
    return absl::InvalidArgumentError(absl::StrCat("LRScheduler load_state_dict: ", state.size() - 1,
                                                   " base lrs for ", base_lrs_.size(), " groups"));
  }
  std::vector<double> base_lrs;
  for (size_t g = 0; g < base_lrs_.size(); ++g) {
    const std::string key = absl::StrCat("base_lr.", g);
    auto b = state.find(key);
    if (b == state.end()) {
      return absl::InvalidArgumentError(absl::StrCat("LRScheduler load_state_dict: missing '", key, "'"));
    }
    base_lrs.push_back(b->second);
  }
  // The lrs first: a schedule that refuses the loaded epoch (LambdaLR's bad
  // factor) leaves the scheduler and the optimizer as they were.
  const auto epoch = static_cast<int64_t>(it->second);
  std::vector<double> lrs;
  try {
    lrs = LrsAt(*this, epoch, base_lrs);
  } catch (const Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("LRScheduler load_state_dict: last_epoch ", epoch, ": ", e.what()));
  }
  base_lrs_ = std::move(base_lrs);
  last_epoch_ = epoch;
  for (int64_t g = 0; g < optimizer_.num_groups(); ++g) optimizer_.set_lr(g, lrs[g]);
  return absl::OkStatus();
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  TANDEM_CHECK(step_size > 0, "StepLR: step_size must be > 0 but is ", step_size);
  Apply();
}

double StepLR::LrAt(int64_t epoch, double base_lr) const {
  return base_lr * std::pow(gamma_, static_cast<double>(epoch / step_size_));
}

MultiStepLR::MultiStepLR(Optimizer& optimizer, std::vector<int64_t> milestones, double gamma)
    : LRScheduler(optimizer), milestones_(std::move(milestones)), gamma_(gamma) {
  for (size_t i = 1; i < milestones_.size(); ++i) {
    TANDEM_CHECK(milestones_[i - 1] < milestones_[i], "MultiStepLR: milestones must increase but ",
                 milestones_[i - 1], " is followed by ", milestones_[i]);
  }
  Apply();
}

double MultiStepLR::LrAt(int64_t epoch, double base_lr) const {
  const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), epoch) -
                      milestones_.begin();
  return base_lr * std::pow(gamma_, static_cast<double>(passed));
}

ExponentialLR::ExponentialLR(Optimizer& optimizer, double gamma)
    : LRScheduler(optimizer), gamma_(gamma) {
  Apply();
}

double ExponentialLR::LrAt(int64_t epoch, double base_lr) const {
  return base_lr * std::pow(gamma_, static_cast<double>(epoch));
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t t_max, double eta_min)
    : LRScheduler(optimizer), t_max_(t_max), eta_min_(eta_min) {
  TANDEM_CHECK(t_max > 0, "CosineAnnealingLR: t_max must be > 0 but is ", t_max);
  Apply();
}

double CosineAnnealingLR::LrAt(int64_t epoch, double base_lr) const {
  const double phase = std::numbers::pi * static_cast<double>(epoch) / static_cast<double>(t_max_);
  return eta_min_ + (base_lr - eta_min_) * (1 + std::cos(phase)) / 2;
}

LambdaLR::LambdaLR(Optimizer& optimizer, std::function<double(int64_t)> lr_lambda)
    : LRScheduler(optimizer), lr_lambda_(std::move(lr_lambda)) {
  TANDEM_CHECK(static_cast<bool>(lr_lambda_), "LambdaLR: lr_lambda is empty");
  Apply();
}

double LambdaLR::LrAt(int64_t epoch, double base_lr) const {
  const double factor = lr_lambda_(epoch);
  TANDEM_CHECK(std::isfinite(factor) && factor >= 0, "LambdaLR: lr_lambda(", epoch, ") is ", factor,
               "; the factor must be finite and >= 0");
  return base_lr * factor;
}

LinearWarmup::LinearWarmup(Optimizer& optimizer, int64_t warmup_steps, double start_factor,
                           std::unique_ptr<LRScheduler> after)
    : LRScheduler(optimizer),
      warmup_steps_(warmup_steps),
      start_factor_(start_factor),
      after_(std::move(after)) {
  TANDEM_CHECK(warmup_steps > 0, "LinearWarmup: warmup_steps must be > 0 but is ", warmup_steps);
  TANDEM_CHECK(start_factor >= 0 && start_factor <= 1,
               "LinearWarmup: start_factor must be in [0, 1] but is ", start_factor);
  // `after` recorded the base lrs before any warm-up changed them; use its.
  if (after_) {
    TANDEM_CHECK(&after_->optimizer() == &optimizer,
                 "LinearWarmup: the schedule after warm-up belongs to another optimizer");
    base_lrs_ = after_->base_lrs();
  }
  Apply();
}

double LinearWarmup::LrAt(int64_t epoch, double base_lr) const {
  if (epoch < warmup_steps_) {
    return base_lr * (start_factor_ + (1 - start_factor_) * static_cast<double>(epoch) /
                                          static_cast<double>(warmup_steps_));
  }
  return after_ ? after_->LrAt(epoch - warmup_steps_, base_lr) : base_lr;
}

}  // namespace tandem::optim
