// hapi::Summary and Model::summary: LeNet's rows and counts against the numbers
// PyTorch gives for the same network (tests/hapi/summary_reference.py) and those
// computed by hand; the model left as it was (buffers, parameters, training
// flags, the thread's generator); bad shapes refused naming them.
#include "hapi/summary.h"

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "apps/models.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/error.h"
#include "nn/layers.h"
#include "nn/ops/elementwise.h"
#include "nn/random.h"

namespace tandem::hapi {
namespace {

struct Row {
  std::string name, type;
  nn::Shape shape;
  int64_t params;
};

// Written by tests/hapi/summary_reference.py (/usr/bin/python3, torch 1.13):
// torch.nn.Sequential with MakeLeNet's layers, forward hooks, input (2, 1, 28, 28).
const std::vector<Row> kTorchLeNet = {
    {"0", "Conv2d", {2, 20, 28, 28}, 520},   {"1", "ReLU", {2, 20, 28, 28}, 0},
    {"2", "MaxPool2d", {2, 20, 14, 14}, 0},  {"3", "Conv2d", {2, 20, 14, 14}, 10020},
    {"4", "ReLU", {2, 20, 14, 14}, 0},       {"5", "MaxPool2d", {2, 20, 7, 7}, 0},
    {"6", "Flatten", {2, 980}, 0},           {"7", "Linear", {2, 10}, 9810},
};
constexpr int64_t kTorchLeNetParams = 20350;  // the script's "total" and "trainable"

TEST(SummaryTest, LeNetMatchesPyTorchAndHandCounts) {
  std::shared_ptr<nn::Module> net = apps::MakeLeNet();
  absl::StatusOr<ModelSummary> s = Summary(*net, {2, 1, 28, 28});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->layers.size(), kTorchLeNet.size()) << s->table;
  for (size_t i = 0; i < kTorchLeNet.size(); ++i) {
    SCOPED_TRACE(kTorchLeNet[i].name);
    EXPECT_EQ(s->layers[i].name, kTorchLeNet[i].name);
    EXPECT_EQ(s->layers[i].type, kTorchLeNet[i].type);
    EXPECT_EQ(s->layers[i].output_shape, kTorchLeNet[i].shape);
    EXPECT_EQ(s->layers[i].params, kTorchLeNet[i].params);
    EXPECT_EQ(s->layers[i].depth, 1);
  }
  // By hand: conv 1*20*5*5 + 20, conv 20*20*5*5 + 20, fc 980*10 + 10.
  const int64_t by_hand = (1 * 20 * 25 + 20) + (20 * 20 * 25 + 20) + (20 * 7 * 7 * 10 + 10);
  EXPECT_EQ(by_hand, kTorchLeNetParams);
  EXPECT_EQ(s->total_params, kTorchLeNetParams);
  EXPECT_EQ(s->trainable_params, kTorchLeNetParams);
  EXPECT_EQ(s->non_trainable_params, 0);
  EXPECT_EQ(s->total_param_bytes, kTorchLeNetParams * 4);
  EXPECT_EQ(s->trainable_param_bytes, kTorchLeNetParams * 4);
  EXPECT_EQ(s->buffer_elements, 0);
  EXPECT_EQ(s->output_shape, (nn::Shape{2, 10}));
  std::cout << s->table;
  EXPECT_NE(s->table.find("Total params: 20,350 (79.49 KiB)\n"), std::string::npos) << s->table;
  EXPECT_NE(s->table.find("7 (Linear)"), std::string::npos) << s->table;
  EXPECT_NE(s->table.find("(2, 20, 14, 14)"), std::string::npos) << s->table;
  // The recorder is gone after the call: nothing records later forwards.
  EXPECT_EQ(nn::internal::forward_recorder, nullptr);
}

// conv + BatchNorm + ReLU (called twice), Dropout, a nested Sequential and a
// frozen parameter. Input (N, 3, 8, 8).
struct MixedNet : nn::Module {
  MixedNet()
      : conv(register_module("conv", nn::Conv2d(3, 8, 3))),
        bn(register_module("bn", nn::BatchNorm2d(8))),
        act(register_module("act", nn::ReLU())),
        drop(register_module("drop", nn::Dropout(0.5))),
        head(register_module("head", nn::Sequential({nn::Flatten(), nn::Linear(8 * 6 * 6, 4)}))),
        scale(register_parameter("scale", nn::ones({1}))) {
    scale.set_requires_grad(false);
  }
  nn::Tensor forward(const nn::Tensor& x) override {
    return head(drop(act(act(bn(conv(x)))))) * scale;
  }
  nn::Conv2d conv;
  nn::BatchNorm2d bn;
  nn::ReLU act;
  nn::Dropout drop;
  nn::Sequential head;
  nn::Tensor scale;
};

std::vector<std::vector<double>> Values(const std::vector<nn::Tensor>& tensors) {
  std::vector<std::vector<double>> out;
  for (const nn::Tensor& t : tensors) out.push_back(t.to(nn::kFloat64).to_vector<double>());
  return out;
}

TEST(SummaryTest, LeavesBuffersParametersFlagsAndGeneratorAsTheyWere) {
  nn::manual_seed(7);
  MixedNet net;
  nn::randn({5});  // the generator somewhere past its start
  net.train();
  net.head->eval();  // mixed flags: each must come back as it was
  // Running statistics away from their initial values, so that any update shows.
  net.bn->running_mean.copy_(nn::full({8}, 0.25));
  const auto buffers_before = Values(net.buffers());
  const auto params_before = Values(net.parameters());
  const nn::Generator generator_before = nn::thread_generator();

  absl::StatusOr<ModelSummary> s = Summary(net, {4, 3, 8, 8});
  ASSERT_TRUE(s.ok()) << s.status();

  EXPECT_EQ(Values(net.buffers()), buffers_before);
  EXPECT_EQ(Values(net.parameters()), params_before);
  EXPECT_EQ(net.bn->num_batches_tracked.item<int64_t>(), 0);
  const nn::Generator& generator_after = nn::thread_generator();
  EXPECT_EQ(generator_after.seed, generator_before.seed);
  EXPECT_EQ(generator_after.offset, generator_before.offset);
  EXPECT_TRUE(net.is_training());
  EXPECT_TRUE(net.conv->is_training());
  EXPECT_TRUE(net.bn->is_training());
  EXPECT_TRUE(net.drop->is_training());
  EXPECT_FALSE(net.head->is_training());
  EXPECT_FALSE((*net.head)[0]->is_training());
  EXPECT_FALSE((*net.head)[1]->is_training());

  // Rows in call order; the ReLU called twice is listed twice.
  const std::vector<std::string> names = {"conv", "bn",     "act",    "act",
                                          "drop", "head",   "head.0", "head.1"};
  ASSERT_EQ(s->layers.size(), names.size()) << s->table;
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(s->layers[i].name, names[i]) << i;
  EXPECT_EQ(s->layers[1].type, "BatchNorm2d");
  EXPECT_EQ(s->layers[1].output_shape, (nn::Shape{4, 8, 6, 6}));
  EXPECT_EQ(s->layers[5].type, "Sequential");
  EXPECT_TRUE(s->layers[5].has_children);
  EXPECT_EQ(s->layers[5].depth, 1);
  EXPECT_EQ(s->layers[6].depth, 2);
  EXPECT_EQ(s->layers[6].output_shape, (nn::Shape{4, 288}));
  EXPECT_EQ(s->layers[7].output_shape, (nn::Shape{4, 4}));
  // By hand: conv 3*8*3*3 + 8 = 224, BatchNorm 8 + 8, Linear 288*4 + 4 = 1156, scale 1.
  EXPECT_EQ(s->layers[0].params, 224);
  EXPECT_EQ(s->layers[5].params, 1156);
  EXPECT_EQ(s->total_params, 224 + 16 + 1156 + 1);
  EXPECT_EQ(s->trainable_params, 224 + 16 + 1156);
  EXPECT_EQ(s->non_trainable_params, 1);
  EXPECT_EQ(s->non_trainable_param_bytes, 4);
  // running_mean and running_var (8 float32 each), num_batches_tracked (int64).
  EXPECT_EQ(s->buffer_elements, 17);
  EXPECT_EQ(s->buffer_bytes, 16 * 4 + 8);
  std::cout << s->table;
  EXPECT_NE(s->table.find("  head.1 (Linear)"), std::string::npos) << s->table;
  EXPECT_NE(s->table.find("Non-trainable params: 1 (4 B)\n"), std::string::npos) << s->table;
}

// A deeper tree: MobileNetV2's count is torchvision's (apps/models.h); every
// called layer is found in the tree.
TEST(SummaryTest, MobileNetV2TotalsAndPaths) {
  std::shared_ptr<nn::Module> net = apps::MakeMobileNetV2();
  absl::StatusOr<ModelSummary> s = Summary(*net, {1, 3, 32, 32});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->total_params, 2236682) << s->table;
  EXPECT_EQ(s->output_shape, (nn::Shape{1, 10}));
  ASSERT_FALSE(s->layers.empty());
  for (const SummaryLayer& layer : s->layers) EXPECT_NE(layer.name, "(unregistered)");
  EXPECT_EQ(s->layers.back().name, "classifier.1");
  EXPECT_EQ(s->layers.back().type, "Linear");
}

TEST(SummaryTest, RefusesBadShapesNamingThem) {
  std::shared_ptr<nn::Module> net = apps::MakeLeNet();
  absl::StatusOr<ModelSummary> empty = Summary(*net, {});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("input shape ()"), std::string::npos) << empty.status();

  absl::StatusOr<ModelSummary> zero = Summary(*net, {2, 0, 28, 28});
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("(2, 0, 28, 28) has dimension 1 = 0"), std::string::npos)
      << zero.status();

  // Three channels into a one-channel convolution: the layer's error, the model as it was.
  net->train();
  absl::StatusOr<ModelSummary> wrong = Summary(*net, {2, 3, 28, 28});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("input of shape (2, 3, 28, 28) failed in layer 0 "
                                         "(Conv2d): conv2d: x (2, 3, 28, 28) has 3 channels"),
            std::string::npos)
      << wrong.status();
  EXPECT_TRUE(net->is_training());
  EXPECT_EQ(nn::internal::forward_recorder, nullptr);
}

// A layer that tries one child and, when it throws, another: the call that
// threw reported no Exit. Its row is left out, and the rows after it still get
// their own shapes (the outer layer's output is not given to the failed child).
struct TryThenFallBack : nn::Module {
  TryThenFallBack()
      : narrow(register_module("narrow", nn::Linear(3, 4))),
        wide(register_module("wide", nn::Linear(5, 6))) {}
  nn::Tensor forward(const nn::Tensor& x) override {
    try {
      return narrow(x);
    } catch (const Error&) {
      return wide(x);
    }
  }
  nn::Linear narrow, wide;
};

struct FallBackNet : nn::Module {
  FallBackNet()
      : block(register_module("block", std::make_shared<TryThenFallBack>())),
        head(register_module("head", nn::Linear(6, 2))) {}
  nn::Tensor forward(const nn::Tensor& x) override { return head((*block)(x)); }
  std::shared_ptr<TryThenFallBack> block;
  nn::Linear head;
};

TEST(SummaryTest, ACallThatThrewAndWasCaughtLeavesNoRowAndShiftsNoShape) {
  FallBackNet net;
  absl::StatusOr<ModelSummary> s = Summary(net, {2, 5});
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<std::string> rows;
  for (const SummaryLayer& layer : s->layers) {
    rows.push_back(absl::StrCat(layer.name, " ", nn::ShapeToString(layer.output_shape)));
  }
  EXPECT_EQ(rows, (std::vector<std::string>{"block (2, 6)", "block.wide (2, 6)", "head (2, 2)"}))
      << s->table;
}

TEST(SummaryTest, ModelSummaryBuildsFromTheFactoryAndPutsTheGeneratorBack) {
  Model model([] { return apps::MakeLeNet(); });
  nn::manual_seed(3);
  const uint64_t offset_before = nn::thread_generator().offset;
  absl::StatusOr<ModelSummary> s = model.summary({1, 1, 28, 28});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(nn::thread_generator().offset, offset_before);  // the factory's init draws undone
  EXPECT_EQ(s->total_params, kTorchLeNetParams);
  EXPECT_EQ(s->layers.back().output_shape, (nn::Shape{1, 10}));
}

// A factory that throws after drawing: a status naming its message, and the
// generator as it was.
TEST(SummaryTest, ModelSummaryOfAThrowingFactoryIsAStatusAndPutsTheGeneratorBack) {
  Model model([]() -> std::shared_ptr<nn::Module> {
    auto net = apps::MakeLeNet();
    throw Error("no such layer width 0");
  });
  nn::manual_seed(3);
  const uint64_t offset_before = nn::thread_generator().offset;
  absl::StatusOr<ModelSummary> s = model.summary({1, 1, 28, 28});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("the network factory threw: no such layer width 0"),
            std::string::npos)
      << s.status();
  EXPECT_EQ(nn::thread_generator().offset, offset_before);
}

}  // namespace
}  // namespace tandem::hapi
