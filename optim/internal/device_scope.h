// The device an optimizer's launch belongs to, current for a scope: a group
// (or clip_grad_norm_'s gradients) may span CUDA devices, and each kernel and
// its stream belong to the current one. No device switch where it is current
// already (the common case: one device per rank).
#ifndef TANDEM_OPTIM_INTERNAL_DEVICE_SCOPE_H_
#define TANDEM_OPTIM_INTERNAL_DEVICE_SCOPE_H_

#include <optional>

#include "nn/device.h"

namespace tandem::optim::internal {

class DeviceScope {
 public:
  explicit DeviceScope(nn::Device device) {
    if (!(device == nn::current_device())) guard_.emplace(device);
  }

 private:
  std::optional<nn::DeviceGuard> guard_;
};

}  // namespace tandem::optim::internal

#endif  // TANDEM_OPTIM_INTERNAL_DEVICE_SCOPE_H_
