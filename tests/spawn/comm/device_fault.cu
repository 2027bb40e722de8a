#include "tests/spawn/comm/device_fault.h"

#include <cuda_runtime_api.h>

namespace tandem::testing {
namespace {

__global__ void WriteThroughNull(volatile int* p) { p[2] = 1; }

}  // namespace

void LaunchFaultingKernel(CUstream_st* stream) {
  WriteThroughNull<<<1, 1, 0, stream>>>(nullptr);
}

}  // namespace tandem::testing
