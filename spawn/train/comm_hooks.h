// Gradient communication hooks: how DataParallel reduces a bucket
// (DataParallelOptions::comm_hook), after PyTorch's DDP register_comm_hook.
//
//   dist::DataParallel dp(net, ctx, {.comm_hook = dist::Bf16CompressHook()});
//   loss.backward();   // each bucket: cast to bfloat16, summed, cast back, / world size
//
// Inside DataParallel::join() the hook runs too, on the bucket scaled by
// n_r N / sum_r n_r (rank r's share of the step's samples times the world
// size N; exactly 1 with equal batches, 0 on a rank that has joined), so the
// mean it produces is the sample-weighted gradient; a joined rank calls the
// same hook on its zeroed bucket, answering the hook's collectives whatever
// they are. So a hook must make the same collectives (kind, shape, dtype,
// order) whatever the gradients hold, as the built-in ones do. The scaling
// can raise a rank's gradients up to N times (one rank with nearly all of a
// step's samples): Fp16CompressHook's range limit below applies to them.
//
// A hook is called on the backward thread when a bucket's last gradient is
// final (the same point as the default all-reduce, overlapping the rest of
// backward), with the bucket's flat buffer holding this rank's local gradients.
// It starts a collective and returns a BucketReduction: the collective's Work
// and where its result will be. DataParallel waits for the Work at the end of
// backward, then copies the result into the bucket (casting it to the bucket's
// dtype) and, unless the hook says it averaged, divides by the world size:
// DataParallel owns the divisor of the average, hooks reduce sums.
//
// Built-in hooks:
//   AllReduceHook      the default reduction: all_reduce_async(kAvg) in place
//                      (the same bits as DataParallel without a hook).
//   Bf16CompressHook   the bucket cast to bfloat16 (half the bytes on the
//                      wire), summed, cast back to float32 and divided. The
//                      in-process and cross-process (MPI) communicators add in
//                      float32 and round the sum once, so only the wire is
//                      compressed (the inputs and the sum are rounded to
//                      bfloat16); NCCL adds in bfloat16.
//   Fp16CompressHook   the same with IEEE float16 (10 mantissa bits against
//                      bfloat16's 7, so about 8x less rounding error, but a
//                      range of only +-65504): summed in float32 and rounded
//                      once in-process and across processes, in float16 by
//                      NCCL. A gradient element of magnitude 65520 or more,
//                      or a sum over the ranks that reaches it, becomes +-inf
//                      (and inf - inf NaN) and the step's gradient with it;
//                      nothing rescales the bucket (PyTorch's fp16_compress_hook
//                      has the same limit). Use bf16 or allreduce where
//                      gradients can be that large (unscaled losses summed over
//                      large batches). At the other end, magnitudes below
//                      2^-14 (6.1e-5) keep less precision (subnormal, steps of
//                      2^-24) and those up to 2^-25 (3e-8) become zero.
//
// Errors: a hook that returns no Work, or a result of the wrong size, dtype or
// device, throws tandem::Error naming the bucket and both sizes or dtypes, on
// the backward pass that launched it (the first one: before the first
// optimizer step), on every rank that runs the same hook.
//
// CUDA graphs: a hook that allocates (the compress hooks' casts) runs under
// capture only where its collective can be captured (NCCL); the in-process
// communicator cannot be captured at all (communicator.h).
//
// Thread-safety: a hook runs on its rank's thread; one hook object may be
// shared by every rank of a run if it keeps no state of its own (the built-in
// ones keep none).
#ifndef TANDEM_SPAWN_TRAIN_COMM_HOOKS_H_
#define TANDEM_SPAWN_TRAIN_COMM_HOOKS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/tensor.h"
#include "spawn/comm/communicator.h"

namespace tandem::dist {

// One gradient bucket of a DataParallel, as a hook sees it.
struct GradBucket {
  int index = 0;                     // 0 is the first bucket backward fills
  // buffer: (numel,) flat, every gradient of the bucket back to back, then
  // zeros up to a multiple of the world size (so that it splits evenly).
  nn::Tensor buffer;
  std::vector<nn::Tensor> params;    // the bucket's parameters, in buffer order
  std::vector<int64_t> offsets;      // where each parameter's gradient starts in buffer
  Communicator* comm = nullptr;      // this rank's
};

// What a hook returns: the bucket's reduction in flight.
struct BucketReduction {
  // The collective; DataParallel waits for it at the end of backward.
  std::shared_ptr<Work> work;
  // Where the reduced values will be once work is done: elements [begin, end)
  // of the bucket (end -1: the whole bucket), (end - begin,) in a floating
  // dtype on the bucket's device. Undefined: the hook reduced into the bucket's
  // buffer itself.
  nn::Tensor result;
  int64_t begin = 0;
  int64_t end = -1;
  // True: the result holds the mean over the ranks; false: their sum, which
  // DataParallel divides by the world size.
  bool averaged = false;
};

using CommHook = std::function<BucketReduction(GradBucket& bucket)>;

CommHook AllReduceHook();
CommHook Bf16CompressHook();
CommHook Fp16CompressHook();

namespace internal {

// The built-in hooks' function objects. ZeroRedundancyOptimizer finds them in a
// DataParallel's hook (std::function::target) and reduce-scatters with the same
// compression; it refuses any other hook.
struct AllReduceHookFn {
  BucketReduction operator()(GradBucket& bucket) const;
};
struct CompressHookFn {
  nn::DType wire;  // kBFloat16 or kFloat16
  BucketReduction operator()(GradBucket& bucket) const;
};

// Runs `hook` on `bucket` and returns the Work DataParallel keeps for it: its
// wait() waits for the hook's collective, then copies the result into the
// bucket and divides by the world size when the hook did not average. Checks
// the hook's answer now and throws tandem::Error naming what is wrong.
// *wire_bytes: the bytes of the tensor the hook reduces (its result's, or the
// range's of the bucket), for the trace.
std::shared_ptr<Work> LaunchCommHook(const CommHook& hook, GradBucket& bucket,
                                     int64_t* wire_bytes);

}  // namespace internal
}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_TRAIN_COMM_HOOKS_H_
