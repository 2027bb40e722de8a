// A kernel that faults on purpose, for tests of how a CUDA error on the device
// is reported (tests/spawn/comm/device_fault.cu). Use it only in a process of
// its own: the fault is sticky, every later CUDA call of the process fails.
#ifndef TANDEM_TESTS_SPAWN_COMM_DEVICE_FAULT_H_
#define TANDEM_TESTS_SPAWN_COMM_DEVICE_FAULT_H_

struct CUstream_st;

namespace tandem::testing {

// Enqueues on `stream` one thread that writes through a null pointer: when it
// runs, the context gets cudaErrorIllegalAddress. The launch itself succeeds.
void LaunchFaultingKernel(CUstream_st* stream);

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_SPAWN_COMM_DEVICE_FAULT_H_
