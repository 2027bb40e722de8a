// Dropout: argument checks, the generator draw, device dispatch and autograd.
#include "nn/ops/dropout.h"

#include "nn/autograd.h"
#include "nn/graph.h"
#include "nn/ops/internal/dispatch.h"
#include "nn/ops/internal/dropout_kernels.h"
#include "nn/random.h"

namespace tandem::nn {

Tensor dropout(const Tensor& x, double p, bool training) {
  CheckDefined(x, "dropout", "x");
  TANDEM_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got ", p, " for ",
               x.ToString());
  if (!training || p == 0.0) return x;
  TANDEM_CHECK(IsFloating(x.dtype()),
               "dropout: expected a float32, float64 or bfloat16 tensor, got ", x.ToString());
  Generator& gen = thread_generator();
  const double scale = 1.0 / (1.0 - p);
  Tensor y = empty_like(x);
  Tensor mask = empty(x.shape(), {.dtype = kUInt8, .device = x.device()});
#if TANDEM_WITH_CUDA
  if (x.is_cuda() && CudaGraph::IsCapturing()) {
    // Captured: the offset baked into the graph would give every replay the
    // same mask. Instead the kernel reads it from device memory (from the
    // graph's arena), and before every replay a hook reserves the counters on
    // the replaying thread's generator, in the order of the step's draws, as
    // an eager step would; nothing is reserved now.
    const uint64_t n = static_cast<uint64_t>(x.numel());
    Tensor slot = empty({1}, {.dtype = kInt64, .device = x.device()});
    auto* offset_on_device = static_cast<uint64_t*>(slot.data_ptr());
    const Device device = x.device();
    CudaGraph::AddPreReplayHook([slot, offset_on_device, n, device] {
      (void)slot;  // held: the arena memory the graph reads
      ops::internal::DropoutWriteOffsetCuda(offset_on_device, thread_generator().Advance(n), device);
    });
    if (n > 0) {
      ops::internal::DropoutForwardCuda(x, y, mask, static_cast<float>(p), scale, gen.seed,
                                        gen.stream, 0, offset_on_device);
    }
  } else
#endif
  {
    const uint64_t offset = gen.Advance(static_cast<uint64_t>(x.numel()));
    if (x.numel() > 0) {
      TANDEM_ON_DEVICE(x, ops::internal::DropoutForward, x, y, mask, static_cast<float>(p), scale,
                       gen.seed, gen.stream, offset);
    }
  }
  return autograd::Record("dropout", {x}, y, [mask, scale](const Tensor& gy) {
    Tensor gx = empty_like(gy);
    if (gy.numel() > 0) TANDEM_ON_DEVICE(gy, ops::internal::DropoutBackward, gy, mask, gx, scale);
    return std::vector<Tensor>{gx};
  });
}

}  // namespace tandem::nn
