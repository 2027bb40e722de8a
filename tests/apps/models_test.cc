// The models of apps/models.h: MobileNetV2 against torchvision's definition
// (parameter count, names, shapes, buffers), forward shapes and a backward pass.
#include "apps/models.h"

#include <gtest/gtest.h>

#include <algorithm>
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
  int64_t buffer_count = 0, batch_counts = 0;
  for (const auto& [name, b] : model->named_buffers()) {
    if (name.ends_with("num_batches_tracked")) {
      ++batch_counts;
      EXPECT_EQ(b.dtype(), nn::kInt64) << name;
    } else {
      buffer_count += b.numel();
    }
  }
  EXPECT_EQ(model->buffers().size() - batch_counts, 104u);
  EXPECT_EQ(batch_counts, 52);  // one per BatchNorm2d, as torchvision's
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

// Every parameter and buffer, in named order (j counts them, parameters first),
// element i: sin(0.37 i + 1.3 j), scaled by kind as the script below does.
void FillByFormula(nn::Module& model) {
  int j = 0;
  auto fill = [&](const std::string& name, const nn::Tensor& t) {
    const std::string kind = name.substr(name.rfind('.') + 1);
    const int64_t n = t.numel();
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const double s = std::sin(0.37 * static_cast<double>(i) + 1.3 * j);
      if (kind == "weight" && t.dim() > 1) {
        v[i] = s * std::sqrt(1.0 / static_cast<double>(n / t.size(0)));
      } else if (kind == "weight") {
        v[i] = 1 + 0.2 * s;
      } else if (kind == "running_var") {
        v[i] = 1 + 0.5 * std::abs(s);
      } else {
        v[i] = 0.1 * s;
      }
    }
    nn::NoGradGuard no_grad;
    t.detach().copy_(nn::from_vector(v, t.shape(), {.dtype = t.dtype()}));
    ++j;
  };
  for (const auto& [name, p] : model.named_parameters()) fill(name, p);
  for (const auto& [name, b] : model.named_buffers()) {
    if (!name.ends_with("num_batches_tracked")) fill(name, b);  // as the script skips them
  }
}

// The same weights in torchvision's model give the same logits and running
// statistics: training mode (BatchNorm on batch statistics, which keeps the
// signal alive through the 52 layers; eval mode on these weights maps every
// input to nearly one output), Dropout off. Reference (float64) from
// torchvision 0.14, /usr/bin/python3 running this script:
//   import math, torch, torchvision
//   torch.set_default_dtype(torch.float64)
//   m = torchvision.models.mobilenet_v2(num_classes=10).double()
//   def fill(t, j, kind):
//       n = t.numel(); v = torch.tensor([math.sin(0.37 * i + 1.3 * j) for i in range(n)])
//       if kind == 'weight' and t.dim() > 1: v = v * math.sqrt(1.0 / (n // t.shape[0]))
//       elif kind == 'weight': v = 1 + 0.2 * v
//       elif kind == 'running_var': v = 1 + 0.5 * v.abs()
//       else: v = 0.1 * v
//       t.copy_(v.reshape(t.shape))
//   with torch.no_grad():
//       j = 0
//       for n, p in m.named_parameters(): fill(p, j, n.split('.')[-1]); j += 1
//       for n, b in m.named_buffers():
//           if 'num_batches' in n: continue
//           fill(b, j, n.split('.')[-1]); j += 1
//       x = torch.tensor([math.sin(0.013 * i * (1 + i // 3072))
//                         for i in range(4 * 3 * 32 * 32)]).reshape(4, 3, 32, 32)
//       m.train(); m.classifier[0].eval()
//       y = m(x)
//       print(', '.join('%.10g' % v for v in y.flatten().tolist()))
//       print(', '.join('%.10g' % v for v in m.features[18][1].running_mean[:4].tolist()))
//       print(', '.join('%.10g' % v for v in m.features[18][1].running_var[:4].tolist()))
TEST(ModelsTest, MobileNetV2MatchesTorchvisionOutputsOnTheSameWeights) {
  std::shared_ptr<nn::Module> model = MakeMobileNetV2();
  FillByFormula(*model);
  model->train();
  for (const auto& [name, child] : model->named_children()) {
    if (name == "classifier") child->children()[0]->eval();  // Dropout(0.2) off
  }
  std::vector<double> xv(4 * 3 * 32 * 32);
  for (size_t i = 0; i < xv.size(); ++i) {
    xv[i] = std::sin(0.013 * static_cast<double>(i) * static_cast<double>(1 + i / 3072));
  }
  nn::Tensor y = model->forward(nn::from_vector(xv, {4, 3, 32, 32}, {.dtype = nn::kFloat32}));
  const std::vector<double> want_y = {
      -1.370760979, -0.3688251655, 1.808385602,  -2.396434405, 1.319641351,  0.1986485317,
      -1.925469629, 2.256846166,   -1.482004346, -0.2431341537, -0.3312140535, -0.6668567709,
      1.192382334,  -1.222977937,  0.2680025461, 0.5197145831,  -1.330109578, 1.089692086,
      -0.4186788784, -0.5871109381, -1.038459561, -0.4874536574, 1.644671489, -2.045145776,
      0.984126295,  0.3241726683,  -1.768341532, 1.908021522,   -1.143404932, -0.3755055682,
      -1.384114377, -0.4020430309, 1.868946128,  -2.449281327,  1.334183526,  0.2308290347,
      -1.985744698, 2.310324778,   -1.497729694, -0.2742648945};
  const std::vector<double> want_mean = {-0.06210443672, 0.01313873519, 0.02283938861,
                                         -0.02318078192};
  const std::vector<double> want_var = {0.9036950673, 1.06616015, 1.206195643, 1.304757343};
  const auto got_y = y.to_vector<double>();
  ASSERT_EQ(got_y.size(), want_y.size());
  double worst = 0;
  for (size_t i = 0; i < got_y.size(); ++i) worst = std::max(worst, std::abs(got_y[i] - want_y[i]));
  // float32 against float64: BatchNorm over 4 values at the 1x1 layers amplifies
  // rounding (torchvision's own float32 run is 2e-4 off, ours 1.1e-3; both grow
  // layer by layer alike, compared block by block); a wrong layer is off by O(1).
  EXPECT_LT(worst, 5e-3) << "float32 logits vs torchvision's float64";
  std::map<std::string, nn::Tensor> buffers;
  for (const auto& [name, b] : model->named_buffers()) buffers[name] = b;
  const auto mean = buffers.at("features.18.1.running_mean").to_vector<double>();
  const auto var = buffers.at("features.18.1.running_var").to_vector<double>();
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(mean[i], want_mean[i], 1e-4) << "running_mean " << i;
    EXPECT_NEAR(var[i], want_var[i], 1e-4) << "running_var " << i;
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
