// ResNet-18 and ResNet-50 of apps/models.h against torchvision 0.14's
// definitions: parameter and buffer counts for 10 and 1000 classes, names and
// shapes, forward shapes of both stems, a backward pass. (That the weights of
// a torchvision model load by name and give its outputs is
// tests/apps/interop_test.py's torchvision case.)
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "apps/models.h"
#include "nn/layers.h"
#include "nn/random.h"

namespace tandem::apps {
namespace {

struct Counts {
  int64_t parameters = 0;
  size_t parameter_tensors = 0;
  size_t buffer_tensors = 0;
  int64_t buffers = 0;  // elements, num_batches_tracked included
};

Counts CountOf(const nn::Module& model) {
  Counts c;
  for (const nn::Tensor& p : model.parameters()) c.parameters += p.numel();
  c.parameter_tensors = model.parameters().size();
  for (const nn::Tensor& b : model.buffers()) c.buffers += b.numel();
  c.buffer_tensors = model.buffers().size();
  return c;
}

// The numbers were printed by torchvision 0.14 (Debian python3-torchvision):
//   /usr/bin/python3 -c "import torchvision
//   for f in ('resnet18', 'resnet50'):
//     for n in (1000, 10):
//       m = getattr(torchvision.models, f)(num_classes=n); b = list(m.buffers())
//       print(f, n, sum(p.numel() for p in m.parameters()), len(list(m.parameters())),
//             len(b), sum(x.numel() for x in b))"
// -> resnet18 1000 11689512 62 60 9620 / resnet18 10 11181642 62 60 9620
//    resnet50 1000 25557032 161 159 53173 / resnet50 10 23528522 161 159 53173
TEST(ResNetTest, CountsMatchTorchvision) {
  nn::manual_seed(1);
  struct Case {
    const char* name;
    std::shared_ptr<nn::Module> model;
    int64_t parameters;
    size_t parameter_tensors, buffer_tensors;
    int64_t buffers;
  };
  const Case cases[] = {
      {"resnet18/1000", MakeResNet18(), 11689512, 62, 60, 9620},
      {"resnet18/10", MakeResNet18({.num_classes = 10}), 11181642, 62, 60, 9620},
      {"resnet50/1000", MakeResNet50(), 25557032, 161, 159, 53173},
      {"resnet50/10", MakeResNet50({.num_classes = 10}), 23528522, 161, 159, 53173},
  };
  for (const Case& c : cases) {
    const Counts got = CountOf(*c.model);
    EXPECT_EQ(got.parameters, c.parameters) << c.name;
    EXPECT_EQ(got.parameter_tensors, c.parameter_tensors) << c.name;
    EXPECT_EQ(got.buffer_tensors, c.buffer_tensors) << c.name;
    EXPECT_EQ(got.buffers, c.buffers) << c.name;
  }
  // The CIFAR stem: conv1 3x3 instead of 7x7 (64 * 3 * (49 - 9) fewer).
  EXPECT_EQ(CountOf(*MakeResNet18({.num_classes = 10, .cifar_stem = true})).parameters,
            11181642 - 64 * 3 * 40);
}

// Names and shapes as torchvision's state_dict() lists them (a sample of each
// kind: stem, plain block, downsampling block, Bottleneck, fc).
TEST(ResNetTest, NamesAndShapesAreTorchvisions) {
  std::map<std::string, nn::Shape> r18, r50;
  for (const auto& [name, t] : MakeResNet18()->state_dict()) r18[name] = t.shape();
  for (const auto& [name, t] : MakeResNet50()->state_dict()) r50[name] = t.shape();
  const std::map<std::string, nn::Shape> want18 = {
      {"conv1.weight", {64, 3, 7, 7}},
      {"bn1.num_batches_tracked", {}},
      {"layer1.0.conv1.weight", {64, 64, 3, 3}},
      {"layer1.1.bn2.running_var", {64}},
      {"layer2.0.conv1.weight", {128, 64, 3, 3}},
      {"layer2.0.downsample.0.weight", {128, 64, 1, 1}},
      {"layer2.0.downsample.1.running_mean", {128}},
      {"layer4.1.conv2.weight", {512, 512, 3, 3}},
      {"fc.weight", {1000, 512}},
      {"fc.bias", {1000}},
  };
  for (const auto& [name, shape] : want18) {
    ASSERT_TRUE(r18.count(name)) << name;
    EXPECT_EQ(r18[name], shape) << name;
  }
  EXPECT_FALSE(r18.count("layer1.0.downsample.0.weight"));  // stride 1, 64 -> 64
  const std::map<std::string, nn::Shape> want50 = {
      {"layer1.0.conv1.weight", {64, 64, 1, 1}},
      {"layer1.0.conv3.weight", {256, 64, 1, 1}},
      {"layer1.0.downsample.0.weight", {256, 64, 1, 1}},  // channels change at stride 1
      {"layer2.0.conv2.weight", {128, 128, 3, 3}},
      {"layer3.5.bn3.weight", {1024}},
      {"layer4.2.conv3.weight", {2048, 512, 1, 1}},
      {"fc.weight", {1000, 2048}},
  };
  for (const auto& [name, shape] : want50) {
    ASSERT_TRUE(r50.count(name)) << name;
    EXPECT_EQ(r50[name], shape) << name;
  }
  EXPECT_EQ(r50.size(), 161u + 159u);
}

TEST(ResNetTest, ForwardShapesOfBothStemsAndABackwardPass) {
  nn::manual_seed(2);
  std::shared_ptr<nn::Module> cifar = MakeResNet18({.num_classes = 10, .cifar_stem = true});
  const nn::Tensor x = nn::randn({2, 3, 32, 32});
  nn::Tensor y = cifar->forward(x);
  EXPECT_EQ(y.shape(), (nn::Shape{2, 10}));
  nn::CrossEntropyLoss loss_fn;
  nn::Tensor loss = loss_fn(y, nn::from_vector(std::vector<int64_t>{3, 7}, {2}));
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item()));
  for (const auto& [name, p] : cifar->named_parameters()) ASSERT_TRUE(p.grad().defined()) << name;
  cifar->eval();
  EXPECT_EQ(cifar->forward(x).to_vector<float>(), cifar->forward(x).to_vector<float>());

  // The ImageNet stem on a small image: 64 -> 32 (conv1) -> 16 (max-pool) -> 2 at layer4.
  std::shared_ptr<nn::Module> r50 = MakeResNet50({.num_classes = 5});
  EXPECT_EQ(r50->forward(nn::randn({1, 3, 64, 64})).shape(), (nn::Shape{1, 5}));
  EXPECT_THROW(MakeResNet18({.num_classes = 0}), Error);
}

// torchvision's init: convolutions kaiming-normal with std sqrt(2 / fan_out).
TEST(ResNetTest, ConvolutionsAreKaimingNormalFanOut) {
  nn::manual_seed(3);
  std::map<std::string, nn::Tensor> state;
  for (const auto& [name, t] : MakeResNet18()->state_dict()) state[name] = t;
  const std::vector<float> w = state.at("layer4.0.conv2.weight").to_vector<float>();
  double sum = 0, sum2 = 0;
  for (float v : w) {
    sum += v;
    sum2 += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(w.size());
  const double want_std = std::sqrt(2.0 / (512 * 9));
  EXPECT_NEAR(sum / n, 0.0, 0.01 * want_std * 10);
  EXPECT_NEAR(std::sqrt(sum2 / n), want_std, 0.01 * want_std);
  EXPECT_EQ(state.at("layer4.0.bn2.weight").to_vector<float>(), std::vector<float>(512, 1.0f));
}

}  // namespace
}  // namespace tandem::apps
