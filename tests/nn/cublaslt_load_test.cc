// A CUDA build opens cuBLASLt the first time a GPU matmul needs it (nn/cuda/cublaslt_api.h):
// a program that only uses the CPU never maps the library (~150 MB of resident
// memory). Needs the toolkit's libraries, not a GPU: loading cuBLASLt touches no device.
#include "nn/cuda/cublaslt_api.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "nn/ops/matmul.h"
#include "nn/ops/reduce.h"
#include "nn/tensor.h"

namespace tandem::nn {
namespace {

bool Mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(library) != std::string::npos) return true;
  }
  return false;
}

TEST(CublasLtLoadTest, OpenedOnFirstUseOnlyWithEveryEntryResolved) {
  // CPU work through nn first, with gradients.
  Tensor a = randn({16, 16}, {.requires_grad = true});
  Tensor b = randn({16, 16});
  sum(matmul(a, b)).backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_FALSE(Mapped("libcublasLt")) << "CPU-only work mapped cuBLASLt";

  const internal::CublasLtApi& api = internal::CublasLt();
  EXPECT_TRUE(Mapped("libcublasLt"));
  EXPECT_EQ(&api, &internal::CublasLt()) << "the table is loaded once";
  const void* entries[] = {
      reinterpret_cast<const void*>(api.Create),
      reinterpret_cast<const void*>(api.Destroy),
      reinterpret_cast<const void*>(api.GetStatusString),
      reinterpret_cast<const void*>(api.Matmul),
      reinterpret_cast<const void*>(api.MatmulAlgoGetHeuristic),
      reinterpret_cast<const void*>(api.MatmulDescCreate),
      reinterpret_cast<const void*>(api.MatmulDescDestroy),
      reinterpret_cast<const void*>(api.MatmulDescSetAttribute),
      reinterpret_cast<const void*>(api.MatmulPreferenceCreate),
      reinterpret_cast<const void*>(api.MatmulPreferenceDestroy),
      reinterpret_cast<const void*>(api.MatmulPreferenceSetAttribute),
      reinterpret_cast<const void*>(api.MatrixLayoutCreate),
      reinterpret_cast<const void*>(api.MatrixLayoutDestroy)};
  for (size_t i = 0; i < std::size(entries); ++i) EXPECT_NE(entries[i], nullptr) << "entry " << i;
  // A call that needs no device: the library answers through the table.
  const std::string message = api.GetStatusString(CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_NE(message.find("not supported"), std::string::npos) << message;
}

}  // namespace
}  // namespace tandem::nn
