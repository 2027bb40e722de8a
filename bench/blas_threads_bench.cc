// How OpenBLAS behaves when several rank threads call it at once (a CPU run of
// dist::spawn with gpus="cpu" does exactly that). Not a ctest: run by hand,
//   scripts/bench.sh blas [--benchmark_filter=...]      # build-cpu/bench/nn_blas_threads_bench
// and compare the 1- and 2-thread rows: with real time, "items_per_second" is
// the total rate of all threads, so 2 threads at twice the 1-thread rate means
// the calls ran in parallel, the same rate means OpenBLAS serialised them.
// OPENBLAS_NUM_THREADS sets OpenBLAS's own threads per call (default: all cores).
#include <benchmark/benchmark.h>

#include <vector>

#include "nn/ops/conv.h"
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/random.h"

namespace tandem::nn {
namespace {

void BM_Sgemm256(benchmark::State& state) {
  constexpr int64_t kN = 256;
  std::vector<float> a(kN * kN), b(kN * kN), c(kN * kN);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i % 7) * 0.1f;
    b[i] = static_cast<float>(i % 5) * 0.2f;
  }
  for (auto _ : state) {
    ops::internal::GemmRaw<float>(false, false, kN, kN, kN, 1.0f, a.data(), kN, b.data(), kN, 0.0f,
                                  c.data(), kN);
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * kN * kN * kN * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Sgemm256)->Threads(1)->Threads(2)->UseRealTime()->Unit(benchmark::kMicrosecond);

// LeNet's first layer: batch 64, 1 -> 20 channels, 28x28, 5x5 kernel, padding 2;
// forward, then backward to the weight and the bias (the input is data).
void BM_LeNetConv1ForwardBackward(benchmark::State& state) {
  manual_seed(static_cast<uint64_t>(state.thread_index()) + 1);
  Tensor x = randn({64, 1, 28, 28});
  Tensor w = randn({20, 1, 5, 5}).mul_(0.2).set_requires_grad(true);
  Tensor b = zeros({20}).set_requires_grad(true);
  Tensor dy = ones({64, 20, 28, 28});
  for (auto _ : state) {
    Tensor y = conv2d(x, w, b, {.padding = {2, 2}});
    y.backward(dy);
    benchmark::DoNotOptimize(w.grad().data_ptr());
    w.set_grad(Tensor());
    b.set_grad(Tensor());
  }
  state.SetItemsProcessed(state.iterations() * 64);  // samples
}
BENCHMARK(BM_LeNetConv1ForwardBackward)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tandem::nn

BENCHMARK_MAIN();
