// A tiny multi-process job that fails on purpose, for mpi_fault_test.sh:
//   mpirun -np 2 spawn_mpi_fault MODE
// MODE: ok (trains and exits 0), throw (process 1's rank throws at step 3), kill
// (process 1 SIGKILLs itself at step 3), stop (process 1 SIGSTOPs itself at step
// 3; the watchdog of process 0 ends the job), early (process 1 exits 3 before
// spawn), flags (the processes disagree on --batch_size), singleton (run without
// mpirun under PMI_SIZE=2: MPI sees a world of 1), log_dir (process 1's log_dir
// cannot be created: start-up fails there after the processes joined), startup
// (a fault at a start-up point, named by TANDEM_TEST_STARTUP_FAULT, which the
// test sets; timeout_s 3), uneven (process 1's rank returns after 3 steps while
// process 0's goes on without DataParallel::join(): process 0's watchdog ends the
// job as soon as the last round between the processes reports the return, long
// before timeout_s 60), even_late (equal steps, but process 0's rank waits 1.5 s
// after its last step while process 1's has returned: silent, exit 0).
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
  // Every rank's lines on the console: the uneven case's return is timed from them.
  if (mode == "uneven" || mode == "even_late") options.log_all_ranks = true;
  const absl::Status status = dist::spawn(
      [&](dist::Context& ctx) {
        for (int step = 0; step < 200; ++step) {
          if (step == 3 && ctx.process_index() == 1) {
            if (mode == "throw") throw std::runtime_error("boom at step 3");
            if (mode == "kill") std::raise(SIGKILL);
            if (mode == "stop") std::raise(SIGSTOP);
            if (mode == "uneven") {
              ctx.log().Info("returns after 3 steps (its peer goes on without join)");
              return;
            }
          }
          nn::Tensor x = nn::full({256}, static_cast<double>(ctx.rank()));
          ctx.communicator().all_reduce(x);
          ::usleep(2000);
        }
        if (mode == "even_late" && ctx.process_index() == 0) ::usleep(1500 * 1000);
        ctx.log().Info("done: 200 steps");
      },
      1, "cpu", options);
  if (!status.ok()) {
    std::cerr << "spawn_mpi_fault: error: " << status << "\n";
    return 1;
  }
  return 0;
}
