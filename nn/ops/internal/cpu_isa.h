// Which build of tandem's own vectorised CPU kernels runs (the depthwise and
// Winograd convolutions compile theirs twice, baseline x86-64 and AVX2 + FMA,
// through cpu_isa_builds.inc).
// Internal to nn.
#ifndef TANDEM_NN_OPS_INTERNAL_CPU_ISA_H_
#define TANDEM_NN_OPS_INTERNAL_CPU_ISA_H_

#include <cstdlib>
#include <string_view>

namespace tandem::nn::ops::internal {

#if defined(__x86_64__) && defined(__GNUC__)
// AVX2 and FMA where the CPU has them, unless ONEDNN_MAX_CPU_ISA (which pins
// oneDNN's instruction set, and so the bits of a run) names one below AVX2.
// Decided once per process. The bits differ between the two builds, as
// oneDNN's do between instruction sets.
inline bool UseAvx2Kernels() {
  static const bool avx2 = [] {
    const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA");
    if (isa != nullptr && (std::string_view(isa) == "SSE41" || std::string_view(isa) == "AVX")) {
      return false;
    }
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return avx2;
}
#endif

// Kernel `...` (a name, or a name<T>) of the build that runs on this CPU, for
// files that compile their kernels twice through cpu_isa_builds.inc.
#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_CPU_ISA_KERNEL(...) (UseAvx2Kernels() ? avx2::__VA_ARGS__ : baseline::__VA_ARGS__)
#else
#define TANDEM_CPU_ISA_KERNEL(...) baseline::__VA_ARGS__
#endif

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_CPU_ISA_H_
