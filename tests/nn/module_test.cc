// Module machinery (names, order, modes, state_dict, to, holders) with
// elementwise-only modules, then the layers built on the op families.
#include "nn/module.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/reduce.h"
#include "nn/random.h"

namespace tandem::nn {
namespace {

// y = tanh(x * scale + shift): parameters (n), a buffer counting calls.
struct Affine : Module {
  explicit Affine(int64_t n) {
    scale = register_parameter("scale", full({n}, 2.0));
    shift = register_parameter("shift", zeros({n}));
    calls = register_buffer("calls", zeros({1}));
  }
  Tensor forward(const Tensor& x) override {
    {
      NoGradGuard g;
      calls.add_(ones({1}));
    }
    return tanh(x * scale + shift);
  }
  Tensor scale, shift, calls;
};

struct Block : Module {
  Block() : first(register_module("first", std::make_shared<Affine>(3))),
            second(register_module("second", std::make_shared<Affine>(3))) {
    gain = register_parameter("gain", ones({3}));
  }
  Tensor forward(const Tensor& x) override { return second->forward(first->forward(x)) * gain; }
  std::shared_ptr<Affine> first, second;
  Tensor gain;
};

struct Net : Module {
  Net() : block(register_module("block", std::make_shared<Block>())),
          head(register_module("head", std::make_shared<Affine>(3))) {}
  Tensor forward(const Tensor& x) override { return head->forward(block->forward(x)); }
  std::shared_ptr<Block> block;
  std::shared_ptr<Affine> head;
};

std::vector<std::string> Names(const NamedTensors& named) {
  std::vector<std::string> out;
  for (const auto& [name, unused] : named) out.push_back(name);
  return out;
}

TEST(ModuleTest, NamedParametersAreDottedPathsInDepthFirstOrder) {
  Net net;
  const std::vector<std::string> expected = {
      "block.gain", "block.first.scale", "block.first.shift", "block.second.scale",
      "block.second.shift", "head.scale", "head.shift"};
  EXPECT_EQ(Names(net.named_parameters()), expected);
  EXPECT_EQ(Names(net.named_buffers()),
            (std::vector<std::string>{"block.first.calls", "block.second.calls", "head.calls"}));
  // parameters() is the same order; each tensor requires grad and knows its name.
  const std::vector<Tensor> params = net.parameters();
  ASSERT_EQ(params.size(), expected.size());
  EXPECT_TRUE(params[1].is_same(net.block->first->scale));
  EXPECT_TRUE(params[5].is_same(net.head->scale));
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(params[i].requires_grad());
    EXPECT_EQ(params[i].name(), expected[i]);
  }
  EXPECT_FALSE(net.buffers()[0].requires_grad());
  EXPECT_EQ(net.children().size(), 2u);
  EXPECT_EQ(net.named_children()[1].first, "head");
}

TEST(ModuleTest, SharedParameterAppearsOnce) {
  struct Tied : Module {
    Tied() {
      Tensor w = register_parameter("w", ones({2}));
      auto child = std::make_shared<Module>();
      child->register_parameter("w_again", w);
      register_module("child", child);
    }
  } tied;
  EXPECT_EQ(tied.parameters().size(), 1u);
  EXPECT_EQ(Names(tied.named_parameters()), std::vector<std::string>{"w"});
}

TEST(ModuleTest, BadRegistrationsThrowNamingTheName) {
  Module m;
  m.register_parameter("w", zeros({2}));
  try {
    m.register_buffer("w", zeros({2}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.register_parameter("a.b", zeros({2})), Error);
  EXPECT_THROW(m.register_parameter("", zeros({2})), Error);
  EXPECT_THROW(m.register_parameter("i", zeros({2}, {.dtype = kInt64})), Error);
}

TEST(ModuleTest, DefaultForwardThrowsNamingTheModule) {
  Block block;  // defines forward
  Module plain;
  try {
    plain(zeros({1}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Module"), std::string::npos) << e.what();
  }
  MSELoss loss;
  try {
    (*loss)(zeros({1}));  // a loss needs two arguments
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MSELossImpl"), std::string::npos) << e.what();
  }
}

TEST(ModuleTest, TrainEvalPropagatesToDescendants) {
  Net net;
  EXPECT_TRUE(net.is_training());
  net.eval();
  EXPECT_FALSE(net.is_training());
  EXPECT_FALSE(net.block->is_training());
  EXPECT_FALSE(net.block->second->is_training());
  net.block->train();
  EXPECT_TRUE(net.block->first->is_training());
  EXPECT_FALSE(net.is_training());
  net.train(true);
  EXPECT_TRUE(net.head->is_training());
}

TEST(ModuleTest, BackwardReachesParametersAndZeroGradClears) {
  manual_seed(3);
  Net net;
  Tensor y = net(randn({4, 3}));
  (y * y).backward(ones({4, 3}));
  for (const auto& [name, p] : net.named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().shape(), p.shape()) << name;
  }
  net.zero_grad();
  for (const Tensor& p : net.parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(ModuleTest, StateDictRoundTripIncludesBuffers) {
  manual_seed(4);
  Net a, b;
  {
    NoGradGuard g;
    for (Tensor p : a.parameters()) p.copy_(randn(p.shape()));
    a.head->calls.fill_(7);
  }
  const StateDict state = a.state_dict();
  EXPECT_EQ(Names(state),
            (std::vector<std::string>{"block.gain", "block.first.scale", "block.first.shift",
                                      "block.first.calls", "block.second.scale",
                                      "block.second.shift", "block.second.calls", "head.scale",
                                      "head.shift", "head.calls"}));
  Tensor b_scale = b.block->first->scale;  // a handle held before loading
  ASSERT_TRUE(b.load_state_dict(state).ok());
  const StateDict loaded = b.state_dict();
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(loaded[i].second.to_vector<float>(), state[i].second.to_vector<float>())
        << state[i].first;
  }
  EXPECT_EQ(b_scale.to_vector<float>(), a.block->first->scale.to_vector<float>());
  EXPECT_EQ(b.head->calls.to_vector<float>(), std::vector<float>{7});
  // Loaded by value: changing a afterwards leaves b alone.
  {
    NoGradGuard g;
    a.head->shift.fill_(100);
  }
  EXPECT_NE(b.head->shift.to_vector<float>()[0], 100.0f);
}

TEST(ModuleTest, LoadErrorsNameKeyAndShapesAndLeaveModuleUnchanged) {
  Net net;
  const std::vector<float> before = net.head->scale.to_vector<float>();

  StateDict wrong_shape = net.state_dict();
  for (auto& [name, t] : wrong_shape) {
    if (name == "head.shift") t = zeros({5, 2});
    if (name == "head.scale") t = full({3}, -1.0);
  }
  absl::Status s = net.load_state_dict(wrong_shape);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'head.shift'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(3)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(5, 2)"), std::string::npos) << s;
  EXPECT_EQ(net.head->scale.to_vector<float>(), before);  // nothing copied

  StateDict wrong_dtype = net.state_dict();
  wrong_dtype[0].second = ones({3}, {.dtype = kFloat64});
  s = net.load_state_dict(wrong_dtype);
  EXPECT_NE(s.message().find("float64"), std::string::npos) << s;

  StateDict missing = net.state_dict();
  missing.erase(missing.begin() + 3);  // block.first.calls
  s = net.load_state_dict(missing);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("missing key 'block.first.calls'"), std::string::npos) << s;
  EXPECT_TRUE(net.load_state_dict(missing, /*strict=*/false).ok());

  StateDict extra = net.state_dict();
  extra.emplace_back("head.extra", zeros({1}));
  s = net.load_state_dict(extra);
  EXPECT_NE(s.message().find("unexpected key 'head.extra'"), std::string::npos) << s;
  EXPECT_TRUE(net.load_state_dict(extra, /*strict=*/false).ok());
}

TEST(ModuleTest, ToCpuKeepsHandlesAndData) {
  Net net;
  const std::vector<Tensor> before = net.parameters();
  const std::vector<float> values = before[0].to_vector<float>();
  const void* data = before[0].data_ptr();
  net.to(Device::CPU());
  const std::vector<Tensor> after = net.parameters();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(after[i].is_same(before[i]));
  EXPECT_EQ(before[0].data_ptr(), data);  // already there: nothing moved
  EXPECT_EQ(before[0].to_vector<float>(), values);
}

TEST(ModuleTest, ToDtypeConvertsFloatingTensorsInPlaceAndKeepsCounts) {
  manual_seed(5);
  Sequential net({Conv2d(2, 3, 3), BatchNorm2d(3)});
  const Tensor x = randn({2, 2, 5, 5});
  sum(net->forward(x)).backward();
  const std::vector<Tensor> handles = net->parameters();
  const std::vector<float> before = handles[0].to_vector<float>();
  const std::vector<float> grad_before = handles[0].grad().to_vector<float>();
  net->to(kFloat64);
  EXPECT_EQ(handles[0].dtype(), kFloat64);  // the same handle sees the new dtype
  EXPECT_EQ(handles[0].grad().dtype(), kFloat64);
  const std::vector<double> after = handles[0].to_vector<double>();
  const std::vector<double> grad_after = handles[0].grad().to_vector<double>();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i], static_cast<double>(before[i])) << i;
    EXPECT_EQ(grad_after[i], static_cast<double>(grad_before[i])) << i;
  }
  for (const auto& [name, b] : net->named_buffers()) {
    EXPECT_EQ(b.dtype(), name.find("num_batches_tracked") != std::string::npos ? kInt64 : kFloat64)
        << name;
  }
  net->zero_grad();
  const Tensor y = net->forward(x.to(kFloat64));
  EXPECT_EQ(y.dtype(), kFloat64);
  sum(y).backward();
  EXPECT_EQ(handles[1].grad().dtype(), kFloat64);
  try {
    net->to(kInt64);
    ADD_FAILURE() << "to(int64) did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("int64"), std::string::npos) << e.what();
  }
}

TEST(ModuleTest, HoldersShareOneModule) {
  manual_seed(5);
  Linear a(4, 2);
  Linear b = a;  // copy of the handle
  EXPECT_EQ(a.get(), b.get());
  EXPECT_TRUE(a->weight.is_same(b->weight));
  Linear fresh(4, 2);
  EXPECT_NE(fresh.get(), a.get());
  EXPECT_EQ(a->weight.shape(), (Shape{2, 4}));
  EXPECT_EQ(a->bias.shape(), (Shape{2}));
  EXPECT_FALSE(Linear(4, 2, /*bias=*/false)->bias.defined());
  // Registering a holder shares it with the parent.
  Module parent;
  Linear registered = parent.register_module("fc", a);
  EXPECT_EQ(registered.get(), a.get());
  EXPECT_EQ(Names(parent.named_parameters()), (std::vector<std::string>{"fc.weight", "fc.bias"}));
  EXPECT_EQ(a->weight.name(), "fc.weight");
  Linear empty = nullptr;
  EXPECT_TRUE(empty.is_empty());
  EXPECT_THROW(empty.get(), Error);
}

TEST(LayersTest, LinearInitIsUniformWithinBoundAndSeeded) {
  manual_seed(6);
  Linear a(100, 50);
  manual_seed(6);
  Linear b(100, 50);
  EXPECT_EQ(a->weight.to_vector<float>(), b->weight.to_vector<float>());
  const double bound = 1.0 / std::sqrt(100.0);
  double lo = 1, hi = -1, sum = 0;
  for (float w : a->weight.to_vector<float>()) {
    lo = std::min<double>(lo, w);
    hi = std::max<double>(hi, w);
    sum += w;
  }
  EXPECT_GE(lo, -bound);
  EXPECT_LT(hi, bound);
  EXPECT_LT(lo, -0.9 * bound);  // spans the range (5000 draws)
  EXPECT_GT(hi, 0.9 * bound);
  EXPECT_NEAR(sum / 5000.0, 0.0, 0.01);
  for (float v : a->bias.to_vector<float>()) EXPECT_LE(std::abs(v), bound);
}

TEST(LayersTest, ActivationsFlattenAndSequential) {
  Tensor x = from_vector(std::vector<float>{-1, 0.5, 2, -3, 0, 1}, {1, 2, 3});
  EXPECT_EQ(ReLU()(x).to_vector<float>(), (std::vector<float>{0, 0.5, 2, 0, 0, 1}));
  EXPECT_FLOAT_EQ(Sigmoid()(x).to_vector<float>()[2], 1.0f / (1.0f + std::exp(-2.0f)));
  EXPECT_FLOAT_EQ(Tanh()(x).to_vector<float>()[0], std::tanh(-1.0f));
  EXPECT_EQ(Flatten()(x).shape(), (Shape{1, 6}));
  EXPECT_EQ(Flatten(0)(x).shape(), (Shape{6}));

  Sequential seq({Flatten(), ReLU(), Tanh()});
  seq->push_back(Sigmoid());
  EXPECT_EQ(seq->size(), 4);
  Tensor y = seq(x);
  Tensor expected = sigmoid(tanh(relu(x.flatten(1))));
  EXPECT_EQ(y.to_vector<float>(), expected.to_vector<float>());
  EXPECT_EQ(seq->named_children()[3].first, "3");
  EXPECT_THROW((*seq)[4], Error);
  // A user module joins a Sequential through shared_ptr.
  Sequential with_user({std::make_shared<Block>(), ReLU()});
  EXPECT_EQ(Names(with_user->named_parameters())[0], "0.gain");
}

TEST(LayersTest, DropoutDropsOnlyWhileTraining) {
  manual_seed(7);
  Dropout drop(0.5);
  Tensor x = ones({2000});
  std::vector<float> y = drop(x).to_vector<float>();
  int64_t zeros_seen = 0;
  for (float v : y) {
    if (v == 0.0f) {
      ++zeros_seen;
    } else {
      EXPECT_FLOAT_EQ(v, 2.0f);  // kept values scaled by 1/(1-p)
    }
  }
  EXPECT_NEAR(static_cast<double>(zeros_seen) / 2000.0, 0.5, 0.05);
  drop->eval();
  EXPECT_EQ(drop(x).to_vector<float>(), x.to_vector<float>());
  // A Dropout inside a parent follows the parent's mode.
  Sequential seq({Dropout(0.9)});
  seq->eval();
  EXPECT_EQ(seq(x).to_vector<float>(), x.to_vector<float>());
  EXPECT_THROW(Dropout(1.0), Error);
}

TEST(LayersTest, BatchNorm2dTrainUsesBatchStatsEvalUsesRunning) {
  manual_seed(8);
  BatchNorm2d bn(3);
  EXPECT_EQ(Names(bn->named_parameters()), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(Names(bn->named_buffers()),
            (std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"}));
  const int64_t n = 4, c = 3, hw = 5;
  Tensor x = randn({n, c, hw, 1}) * 3.0 + 1.0;
  const std::vector<float> xv = x.to_vector<float>();
  std::vector<double> mean(c, 0), var(c, 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k)
      for (int64_t j = 0; j < hw; ++j) mean[k] += xv[(i * c + k) * hw + j] / (n * hw);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < c; ++k)
      for (int64_t j = 0; j < hw; ++j) {
        const double d = xv[(i * c + k) * hw + j] - mean[k];
        var[k] += d * d / (n * hw);
      }
  // Training: batch statistics, running ones move by momentum 0.1.
  const std::vector<float> y = bn(x).to_vector<float>();
  for (int64_t k = 0; k < c; ++k) {
    const int64_t at = (1 * c + k) * hw + 2;
    EXPECT_NEAR(y[at], (xv[at] - mean[k]) / std::sqrt(var[k] + 1e-5), 1e-4);
    EXPECT_NEAR(bn->running_mean.to_vector<float>()[k], 0.1 * mean[k], 1e-5);
    const double unbiased = var[k] * (n * hw) / (n * hw - 1);
    EXPECT_NEAR(bn->running_var.to_vector<float>()[k], 0.9 + 0.1 * unbiased, 1e-4);
  }
  // Eval: running statistics, which stay put.
  bn->eval();
  const std::vector<float> rm = bn->running_mean.to_vector<float>();
  const std::vector<float> rv = bn->running_var.to_vector<float>();
  const std::vector<float> z = bn(x).to_vector<float>();
  for (int64_t k = 0; k < c; ++k) {
    const int64_t at = (2 * c + k) * hw + 4;
    EXPECT_NEAR(z[at], (xv[at] - rm[k]) / std::sqrt(rv[k] + 1e-5), 1e-4);
  }
  EXPECT_EQ(bn->running_mean.to_vector<float>(), rm);
  // The running statistics travel in the state dict.
  BatchNorm2d other(3);
  ASSERT_TRUE(other->load_state_dict(bn->state_dict()).ok());
  EXPECT_EQ(other->running_var.to_vector<float>(), rv);
}

TEST(LayersTest, ConvPoolFlattenLinearChain) {
  manual_seed(9);
  Sequential net({Conv2d(1, 6, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2),
                  Conv2d(6, 4, 3), AvgPool2d(Pool2dParams{.kernel = {2, 2}}), Flatten(),
                  Linear(4 * 6 * 6, 10)});
  EXPECT_EQ(Names(net->named_parameters()),
            (std::vector<std::string>{"0.weight", "0.bias", "3.weight", "3.bias", "6.weight",
                                      "6.bias"}));
  Tensor x = randn({2, 1, 28, 28});
  Tensor y = net(x);
  ASSERT_EQ(y.shape(), (Shape{2, 10}));
  CrossEntropyLoss loss_fn;
  Tensor loss = loss_fn(y, from_vector(std::vector<int64_t>{3, 7}, {2}));
  loss.backward();
  for (const auto& [name, p] : net->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_EQ(p.grad().shape(), p.shape()) << name;
  }
}

TEST(LayersTest, LossModules) {
  CrossEntropyLoss ce;
  Tensor uniform = zeros({2, 3});
  EXPECT_NEAR(ce(uniform, from_vector(std::vector<int64_t>{0, 2}, {2})).item(), std::log(3.0),
              1e-6);
  MSELoss mse;
  Tensor pred = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  EXPECT_NEAR(mse(pred, zeros({2, 2})).item(), (1 + 4 + 9 + 16) / 4.0, 1e-6);
}

// Records (type, depth of open calls) at Enter and the output shape at Exit.
struct CallLog : ForwardRecorder {
  void Enter(const Module& module) override {
    entered.push_back(module.type_name() + "@" + std::to_string(open++));
  }
  void Exit(const Module& module, const Tensor& output) override {
    --open;
    exited.push_back(module.type_name() + ShapeToString(output.shape()));
  }
  std::vector<std::string> entered, exited;
  int open = 0;
};

TEST(ForwardRecorderTest, SeesEachLayerOfASequentialUnfusedWithTheSameValues) {
  manual_seed(5);
  Sequential net({Conv2d(1, 2, 3), ReLU(), MaxPool2d(2), Flatten()});
  const Tensor x = randn({1, 1, 6, 6});
  const std::vector<float> fused = net(x).to_vector<float>();  // conv+ReLU+pool as one op
  CallLog log;
  std::vector<float> recorded;
  {
    ForwardRecordScope scope(&log);
    recorded = net(x).to_vector<float>();
  }
  EXPECT_EQ(recorded, fused);
  EXPECT_EQ(log.entered,
            (std::vector<std::string>{"SequentialImpl@0", "Conv2dImpl@1",
                                      "ReLUImpl@1", "MaxPool2dImpl@1",
                                      "FlattenImpl@1"}));
  EXPECT_EQ(log.exited, (std::vector<std::string>{
                            "Conv2dImpl(1, 2, 4, 4)", "ReLUImpl(1, 2, 4, 4)",
                            "MaxPool2dImpl(1, 2, 2, 2)",
                            "FlattenImpl(1, 8)", "SequentialImpl(1, 8)"}));
  // The scope put back "none": later calls are not seen.
  EXPECT_EQ(internal::forward_recorder, nullptr);
  net(x);
  EXPECT_EQ(log.exited.size(), 5u);
}

TEST(ForwardRecorderTest, ScopesNest) {
  CallLog outer, inner;
  ReLU relu;
  {
    ForwardRecordScope a(&outer);
    {
      ForwardRecordScope b(&inner);
      relu(zeros({2}));
    }
    relu(zeros({3}));
  }
  EXPECT_EQ(inner.exited, (std::vector<std::string>{"ReLUImpl(2)"}));
  EXPECT_EQ(outer.exited, (std::vector<std::string>{"ReLUImpl(3)"}));
}

}  // namespace
}  // namespace tandem::nn
