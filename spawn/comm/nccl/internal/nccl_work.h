// The event pool of a NCCL communicator's device and the handle of its
// asynchronous collectives (NcclWork, nccl_work.cc), apart from the
// communicator itself (nccl_communicator.cc). Compiled only with CUDA; includes
// the CUDA runtime header, not nccl.h. Internal to spawn/comm/nccl.
#ifndef TANDEM_SPAWN_COMM_NCCL_INTERNAL_NCCL_WORK_H_
#define TANDEM_SPAWN_COMM_NCCL_INTERNAL_NCCL_WORK_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "nn/cuda/context.h"
#include "nn/device.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist::internal {

// The event calls of the NCCL communicator and its handles, counted
// (nn/cuda/internal/call_counter.h).
inline cudaError_t EventCreate(cudaEvent_t* event) {
  nn::internal::CountCudaCall(nn::internal::CudaCall::kEventCreate);
  return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
}
inline cudaError_t EventRecord(cudaEvent_t event, cudaStream_t stream) {
  nn::internal::CountCudaCall(nn::internal::CudaCall::kEventRecord);
  return cudaEventRecord(event, stream);
}
inline cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags) {
  nn::internal::CountCudaCall(nn::internal::CudaCall::kStreamWaitEvent);
  return cudaStreamWaitEvent(stream, event, flags);
}

// Events of one communicator's device, made once and reused: a collective
// costs no cudaEventCreate / cudaEventDestroy. Shared by the communicator and
// the handles of its asynchronous collectives (which may outlive it).
// Thread-safe.
class EventPool {
 public:
  explicit EventPool(nn::Device device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t event : free_) cudaEventDestroy(event);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  cudaEvent_t Take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t event = free_.back();
        free_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    nn::internal::CudaDeviceScope on_device(device_);
    TANDEM_CHECK_CUDA(EventCreate(&event), device_);
    return event;
  }
  // `event` may be recorded again at once: a wait already enqueued on it keeps
  // the state it had when it was enqueued.
  void Give(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(event);
  }

 private:
  const nn::Device device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// The handle of an asynchronous collective just queued on a communication
// stream of `device`: `done` (taken from `pool`, given back when the handle
// goes) was recorded after it there; `capture` is nn::CudaGraph::CaptureId()
// when it was queued (0: eager). See nccl_work.cc.
std::shared_ptr<Work> MakeNcclWork(cudaEvent_t done, nn::Device device,
                                   std::shared_ptr<EventPool> pool, uint64_t capture);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_NCCL_INTERNAL_NCCL_WORK_H_
