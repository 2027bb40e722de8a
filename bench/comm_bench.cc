// comm_bench: the collectives of dist::Communicator timed the way NCCL users know
// from nccl-tests' all_reduce_perf (size, count, type, time, algbw, busbw), on
// ranks started by dist::spawn: CPU ranks (--gpus=cpu, the in-process
// communicator), ranks sharing one GPU (--gpus=0,0, in-process on the GPU) or
// distinct GPUs (--gpus=0,1, NCCL).
//
//   comm_bench --ranks=2,4 --max_bytes=256M          # every collective, 8 B .. 256 MB
//   comm_bench --ranks=2 --collectives=all_reduce --max_bytes=1M --iters=100
//   comm_bench --mode=memcpy                          # single-thread memcpy of 64 MB
//   comm_bench --mode=handover                        # thread hand-over costs (floors)
//   comm_bench --mode=dp --ranks=1,2 --models=lenet,mlp --batch=32
//
// Collectives (--mode=collectives): for each size, every rank runs
// --warmup_iters collectives, meets the others in a barrier, then times --iters
// back-to-back collectives on its own clock; the row shows the slowest rank's
// mean time per collective (with --windows=k: the fastest of k consecutive
// windows of iters/k collectives, each the slowest rank's mean). size is nccl-tests' "size": the bytes of one rank's
// buffer (all_reduce, broadcast), of the gathered output (all_gather), of the
// input that is scattered (reduce_scatter); count is its element count.
//   algbw = size / time; busbw = algbw * (all_reduce 2(n-1)/n; all_gather and
//   reduce_scatter (n-1)/n; broadcast 1), the per-link load of a ring, so rows
//   of different rank counts compare. all_gather and reduce_scatter go through
//   the API that returns a new tensor, so their time includes its allocation.
// Before timing, each size's result is checked once against a closed form
// (--check); a wrong result ends the program with status 1.
//
// Hand-overs (--mode=handover): what passing control between two threads costs
// on this machine, the floors under a collective's latency: two threads on two
// CPUs taking turns through one spinning flag (what 2 ranks on free CPUs pay per
// meeting), and two threads pinned to one CPU taking turns through sched_yield
// (what every meeting costs each CPU when there are more ranks than CPUs: both
// ranks of a CPU must run between two meetings). Linux only.
//
// DataParallel (--mode=dp): the training step (forward, backward with gradient
// all-reduce, SGD) of each model at --batch samples per rank, on synthetic data,
// per rank count: median step time of --repetitions runs of --steps steps after
// --warmup_steps. OpenBLAS runs one thread per rank (--threads).
//
// Exit statuses: 0 ok, 1 a failure (a rank's error, a wrong result), 2 a bad flag.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "apps/flag_check.h"
#include "apps/models.h"
#include "nn/nn.h"
#include "nn/ops/matmul.h"
#include "optim/sgd.h"
#include "spawn/spawn.h"

ABSL_FLAG(std::string, mode, "collectives", "collectives, memcpy, handover or dp.");
ABSL_FLAG(std::string, ranks, "2,4", "Comma-separated rank counts, each >= 1.");
ABSL_FLAG(std::string, gpus, "cpu",
          "Where the ranks run: cpu (in-process), 0,0 (ranks sharing GPU 0, in-process) or "
          "0,1 (NCCL); passed to dist::spawn with nprocs = the rank count.");
ABSL_FLAG(std::string, collectives, "all_reduce,broadcast,all_gather,reduce_scatter,barrier",
          "Comma-separated collectives to time.");
ABSL_FLAG(std::string, min_bytes, "8", "Smallest size (suffixes K, M, G: powers of 1024).");
ABSL_FLAG(std::string, max_bytes, "256M", "Largest size (suffixes K, M, G).");
ABSL_FLAG(int, step_factor, 2, "Each size is this many times the last (>= 2).");
ABSL_FLAG(int, iters, 20, "Timed collectives per size (>= 1).");
ABSL_FLAG(int, warmup_iters, 5, "Untimed collectives per size before the timed ones (>= 0).");
ABSL_FLAG(std::string, dtype, "float32", "float32, float64 or bfloat16.");
ABSL_FLAG(std::string, op, "sum", "sum, avg or max.");
ABSL_FLAG(int, windows, 1,
          "Split the timed collectives of a size into this many windows and report the "
          "fastest window (1: the mean of all, as nccl-tests). On a busy machine, "
          "e.g. --iters=2000 --windows=20 shows what a quiet moment gives.");
ABSL_FLAG(bool, check, true, "Check each size's result once before timing it.");
ABSL_FLAG(double, timeout_s, 300, tandem::apps::kTimeoutHelp);
ABSL_FLAG(std::string, memcpy_bytes, "64M", "Buffer size of --mode=memcpy.");
ABSL_FLAG(std::string, models, "lenet,mlp", "--mode=dp: comma-separated models (mlp, lenet).");
ABSL_FLAG(int, batch, 32, "--mode=dp: samples per rank per step.");
ABSL_FLAG(int, steps, 30, "--mode=dp: timed steps per repetition (>= 1).");
ABSL_FLAG(int, warmup_steps, 5, "--mode=dp: untimed steps before each repetition.");
ABSL_FLAG(int, repetitions, 5, "--mode=dp: repetitions; the median is reported.");
ABSL_FLAG(int, threads, 1, "--mode=dp: OpenBLAS threads (shared by the ranks; 0 keeps it).");

namespace tandem::apps {
namespace {

using dist::ReduceOp;

struct BadFlag {
  std::string message;
};

[[noreturn]] void Bad(const std::string& message) { throw BadFlag{message}; }

int64_t ParseBytes(const std::string& flag, const std::string& text) {
  std::string digits = text;
  int64_t scale = 1;
  if (!digits.empty()) {
    const char suffix = static_cast<char>(std::toupper(static_cast<unsigned char>(digits.back())));
    const int64_t scales[] = {int64_t{1} << 10, int64_t{1} << 20, int64_t{1} << 30};
    const char* suffixes = "KMG";
    if (const char* p = std::strchr(suffixes, suffix); p != nullptr && suffix != '\0') {
      scale = scales[p - suffixes];
      digits.pop_back();
    }
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(digits, &value) || value < 0 || value > (int64_t{1} << 40) / scale) {
    Bad(absl::StrCat("--", flag, "=", text, ": not a byte count (e.g. 8, 64K, 256M)"));
  }
  return value * scale;
}

std::vector<int> ParseRanks(const std::string& text) {
  std::vector<int> ranks;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int r = 0;
    if (!absl::SimpleAtoi(part, &r) || r < 1 || r > 1024) {
      Bad(absl::StrCat("--ranks=", text, ": '", part, "' is not a rank count >= 1"));
    }
    ranks.push_back(r);
  }
  return ranks;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Ranks may share a GPU; spawn's log (its environment table) goes nowhere, so
// that stdout holds only the tables. Errors still come back as a Status.
dist::SpawnOptions QuietSpawn() {
  static std::ostream* null_stream = new std::ostream(nullptr);  // discards, never freed
  dist::SpawnOptions options;
  options.share_devices = true;
  options.console = null_stream;
  options.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  return options;
}

// --- collectives ----------------------------------------------------------------

struct SweepConfig {
  std::string collective;
  std::vector<int64_t> sizes;  // bytes
  nn::DType dtype;
  ReduceOp op;
  int iters;
  int warmup_iters;
  int windows;
  bool check;
};

struct Row {
  int64_t bytes = 0;
  int64_t count = 0;
  double seconds = 0;  // per collective, slowest rank
};

double BusFactor(const std::string& collective, int n) {
  if (collective == "all_reduce") return 2.0 * (n - 1) / n;
  if (collective == "all_gather" || collective == "reduce_scatter") return 1.0 * (n - 1) / n;
  if (collective == "broadcast") return 1;
  return 0;
}

// Runs one collective on x (buffer of the size row); returns what the check reads.
nn::Tensor RunOnce(dist::Communicator& comm, const std::string& collective, nn::Tensor& x,
                   ReduceOp op) {
  if (collective == "all_reduce") {
    comm.all_reduce(x, op);
    return x;
  }
  if (collective == "broadcast") {
    comm.broadcast(x, 0);
    return x;
  }
  if (collective == "all_gather") return comm.all_gather(x);
  if (collective == "reduce_scatter") return comm.reduce_scatter(x, op);
  comm.barrier();
  return x;
}

// Rank r's input is r + 1 everywhere: every result below is exact in every dtype.
void Check(dist::Communicator& comm, const std::string& collective, const nn::Tensor& result,
           ReduceOp op, int64_t bytes) {
  if (collective == "barrier" || result.numel() == 0) return;
  const int n = comm.world_size();
  double want = 0;
  if (collective == "broadcast") {
    want = 1;  // root 0's value
  } else if (collective == "all_gather") {
    const std::vector<double> got = result.to(nn::kFloat64).to_vector<double>();
    const int64_t per_rank = result.numel() / n;
    for (int64_t i = 0; i < result.numel(); ++i) {
      TANDEM_CHECK(got[i] == static_cast<double>(i / per_rank + 1), collective, " of ", bytes,
                   " B on rank ", comm.rank(), ": element ", i, " is ", got[i]);
    }
    return;
  } else {
    want = op == ReduceOp::kMax ? n : op == ReduceOp::kAvg ? (n + 1) / 2.0 : n * (n + 1) / 2.0;
  }
  const std::vector<double> got = result.to(nn::kFloat64).to_vector<double>();
  for (int64_t i = 0; i < result.numel(); ++i) {
    TANDEM_CHECK(got[i] == want, collective, " of ", bytes, " B on rank ", comm.rank(),
                 ": element ", i, " is ", got[i], ", want ", want);
  }
}

// The buffer of one rank for a row: all_gather sends size/n, the others size.
int64_t InputCount(const std::string& collective, int64_t count, int n) {
  if (collective == "all_gather") return count / n;
  if (collective == "reduce_scatter") return count / n * n;
  return count;
}

std::vector<Row> Sweep(dist::Context& ctx, const SweepConfig& config) {
  dist::Communicator& comm = ctx.communicator();
  const int n = comm.world_size();
  const int64_t element = nn::ElementSize(config.dtype);
  const nn::TensorOptions options{.dtype = config.dtype, .device = ctx.device()};
  std::vector<Row> rows;
  std::vector<int64_t> sizes = config.sizes;
  if (config.collective == "barrier") sizes = {0};
  for (int64_t bytes : sizes) {
    const int64_t count = bytes / element;
    const int64_t input = InputCount(config.collective, count, n);
    if (config.collective != "barrier" && input == 0) continue;  // smaller than one element per rank
    nn::Tensor x = nn::full({input}, comm.rank() + 1.0, options);
    if (config.check) {
      nn::Tensor probe = x.clone();
      Check(comm, config.collective, RunOnce(comm, config.collective, probe, config.op),
            config.op, bytes);
    }
    // Sums grow by n per call: start from a value that stays finite.
    for (int i = 0; i < config.warmup_iters; ++i) RunOnce(comm, config.collective, x, config.op);
    comm.barrier();
    std::vector<double> window_seconds;
    const int per_window = std::max(1, config.iters / config.windows);
    for (int w = 0; w < config.windows; ++w) {
      nn::Synchronize(ctx.device());
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < per_window; ++i) RunOnce(comm, config.collective, x, config.op);
      nn::Synchronize(ctx.device());
      window_seconds.push_back(SecondsSince(start) / per_window);
    }
    // Slowest rank per window, then the fastest window.
    nn::Tensor seconds = nn::from_vector(window_seconds, {config.windows},
                                         {.dtype = nn::kFloat64, .device = ctx.device()});
    comm.all_reduce(seconds, ReduceOp::kMax);
    const std::vector<double> slowest = seconds.to_vector<double>();
    rows.push_back({.bytes = config.collective == "barrier" ? 0 : input * element *
                                  (config.collective == "all_gather" ? n : 1),
                    .count = config.collective == "barrier" ? 0
                             : config.collective == "all_gather" ? input * n : input,
                    .seconds = *std::min_element(slowest.begin(), slowest.end())});
  }
  return rows;
}

void PrintTable(const std::string& collective, int n, const std::string& where,
                const std::string& kind, nn::DType dtype, ReduceOp op,
                const std::vector<Row>& rows) {
  const bool reduces = collective == "all_reduce" || collective == "reduce_scatter";
  std::cout << absl::StrFormat("#\n# %s: %d ranks on %s (%s communicator), %s%s\n", collective, n,
                               where, kind, nn::DTypeName(dtype),
                               reduces ? absl::StrCat(", ", dist::ReduceOpName(op)) : "");
  std::cout << absl::StrFormat("# %12s %12s %9s %6s %10s %9s %9s\n", "size", "count", "type",
                               "redop", "time", "algbw", "busbw");
  std::cout << absl::StrFormat("# %12s %12s %9s %6s %10s %9s %9s\n", "(B)", "(elements)", "", "",
                               "(us)", "(GB/s)", "(GB/s)");
  const double factor = BusFactor(collective, n);
  for (const Row& r : rows) {
    const double algbw = r.bytes > 0 ? r.bytes / r.seconds / 1e9 : 0;
    std::cout << absl::StrFormat("  %12d %12d %9s %6s %10.2f %9.2f %9.2f\n", r.bytes, r.count,
                                 nn::DTypeName(dtype), reduces ? dist::ReduceOpName(op) : "-",
                                 r.seconds * 1e6, algbw, algbw * factor);
  }
  std::cout.flush();
}

int RunCollectives(const std::vector<int>& rank_counts, const std::string& gpus) {
  std::vector<std::string> collectives =
      absl::StrSplit(absl::GetFlag(FLAGS_collectives), ',', absl::SkipEmpty());
  for (const std::string& c : collectives) {
    if (c != "all_reduce" && c != "broadcast" && c != "all_gather" && c != "reduce_scatter" &&
        c != "barrier") {
      Bad(absl::StrCat("--collectives: unknown collective '", c, "'"));
    }
  }
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  nn::DType dtype = nn::kFloat32;
  if (dtype_name == "float64") {
    dtype = nn::kFloat64;
  } else if (dtype_name == "bfloat16") {
    dtype = nn::kBFloat16;
  } else if (dtype_name != "float32") {
    Bad(absl::StrCat("--dtype=", dtype_name, ": not float32, float64 or bfloat16"));
  }
  const std::string op_name = absl::GetFlag(FLAGS_op);
  const ReduceOp op = op_name == "avg" ? ReduceOp::kAvg
                      : op_name == "max" ? ReduceOp::kMax
                      : op_name == "sum" ? ReduceOp::kSum
                      : (Bad(absl::StrCat("--op=", op_name, ": not sum, avg or max")), ReduceOp::kSum);
  const int64_t min_bytes = ParseBytes("min_bytes", absl::GetFlag(FLAGS_min_bytes));
  const int64_t max_bytes = ParseBytes("max_bytes", absl::GetFlag(FLAGS_max_bytes));
  const int factor = absl::GetFlag(FLAGS_step_factor);
  if (factor < 2) Bad(absl::StrCat("--step_factor=", factor, ": must be >= 2"));
  if (min_bytes < 1 || max_bytes < min_bytes) {
    Bad(absl::StrCat("--min_bytes=", min_bytes, " --max_bytes=", max_bytes,
                     ": need 1 <= min_bytes <= max_bytes"));
  }
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup_iters);
  const int windows = absl::GetFlag(FLAGS_windows);
  if (iters < 1 || warmup < 0 || windows < 1 || windows > iters) {
    Bad(absl::StrCat("--iters=", iters, " --warmup_iters=", warmup, " --windows=", windows,
                     ": need iters >= 1, warmup_iters >= 0, 1 <= windows <= iters"));
  }
  std::vector<int64_t> sizes;
  for (int64_t b = min_bytes; b <= max_bytes; b *= factor) sizes.push_back(b);

  dist::SpawnOptions options = QuietSpawn();
  for (int n : rank_counts) {
    for (const std::string& collective : collectives) {
      const SweepConfig config{collective, sizes, dtype, op, iters, warmup, windows,
                               absl::GetFlag(FLAGS_check)};
      std::string kind;
      auto rows = dist::spawn(
          [&](dist::Context& ctx) {
            if (ctx.rank() == 0) kind = ctx.communicator().kind();
            return Sweep(ctx, config);
          },
          std::make_tuple(), n, gpus, options);
      if (!rows.ok()) {
        std::cerr << "comm_bench: " << collective << " on " << n << " ranks: " << rows.status()
                  << "\n";
        return 1;
      }
      PrintTable(collective, n, gpus, kind, dtype, op, (*rows)[0]);
    }
  }
  return 0;
}

// --- memcpy ----------------------------------------------------------------------

int RunMemcpy() {
  const int64_t bytes = ParseBytes("memcpy_bytes", absl::GetFlag(FLAGS_memcpy_bytes));
  std::vector<char> src(static_cast<size_t>(bytes), 1), dst(static_cast<size_t>(bytes), 0);
  std::memcpy(dst.data(), src.data(), src.size());  // fault both in
  double best = 1e30;
  for (int rep = 0; rep < 10; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), src.size());
    best = std::min(best, SecondsSince(start));
    src[static_cast<size_t>(rep) % src.size()] = dst[0];  // keep the copies observable
  }
  std::cout << absl::StrFormat(
      "# memcpy (one thread) of %d B: %.2f GB/s (best of 10: %.1f us); a 2-rank in-process "
      "all_reduce moves one such copy per rank, so its algbw bound is about the same figure\n",
      bytes, bytes / best / 1e9, best * 1e6);
  return 0;
}

// --- hand-overs --------------------------------------------------------------------

// Two threads take turns `turns` times through a shared counter, the first
// pinned to CPU cpu_a, the second to cpu_b; yield: wait with sched_yield rather
// than a pause loop. Returns the mean seconds per hand-over, or -1 when the
// threads cannot be pinned there.
double TimeHandOver(int cpu_a, int cpu_b, bool yield, int64_t turns) {
#ifdef __linux__
  std::atomic<int64_t> turn{0};
  std::atomic<bool> pin_failed{false};
  auto body = [&](int me, int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) pin_failed = true;
    for (int64_t i = me; i < 2 * turns && !pin_failed.load(std::memory_order_relaxed); i += 2) {
      while (turn.load(std::memory_order_acquire) != i) {
        if (pin_failed.load(std::memory_order_relaxed)) return;
        if (yield) {
          sched_yield();
        } else {
          dist::internal::CpuRelax();
        }
      }
      turn.store(i + 1, std::memory_order_release);
    }
  };
  const auto start = std::chrono::steady_clock::now();
  std::thread a(body, 0, cpu_a), b(body, 1, cpu_b);
  a.join();
  b.join();
  if (pin_failed) return -1;
  return SecondsSince(start) / static_cast<double>(2 * turns);
#else
  (void)cpu_a, (void)cpu_b, (void)yield, (void)turns;
  return -1;
#endif
}

int RunHandOver() {
#ifdef __linux__
  cpu_set_t set;
  TANDEM_CHECK(sched_getaffinity(0, sizeof set, &set) == 0, "sched_getaffinity failed");
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  auto report = [](const char* what, double seconds) {
    if (seconds < 0) {
      std::cout << absl::StrFormat("# %-58s could not pin the threads\n", what);
    } else {
      std::cout << absl::StrFormat("# %-58s %8.3f us\n", what, seconds * 1e6);
    }
  };
  // Medians of 5 runs of 100,000 hand-overs each.
  auto median = [](int a, int b, bool yield) {
    std::vector<double> t;
    for (int rep = 0; rep < 5; ++rep) t.push_back(TimeHandOver(a, b, yield, 100'000));
    std::sort(t.begin(), t.end());
    return t[0] < 0 ? -1.0 : t[2];
  };
  std::cout << "# hand-over between two threads, median of 5 x 100,000\n";
  if (cpus.size() >= 2) {
    report(absl::StrFormat("CPUs %d and %d, spinning (2 ranks on free CPUs):", cpus[0], cpus[1])
               .c_str(),
           median(cpus[0], cpus[1], false));
  } else {
    std::cout << "# two CPUs: only one CPU is usable\n";
  }
  report(absl::StrFormat("CPU %d, sched_yield (more ranks than CPUs):", cpus[0]).c_str(),
         median(cpus[0], cpus[0], true));
  return 0;
#else
  std::cerr << "comm_bench: --mode=handover needs Linux\n";
  return 1;
#endif
}

// --- DataParallel steps ------------------------------------------------------------

std::shared_ptr<nn::Module> MakeModel(const std::string& name) {
  if (name == "mlp") return MakeMlp();
  if (name == "lenet") return MakeLeNet();
  Bad(absl::StrCat("--models: unknown model '", name, "' (mlp, lenet)"));
}

// Median seconds per step on this rank.
double DpSteps(dist::Context& ctx, const std::string& name) {
  nn::manual_seed(1, 0);
  std::shared_ptr<nn::Module> model = MakeModel(name);
  dist::DataParallel dp(*model, ctx);
  optim::SGD sgd(dp.parameters(), optim::SGDOptions{.lr = 0.01});
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  nn::manual_seed(2, static_cast<uint64_t>(ctx.rank()));
  const nn::Tensor images = nn::randn({batch, 1, 28, 28});
  std::vector<int64_t> label_values(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) label_values[i] = (i * 7 + ctx.rank()) % 10;
  const nn::Tensor labels = nn::from_vector(label_values, {batch}, {.dtype = nn::kInt64});
  auto step = [&] {
    sgd.zero_grad();
    nn::Tensor loss = nn::cross_entropy(dp(images), labels);
    loss.backward();
    sgd.step();
    return loss;
  };
  std::vector<double> times;
  for (int rep = 0; rep < absl::GetFlag(FLAGS_repetitions); ++rep) {
    for (int i = 0; i < absl::GetFlag(FLAGS_warmup_steps); ++i) step();
    ctx.communicator().barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < absl::GetFlag(FLAGS_steps); ++i) step();
    times.push_back(SecondsSince(start) / absl::GetFlag(FLAGS_steps));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int RunDp(const std::vector<int>& rank_counts, const std::string& gpus) {
  if (absl::GetFlag(FLAGS_batch) < 1 || absl::GetFlag(FLAGS_steps) < 1 ||
      absl::GetFlag(FLAGS_repetitions) < 1 || absl::GetFlag(FLAGS_warmup_steps) < 0) {
    Bad("--batch, --steps and --repetitions must be >= 1, --warmup_steps >= 0");
  }
  if (absl::GetFlag(FLAGS_threads) > 0) nn::set_cpu_blas_threads(absl::GetFlag(FLAGS_threads));
  std::vector<std::string> models =
      absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty());
  for (const std::string& m : models) MakeModel(m);  // a bad name fails before any run
  std::cout << absl::StrFormat("# DataParallel step (forward, backward + all-reduce, SGD), "
                               "batch %d per rank, on %s\n",
                               absl::GetFlag(FLAGS_batch), gpus);
  std::cout << absl::StrFormat("# %8s %6s %12s %12s\n", "model", "ranks", "step (ms)",
                               "slowest rank");
  dist::SpawnOptions options = QuietSpawn();
  for (const std::string& m : models) {
    for (int n : rank_counts) {
      auto times = dist::spawn([&](dist::Context& ctx) { return DpSteps(ctx, m); },
                               std::make_tuple(), n, gpus, options);
      if (!times.ok()) {
        std::cerr << "comm_bench: dp " << m << " on " << n << " ranks: " << times.status() << "\n";
        return 1;
      }
      std::cout << absl::StrFormat("  %8s %6d %12.3f %12.3f\n", m, n, (*times)[0] * 1e3,
                                   *std::max_element(times->begin(), times->end()) * 1e3);
    }
  }
  return 0;
}

int Main(int argc, char** argv) {
  SetUpHelp("comm_bench",
            "Times dist::Communicator's collectives nccl-tests style (see the header of "
            "bench/comm_bench.cc).");
  ParseCommandLineOrExit("comm_bench", argc, argv);
  try {
    if (std::optional<std::string> bad = CheckTimeout(absl::GetFlag(FLAGS_timeout_s))) Bad(*bad);
    const std::string mode = absl::GetFlag(FLAGS_mode);
    const std::vector<int> ranks = ParseRanks(absl::GetFlag(FLAGS_ranks));
    const std::string gpus = absl::GetFlag(FLAGS_gpus);
    if (mode == "collectives") return RunCollectives(ranks, gpus);
    if (mode == "memcpy") return RunMemcpy();
    if (mode == "dp") return RunDp(ranks, gpus);
    if (mode == "handover") return RunHandOver();
    Bad(absl::StrCat("--mode=", mode, ": not collectives, memcpy, handover or dp"));
  } catch (const BadFlag& bad) {
    std::cerr << "comm_bench: " << bad.message << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "comm_bench: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace
}  // namespace tandem::apps

int main(int argc, char** argv) { return tandem::apps::Main(argc, argv); }
