// The models of apps/models.h: MobileNetV2 against torchvision's definition
// (parameter count, names, shapes, buffers), forward shapes and a backward pass.
#include "apps/models.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "nn/random.h"

namespace tandem::apps {
namespace {

// The reference numbers come from torchvision 0.14 (Debian python3-torchvision):
//   /usr/bin/python3 -c "import torchvision; m = torchvision.models.mobilenet_v2(num_classes=10);
//     print(sum(p.numel() for p in m.parameters()), len(list(m.parameters())));
//     b = [(n, x) for n, x in m.named_buffers() if 'num_batches' not in n];
//     print(len(b), sum(x.numel() for n, x in b));
//     [print(n, tuple(p.shape)) for n, p in m.named_parameters()]"
// -> 2236682 158 / 104 34112 / the names and shapes checked below.
TEST(ModelsTest, MobileNetV2MatchesTorchvision) {
  nn::manual_seed(71);
  std::shared_ptr<nn::Module> model = MakeMobileNetV2();
  int64_t count = 0;
  std::map<std::string, nn::Shape> shapes;
  for (const auto& [name, p] : model->named_parameters()) {
    count += p.numel();
    shapes[name] = p.shape();
  }
  EXPECT_EQ(count, 2236682);
  EXPECT_EQ(model->named_parameters().size(), 158u);
  int64_t buffer_count = 0;
  for (const nn::Tensor& b : model->buffers()) buffer_count += b.numel();
  EXPECT_EQ(model->buffers().size(), 104u);  // torchvision's less num_batches_tracked
  EXPECT_EQ(buffer_count, 34112);
  const std::map<std::string, nn::Shape> want = {
      {"features.0.0.weight", {32, 3, 3, 3}},
      {"features.0.1.weight", {32}},
      {"features.0.1.bias", {32}},
      {"features.1.conv.0.0.weight", {32, 1, 3, 3}},
      {"features.1.conv.0.1.weight", {32}},
      {"features.1.conv.1.weight", {16, 32, 1, 1}},
      {"features.1.conv.2.weight", {16}},
      {"features.17.conv.2.weight", {320, 960, 1, 1}},
      {"features.17.conv.3.weight", {320}},
      {"features.17.conv.3.bias", {320}},
      {"features.18.0.weight", {1280, 320, 1, 1}},
      {"features.18.1.weight", {1280}},
      {"features.18.1.bias", {1280}},
      {"classifier.1.weight", {10, 1280}},
      {"classifier.1.bias", {10}},
  };
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(shapes.count(name)) << name;
    EXPECT_EQ(shapes[name], shape) << name;
  }
}

TEST(ModelsTest, MobileNetV2ForwardAndBackwardOnCifarInput) {
  nn::manual_seed(72);
  std::shared_ptr<nn::Module> model = MakeMobileNetV2();
  nn::Tensor x = nn::randn({2, 3, 32, 32});
  nn::Tensor y = model->forward(x);
  EXPECT_EQ(y.shape(), (nn::Shape{2, 10}));
  nn::CrossEntropyLoss loss_fn;
  nn::Tensor loss = loss_fn(y, nn::from_vector(std::vector<int64_t>{3, 7}, {2}));
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item()));
  for (const auto& [name, p] : model->named_parameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
  }
  model->eval();
  nn::Tensor y_eval = model->forward(x);
  EXPECT_EQ(y_eval.shape(), (nn::Shape{2, 10}));
  // Eval mode is deterministic (no dropout, running statistics).
  EXPECT_EQ(model->forward(x).to_vector<float>(), y_eval.to_vector<float>());
}

}  // namespace
}  // namespace tandem::apps
