// mpi_allreduce_bench: cross-process all_reduce bandwidth, tandem's hierarchical
// communicator (one CPU rank per process, dist::spawn) against a raw
// MPI_Allreduce on the same processes and sizes. Run under mpirun:
//
//   tests/spawn/mpirun.sh -np 2 build-cpu/bench/mpi_allreduce_bench [min_bytes max_bytes reps]
//
// For each size (powers of 4 from min_bytes, 1 KB, to max_bytes, 64 MB; float32
// sum): warm-up, then `reps` timed repetitions of an all-reduce loop (enough
// iterations for ~20 ms), median per call. Process 0 prints one CSV row per size
// and implementation: impl,bytes,us_per_call,algbw_GBps (algbw = bytes / time).
// Raw MPI runs first on MPI_COMM_WORLD (blocking MPI_Allreduce, and the
// non-blocking MPI_Iallreduce + MPI_Test loop, row mpi_nonblocking), then tandem
// inside one spawn (its own duplicate communicator), in the same processes.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "nn/tensor.h"
#include "spawn/spawn.h"

namespace {

using Clock = std::chrono::steady_clock;

// Median microseconds per call of fn over reps repetitions of `iters` calls,
// after a barrier each; iters is chosen on the first repetition for ~20 ms.
double TimeIt(const std::function<void()>& fn, const std::function<void()>& barrier, int reps,
              const std::function<int(int)>& agree_iters) {
  for (int i = 0; i < 3; ++i) fn();
  barrier();
  auto start = Clock::now();
  fn();
  const double one_us =
      std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  const int iters = agree_iters(std::clamp(static_cast<int>(20000 / std::max(one_us, 1.0)), 1, 1000));
  std::vector<double> per_call;
  for (int r = 0; r < reps; ++r) {
    barrier();
    start = Clock::now();
    for (int i = 0; i < iters; ++i) fn();
    per_call.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() /
                       iters);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem;
  const int64_t min_bytes = argc > 1 ? std::atoll(argv[1]) : 1024;
  const int64_t max_bytes = argc > 2 ? std::atoll(argv[2]) : 64 << 20;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  int provided = 0;
  dist::PrepareMpiInit();  // the tuning spawn applies when it initializes MPI
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int64_t> sizes;
  for (int64_t b = min_bytes; b <= max_bytes; b *= 4) sizes.push_back(b);
  auto max_iters = [&](MPI_Comm comm) {
    return [comm](int mine) {
      int agreed = 0;
      MPI_Allreduce(&mine, &agreed, 1, MPI_INT, MPI_MIN, comm);
      return agreed;
    };
  };
  if (rank == 0) std::printf("impl,bytes,us_per_call,algbw_GBps\n");
  for (int64_t bytes : sizes) {
    std::vector<float> send(static_cast<size_t>(bytes / 4), 1.0f), recv(send.size());
    const double us = TimeIt(
        [&] {
          MPI_Allreduce(send.data(), recv.data(), static_cast<int>(send.size()), MPI_FLOAT, MPI_SUM,
                        MPI_COMM_WORLD);
        },
        [] { MPI_Barrier(MPI_COMM_WORLD); }, reps, max_iters(MPI_COMM_WORLD));
    if (rank == 0) std::printf("mpi,%lld,%.2f,%.3f\n", static_cast<long long>(bytes), us, bytes / us / 1e3);
    // The non-blocking form tandem's communication thread must use (it polls the
    // stop flag between tests): MPI_Iallreduce in place, MPI_Test in a tight loop.
    const double nb_us = TimeIt(
        [&] {
          MPI_Request request;
          MPI_Iallreduce(MPI_IN_PLACE, recv.data(), static_cast<int>(recv.size()), MPI_FLOAT,
                         MPI_SUM, MPI_COMM_WORLD, &request);
          int done = 0;
          while (!done) MPI_Test(&request, &done, MPI_STATUS_IGNORE);
        },
        [] { MPI_Barrier(MPI_COMM_WORLD); }, reps, max_iters(MPI_COMM_WORLD));
    if (rank == 0) {
      std::printf("mpi_nonblocking,%lld,%.2f,%.3f\n", static_cast<long long>(bytes), nb_us,
                  bytes / nb_us / 1e3);
    }
    std::fflush(stdout);
  }
  // tandem: one CPU rank per process; the timing agreement goes through the
  // communicator itself (an all_reduce of the iteration count, then max).
  std::vector<std::pair<int64_t, double>> results;
  const absl::Status status = dist::spawn(
      [&](dist::Context& ctx) {
        dist::Communicator& comm = ctx.communicator();
        for (int64_t bytes : sizes) {
          nn::Tensor x = nn::full({bytes / 4}, 1.0, {.dtype = nn::kFloat32});
          const double us = TimeIt([&] { comm.all_reduce(x); }, [&] { comm.barrier(); }, reps,
                                   [&](int mine) {
                                     nn::Tensor t = nn::full({1}, static_cast<double>(mine),
                                                             {.dtype = nn::kInt64});
                                     comm.all_reduce(t, dist::ReduceOp::kMax);
                                     return static_cast<int>(t.to_vector<int64_t>()[0]);
                                   });
          results.emplace_back(bytes, us);
        }
      },
      1, "cpu", {.console = nullptr, .processes = dist::Processes::kOn});
  if (!status.ok()) {
    std::fprintf(stderr, "mpi_allreduce_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  if (rank == 0) {
    for (const auto& [bytes, us] : results) {
      std::printf("tandem,%lld,%.2f,%.3f\n", static_cast<long long>(bytes), us, bytes / us / 1e3);
    }
  }
  MPI_Finalize();  // this program initialised MPI, so it finalises it
  return 0;
}
