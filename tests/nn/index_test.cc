// index_select on the CPU: values for every dtype and for views, float64
// gradient checks (with repeated indices), the in-order index_add backward,
// and errors that name the bad value.
#include "nn/ops/index.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "nn/ops/reduce.h"
#include "nn/random.h"
#include "tests/test_util.h"
#include "tests/nn/gradcheck.h"

namespace tandem::nn {
namespace {

using testing::GradCheck;
using testing::RandomInput;

Tensor Indices(const std::vector<int64_t>& values) {
  return from_vector<int64_t>(values, {static_cast<int64_t>(values.size())}, {.dtype = kInt64});
}

// Rows of a row-major (n, row) vector picked by `indices`.
template <typename T>
std::vector<T> ExpectedRows(const std::vector<T>& source, int64_t row,
                            const std::vector<int64_t>& indices) {
  std::vector<T> out;
  for (int64_t i : indices) out.insert(out.end(), source.begin() + i * row, source.begin() + (i + 1) * row);
  return out;
}

using ::tandem::testing::ErrorOf;

TEST(IndexSelectTest, GathersRowsInIndexOrderWithRepeats) {
  Tensor source = arange(5 * 2 * 3, {.dtype = kFloat32}).reshape({5, 2, 3});
  const std::vector<int64_t> idx = {4, 0, 0, 2};
  Tensor out = index_select(source, Indices(idx));
  EXPECT_EQ(out.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(out.dtype(), kFloat32);
  EXPECT_EQ(out.to_vector<float>(), ExpectedRows(source.to_vector<float>(), 6, idx));
}

TEST(IndexSelectTest, EveryDtypeAndOneDimSources) {
  const std::vector<int64_t> idx = {3, 1, 3, 0};
  Tensor i64 = arange(4 * 3, {.dtype = kInt64}).reshape({4, 3});
  EXPECT_EQ(index_select(i64, Indices(idx)).to_vector<int64_t>(),
            ExpectedRows(i64.to_vector<int64_t>(), 3, idx));
  Tensor u8 = from_vector<uint8_t>({10, 20, 30, 40, 50, 60, 70, 255}, {4, 2}, {.dtype = kUInt8});
  EXPECT_EQ(index_select(u8, Indices(idx)).to_vector<int64_t>(),
            ExpectedRows(u8.to_vector<int64_t>(), 2, idx));
  Tensor f64 = arange(4, {.dtype = kFloat64});  // (N): rows of one element, out (B)
  Tensor out = index_select(f64, Indices(idx));
  EXPECT_EQ(out.shape(), (Shape{4}));
  EXPECT_EQ(out.to_vector<double>(), (std::vector<double>{3, 1, 3, 0}));
  Tensor bf16 = arange(4 * 5, {.dtype = kFloat32}).reshape({4, 5}).to(kBFloat16);
  Tensor b = index_select(bf16, Indices(idx));
  EXPECT_EQ(b.dtype(), kBFloat16);
  EXPECT_EQ(b.to(kFloat32).to_vector<float>(), ExpectedRows(bf16.to(kFloat32).to_vector<float>(), 5, idx));
}

TEST(IndexSelectTest, SourceViewAndViewIndices) {
  Tensor base = arange(6 * 4, {.dtype = kFloat32}).reshape({6, 4});
  Tensor view = base.slice(2, 5);  // rows 2, 3, 4 of base
  Tensor all = Indices({9, 2, 0, 1, 9});
  Tensor idx = all.slice(1, 4);  // {2, 0, 1}, a view with an offset
  EXPECT_EQ(index_select(view, idx).to_vector<float>(),
            ExpectedRows(base.to_vector<float>(), 4, {4, 2, 3}));
}

TEST(IndexSelectTest, EmptyIndicesAndEmptyRows) {
  Tensor source = randn({3, 4});
  Tensor out = index_select(source, Indices({}));
  EXPECT_EQ(out.shape(), (Shape{0, 4}));
  Tensor narrow = zeros({3, 0});
  EXPECT_EQ(index_select(narrow, Indices({2, 0})).shape(), (Shape{2, 0}));
  // Nothing to copy, but the index is still checked.
  EXPECT_THROW(index_select(narrow, Indices({3})), Error);
}

TEST(IndexSelectTest, GradCheckFloat64WithRepeatedIndices) {
  manual_seed(11);
  const Tensor idx = Indices({5, 1, 1, 3, 1, 0});
  EXPECT_TRUE(GradCheck([&](const std::vector<Tensor>& in) { return index_select(in[0], idx); },
                        {RandomInput({6, 2, 3})}));
  EXPECT_TRUE(GradCheck([&](const std::vector<Tensor>& in) { return index_select(in[0], idx); },
                        {RandomInput({7})}));
  // Through a later op: the gradient flows on.
  EXPECT_TRUE(GradCheck(
      [&](const std::vector<Tensor>& in) { return sum(index_select(in[0], idx), 1); },
      {RandomInput({6, 4})}));
}

TEST(IndexSelectTest, BackwardAddsRowsIntoZeros) {
  Tensor source = zeros({4, 2}, {.dtype = kFloat32, .requires_grad = true});
  Tensor out = index_select(source, Indices({2, 0, 2, 2}));
  out.backward(from_vector<float>({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2}));
  // Row 2 gets rows 0, 2 and 3 of the output gradient; rows 1 and 3 get nothing.
  EXPECT_EQ(source.grad().to_vector<float>(), (std::vector<float>{3, 4, 0, 0, 1 + 5 + 7, 2 + 6 + 8, 0, 0}));
}

TEST(IndexSelectTest, OutOfRangeIndexNamesPositionValueAndN) {
  Tensor source = randn({5, 3});
  std::string msg = ErrorOf([&] { index_select(source, Indices({0, 4, 5})); });
  EXPECT_NE(msg.find("indices[2] = 5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("N = 5"), std::string::npos) << msg;
  msg = ErrorOf([&] { index_select(source, Indices({-1})); });
  EXPECT_NE(msg.find("indices[0] = -1"), std::string::npos) << msg;
  msg = ErrorOf([&] { index_select(zeros({0, 3}), Indices({0})); });
  EXPECT_NE(msg.find("N = 0"), std::string::npos) << msg;
}

TEST(IndexSelectTest, BadArgumentsNameTheTensor) {
  Tensor source = randn({5, 3});
  std::string msg = ErrorOf([&] { index_select(source, arange(3, {.dtype = kFloat32})); });
  EXPECT_NE(msg.find("1-dim int64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("float32(3)"), std::string::npos) << msg;
  msg = ErrorOf([&] { index_select(source, zeros({2, 2}, {.dtype = kInt64})); });
  EXPECT_NE(msg.find("int64(2, 2)"), std::string::npos) << msg;
  msg = ErrorOf([&] { index_select(scalar_tensor(1.0), Indices({0})); });
  EXPECT_NE(msg.find("dim 0"), std::string::npos) << msg;
  EXPECT_THROW(index_select(Tensor(), Indices({0})), Error);
  EXPECT_THROW(index_select(source, Tensor()), Error);
  Tensor bf16 = zeros({3, 2}).to(kBFloat16);
  bf16.set_requires_grad(true);
  msg = ErrorOf([&] { index_select(bf16, Indices({0})); });
  EXPECT_NE(msg.find("bfloat16(3, 2)"), std::string::npos) << msg;
  NoGradGuard no_grad;  // without grad mode a bfloat16 source is fine
  EXPECT_EQ(index_select(bf16, Indices({1})).shape(), (Shape{1, 2}));
}

}  // namespace
}  // namespace tandem::nn
