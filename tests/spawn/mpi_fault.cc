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
// after its last step while process 1's has returned: silent, exit 0),
// mismatch_{op,size,dtype,root,extra} (at step 3 process 0's rank calls
// all_reduce of 1530 float32 and process 1's all_gather of 4 float64, an
// all_reduce of 1531 float32 or of 1530 float64, a broadcast from root 1 instead
// of 0, or a barrier before the step's all_reduce), mismatch_last (the roots
// differ in a broadcast after the 200 steps, the ranks' last collective: MPI
// completes it and the ranks return), extra_last (process 1's rank calls a
// barrier after the 200 steps, which process 0's never enters), refused (trains
// as ok does; its test sets an environment that spawn refuses), rounds_one
// (trains as ok does, with TANDEM_CHECK_COLLECTIVES=rounds, the default, set on
// process 1 only: the same setting as unset, so the processes agree), each_one
// (TANDEM_CHECK_COLLECTIVES=each on process 1 only: refused at the join).
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

// Step 3 of the mismatch modes: process 0's and process 1's ranks call
// collectives that do not pair.
void CallMismatched(tandem::dist::Context& ctx, const std::string& mode) {
  using namespace tandem;
  dist::Communicator& comm = ctx.communicator();
  const bool first = ctx.process_index() == 0;
  if (mode == "mismatch_op") {
    if (first) {
      nn::Tensor x = nn::zeros({1530});
      comm.all_reduce(x);
    } else {
      nn::Tensor in = nn::zeros({4}, {.dtype = nn::DType::kFloat64});
      nn::Tensor out = nn::zeros({4 * ctx.world_size()}, {.dtype = nn::DType::kFloat64});
      comm.all_gather_into(in, out);
    }
  } else if (mode == "mismatch_size") {
    nn::Tensor x = nn::zeros({first ? 1530 : 1531});
    comm.all_reduce(x);
  } else if (mode == "mismatch_dtype") {
    nn::Tensor x = nn::zeros({1530}, {.dtype = first ? nn::DType::kFloat32 : nn::DType::kFloat64});
    comm.all_reduce(x);
  } else if (mode == "mismatch_root" || mode == "mismatch_last") {
    nn::Tensor x = nn::zeros({64});
    comm.broadcast(x, first ? 0 : 1);
  } else if (mode == "mismatch_extra" && !first) {
    comm.barrier();
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem;
  const std::string mode = argc > 1 ? argv[1] : "ok";
  if (mode == "early" && ProcessIndex() == 1) {
    std::cerr << "spawn_mpi_fault: process 1 fails before spawn (bad flag)\n";
    return 3;
  }
  if (ProcessIndex() == 1 && (mode == "rounds_one" || mode == "each_one")) {
    ::setenv("TANDEM_CHECK_COLLECTIVES", mode == "rounds_one" ? "rounds" : "each", 1);
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
          if (step == 3 && mode.rfind("mismatch_", 0) == 0 && mode != "mismatch_last") {
            CallMismatched(ctx, mode);
          }
          nn::Tensor x = nn::full({256}, static_cast<double>(ctx.rank()));
          ctx.communicator().all_reduce(x);
          ::usleep(2000);
        }
        if (mode == "even_late" && ctx.process_index() == 0) ::usleep(1500 * 1000);
        if (mode == "extra_last" && ctx.process_index() == 1) ctx.communicator().barrier();
        if (mode == "mismatch_last") CallMismatched(ctx, mode);
        ctx.log().Info("done: 200 steps");
      },
      1, "cpu", options);
  if (!status.ok()) {
    std::cerr << "spawn_mpi_fault: error: " << status << "\n";
    return 1;
  }
  return 0;
}
