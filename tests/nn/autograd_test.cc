#include "nn/autograd.h"

#include <gtest/gtest.h>

#include "nn/ops/elementwise.h"

namespace tandem::nn {
namespace {

TEST(AutogradTest, ViewsAndClonePropagateGradients) {
  Tensor x = from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {3, 2}, {.requires_grad = true});
  // y = slice rows 1..3, reshape, clone; backward with an explicit gradient.
  Tensor y = x.slice(1, 3).reshape({4}).clone();
  y.backward(from_vector(std::vector<double>{1, 2, 3, 4}, {4}));
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{0, 0, 1, 2, 3, 4}));
  // Gradients accumulate.
  x.slice(0, 1).reshape({2}).backward(from_vector(std::vector<double>{10, 10}, {2}));
  EXPECT_EQ(x.grad().to_vector<double>(), (std::vector<double>{10, 10, 1, 2, 3, 4}));
}

// A leaf used on several paths gets the sum of their gradients, and its
// grad-ready hook fires once per backward pass, after every contribution:
// DataParallel reduces a parameter's bucket from the hook, so a hook that fired
// at the first contribution would send a partial gradient. Three contributions
// from two nodes: x * 3 and x * x (both operands), d/dx = 3 + 2x.
TEST(AutogradTest, GradientFromTwoPathsIsSummedBeforeTheHookFires) {
  Tensor x = from_vector(std::vector<double>{1, 2}, {2}, {.requires_grad = true});
  std::vector<std::vector<double>> seen;  // grad() at each firing
  x.register_grad_ready_hook([&](Tensor& p) { seen.push_back(p.grad().to_vector<double>()); });
  Tensor y = x * 3.0 + x * x;
  y.backward(ones({2}, {.dtype = kFloat64}));
  EXPECT_EQ(seen, (std::vector<std::vector<double>>{{5, 7}}));
  // A second pass accumulates, and fires the hook once more.
  (x * 3.0 + x * x).backward(ones({2}, {.dtype = kFloat64}));
  EXPECT_EQ(seen, (std::vector<std::vector<double>>{{5, 7}, {10, 14}}));
}

TEST(AutogradTest, NoGradGuardRecordsNothing) {
  Tensor x = ones({2}, {.requires_grad = true});
  {
    NoGradGuard g;
    EXPECT_FALSE(x.clone().requires_grad());
  }
  EXPECT_TRUE(x.clone().requires_grad());
  EXPECT_FALSE(x.detach().requires_grad());
}

TEST(AutogradTest, BackwardChecksItsArguments) {
  EXPECT_THROW(ones({2}).backward(), Error);                 // not a scalar
  EXPECT_THROW(ones({1}).backward(), Error);                 // does not require grad
  Tensor x = ones({2}, {.requires_grad = true});
  EXPECT_THROW(x.clone().backward(ones({3})), Error);         // wrong gradient shape
  try {
    x.clone().backward(ones({2}, {.dtype = kFloat64}));       // wrong gradient dtype
    ADD_FAILURE() << "a float64 gradient for a float32 output was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("must have the dtype and device"), std::string::npos)
        << e.what();
  }
}

TEST(AutogradTest, QueuedCallbackRunsAfterAllNodes) {
  Tensor x = ones({2}, {.requires_grad = true});
  std::vector<std::string> order;
  x.register_grad_ready_hook([&](Tensor&) {
    order.push_back("hook");
    autograd::QueueCallback([&] { order.push_back("end"); });
  });
  x.clone().backward(ones({2}));
  EXPECT_EQ(order, (std::vector<std::string>{"hook", "end"}));
  EXPECT_FALSE(autograd::InBackward());
}

}  // namespace
}  // namespace tandem::nn
