// Communicator::reduce_scatter_async on in-process CPU ranks: the same bits as
// reduce_scatter, into a separate output and in place (output = this rank's
// block of the input, as the sharded optimizer reduces its buckets), for
// float32 and bfloat16, sum and avg, 1 to 4 ranks; all_gather_into gives
// all_gather's bytes; bad outputs are errors naming the shapes.
#include <cmath>
#include <sstream>
#include <tuple>

#include "gtest/gtest.h"
#include "spawn/spawn.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

using nn::Tensor;

// Rank-dependent values whose float32 sums depend on the order of addition.
Tensor RankData(int rank, int64_t n, nn::DType dtype) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = std::sin(0.37 * i + rank) * std::pow(10.0, (i + rank) % 5 - 2);
  }
  return nn::from_vector<double>(v, {n}, {.dtype = nn::kFloat64}).to(dtype);
}

std::vector<float> AsFloats(const Tensor& t) { return t.to(nn::kFloat32).to_vector<float>(); }

// (ranks, dtype, op)
class ReduceScatterAsyncTest
    : public ::testing::TestWithParam<std::tuple<int, nn::DType, ReduceOp>> {
 protected:
  std::ostringstream console_;
  SpawnOptions options_{.seed = 1, .console = &console_};
};

TEST_P(ReduceScatterAsyncTest, SameBitsAsReduceScatterOutOfPlaceAndInPlace) {
  // Named, not structured bindings: the lambda below captures them (clang before
  // 16 cannot capture a structured binding).
  const int ranks = std::get<0>(GetParam());
  const nn::DType dtype = std::get<1>(GetParam());
  const ReduceOp op = std::get<2>(GetParam());
  // 4 KB and more per rank: past the staging buffers, so both paths run.
  for (const int64_t per_rank : {int64_t{3}, int64_t{1500}}) {
    auto result = spawn(
        [&](Context& ctx) {
          Communicator& comm = ctx.communicator();
          const int64_t n = per_rank * ctx.world_size();
          const Tensor input = RankData(ctx.rank(), n, dtype);
          const Tensor expected = comm.reduce_scatter(input, op);
          Tensor out = nn::empty({per_rank}, {.dtype = dtype});
          comm.reduce_scatter_async(input, out, op)->wait();
          Tensor in_place = input.clone();
          Tensor block = in_place.slice(ctx.rank() * per_rank, (ctx.rank() + 1) * per_rank);
          std::shared_ptr<Work> work = comm.reduce_scatter_async(in_place, block, op);
          work->wait();
          return std::vector<std::vector<float>>{AsFloats(expected), AsFloats(out),
                                                 AsFloats(block)};
        },
        ranks, "cpu", options_);
    ASSERT_TRUE(result.ok()) << result.status();
    for (const auto& r : *result) {
      testing::ExpectSameBits(r[1], r[0], "reduce_scatter_async into an output");
      testing::ExpectSameBits(r[2], r[0], "reduce_scatter_async in place");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksDtypesOps, ReduceScatterAsyncTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(nn::kFloat32, nn::kBFloat16),
                                            ::testing::Values(ReduceOp::kSum, ReduceOp::kAvg)));

TEST(ReduceScatterAsyncErrorTest, OutputOfTheWrongShapeNamesBoth) {
  std::ostringstream console;
  absl::Status s = spawn(
      [](Context& ctx) {
        Tensor input = nn::zeros({8});
        Tensor out = nn::zeros({3});
        ctx.communicator().reduce_scatter_async(input, out);
      },
      2, "cpu", {.console = &console});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("reduce_scatter_async: output"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(4)"), std::string::npos) << s;
}

TEST(ReduceScatterAsyncErrorTest, InputNotDivisibleByTheWorldSize) {
  std::ostringstream console;
  absl::Status s = spawn(
      [](Context& ctx) {
        Tensor input = nn::zeros({7});
        Tensor out = nn::zeros({3});
        ctx.communicator().reduce_scatter_async(input, out);
      },
      2, "cpu", {.console = &console});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("divisible by the world size 2"), std::string::npos) << s;
}

TEST(AllGatherIntoTest, SameBytesAsAllGatherIntoAFlatOutput) {
  std::ostringstream console;
  for (const int64_t n : {int64_t{3}, int64_t{3000}}) {
    auto result = spawn(
        [&](Context& ctx) {
          const Tensor input = RankData(ctx.rank(), n, nn::kFloat32);
          Tensor flat = nn::empty({n * ctx.world_size()});
          ctx.communicator().all_gather_into(input, flat);
          return std::vector<std::vector<float>>{
              ctx.communicator().all_gather(input).to_vector<float>(), flat.to_vector<float>()};
        },
        3, "cpu", {.console = &console});
    ASSERT_TRUE(result.ok()) << result.status();
    for (const auto& r : *result) testing::ExpectSameBits(r[1], r[0], "all_gather_into");
  }
}

TEST(AllGatherIntoTest, OverlappingOrWrongSizedOutputIsAnError) {
  std::ostringstream console;
  absl::Status s = spawn(
      [](Context& ctx) {
        Tensor buffer = nn::zeros({8});
        Tensor input = buffer.slice(0, 4);
        ctx.communicator().all_gather_into(input, buffer);
      },
      2, "cpu", {.console = &console});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("all_gather_into: output"), std::string::npos) << s;
  EXPECT_NE(s.message().find("overlaps input"), std::string::npos) << s;
  s = spawn(
      [](Context& ctx) {
        Tensor input = nn::zeros({4});
        Tensor out = nn::zeros({7});
        ctx.communicator().all_gather_into(input, out);
      },
      2, "cpu", {.console = &console});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("must hold 2 x 4 elements"), std::string::npos) << s;
}

}  // namespace
}  // namespace tandem::dist
