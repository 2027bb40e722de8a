// Learning-rate schedules against their closed forms, and clip_grad_norm_.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numbers>
#include <string>

#include "absl/strings/str_cat.h"
#include "optim/clip_grad.h"
#include "optim/lr_scheduler.h"
#include "optim/sgd.h"

namespace tandem::optim {
namespace {

// An SGD with two groups, base lrs 0.1 and 0.4.
struct TwoGroups {
  nn::Tensor a = nn::zeros({2}, {.dtype = nn::kFloat64, .requires_grad = true});
  nn::Tensor b = nn::zeros({3}, {.dtype = nn::kFloat64, .requires_grad = true});
  SGD sgd{std::vector<ParamGroup<SGDOptions>>{{{a}, {.lr = 0.1}}, {{b}, {.lr = 0.4}}}};
};

// Steps `sched` 12 times; at every epoch the optimizer's lrs and get_lr() must
// equal expected(epoch, base).
void ExpectSchedule(LRScheduler& sched, Optimizer& opt,
                    const std::function<double(int64_t, double)>& expected) {
  const double bases[2] = {0.1, 0.4};
  for (int64_t epoch = 0; epoch <= 12; ++epoch) {
    if (epoch > 0) sched.step();
    ASSERT_EQ(sched.last_epoch(), epoch);
    for (int g = 0; g < 2; ++g) {
      const double want = expected(epoch, bases[g]);
      EXPECT_NEAR(opt.lr(g), want, 1e-15) << "epoch " << epoch << " group " << g;
      EXPECT_EQ(sched.get_lr()[g], opt.lr(g));
    }
  }
}

TEST(LRSchedulerTest, StepLR) {
  TwoGroups t;
  StepLR sched(t.sgd, 3, 0.5);
  ExpectSchedule(sched, t.sgd, [](int64_t e, double base) { return base * std::pow(0.5, e / 3); });
}

TEST(LRSchedulerTest, MultiStepLR) {
  TwoGroups t;
  MultiStepLR sched(t.sgd, {2, 5, 9}, 0.1);
  ExpectSchedule(sched, t.sgd, [](int64_t e, double base) {
    const int passed = (e >= 2) + (e >= 5) + (e >= 9);
    return base * std::pow(0.1, passed);
  });
  EXPECT_THROW(MultiStepLR(t.sgd, {5, 2}), Error);
}

TEST(LRSchedulerTest, ExponentialLR) {
  TwoGroups t;
  ExponentialLR sched(t.sgd, 0.9);
  ExpectSchedule(sched, t.sgd, [](int64_t e, double base) { return base * std::pow(0.9, e); });
}

TEST(LRSchedulerTest, CosineAnnealingLR) {
  TwoGroups t;
  CosineAnnealingLR sched(t.sgd, 10, 0.01);
  ExpectSchedule(sched, t.sgd, [](int64_t e, double base) {
    return 0.01 + (base - 0.01) * (1 + std::cos(std::numbers::pi * e / 10)) / 2;
  });
}

TEST(LRSchedulerTest, LinearWarmupThenCosine) {
  TwoGroups t;
  LinearWarmup sched(t.sgd, 4, 0.25, std::make_unique<CosineAnnealingLR>(t.sgd, 8));
  ExpectSchedule(sched, t.sgd, [](int64_t e, double base) {
    if (e < 4) return base * (0.25 + 0.75 * e / 4.0);
    return base * (1 + std::cos(std::numbers::pi * (e - 4) / 8)) / 2;
  });
}

TEST(LRSchedulerTest, LinearWarmupAlone) {
  TwoGroups t;
  LinearWarmup sched(t.sgd, 5);
  ExpectSchedule(sched, t.sgd,
                 [](int64_t e, double base) { return e < 5 ? base * e / 5.0 : base; });
  EXPECT_THROW(LinearWarmup(t.sgd, 0), Error);
}

// torch's LambdaLR (Paddle's LambdaDecay): lr = base * lr_lambda(epoch); a
// negative or non-finite factor is named with its epoch.
TEST(LRSchedulerTest, LambdaLR) {
  TwoGroups t;
  LambdaLR sched(t.sgd, [](int64_t e) { return 1.0 / (1.0 + 0.5 * static_cast<double>(e)); });
  ExpectSchedule(sched, t.sgd, [](int64_t e, double base) { return base / (1.0 + 0.5 * e); });
  std::string what;
  TwoGroups u;
  LambdaLR bad(u.sgd, [](int64_t e) { return e < 2 ? 1.0 : -0.5; });
  bad.step();
  const double lr_before = u.sgd.lr(1);
  try {
    bad.step();
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_EQ(what, "LambdaLR: lr_lambda(2) is -0.5; the factor must be finite and >= 0");
  // The refused step changed nothing: the epoch and every group's lr stand.
  EXPECT_EQ(bad.last_epoch(), 1);
  EXPECT_EQ(u.sgd.lr(1), lr_before);
  EXPECT_THROW(LambdaLR(t.sgd, nullptr), Error);

  // A resume saves the epoch and base lrs only: the schedule made again with
  // the same function continues where the first stood.
  for (int i = 0; i < 3; ++i) sched.step();
  TwoGroups fresh;
  LambdaLR resumed(fresh.sgd, [](int64_t e) { return 1.0 / (1.0 + 0.5 * static_cast<double>(e)); });
  ASSERT_TRUE(resumed.load_state_dict(sched.state_dict()).ok());
  EXPECT_EQ(resumed.last_epoch(), sched.last_epoch());
  EXPECT_EQ(fresh.sgd.lr(1), t.sgd.lr(1));
}

// lr = base * (1 + epoch), refused from epoch 2 on for a base lr above 0.2
// (the second of TwoGroups' groups only).
class RefusesSecondGroup final : public LRScheduler {
 public:
  explicit RefusesSecondGroup(Optimizer& optimizer) : LRScheduler(optimizer) { Apply(); }
  double LrAt(int64_t epoch, double base_lr) const override {
    TANDEM_CHECK(epoch < 2 || base_lr <= 0.2, "RefusesSecondGroup: epoch ", epoch);
    return base_lr * static_cast<double>(1 + epoch);
  }
};

// A step that one group's lr refuses sets no group's lr (the first group's
// was set before the second's threw) and leaves the epoch.
TEST(LRSchedulerTest, StepRefusedByOneGroupChangesNoGroup) {
  TwoGroups t;
  RefusesSecondGroup sched(t.sgd);
  sched.step();
  EXPECT_THROW(sched.step(), Error);
  EXPECT_EQ(sched.last_epoch(), 1);
  EXPECT_EQ(t.sgd.lr(0), 0.1 * 2);
  EXPECT_EQ(t.sgd.lr(1), 0.4 * 2);
}

// A loaded epoch that the schedule refuses is an error naming it; the
// scheduler and the optimizer stay as they were. So is an epoch that is no
// whole number >= 0.
TEST(LRSchedulerTest, LoadOfARefusedEpochChangesNothing) {
  TwoGroups t;
  LambdaLR sched(t.sgd, [](int64_t e) { return e < 2 ? 1.0 : -0.5; });
  sched.step();
  const absl::Status s =
      sched.load_state_dict({{"last_epoch", 5}, {"base_lr.0", 0.3}, {"base_lr.1", 0.6}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("last_epoch 5: LambdaLR: lr_lambda(5) is -0.5"), std::string::npos)
      << s;
  EXPECT_EQ(sched.last_epoch(), 1);
  EXPECT_EQ(sched.base_lrs(), (std::vector<double>{0.1, 0.4}));
  EXPECT_EQ(t.sgd.lr(0), 0.1);
  EXPECT_EQ(t.sgd.lr(1), 0.4);
  for (double bad : {-1.0, 1.5, std::nan(""), 1e300}) {
    const absl::Status b =
        sched.load_state_dict({{"last_epoch", bad}, {"base_lr.0", 0.3}, {"base_lr.1", 0.6}});
    EXPECT_EQ(b.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.message().find(absl::StrCat("'last_epoch' is ", bad)), std::string::npos) << b;
  }
  EXPECT_EQ(sched.last_epoch(), 1);
}

TEST(LRSchedulerTest, StateRoundTrip) {
  TwoGroups t;
  StepLR sched(t.sgd, 2, 0.5);
  for (int i = 0; i < 5; ++i) sched.step();
  const auto state = sched.state_dict();
  EXPECT_EQ(state.at("last_epoch"), 5);

  TwoGroups fresh;
  StepLR resumed(fresh.sgd, 2, 0.5);
  ASSERT_TRUE(resumed.load_state_dict(state).ok());
  EXPECT_EQ(resumed.last_epoch(), 5);
  EXPECT_EQ(fresh.sgd.lr(0), t.sgd.lr(0));
  sched.step();
  resumed.step();
  EXPECT_EQ(fresh.sgd.lr(1), t.sgd.lr(1));
  EXPECT_EQ(fresh.sgd.lr(1), 0.4 * 0.125);

  auto bad = state;
  bad.erase("base_lr.1");
  EXPECT_FALSE(resumed.load_state_dict(bad).ok());
}

TEST(ClipGradNormTest, ScalesToMaxNorm) {
  nn::Tensor a = nn::zeros({2}, {.dtype = nn::kFloat64, .requires_grad = true});
  nn::Tensor b = nn::zeros({1}, {.dtype = nn::kFloat64, .requires_grad = true});
  nn::Tensor c = nn::zeros({1}, {.dtype = nn::kFloat64, .requires_grad = true});  // no grad
  a.set_grad(nn::from_vector(std::vector<double>{3, 0}, {2}));
  b.set_grad(nn::from_vector(std::vector<double>{-4}, {1}));
  const nn::Tensor grad_a = a.grad();
  nn::Tensor norm = clip_grad_norm_({a, b, c}, 1.0);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.dtype(), nn::kFloat64);
  EXPECT_DOUBLE_EQ(norm.item(), 5.0);
  const double coef = 1.0 / (5.0 + 1e-6);
  EXPECT_TRUE(a.grad().is_same(grad_a));  // in place
  EXPECT_DOUBLE_EQ(a.grad().to_vector<double>()[0], 3 * coef);
  EXPECT_DOUBLE_EQ(b.grad().to_vector<double>()[0], -4 * coef);

  // Below the limit: unchanged.
  a.set_grad(nn::from_vector(std::vector<double>{0.3, 0.4}, {2}));
  norm = clip_grad_norm_({a}, 10.0);
  EXPECT_DOUBLE_EQ(norm.item(), 0.5);
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0.3, 0.4}));

  EXPECT_EQ(clip_grad_norm_({c}, 1.0).item(), 0.0);
}

TEST(ClipGradNormTest, Float32AndMismatch) {
  nn::Tensor a = nn::zeros({3}, {.requires_grad = true});
  a.set_grad(nn::from_vector(std::vector<float>{1, 2, 2}, {3}));
  nn::Tensor norm = clip_grad_norm_({a}, 1.5);
  EXPECT_EQ(norm.dtype(), nn::kFloat32);
  EXPECT_FLOAT_EQ(static_cast<float>(norm.item()), 3.0f);
  EXPECT_FLOAT_EQ(a.grad().to_vector<float>()[1], 2.0f * static_cast<float>(1.5 / (3.0 + 1e-6)));

  nn::Tensor d = nn::zeros({1}, {.dtype = nn::kFloat64, .requires_grad = true});
  d.set_grad(nn::ones({1}, {.dtype = nn::kFloat64}));
  EXPECT_THROW(clip_grad_norm_({a, d}, 1.0), Error);
}

}  // namespace
}  // namespace tandem::optim
