// Learning-rate schedules (PyTorch's torch.optim.lr_scheduler closed forms).
//
// A schedule records each group's lr at construction as its base lr and, at
// epoch e (0 at construction, +1 per step()), sets group g's lr to
// LrAt(e, base_lr[g]). Call step() after the optimizer's step(), once per
// epoch or per iteration as the schedule is meant.
//
// The schedule holds a reference to the optimizer, which must outlive it.
// Not thread-safe (one rank's thread, like its optimizer).
#ifndef TANDEM_OPTIM_LR_SCHEDULER_H_
#define TANDEM_OPTIM_LR_SCHEDULER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "optim/optimizer.h"

namespace tandem::optim {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances one epoch and writes the new lrs into the optimizer.
  void step();
  // The lr of every group at the current epoch.
  std::vector<double> get_lr() const;
  int64_t last_epoch() const { return last_epoch_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  const Optimizer& optimizer() const { return optimizer_; }
  // The closed form: lr at `epoch` (>= 0) for a group whose base lr is `base_lr`.
  virtual double LrAt(int64_t epoch, double base_lr) const = 0;

  // {"last_epoch", "base_lr.<g>"}; load checks the group count and the epoch (a
  // whole number >= 0 the schedule accepts) and sets the lrs; on error, naming
  // the bad value, the scheduler and the optimizer are unchanged.
  std::map<std::string, double> state_dict() const;
  absl::Status load_state_dict(const std::map<std::string, double>& state);

 protected:
  explicit LRScheduler(Optimizer& optimizer);
  // Writes the lrs of last_epoch_ into the optimizer; each constructor calls it.
  void Apply();

  Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  int64_t last_epoch_ = 0;
};

// lr = base * gamma^floor(epoch / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double LrAt(int64_t epoch, double base_lr) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = base * gamma^(number of milestones <= epoch). Milestones must increase.
class MultiStepLR : public LRScheduler {
 public:
  MultiStepLR(Optimizer& optimizer, std::vector<int64_t> milestones, double gamma = 0.1);
  double LrAt(int64_t epoch, double base_lr) const override;

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
};

// lr = base * gamma^epoch.
class ExponentialLR : public LRScheduler {
 public:
  ExponentialLR(Optimizer& optimizer, double gamma);
  double LrAt(int64_t epoch, double base_lr) const override;

 private:
  double gamma_;
};

// lr = eta_min + (base - eta_min) * (1 + cos(pi * epoch / t_max)) / 2.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t t_max, double eta_min = 0);
  double LrAt(int64_t epoch, double base_lr) const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// lr = base * lr_lambda(epoch) (torch's LambdaLR, Paddle's LambdaDecay).
// lr_lambda is called on the schedule's thread at construction and each
// step(); it must be deterministic in `epoch` (a checkpoint stores the epoch
// only). Throws tandem::Error for an empty function and, when a factor is
// negative or not finite, naming the epoch and the factor.
class LambdaLR : public LRScheduler {
 public:
  LambdaLR(Optimizer& optimizer, std::function<double(int64_t epoch)> lr_lambda);
  double LrAt(int64_t epoch, double base_lr) const override;

 private:
  std::function<double(int64_t)> lr_lambda_;
};

// Linear warm-up over `warmup_steps` epochs from base * start_factor to base:
//   epoch < warmup_steps: lr = base * (start_factor + (1 - start_factor) * epoch / warmup_steps)
//   afterwards: `after`'s lr at (epoch - warmup_steps), or base when `after` is null.
// `after` must have been built on the same optimizer (its base lrs are used).
class LinearWarmup : public LRScheduler {
 public:
  LinearWarmup(Optimizer& optimizer, int64_t warmup_steps, double start_factor = 0.0,
               std::unique_ptr<LRScheduler> after = nullptr);
  double LrAt(int64_t epoch, double base_lr) const override;

 private:
  int64_t warmup_steps_;
  double start_factor_;
  std::unique_ptr<LRScheduler> after_;
};

}  // namespace tandem::optim

#endif  // TANDEM_OPTIM_LR_SCHEDULER_H_
