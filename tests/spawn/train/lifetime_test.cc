// What a user holds past spawn's return, or loses to a rank's failure: the
// training objects of spawn/train/ are destroyed after their Context is gone
// (held by the caller) or while the stack unwinds, without a crash.
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nn/layers.h"
#include "nn/ops/loss.h"
#include "nn/status_macros.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"
#include "spawn/train/checkpoint_manager.h"
#include "spawn/train/zero_redundancy_optimizer.h"
#include "tests/test_util.h"

namespace tandem::dist {
namespace {

SpawnOptions QuietOptions() {
  SpawnOptions options;
  options.handle_sigint = false;
  options.stop_signals = {};
  options.timeout_s = 30;
  return options;
}

// DataParallel, ZeroRedundancyOptimizer and CheckpointManager made on the rank
// threads and kept by the caller after spawn returned. Rank 0's last write
// fails (its directory is gone) and nothing collected it (no Finish): the
// manager's destructor reports it on stderr, since the rank's logger ended with
// the run, rather than logging through the Context it no longer has.
TEST(LifetimeTest, TrainingObjectsHeldPastSpawnsReturn) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / "tandem_lifetime_held").string();
  std::filesystem::remove_all(dir);
  std::vector<std::shared_ptr<nn::Linear>> nets(2);
  std::vector<std::unique_ptr<DataParallel>> dps(2);
  std::vector<std::unique_ptr<ZeroRedundancyOptimizer>> zeros(2);
  std::vector<std::unique_ptr<CheckpointManager>> managers(2);
  absl::Status s = spawn(
      [&](Context& ctx) -> absl::Status {
        const int r = ctx.rank();
        nets[r] = std::make_shared<nn::Linear>(3, 1);
        dps[r] = std::make_unique<DataParallel>(**nets[r], ctx);
        zeros[r] = std::make_unique<ZeroRedundancyOptimizer>(*dps[r], [](std::vector<nn::Tensor> p) {
          return std::make_unique<optim::SGD>(std::move(p), optim::SGDOptions{.lr = 0.1});
        });
        managers[r] = std::make_unique<CheckpointManager>(ctx, CheckpointManagerOptions{.dir = dir});
        nn::Tensor loss = nn::mse_loss((*dps[r])(nn::ones({2, 3})), nn::zeros({2, 1}));
        loss.backward();
        zeros[r]->step();
        if (r == 0) std::filesystem::remove_all(dir);  // the write below fails
        int64_t step = 1;
        return managers[r]->Save({.model = nets[r]->get(), .step = &step});
      },
      2, "cpu", QuietOptions());
  ASSERT_TRUE(s.ok()) << s;
  ::testing::internal::CaptureStderr();
  managers.clear();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("CheckpointManager of rank 0, destroyed after its rank's run: checkpoint " +
                     CheckpointManager::PathFor(dir, 1) + ": write failed"),
            std::string::npos)
      << err;
  zeros.clear();
  dps.clear();
  nets.clear();
}

// A manager held past spawn's return with a background write still running
// when its rank's function returned: the write finishes (and logs its line)
// when the rank thread ends, while the run's logger exists, so the file is
// complete once spawn returns and nothing writes to the logger after it.
TEST(LifetimeTest, WriteInFlightOfAManagerHeldPastSpawnsReturn) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / "tandem_lifetime_in_flight").string();
  std::filesystem::remove_all(dir);
  std::vector<std::unique_ptr<CheckpointManager>> managers(2);
  std::vector<std::shared_ptr<nn::Linear>> nets(2);
  auto console = std::make_unique<std::ostringstream>();
  SpawnOptions options = QuietOptions();
  options.console = console.get();
  absl::Status s = spawn(
      [&](Context& ctx) -> absl::Status {
        const int r = ctx.rank();
        nets[r] = std::make_shared<nn::Linear>(3, 1);
        managers[r] = std::make_unique<CheckpointManager>(
            ctx, CheckpointManagerOptions{.dir = dir, .write_delay_s = 0.2});
        int64_t step = 1;
        return managers[r]->Save({.model = nets[r]->get(), .step = &step});
      },
      2, "cpu", options);
  ASSERT_TRUE(s.ok()) << s;
  const std::string log = console->str();
  console.reset();  // the run's console is gone: nothing may write to it now
  EXPECT_TRUE(std::filesystem::exists(CheckpointManager::PathFor(dir, 1))) << log;
  EXPECT_NE(log.find("checkpoint " + CheckpointManager::PathFor(dir, 1) + " written"),
            std::string::npos)
      << log;
  managers.clear();
  std::filesystem::remove_all(dir);
}

// A manager made on rank 0's thread and destroyed on another thread while the
// rank still runs (its write in flight waited for there): the rank thread's
// end then finds nothing of it to wait for (it took itself out of the list).
TEST(LifetimeTest, ManagerDestroyedOnAnotherThreadWhileItsRankRuns) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / "tandem_lifetime_other_thread").string();
  std::filesystem::remove_all(dir);
  absl::Status s = spawn(
      [&](Context& ctx) -> absl::Status {
        auto net = std::make_shared<nn::Linear>(3, 1);
        auto manager = std::make_unique<CheckpointManager>(
            ctx, CheckpointManagerOptions{.dir = dir, .write_delay_s = 0.1});
        int64_t step = 1;
        RETURN_IF_ERROR(manager->Save({.model = net->get(), .step = &step}));
        std::thread([&] { manager.reset(); }).join();
        // Another manager of this thread, alive at its end.
        auto second = std::make_unique<CheckpointManager>(ctx, CheckpointManagerOptions{.dir = dir});
        step = 2;
        RETURN_IF_ERROR(second->Save({.model = net->get(), .step = &step}));
        return second->Finish();
      },
      2, "cpu", QuietOptions());
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(std::filesystem::exists(CheckpointManager::PathFor(dir, 1)));
  EXPECT_TRUE(std::filesystem::exists(CheckpointManager::PathFor(dir, 2)));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tandem::dist
