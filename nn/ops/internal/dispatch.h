// TANDEM_ON_DEVICE(tensor, Name, args...): calls NameCpu(args...) or, for a CUDA
// tensor, NameCuda(args...). In a build without CUDA a CUDA tensor cannot exist
// (allocation fails first), so only the CPU branch is compiled there.
#ifndef TANDEM_NN_OPS_INTERNAL_DISPATCH_H_
#define TANDEM_NN_OPS_INTERNAL_DISPATCH_H_

#if TANDEM_WITH_CUDA
#define TANDEM_ON_DEVICE(t, Name, ...) \
  ((t).is_cuda() ? Name##Cuda(__VA_ARGS__) : Name##Cpu(__VA_ARGS__))
#else
#define TANDEM_ON_DEVICE(t, Name, ...) Name##Cpu(__VA_ARGS__)
#endif

#endif  // TANDEM_NN_OPS_INTERNAL_DISPATCH_H_
