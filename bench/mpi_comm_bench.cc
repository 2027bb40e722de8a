// mpi_comm_bench: MPI's collectives between processes (OpenMPI's shared-memory
// transport on one machine), timed and printed like comm_bench, so the two tables
// compare row by row: the reference that separate processes reach.
//
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
//       build-cpu/bench/mpi_comm_bench --max_bytes=256M --iters=20
//
// Flags (--name=value): --collectives (all_reduce,broadcast,all_gather,
// reduce_scatter,barrier), --min_bytes (8), --max_bytes (256M; suffixes K M G),
// --step_factor (2), --iters (20), --warmup_iters (5). float32, MPI_SUM.
// Sizes and busbw as in comm_bench: the slowest process's mean time per call.
// Plain MPI and the C++ standard library only: no tandem code.
#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

int64_t ParseBytes(const std::string& text) {
  std::string digits = text;
  int64_t scale = 1;
  if (!digits.empty()) {
    switch (std::toupper(static_cast<unsigned char>(digits.back()))) {
      case 'K': scale = int64_t{1} << 10; break;
      case 'M': scale = int64_t{1} << 20; break;
      case 'G': scale = int64_t{1} << 30; break;
      default: scale = 0;
    }
    if (scale != 0) {
      digits.pop_back();
    } else {
      scale = 1;
    }
  }
  char* end = nullptr;
  const long long value = std::strtoll(digits.c_str(), &end, 10);
  if (digits.empty() || *end != '\0' || value < 0) return -1;
  return value * scale;
}

double BusFactor(const std::string& collective, int n) {
  if (collective == "all_reduce") return 2.0 * (n - 1) / n;
  if (collective == "all_gather" || collective == "reduce_scatter") return 1.0 * (n - 1) / n;
  if (collective == "broadcast") return 1;
  return 0;
}

// One call of `collective` on `bytes` (nccl-tests' size: the gathered output of
// all_gather, the scattered input of reduce_scatter).
void RunOnce(const std::string& collective, std::vector<float>& a, std::vector<float>& b,
             int64_t count, int n) {
  const int c = static_cast<int>(count);
  if (collective == "all_reduce") {
    MPI_Allreduce(MPI_IN_PLACE, a.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else if (collective == "broadcast") {
    MPI_Bcast(a.data(), c, MPI_FLOAT, 0, MPI_COMM_WORLD);
  } else if (collective == "all_gather") {
    MPI_Allgather(a.data(), c / n, MPI_FLOAT, b.data(), c / n, MPI_FLOAT, MPI_COMM_WORLD);
  } else if (collective == "reduce_scatter") {
    MPI_Reduce_scatter_block(a.data(), b.data(), c / n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

struct Config {
  std::vector<std::string> collectives;
  int64_t min_bytes, max_bytes;
  int factor, iters, warmup;
};

// Parses --name=value flags; false (after printing why on rank 0) on a bad one.
bool ParseConfig(int argc, char** argv, int rank, Config& config) {
  std::map<std::string, std::string> flags = {
      {"collectives", "all_reduce,broadcast,all_gather,reduce_scatter,barrier"},
      {"min_bytes", "8"}, {"max_bytes", "256M"}, {"step_factor", "2"},
      {"iters", "20"}, {"warmup_iters", "5"}};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const bool dashes = arg.rfind("--", 0) == 0;
    const std::string name = dashes && eq != std::string::npos ? arg.substr(2, eq - 2) : "";
    if (flags.count(name) == 0) {
      if (rank == 0) std::fprintf(stderr, "mpi_comm_bench: bad flag %s\n", arg.c_str());
      return false;
    }
    flags[name] = arg.substr(eq + 1);
  }
  config.min_bytes = ParseBytes(flags["min_bytes"]);
  config.max_bytes = ParseBytes(flags["max_bytes"]);
  config.factor = std::atoi(flags["step_factor"].c_str());
  config.iters = std::atoi(flags["iters"].c_str());
  config.warmup = std::atoi(flags["warmup_iters"].c_str());
  if (config.min_bytes < 1 || config.max_bytes < config.min_bytes ||
      config.max_bytes > (int64_t{1} << 33) || config.factor < 2 || config.iters < 1 ||
      config.warmup < 0) {
    if (rank == 0) std::fprintf(stderr, "mpi_comm_bench: bad sizes or counts\n");
    return false;
  }
  std::stringstream list(flags["collectives"]);
  for (std::string c; std::getline(list, c, ',');) config.collectives.push_back(c);
  return true;
}

void PrintHeader(const std::string& collective, int n, bool reduces) {
  std::printf("#\n# %s: %d MPI processes (MPI_COMM_WORLD), float32%s\n", collective.c_str(), n,
              reduces ? ", sum" : "");
  std::printf("# %12s %12s %9s %6s %10s %9s %9s\n", "size", "count", "type", "redop", "time",
              "algbw", "busbw");
  std::printf("# %12s %12s %9s %6s %10s %9s %9s\n", "(B)", "(elements)", "", "", "(us)",
              "(GB/s)", "(GB/s)");
}

// Times `collective` on `bytes` (the slowest process's mean per call) and prints
// its row on rank 0; skips sizes too small to give every process an element.
void TimeOneSize(const std::string& collective, int64_t bytes, const Config& config, int rank,
                 int n) {
  const bool per_process = collective == "all_gather" || collective == "reduce_scatter";
  int64_t count = bytes / 4;
  if (per_process) count = count / n * n;
  if (collective != "barrier" && count / (per_process ? n : 1) == 0) return;
  std::vector<float> a(static_cast<size_t>(std::max<int64_t>(count, 1)), 1.0f);
  std::vector<float> b(a.size(), 0.0f);
  for (int i = 0; i < config.warmup; ++i) RunOnce(collective, a, b, count, n);
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  for (int i = 0; i < config.iters; ++i) RunOnce(collective, a, b, count, n);
  double seconds = (MPI_Wtime() - start) / config.iters;
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank != 0) return;
  const bool reduces = collective == "all_reduce" || collective == "reduce_scatter";
  const int64_t row_bytes = count * 4;
  const double algbw = row_bytes > 0 ? row_bytes / seconds / 1e9 : 0;
  std::printf("  %12lld %12lld %9s %6s %10.2f %9.2f %9.2f\n", static_cast<long long>(row_bytes),
              static_cast<long long>(count), "float32", reduces ? "sum" : "-", seconds * 1e6,
              algbw, algbw * BusFactor(collective, n));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  Config config;
  if (!ParseConfig(argc, argv, rank, config)) {
    MPI_Finalize();
    return 2;
  }
  for (const std::string& collective : config.collectives) {
    if (rank == 0) {
      PrintHeader(collective, n, collective == "all_reduce" || collective == "reduce_scatter");
    }
    std::vector<int64_t> sizes = {0};  // barrier
    if (collective != "barrier") {
      sizes.clear();
      for (int64_t b = config.min_bytes; b <= config.max_bytes; b *= config.factor) {
        sizes.push_back(b);
      }
    }
    for (int64_t bytes : sizes) TimeOneSize(collective, bytes, config, rank, n);
  }
  MPI_Finalize();
  return 0;
}
