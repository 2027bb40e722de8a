// A tiny multi-process job that fails on purpose, for mpi_fault_test.sh:
//   mpirun -np 2 spawn_mpi_fault MODE
// MODE: ok (trains and exits 0), throw (process 1's rank throws at step 3), kill
// (process 1 SIGKILLs itself at step 3), stop (process 1 SIGSTOPs itself at step
// 3; the watchdog of process 0 ends the job), early (process 1 exits 3 before
// spawn), flags (the processes disagree on --batch_size), singleton (run without
// mpirun under PMI_SIZE=2: MPI sees a world of 1), log_dir (process 1's log_dir
// cannot be created: start-up fails there after the processes joined), startup
// (a fault at a start-up point, named by TANDEM_TEST_STARTUP_FAULT, which the
// test sets; timeout_s 3).
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>

#include "nn/tensor.h"
#include "spawn/spawn.h"

namespace {

int ProcessIndex() {
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  return rank != nullptr ? std::atoi(rank) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem;
  const std::string mode = argc > 1 ? argv[1] : "ok";
  if (mode == "early" && ProcessIndex() == 1) {
    std::cerr << "spawn_mpi_fault: process 1 fails before spawn (bad flag)\n";
    return 3;
  }
  dist::SpawnOptions options;
  options.timeout_s = mode == "stop" || mode == "startup" ? 3 : 60;
  if (mode == "flags") options.must_agree = {{"--batch_size", ProcessIndex() == 0 ? "64" : "32"}};
  // A path under a regular file: mkdir fails (ENOTDIR), also as root.
  if (mode == "log_dir" && ProcessIndex() == 1) options.log_dir = "/proc/self/status/logs";
  const absl::Status status = dist::spawn(
      [&](dist::Context& ctx) {
        for (int step = 0; step < 200; ++step) {
          if (step == 3 && ctx.process_index() == 1) {
            if (mode == "throw") throw std::runtime_error("boom at step 3");
            if (mode == "kill") std::raise(SIGKILL);
            if (mode == "stop") std::raise(SIGSTOP);
          }
          nn::Tensor x = nn::full({256}, static_cast<double>(ctx.rank()));
          ctx.communicator().all_reduce(x);
          ::usleep(2000);
        }
        ctx.log().Info("done: 200 steps");
      },
      1, "cpu", options);
  if (!status.ok()) {
    std::cerr << "spawn_mpi_fault: error: " << status << "\n";
    return 1;
  }
  return 0;
}
