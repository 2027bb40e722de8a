// hapi::Model::save inside the ranks' function of one job of several
// processes: run under mpirun (ctest does: label mpi), e.g.
//   tests/spawn/mpirun.sh -np 2 build-cpu/tests/hapi/hapi_mpi_test
// Each process's first rank writes its copy of both files (one temporary file
// each, named with its pid: nn/internal/atomic_file.h), and every rank of
// every process finds both when its save returns and loads them.
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

}  // namespace
}  // namespace tandem::hapi
