// Where a tensor lives: the CPU or CUDA device N. Each thread has a current
// device (CPU unless set); factories and module constructors put new tensors
// there. spawn sets it for each rank's thread with DeviceGuard.
#ifndef TANDEM_NN_DEVICE_H_
#define TANDEM_NN_DEVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::nn {

struct Device {
  enum class Type : uint8_t { kCPU, kCUDA };
  Type type = Type::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static constexpr Device CPU() { return {Type::kCPU, 0}; }
  static constexpr Device CUDA(int index) { return {Type::kCUDA, index}; }
  bool is_cpu() const { return type == Type::kCPU; }
  bool is_cuda() const { return type == Type::kCUDA; }
  std::string ToString() const;  // "cpu" or "cuda:N"
  friend bool operator==(const Device&, const Device&) = default;
};

// Parses "cpu", "cuda" (= cuda:0) or "cuda:N".
absl::StatusOr<Device> ParseDevice(absl::string_view text);

// The calling thread's current device (CPU by default).
Device current_device();

// Sets the calling thread's current device for its lifetime (and, for CUDA,
// cudaSetDevice); restores the previous one on destruction.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  Device previous_;
};

// Makes `device` the CUDA runtime's current device of the calling thread for the
// rest of its life, without changing current_device() (new tensors still go to
// the CPU). For helper threads that reach CUDA only through nn's services, such
// as DataLoader workers collating into pinned memory (cudaHostAlloc,
// cudaEventQuery): a thread that never selects a device uses GPU 0, the
// runtime's default, and would create a context there even when the run uses
// other GPUs. A no-op for the CPU and in a build without CUDA. Throws
// tandem::Error when CUDA refuses the device.
void SetThreadCudaDevice(Device device);

// True when this binary was built with the CUDA backend.
bool cuda_built();

// Number of CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies).
// 0 when the binary was built without CUDA, when there is no driver, or no device:
// none of these is an error.
int cuda_device_count();

// The UUID of visible CUDA device `index` as nvidia-smi prints it
// ("GPU-8f2d3c1a-..."): the same physical GPU has the same UUID in every
// process, whatever CUDA_VISIBLE_DEVICES says. "" in a build without CUDA or
// when CUDA cannot say.
std::string cuda_device_uuid(int index);

// Waits until the work the calling thread has enqueued on `device` (its CUDA
// stream: ops and copies) is done, then raises a deferred device error of the
// device as tandem::Error, if a kernel reported one (e.g. "cross_entropy: target
// 12 of sample 3 is out of range [0, 10) on cuda:0"). Kernels report bad input
// that way instead of trapping, which would kill the CUDA context: the error
// surfaces at the next point where the host waits for the device (this call,
// Tensor::item(), a copy to the host), and the device stays usable afterwards.
// A no-op for the CPU. Throws tandem::Error for a CUDA device that is not
// visible or when tandem was built without CUDA. Like every host wait of nn
// (item(), copies to the host), it polls against the thread's interrupt check
// when one is installed (nn/interrupt.h; spawn installs one on rank threads) and
// throws what the check throws.
void Synchronize(Device device);

}  // namespace tandem::nn

#endif  // TANDEM_NN_DEVICE_H_
