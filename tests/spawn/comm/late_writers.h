// LateWriters: tensors whose values another thread writes late on its own CUDA
// stream, for the tests that a collective reads what a producer on another
// stream finally wrote (tests/spawn/comm/nccl_gpu_test.cc and
// nccl_two_process_gpu_test.cc). CUDA builds only.
#ifndef TANDEM_TESTS_SPAWN_COMM_LATE_WRITERS_H_
#define TANDEM_TESTS_SPAWN_COMM_LATE_WRITERS_H_

#include <cstdint>
#include <future>
#include <thread>
#include <vector>

#include "nn/device.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/ops/matmul.h"
#include "nn/tensor.h"

namespace tandem::dist::testing_support {

inline constexpr int64_t kLateElements = int64_t{1} << 22;  // 16 MiB of float32

// Enqueues tens of milliseconds of matmuls on the calling thread's stream of
// `device`: work queued after it runs late, so a reader on another stream that
// is not ordered after it runs first.
inline void Burn(nn::Device device) {
  nn::DeviceGuard guard(device);
  nn::Tensor a = nn::full({4096, 4096}, 1e-4);
  for (int i = 0; i < 24; ++i) a = nn::matmul(a, a);
}

// Makes tensors of kLateElements holding a value, each written on another
// thread's stream behind a Burn, after that thread left a freed block holding
// 7 at the head of its pool (a read that comes too early most likely sees 7
// there). The calling thread has a stream of its own on `device` first, so the
// other thread gets another one. The writing threads stay, idle, until this
// goes: a thread's exit runs its CUDA teardown (its cuBLASLt handle is
// destroyed; cublasDestroy synchronises the device, and cublasLtDestroy may),
// which would finish the late write before the collective and hide a missing
// order.
class LateWriters {
 public:
  LateWriters() = default;
  LateWriters(const LateWriters&) = delete;
  LateWriters& operator=(const LateWriters&) = delete;
  ~LateWriters() {
    release_.set_value();
    for (std::thread& t : threads_) t.join();
  }

  nn::Tensor Write(nn::Device device, float value) {
    nn::internal::CudaThreadStream(device);
    nn::Tensor made;
    std::promise<void> written;
    std::future<void> done = written.get_future();
    threads_.emplace_back(
        [&made, device, value, written = std::move(written), released = released_]() mutable {
          nn::DeviceGuard guard(device);
          {
            nn::Tensor junk = nn::full({kLateElements}, 7.0f);
            (void)junk.to_vector<float>();
          }
          Burn(device);
          made = nn::full({kLateElements}, value);
          written.set_value();
          released.wait();
        });
    done.wait();
    return made;
  }

 private:
  std::promise<void> release_;
  std::shared_future<void> released_ = release_.get_future().share();
  std::vector<std::thread> threads_;
};

}  // namespace tandem::dist::testing_support

#endif  // TANDEM_TESTS_SPAWN_COMM_LATE_WRITERS_H_
