#include "nn/device.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "nn/error.h"
#include "nn/internal/cuda_runtime.h"

namespace tandem::nn {
namespace {
thread_local Device t_current_device = Device::CPU();
}  // namespace

std::string Device::ToString() const {
  return is_cpu() ? std::string("cpu") : absl::StrCat("cuda:", index);
}

absl::StatusOr<Device> ParseDevice(absl::string_view text) {
  if (text == "cpu") return Device::CPU();
  if (text == "cuda") return Device::CUDA(0);
  absl::string_view rest = text;
  int index = -1;
  if (absl::ConsumePrefix(&rest, "cuda:") && absl::SimpleAtoi(rest, &index) && index >= 0) {
    return Device::CUDA(index);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("bad device '", text, "': expected cpu, cuda or cuda:N"));
}

Device current_device() { return t_current_device; }

DeviceGuard::DeviceGuard(Device device) : previous_(t_current_device) {
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) internal::CudaSetDevice(device.index);
#endif
  t_current_device = device;
}

DeviceGuard::~DeviceGuard() {
#if TANDEM_WITH_CUDA
  if (previous_.is_cuda()) internal::CudaSetDevice(previous_.index);
#endif
  t_current_device = previous_;
}

void SetThreadCudaDevice(Device device) {
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) internal::CudaSetDevice(device.index);
#else
  (void)device;
#endif
}

bool cuda_built() { return TANDEM_WITH_CUDA != 0; }

int cuda_device_count() {
#if TANDEM_WITH_CUDA
  return internal::CudaDeviceCount();
#else
  return 0;
#endif
}

std::string cuda_device_uuid(int index) {
#if TANDEM_WITH_CUDA
  return internal::CudaDeviceUuid(index);
#else
  (void)index;
  return "";
#endif
}

void Synchronize(Device device) {
  if (device.is_cpu()) return;
#if TANDEM_WITH_CUDA
  const int count = internal::CudaDeviceCount();
  TANDEM_CHECK(device.index >= 0 && device.index < count, "Synchronize: ", device.ToString(),
               " is not visible (", count, " CUDA devices)");
  internal::CudaSynchronize(device);
#else
  Fail("Synchronize: ", device.ToString(), ": tandem was built without CUDA");
#endif
}

}  // namespace tandem::nn
