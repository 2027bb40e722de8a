// Optimizers against the pure-Python reference of PyTorch's update rules
// (optim_reference.py -> optim_reference_data.h), parameter groups, zero_grad
// and state_dict.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>

#include "nn/ops/elementwise.h"
#include "optim/adagrad.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/internal/fused_kernels.h"
#include "optim/sgd.h"
#include "tests/optim/optim_reference_data.h"

namespace tandem::optim {
namespace {

namespace ref = reference;

// w1 (3 elements) and w2 (2 elements) holding ref::kW0, with zero gradients.
std::vector<nn::Tensor> MakeParams(nn::DType dtype = nn::kFloat64) {
  std::vector<double> w(ref::kW0, ref::kW0 + ref::kElements);
  nn::Tensor w1 = nn::from_vector(std::vector<double>(w.begin(), w.begin() + 3), {3},
                                  {.dtype = dtype, .requires_grad = true});
  nn::Tensor w2 = nn::from_vector(std::vector<double>(w.begin() + 3, w.end()), {2},
                                  {.dtype = dtype, .requires_grad = true});
  w1.set_grad(nn::zeros_like(w1));
  w2.set_grad(nn::zeros_like(w2));
  return {w1, w2};
}

// Writes df/dw = 2 a w + b into the existing gradient tensors.
void ComputeGrads(const std::vector<nn::Tensor>& params) {
  int k = 0;
  for (const nn::Tensor& p : params) {
    double* w = p.data<double>();
    double* g = p.grad().data<double>();
    for (int64_t i = 0; i < p.numel(); ++i, ++k) g[i] = 2 * ref::kA[k] * w[i] + ref::kB[k];
  }
}

std::vector<double> Values(const std::vector<nn::Tensor>& params) {
  std::vector<double> out;
  for (const nn::Tensor& p : params) {
    for (double v : p.to_vector<double>()) out.push_back(v);
  }
  return out;
}

std::unique_ptr<Optimizer> MakeOptimizer(const std::string& name, std::vector<nn::Tensor> params) {
  if (name == "sgd_plain") return std::make_unique<SGD>(params, SGDOptions{.lr = 0.1});
  if (name == "sgd_momentum") {
    return std::make_unique<SGD>(
        params, SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01});
  }
  if (name == "sgd_nesterov") {
    return std::make_unique<SGD>(
        params, SGDOptions{.lr = 0.05, .momentum = 0.8, .weight_decay = 0.02, .nesterov = true});
  }
  if (name == "adagrad") {
    return std::make_unique<Adagrad>(params, AdagradOptions{.lr = 0.1,
                                                            .lr_decay = 0.05,
                                                            .weight_decay = 0.01,
                                                            .initial_accumulator_value = 0.1,
                                                            .eps = 1e-10});
  }
  if (name == "adam") return std::make_unique<Adam>(params, AdamOptions{.lr = 0.05});
  if (name == "adam_amsgrad_wd") {
    return std::make_unique<Adam>(params, AdamOptions{.lr = 0.05,
                                                      .betas = {0.8, 0.95},
                                                      .eps = 1e-6,
                                                      .weight_decay = 0.1,
                                                      .amsgrad = true});
  }
  if (name == "adamw") {
    return std::make_unique<AdamW>(params, AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
  }
  if (name == "adamw_amsgrad") {
    return std::make_unique<AdamW>(
        params,
        AdamWOptions{.lr = 0.02, .betas = {0.85, 0.9}, .weight_decay = 0.05, .amsgrad = true});
  }
  ADD_FAILURE() << "no optimizer for case " << name;
  return nullptr;
}

TEST(OptimReferenceTest, TrajectoriesMatchPyTorchRules) {
  ASSERT_EQ(std::size(ref::kTrajectories), 8u);
  for (const ref::Trajectory& traj : ref::kTrajectories) {
    SCOPED_TRACE(traj.name);
    std::vector<nn::Tensor> params = MakeParams();
    std::unique_ptr<Optimizer> opt = MakeOptimizer(traj.name, params);
    ASSERT_NE(opt, nullptr);
    for (int step = 0; step < ref::kSteps; ++step) {
      opt->zero_grad();
      ComputeGrads(params);
      opt->step();
      const std::vector<double> w = Values(params);
      for (int k = 0; k < ref::kElements; ++k) {
        const double expected = traj.w[step][k];
        EXPECT_NEAR(w[k], expected, 1e-6 * std::abs(expected) + 1e-12)
            << "step " << step + 1 << " element " << k;
      }
    }
    EXPECT_EQ(opt->step_count(0, 0), ref::kSteps);
  }
}

TEST(OptimizerTest, ZeroGradZeroesInPlace) {
  std::vector<nn::Tensor> params = MakeParams();
  Adam adam(params, {.lr = 1e-3});
  ComputeGrads(params);
  const nn::Tensor grad_before = params[0].grad();
  adam.zero_grad();
  EXPECT_TRUE(params[0].grad().is_same(grad_before));
  EXPECT_EQ(params[0].grad().data_ptr(), grad_before.data_ptr());
  EXPECT_EQ(params[0].grad().to_vector<double>(), (std::vector<double>{0, 0, 0}));
  ComputeGrads(params);
  adam.clear_grad();
  EXPECT_EQ(params[1].grad().to_vector<double>(), (std::vector<double>{0, 0}));
}

TEST(OptimizerTest, ParameterWithoutGradIsSkipped) {
  std::vector<nn::Tensor> params = MakeParams();
  nn::Tensor frozen = nn::ones({4}, {.dtype = nn::kFloat64, .requires_grad = true});
  SGD sgd({params[0], params[1], frozen}, {.lr = 0.5, .momentum = 0.9});
  ComputeGrads(params);
  sgd.step();
  EXPECT_EQ(frozen.to_vector<double>(), (std::vector<double>{1, 1, 1, 1}));
  EXPECT_EQ(sgd.step_count(0, 2), 0);
  EXPECT_EQ(sgd.step_count(0, 0), 1);
}

// A parameter that misses steps keeps its own step count (bias corrections):
// the same as an optimizer of its own that saw only its steps.
TEST(OptimizerTest, StepCountsArePerParameter) {
  std::vector<nn::Tensor> joint = MakeParams();
  std::vector<nn::Tensor> alone = MakeParams();
  Adam adam_joint(joint, {.lr = 0.05});
  Adam adam_a({alone[0]}, {.lr = 0.05});
  Adam adam_b({alone[1]}, {.lr = 0.05});
  for (int step = 0; step < 6; ++step) {
    ComputeGrads(joint);
    ComputeGrads(alone);
    const bool b_has_grad = step % 2 == 0;
    nn::Tensor saved = joint[1].grad();
    if (!b_has_grad) joint[1].set_grad(nn::Tensor());
    adam_joint.step();
    if (!b_has_grad) joint[1].set_grad(saved);
    adam_a.step();
    if (b_has_grad) adam_b.step();
  }
  EXPECT_EQ(adam_joint.step_count(0, 0), 6);
  EXPECT_EQ(adam_joint.step_count(0, 1), 3);
  EXPECT_EQ(Values(joint), Values(alone));
}

TEST(OptimizerTest, ParamGroupsHaveTheirOwnLr) {
  std::vector<nn::Tensor> params = MakeParams();
  SGD sgd(std::vector<ParamGroup<SGDOptions>>{{{params[0]}, {.lr = 0.1}},
                                               {{params[1]}, {.lr = 0.01}}});
  ASSERT_EQ(sgd.num_groups(), 2);
  EXPECT_EQ(sgd.lr(0), 0.1);
  EXPECT_EQ(sgd.lr(1), 0.01);
  std::vector<double> w(ref::kW0, ref::kW0 + ref::kElements);
  for (int step = 0; step < 3; ++step) {
    if (step == 2) sgd.set_lr(1, 0.2);
    sgd.zero_grad();
    ComputeGrads(params);
    sgd.step();
    for (int k = 0; k < ref::kElements; ++k) {
      const double lr = k < 3 ? 0.1 : (step == 2 ? 0.2 : 0.01);
      w[k] -= lr * (2 * ref::kA[k] * w[k] + ref::kB[k]);
    }
  }
  const std::vector<double> got = Values(params);
  for (int k = 0; k < ref::kElements; ++k) EXPECT_DOUBLE_EQ(got[k], w[k]) << k;
  EXPECT_EQ(sgd.options(1).lr, 0.2);
  EXPECT_THROW(sgd.lr(2), Error);
  EXPECT_THROW(sgd.hyper(0, "beta1"), Error);
}

TEST(OptimizerTest, InvalidOptionsThrow) {
  std::vector<nn::Tensor> params = MakeParams();
  EXPECT_THROW(SGD(params, {.lr = 0.1, .nesterov = true}), Error);
  EXPECT_THROW(SGD(params, {.lr = -1}), Error);
  EXPECT_THROW(Adam(params, {.betas = {1.0, 0.999}}), Error);
  EXPECT_THROW(Adagrad(params, {.lr_decay = -1}), Error);
  EXPECT_THROW(SGD(std::vector<nn::Tensor>{}), Error);
  EXPECT_THROW(SGD({nn::zeros({2}, {.dtype = nn::kInt64})}), Error);
}

// Save after 5 steps, load into a fresh optimizer over fresh parameters holding
// the same values, 5 more steps: bit-identical to 10 straight steps.
TEST(OptimizerStateTest, RoundTripIsBitExact) {
  for (const char* name : {"sgd_momentum", "sgd_nesterov", "adagrad", "adam_amsgrad_wd", "adamw"}) {
    SCOPED_TRACE(name);
    std::vector<nn::Tensor> straight = MakeParams();
    std::unique_ptr<Optimizer> opt_straight = MakeOptimizer(name, straight);
    std::vector<nn::Tensor> first = MakeParams();
    std::unique_ptr<Optimizer> opt_first = MakeOptimizer(name, first);
    for (int step = 0; step < 10; ++step) {
      ComputeGrads(straight);
      opt_straight->step();
      if (step < 5) {
        ComputeGrads(first);
        opt_first->step();
      }
    }
    const StateDict saved = opt_first->state_dict();
    const std::vector<double> w5 = Values(first);
    // The dict holds copies: stepping the source on must not change it.
    ComputeGrads(first);
    opt_first->step();

    std::vector<nn::Tensor> resumed = MakeParams();
    for (int k = 0; k < ref::kElements; ++k) {
      (k < 3 ? resumed[0].data<double>()[k] : resumed[1].data<double>()[k - 3]) = w5[k];
    }
    std::unique_ptr<Optimizer> opt_resumed = MakeOptimizer(name, resumed);
    ASSERT_TRUE(opt_resumed->load_state_dict(saved).ok());
    EXPECT_EQ(opt_resumed->step_count(0, 1), 5);
    for (int step = 5; step < 10; ++step) {
      ComputeGrads(resumed);
      opt_resumed->step();
    }
    EXPECT_EQ(Values(resumed), Values(straight));
  }
}

TEST(OptimizerStateTest, StateDictHasNamedEntries) {
  std::vector<nn::Tensor> params = MakeParams();
  Adam adam(params, {.lr = 0.01, .amsgrad = true});
  ComputeGrads(params);
  adam.step();
  const StateDict dict = adam.state_dict();
  EXPECT_EQ(dict.scalars.at("num_groups"), 1);
  EXPECT_EQ(dict.scalars.at("group.0.num_params"), 2);
  EXPECT_EQ(dict.scalars.at("group.0.lr"), 0.01);
  EXPECT_EQ(dict.scalars.at("group.0.amsgrad"), 1);
  EXPECT_EQ(dict.scalars.at("state.0.1.step"), 1);
  ASSERT_EQ(dict.tensors.size(), 6u);
  EXPECT_EQ(dict.tensors[0].first, "state.0.0.exp_avg");
  EXPECT_EQ(dict.tensors[5].first, "state.0.1.max_exp_avg_sq");
  EXPECT_EQ(dict.tensors[3].second.shape(), (nn::Shape{2}));
}

TEST(OptimizerStateTest, LoadErrorsNameTheKey) {
  std::vector<nn::Tensor> params = MakeParams();
  Adam adam(params, {.lr = 0.01});
  ComputeGrads(params);
  adam.step();
  const StateDict good = adam.state_dict();

  Adam other(MakeParams(), {.lr = 0.5});
  StateDict bad_shape = good;
  bad_shape.tensors[1].second = nn::zeros({4}, {.dtype = nn::kFloat64});
  absl::Status s = other.load_state_dict(bad_shape);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("state.0.0.exp_avg_sq"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("(4)"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("(3)"), absl::string_view::npos) << s;
  EXPECT_EQ(other.lr(), 0.5);  // unchanged on error
  EXPECT_EQ(other.step_count(0, 0), 0);

  StateDict missing = good;
  missing.scalars.erase("group.0.beta2");
  s = other.load_state_dict(missing);
  EXPECT_NE(s.message().find("group.0.beta2"), absl::string_view::npos) << s;

  StateDict extra = good;
  extra.tensors.emplace_back("state.0.7.exp_avg", nn::zeros({3}, {.dtype = nn::kFloat64}));
  s = other.load_state_dict(extra);
  EXPECT_NE(s.message().find("state.0.7.exp_avg"), absl::string_view::npos) << s;

  SGD sgd({MakeParams()[0]}, {.lr = 0.1});
  s = sgd.load_state_dict(good);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("num_params"), absl::string_view::npos) << s;

  EXPECT_TRUE(other.load_state_dict(good).ok());
  EXPECT_EQ(other.lr(), 0.01);
}

TEST(OptimizerTest, Float32ParametersFollowTheFloat64Path) {
  std::vector<nn::Tensor> p64 = MakeParams();
  std::vector<nn::Tensor> p32 = MakeParams(nn::kFloat32);
  Adam a64(p64, {.lr = 0.05});
  Adam a32(p32, {.lr = 0.05});
  for (int step = 0; step < 10; ++step) {
    ComputeGrads(p64);
    a64.step();
    // float32 gradients from the float32 values.
    int k = 0;
    for (const nn::Tensor& p : p32) {
      float* w = p.data<float>();
      float* g = p.grad().data<float>();
      for (int64_t i = 0; i < p.numel(); ++i, ++k) {
        g[i] = static_cast<float>(2 * ref::kA[k] * w[i] + ref::kB[k]);
      }
    }
    a32.step();
  }
  const std::vector<double> w64 = Values(p64), w32 = Values(p32);
  for (int k = 0; k < ref::kElements; ++k) EXPECT_NEAR(w32[k], w64[k], 1e-5) << k;
}

}  // namespace
}  // namespace tandem::optim

namespace tandem::optim {
namespace {

// A group mixing dtypes gets one launch per dtype (the grouping that also
// splits a group across devices): each parameter moves as it does alone.
TEST(OptimizerTest, GroupMixingDtypesUpdatesEachAsAlone) {
  std::vector<nn::Tensor> mixed = {MakeParams(nn::kFloat64)[0], MakeParams(nn::kFloat32)[1]};
  std::vector<nn::Tensor> alone64 = {MakeParams(nn::kFloat64)[0]};
  std::vector<nn::Tensor> alone32 = {MakeParams(nn::kFloat32)[1]};
  Adam both(mixed, {.lr = 0.1}), a64(alone64, {.lr = 0.1}), a32(alone32, {.lr = 0.1});
  for (int step = 0; step < 3; ++step) {
    for (auto* params : {&mixed, &alone64, &alone32}) {
      for (const nn::Tensor& p : *params) p.grad().copy_(p.detach() * 2.0 + 0.5);
    }
    both.step();
    a64.step();
    a32.step();
  }
  EXPECT_EQ(mixed[0].to_vector<double>(), alone64[0].to_vector<double>());
  EXPECT_EQ(mixed[1].to_vector<float>(), alone32[0].to_vector<float>());
}

// Gradients with the norms 3 and 4 (total 5), split into two sets.
std::vector<nn::Tensor> Grads345() {
  return {nn::from_vector(std::vector<double>{3.0, 0.0}, {2}),
          nn::from_vector(std::vector<double>{0.0, 4.0}, {2})};
}

// clip_grad_norm_ over gradients on several devices: each device's norm, the
// total from them, each device's gradients scaled by the one coefficient. Runs
// here with two CPU groups standing for two devices.
TEST(ClipGradNormTest, GroupsOfDevicesCombineAsOne) {
  for (double max_norm : {1.0, 2.5, 100.0}) {
    std::vector<nn::Tensor> split = Grads345(), whole = Grads345();
    const nn::Tensor total_split =
        internal::ClipGradNormByDevice({{split[0]}, {split[1]}}, max_norm);
    const nn::Tensor total_whole = internal::ClipGradNormByDevice({whole}, max_norm);
    EXPECT_DOUBLE_EQ(total_split.item(), 5.0) << max_norm;
    EXPECT_DOUBLE_EQ(total_whole.item(), 5.0) << max_norm;
    const double coef = std::min(1.0, max_norm / (5.0 + 1e-6));
    for (int i = 0; i < 2; ++i) {
      const std::vector<double> a = split[i].to_vector<double>(), b = whole[i].to_vector<double>();
      for (size_t k = 0; k < a.size(); ++k) {
        EXPECT_NEAR(a[k], b[k], 1e-15) << max_norm;
        EXPECT_NEAR(a[k], Grads345()[i].to_vector<double>()[k] * coef, 1e-15) << max_norm;
      }
    }
    if (max_norm == 100.0) {  // no clipping: the gradients are left exactly as they were
      EXPECT_EQ(split[0].to_vector<double>(), Grads345()[0].to_vector<double>());
      EXPECT_EQ(split[1].to_vector<double>(), Grads345()[1].to_vector<double>());
    }
  }
}

TEST(ClipGradNormTest, GradientsOfTwoDTypesAreAnError) {
  std::vector<nn::Tensor> params = MakeParams(nn::kFloat64);
  params[1] = MakeParams(nn::kFloat32)[1];
  try {
    clip_grad_norm_(params, 1.0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs in dtype"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("float32"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem::optim
