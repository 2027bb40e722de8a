// conv2d_relu_max_pool2d: the same bits as conv2d_relu then max_pool2d, values
// and gradients, on every CPU convolution path, where the fused path runs
// (channels-last and blocked layouts) and where the ops run one by one; and
// nn::Sequential's use of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "nn/autograd.h"
#include "nn/layers.h"
#include "nn/ops/conv.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/conv_kernels.h"  // CpuConvPath
#include "nn/ops/matmul.h"                 // set_cpu_blas_threads
#include "nn/ops/pool.h"
#include "nn/random.h"
#include "tests/nn/cpu_conv_paths.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using ops::internal::CpuConvPath;

// How many autograd nodes named `op` produced `t` (each node counted once).
int CountOps(const Tensor& t, const std::string& op) {
  int count = 0;
  std::vector<std::shared_ptr<autograd::Node>> stack{t.grad_fn()};
  std::vector<const autograd::Node*> seen;
  while (!stack.empty()) {
    std::shared_ptr<autograd::Node> node = std::move(stack.back());
    stack.pop_back();
    if (!node || std::find(seen.begin(), seen.end(), node.get()) != seen.end()) continue;
    seen.push_back(node.get());
    count += node->name() == op;
    for (const auto& next : node->next_edges()) stack.push_back(next);
  }
  return count;
}

struct Case {
  std::string name;
  Shape x, w;
  Conv2dParams conv;
  Pool2dParams pool;
  bool bias = true;
  // Which inputs require grad: x, weight, bias.
  bool gx = true, gw = true, gb = true;
  // Whether the fused path can take it (windows that tile, no padding).
  bool tiles = true;
};

std::vector<Case> Cases() {
  const Conv2dParams pad2{.padding = {2, 2}}, pad1{.padding = {1, 1}};
  return {
      {"lenet conv1", {5, 1, 28, 28}, {20, 1, 5, 5}, pad2, {}},
      {"lenet conv2", {3, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}},
      // The ConvNet's: 3 -> 32 channels (channels-last or blocked), 32 -> 64 (blocked).
      {"convnet conv1", {2, 3, 32, 32}, {32, 3, 3, 3}, {}, {}},
      {"convnet conv2", {2, 32, 15, 15}, {64, 32, 3, 3}, {}, {}},
      // Odd sizes: the last row and column of y belong to no window.
      {"odd sizes", {2, 12, 13, 11}, {20, 12, 3, 3}, pad1, {}},
      {"3x3 windows", {2, 3, 9, 9}, {12, 3, 3, 3}, pad1, {.kernel = {3, 3}}},
      {"2x3 windows", {2, 20, 8, 9}, {20, 20, 3, 3}, pad1, {.kernel = {2, 3}}},
      {"no bias", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, /*bias=*/false},
      {"x as data", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, true, /*gx=*/false},
      {"frozen weight", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, true, true, /*gw=*/false},
      {"only the bias", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2, {}, true, false, false, true},
      // Overlapping and padded windows: the ops one by one.
      {"overlapping windows", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2,
       {.kernel = {3, 3}, .stride = {2, 2}}, true, true, true, true, /*tiles=*/false},
      {"padded windows", {2, 20, 14, 14}, {20, 20, 5, 5}, pad2,
       {.kernel = {2, 2}, .padding = {1, 1}}, true, true, true, true, /*tiles=*/false},
  };
}

// Inputs with ties: x and weight on a coarse grid, so equal maxima in a window
// are common, and a bias below zero in some channels, so whole windows are 0
// after the ReLU.
Tensor Coarse(const Shape& shape, float scale) {
  std::vector<float> v = randn(shape).to_vector<float>();
  for (float& e : v) e = std::round(2.0f * e) * scale;
  return from_vector<float>(v, shape);
}

std::vector<Tensor> RunCase(const Case& c, const Tensor& x0, const Tensor& w0, const Tensor& b0,
                        const Tensor& dy, bool fused, Tensor* out = nullptr) {
  Tensor x = x0.detach().set_requires_grad(c.gx);
  Tensor w = w0.detach().set_requires_grad(c.gw);
  Tensor b = c.bias ? b0.detach().set_requires_grad(c.gb) : Tensor();
  Tensor y = fused ? conv2d_relu_max_pool2d(x, w, b, c.conv, c.pool)
                   : max_pool2d(conv2d_relu(x, w, b, c.conv), c.pool);
  if (out != nullptr) *out = y;
  y.backward(dy);
  return {y, c.gx ? x.grad() : Tensor(), c.gw ? w.grad() : Tensor(),
          c.bias && c.gb ? b.grad() : Tensor()};
}

void ExpectSameBits(const std::vector<Tensor>& a, const std::vector<Tensor>& b,
                    const std::string& what) {
  const char* names[] = {"output", "dx", "dweight", "dbias"};
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].defined(), b[k].defined()) << names[k] << ", " << what;
    if (!a[k].defined()) continue;
    ASSERT_EQ(a[k].shape(), b[k].shape()) << names[k] << ", " << what;
    EXPECT_EQ(std::memcmp(a[k].data_ptr(), b[k].data_ptr(), a[k].numel() * sizeof(float)), 0)
        << names[k] << " differs: " << what;
  }
}

TEST(ConvReluPoolTest, FusedEqualsTheOpsOneByOneBitForBit) {
  const testing::RestoreCpuConv restore;
  const std::vector<CpuConvPath> paths = testing::CpuConvPathsToCompare(/*with_auto=*/true);
  manual_seed(31);
  for (const Case& c : Cases()) {
    const Tensor x0 = Coarse(c.x, 0.5), w0 = Coarse(c.w, 0.125);
    const Tensor b0 = Coarse({c.w[0]}, 0.5);
    Shape y_shape = max_pool2d(conv2d_relu(x0, w0, b0, c.conv), c.pool).shape();
    const Tensor dy = randn(y_shape);
    for (CpuConvPath path : paths) {
      ops::internal::SetCpuConvPath(path);
      const std::string what = c.name + ", path " + std::to_string(static_cast<int>(path));
      Tensor y;
      const std::vector<Tensor> fused = RunCase(c, x0, w0, b0, dy, true, &y);
      const std::vector<Tensor> plain = RunCase(c, x0, w0, b0, dy, false);
      ExpectSameBits(fused, plain, what);
      // Channels-last oneDNN takes every tiling case, blocked oneDNN those whose
      // output channels fill its 8- or 16-channel blocks; kAuto chooses between
      // them by shape. The fused node is what tells the fused kernels ran.
      const int fused_ops = CountOps(y, "conv2d_relu_max_pool2d");
      if (path == CpuConvPath::kDnnlNhwc) EXPECT_EQ(fused_ops, c.tiles ? 1 : 0) << what;
      if (path == CpuConvPath::kDnnlBlocked && c.w[0] % 16 == 0) {
        EXPECT_EQ(fused_ops, c.tiles ? 1 : 0) << what;
      }
      if (path == CpuConvPath::kIm2col || path == CpuConvPath::kDnnl) EXPECT_EQ(fused_ops, 0);
      // The ReLU zeroed whole windows and ties happened: both rules were tested.
      const std::vector<float> v = fused[0].to_vector<float>();
      EXPECT_GT(std::count(v.begin(), v.end(), 0.0f), 0) << what;
      EXPECT_GT(std::count_if(v.begin(), v.end(), [](float e) { return e > 0; }), 0) << what;
    }
  }
}

// The fused kernels split rows over the rank's threads (oneDNN's own results
// depend on the thread count, so each count is compared with the ops one by one
// at that count); without grad mode (evaluation) the same output.
TEST(ConvReluPoolTest, SameBitsAtOneAndTwoThreadsAndInEvaluation) {
  const testing::RestoreCpuConv restore;
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  const Case c = Cases()[1];  // LeNet's second convolution: channels-last on kAuto
  manual_seed(32);
  const Tensor x0 = randn({16, 20, 14, 14}), w0 = randn(c.w), b0 = randn({20});
  const Tensor dy = randn({16, 20, 7, 7});
  for (int threads : {1, 2}) {
    set_cpu_blas_threads(threads);
    Tensor y;
    const std::vector<Tensor> fused = RunCase(c, x0, w0, b0, dy, true, &y);
    if (ops::internal::CpuConvUsesDnnl()) EXPECT_EQ(CountOps(y, "conv2d_relu_max_pool2d"), 1);
    const std::string what = std::to_string(threads) + " thread(s)";
    ExpectSameBits(fused, RunCase(c, x0, w0, b0, dy, false), what);
    NoGradGuard no_grad;
    ExpectSameBits({conv2d_relu_max_pool2d(x0, w0, b0, c.conv, c.pool)}, {fused[0]},
                   "evaluation, " + what);
  }
}

// Other dtypes run the ops one by one: float64 gradients against finite
// differences, as every op's.
TEST(ConvReluPoolTest, GradCheckFloat64) {
  manual_seed(33);
  using testing::RandomInput;
  EXPECT_TRUE(testing::GradCheck(
      [](const auto& in) {
        return conv2d_relu_max_pool2d(in[0], in[1], in[2], {.padding = {1, 1}}, {});
      },
      {RandomInput({2, 3, 6, 7}), RandomInput({4, 3, 3, 3}), RandomInput({4})}));
}

// Sequential runs Conv2d, ReLU, MaxPool2d as conv2d_relu_max_pool2d (or, where
// the fused path does not apply, conv2d_relu and max_pool2d): LeNet's modules
// give the same bits as run one by one, forward and backward.
TEST(ConvReluPoolTest, SequentialFusesConvReluPoolWithTheSameBits) {
  manual_seed(34);
  Sequential net({Conv2d(1, 20, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2),
                  Conv2d(20, 20, 5, {.padding = {2, 2}}), ReLU(), MaxPool2d(2), Flatten(),
                  Linear(20 * 7 * 7, 10)});
  const Tensor x = randn({6, 1, 28, 28});
  Tensor fused = net->forward(x);
  const int triples = CountOps(fused, "conv2d_relu_max_pool2d");
  EXPECT_EQ(triples + CountOps(fused, "conv2d_relu"), 2);
  EXPECT_EQ(triples + CountOps(fused, "max_pool2d"), 2);
  EXPECT_EQ(CountOps(fused, "relu"), 0);
  // LeNet's second convolution (20 channels) is channels-last on oneDNN.
  if (ops::internal::CpuConvUsesDnnl()) EXPECT_GE(triples, 1);
  const Tensor dy = randn(fused.shape());
  fused.backward(dy);
  std::vector<std::vector<float>> grads;
  for (const Tensor& p : net->parameters()) grads.push_back(p.grad().to_vector<float>());
  net->zero_grad();
  Tensor y = x;  // the children one by one: no fusion
  for (int64_t i = 0; i < net->size(); ++i) y = (*net)[i]->forward(y);
  EXPECT_EQ(CountOps(y, "conv2d_relu_max_pool2d"), 0);
  EXPECT_EQ(CountOps(y, "relu"), 2);
  y.backward(dy);
  EXPECT_EQ(fused.to_vector<float>(), y.to_vector<float>());
  size_t k = 0;
  for (const Tensor& p : net->parameters()) {
    EXPECT_EQ(p.grad().to_vector<float>(), grads[k]) << "parameter " << k;
    ++k;
  }
}

}  // namespace
}  // namespace tandem::nn
