// hapi::Model::save inside the ranks' function of one job of several
// processes: run under mpirun (ctest does: label mpi), e.g.
//   tests/spawn/mpirun.sh -np 2 build-cpu/tests/hapi/hapi_mpi_test
// Each process's first rank writes its copy of both files (one temporary file
// each, named with its pid: nn/internal/atomic_file.h), and every rank of
// every process finds both when its save returns and loads them. A save
// before any fit gives every rank of every process rank 0's weights.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hapi/model.h"
#include "nn/status_macros.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "tests/hapi/classification.h"
#include "tests/hapi/temporary_files.h"
#include "tests/spawn/mpi_fixture.h"

namespace tandem::hapi {
namespace {

using ::tandem::testing::Classification;
using ::tandem::testing::LaunchedProcesses;
using Net = ::tandem::testing::TwoLayerNet;

class HapiMpiTest : public testing::MpiFixture {};

// Every process (2 CPU ranks each) fits, then every rank saves to one path on
// the shared /tmp: each process writes each file once, through its first rank,
// and every rank loads both files when its save returns.
TEST_F(HapiMpiTest, EachProcessWritesItsCopyOnce) {
  auto train = Classification(32, 44);
  const std::string dir = ::testing::TempDir() + "/hapi_mpi_save";
  const std::string path = dir + "/model.safetensors";
  std::unique_ptr<testing::TemporaryFiles> temporaries;
  std::vector<int> loaded(2, 0);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        if (ctx.rank() == 0) {
          std::filesystem::remove_all(dir);
          std::filesystem::create_directories(dir);
        }
        ctx.communicator().barrier();
        if (ctx.local_rank() == 0) temporaries = std::make_unique<testing::TemporaryFiles>(dir);
        ctx.communicator().barrier();  // every process watches before any writes
        Model model([] { return std::make_shared<Net>(); });
        model.prepare(
            [](std::vector<nn::Tensor> params) {
              return std::make_unique<optim::Adam>(std::move(params),
                                                   optim::AdamOptions{.lr = 1e-2});
            },
            CrossEntropy());
        RETURN_IF_ERROR(model.fit(train, {.epochs = 1, .batch_size = 4}).status());
        RETURN_IF_ERROR(model.save(path));
        Model other([] { return std::make_shared<Net>(); });
        RETURN_IF_ERROR(other.load(path));
        if (std::filesystem::exists(OptimizerStatePath(path))) loaded[ctx.local_rank()] = 1;
        return absl::OkStatus();
      },
      2, "cpu", Options());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_EQ(loaded, (std::vector<int>{1, 1}));
  ASSERT_TRUE(temporaries != nullptr && temporaries->ok()) << std::strerror(errno);
  const testing::Writes each = {.all = LaunchedProcesses(), .this_process = 1};
  const std::map<std::string, testing::Writes> want = {{"model.safetensors", each},
                                                       {"model.safetensors.optim", each}};
  EXPECT_EQ(temporaries->Take(), want);
}

// A save before any fit, on every rank of every process (2 ranks each): each
// rank's factory draws its own weights, and the save gives every rank of every
// process rank 0's, which each process's copy of the file holds.
TEST_F(HapiMpiTest, ASaveBeforeAnyFitGivesEveryProcessRankZerosWeights) {
  const std::string dir = ::testing::TempDir() + "/hapi_mpi_save_fresh";
  // A sum that tells draws apart: each value weighed by its place.
  auto checksum = [](const nn::StateDict& state) {
    double sum = 0;
    int64_t at = 0;
    for (const auto& [name, t] : state)
      for (float v : t.to_vector<float>())
        sum += static_cast<double>(v) * static_cast<double>(++at);
    return sum;
  };
  // {drawn, kept}: each the largest minus the smallest over the ranks.
  std::vector<double> spread(2, -1);
  std::vector<int> same_as_file(2, 0);
  absl::Status run = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        // Each process its own file: a process reads only its own copy.
        const std::string path =
            absl::StrCat(dir, "/p", ctx.rank() - ctx.local_rank(), ".safetensors");
        if (ctx.local_rank() == 0) std::filesystem::create_directories(dir);
        Model model([] { return std::make_shared<Net>(); });
        ASSIGN_OR_RETURN(nn::StateDict drawn, model.state_dict());
        RETURN_IF_ERROR(model.save(path));
        ASSIGN_OR_RETURN(nn::StateDict kept, model.state_dict());
        Model file([] { return std::make_shared<Net>(); });
        RETURN_IF_ERROR(file.load(path));
        ASSIGN_OR_RETURN(nn::StateDict read, file.state_dict());
        const double d = checksum(drawn), k = checksum(kept);
        nn::Tensor t = nn::from_vector<double>({d, -d, k, -k}, {4}, {.dtype = nn::kFloat64});
        ctx.communicator().all_reduce(t, dist::ReduceOp::kMax);
        const std::vector<double> m = t.to_vector<double>();
        if (ctx.local_rank() == 0) spread = {m[0] + m[1], m[2] + m[3]};
        same_as_file[static_cast<size_t>(ctx.local_rank())] = checksum(read) == k ? 1 : 0;
        return absl::OkStatus();
      },
      2, "cpu", Options());
  ASSERT_TRUE(run.ok()) << run;
  EXPECT_GT(spread[0], 0) << "the ranks drew the same weights: the test shows nothing";
  EXPECT_EQ(spread[1], 0) << "the ranks kept different weights after the save";
  EXPECT_EQ(same_as_file, (std::vector<int>{1, 1})) << "a rank kept other weights than its file";
}

}  // namespace
}  // namespace tandem::hapi
