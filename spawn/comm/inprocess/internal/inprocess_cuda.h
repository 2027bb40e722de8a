// CUDA side of the in-process communicator (ranks sharing one GPU). Compiled only
// with TANDEM_WITH_CUDA (spawn/inprocess_cuda.cu). Internal to spawn.
//
// Protocol for each collective, per rank r on its compute stream s_r:
//   1. RecordEvent(e_r, s_r) after r's inputs are ready; publish; host barrier.
//   2. s_r waits for every e_k; r's kernel reads every rank's buffer and writes
//      its slice (or its own output); RecordEvent(e_r, s_r); host barrier.
//   3. s_r waits for every e_k, so no rank reuses a buffer another still reads.
#ifndef TANDEM_SPAWN_COMM_INPROCESS_INTERNAL_INPROCESS_CUDA_H_
#define TANDEM_SPAWN_COMM_INPROCESS_INTERNAL_INPROCESS_CUDA_H_

#include <cstdint>
#include <vector>

#include "nn/device.h"
#include "nn/dtype.h"

namespace tandem::dist::internal {

void* CreateEvent(nn::Device device);
void DestroyEvent(void* event, nn::Device device);
// Records `event` on the calling thread's compute stream for `device`.
void RecordEvent(void* event, nn::Device device);
// Makes the calling thread's compute stream wait for each event.
void WaitEvents(const std::vector<void*>& events, nn::Device device);

// Elements [begin, end) of out[k] (k = 0..n-1) set to the reduction over k of
// in[k], combining in order k = 0, 1, ... (op: 0 sum, 1 avg, 2 max).
void ReduceSliceCuda(const std::vector<const void*>& in, const std::vector<void*>& out,
                     int64_t begin, int64_t end, nn::DType dtype, int op, nn::Device device);
// Device-to-device copy of `bytes` on the calling thread's compute stream.
void CopyCuda(void* dst, const void* src, int64_t bytes, nn::Device device);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_INPROCESS_INTERNAL_INPROCESS_CUDA_H_
