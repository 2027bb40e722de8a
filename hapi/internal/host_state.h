// Internal to hapi (model.cc, save_load.cc): the host copies a Model keeps
// between calls. Not installed for other folders' use.
#ifndef TANDEM_HAPI_INTERNAL_HOST_STATE_H_
#define TANDEM_HAPI_INTERNAL_HOST_STATE_H_

#include "nn/module.h"
#include "nn/tensor.h"

namespace tandem::hapi::internal {

// A host copy of `t`, detached from autograd (a clone when it is on the host already).
nn::Tensor HostCopy(const nn::Tensor& t);
// Host copies of the module's parameters and buffers.
nn::StateDict HostState(const nn::Module& module);

}  // namespace tandem::hapi::internal

#endif  // TANDEM_HAPI_INTERNAL_HOST_STATE_H_
