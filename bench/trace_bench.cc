// The cost of observability per training step, by itself: what the
// programs add to each step with --trace (five TraceSpans: data, forward,
// backward, optimizer, checkpoint, plus BeginStep) and without it (the same
// spans on a Context without a recorder: a null check each), and what
// --tensorboard_dir adds at a log interval (SummaryWriter::AddScalar x 5).
// Not a ctest: run by hand; docs/benchmarks.md cites it.
//   scripts/bench.sh trace    # build-cpu/bench/spawn_trace_bench --benchmark_repetitions=5
#include <unistd.h>

#include <filesystem>
#include <string>

#include "benchmark/benchmark.h"
#include "spawn/spawn.h"
#include "spawn/observe/summary_writer.h"
#include "spawn/observe/trace.h"

namespace tandem::dist {
namespace {

// One rank's Context made by spawn, for the duration of `body`.
template <typename Body>
void InRank(const Body& body) {
  static std::ostream* quiet = new std::ostream(nullptr);
  const absl::Status s = spawn([&](Context& ctx) { body(ctx); }, 1, "cpu", {.console = quiet});
  if (!s.ok()) std::abort();
}

void SpansPerStep(benchmark::State& state, bool recording) {
  InRank([&](Context& ctx) {
    TraceRecorder recorder({.first_step = 0, .steps = recording ? INT64_MAX : 0});
    ctx.set_trace(recording ? &recorder : nullptr);
    int64_t step = 0;
    for (auto _ : state) {
      if (recording) recorder.BeginStep(ctx.rank(), step);
      { TraceSpan s(ctx, "data"); }
      { TraceSpan s(ctx, "forward"); }
      { TraceSpan s(ctx, "backward"); }
      { TraceSpan s(ctx, "optimizer"); }
      { TraceSpan s(ctx, "checkpoint"); }
      ++step;
      // Keep the recorder's buffer from growing without bound over millions of steps.
      if (recording && step % 100000 == 0) recorder.BeginStep(ctx.rank(), -1);
    }
  });
}
void BM_StepSpansTraceOff(benchmark::State& state) { SpansPerStep(state, false); }
void BM_StepSpansTraceOn(benchmark::State& state) { SpansPerStep(state, true); }
BENCHMARK(BM_StepSpansTraceOff);
BENCHMARK(BM_StepSpansTraceOn);

void BM_TensorBoardLogInterval(benchmark::State& state) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("tandem_trace_bench_" + std::to_string(::getpid()));
  auto writer = SummaryWriter::Open(dir);
  if (!writer.ok()) std::abort();
  int64_t step = 0;
  for (auto _ : state) {
    (*writer)->AddScalar("train/loss", 0.5, step);
    (*writer)->AddScalar("train/learning_rate", 1e-3, step);
    (*writer)->AddScalar("train/samples_per_s", 5000, step);
    (*writer)->AddScalar("step_time_ms/rank_0", 20, step);
    (*writer)->AddScalar("step_time_ms/rank_1", 20, step);
    ++step;
  }
  (void)(*writer)->Close();
  std::filesystem::remove_all(dir);
}
BENCHMARK(BM_TensorBoardLogInterval);

}  // namespace
}  // namespace tandem::dist

BENCHMARK_MAIN();
