// hapi::Model::save called on one process's rank alone inside the ranks'
// function of a 2-process job, for tests/spawn/mpi_fault_test.sh:
//   mpirun -np 2 hapi_mpi_save_alone MODE
// Every rank fits one epoch; then global rank 0 saves (save is a collective
// inside a rank's function: call it on every rank ...) while the other ranks do
// something else. MODE: mismatch_save_barrier (one rank a process; process
// 1's rank calls a barrier instead: the processes' collectives differ, and
// every process must name save, whose label only process 0 knows),
// save_returns (one rank a process; process 1's rank returns: process 0's
// watchdog), save_local (two ranks a process; rank 1, on process 0 too,
// calls a barrier: process 0's check of its local ranks). Every case must end
// the job within seconds (timeout_s is 60) naming hapi::Model::save.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hapi/model.h"
#include "optim/adam.h"
#include "spawn/spawn.h"
#include "tests/hapi/classification.h"

int main(int argc, char** argv) {
  using namespace tandem;
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "mismatch_save_barrier" && mode != "save_returns" && mode != "save_local") {
    std::cerr << "hapi_mpi_save_alone: mode \"" << mode
              << "\" is not one of mismatch_save_barrier, save_returns, save_local\n";
    return 2;
  }
  auto train = testing::Classification(32, 44);
  const char* tmp = std::getenv("TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/hapi_mpi_save_alone_" +
                           std::to_string(::getppid()) + ".safetensors";
  dist::SpawnOptions options;
  options.timeout_s = 60;
  const absl::Status status = dist::spawn(
      [&](dist::Context& ctx) -> absl::Status {
        hapi::Model model([] { return std::make_shared<testing::TwoLayerNet>(); });
        model.prepare(
            [](std::vector<nn::Tensor> params) {
              return std::make_unique<optim::Adam>(std::move(params),
                                                   optim::AdamOptions{.lr = 1e-2});
            },
            hapi::CrossEntropy());
        absl::StatusOr<hapi::History> fitted = model.fit(train, {.epochs = 1, .batch_size = 4});
        if (!fitted.ok()) return fitted.status();
        if (ctx.rank() == 0) return model.save(path);  // as a PyTorch script saves
        if (mode == "save_returns") return absl::OkStatus();
        ctx.communicator().barrier();
        return absl::OkStatus();
      },
      mode == "save_local" ? 2 : 1, "cpu", options);
  std::remove(path.c_str());
  std::remove(hapi::OptimizerStatePath(path).c_str());
  if (!status.ok()) {
    std::cerr << "hapi_mpi_save_alone: error: " << status << "\n";
    return 1;
  }
  return 0;
}
