// The float32 CPU convolution paths the conv tests compare, and a guard that puts
// the path switch and the CPU thread count back when a test ends.
#ifndef TANDEM_TESTS_NN_CPU_CONV_PATHS_H_
#define TANDEM_TESTS_NN_CPU_CONV_PATHS_H_

#include <vector>

#include "nn/ops/conv.h"                   // set_cpu_winograd
#include "nn/ops/internal/conv_kernels.h"  // CpuConvPath
#include "nn/ops/matmul.h"                 // cpu_blas_threads

namespace tandem::nn::testing {

// Restores kAuto, the Winograd switch and the CPU thread count of the test's
// start on destruction.
class RestoreCpuConv {
 public:
  RestoreCpuConv() = default;
  RestoreCpuConv(const RestoreCpuConv&) = delete;
  RestoreCpuConv& operator=(const RestoreCpuConv&) = delete;
  ~RestoreCpuConv() {
    set_cpu_blas_threads(threads_);
    set_cpu_winograd(winograd_);
    ops::internal::SetCpuConvPath(ops::internal::CpuConvPath::kAuto);
  }

 private:
  int threads_ = cpu_blas_threads();
  bool winograd_ = cpu_winograd();
};

// im2col, with_auto: kAuto's choice (oneDNN by shape where built; the direct
// depthwise kernels on every build), Winograd for every shape it applies to,
// then (when tandem is built with oneDNN) oneDNN on plain NCHW, blocked and
// channels-last layouts.
inline std::vector<ops::internal::CpuConvPath> CpuConvPathsToCompare(bool with_auto = false) {
  using ops::internal::CpuConvPath;
  std::vector<CpuConvPath> paths = {CpuConvPath::kIm2col};
  ops::internal::SetCpuConvPath(CpuConvPath::kAuto);
  if (with_auto) paths.push_back(CpuConvPath::kAuto);
  paths.push_back(CpuConvPath::kWinograd);
  if (ops::internal::CpuConvUsesDnnl()) {
    paths.insert(paths.end(),
                 {CpuConvPath::kDnnl, CpuConvPath::kDnnlBlocked, CpuConvPath::kDnnlNhwc});
  }
  return paths;
}

// Whether a float32 conv2d of these shapes runs on the Winograd kernels now.
inline bool TakesWinograd(const Shape& x, const Shape& w, const Conv2dParams& p) {
  return ops::internal::UseWinograd(kFloat32, ops::internal::Conv2dGeometryOf(x, w, p));
}

}  // namespace tandem::nn::testing

#endif  // TANDEM_TESTS_NN_CPU_CONV_PATHS_H_
