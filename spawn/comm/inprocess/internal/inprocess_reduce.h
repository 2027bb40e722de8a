// CPU loops of the in-process communicator (spawn/comm/inprocess/inprocess_communicator.cc).
// Internal to spawn.
//
// The reduction order is part of the contract: element i of the result is
//   ((in[0][i] op in[1][i]) op in[2][i]) op ... op in[n-1][i]
// evaluated left to right in the element type (bfloat16 and float16: in
// float32, rounded to the 16-bit type once at the end), then, for avg, divided by n (integer division for
// int64). Any split of [begin, end) between threads gives the same bits.
#ifndef TANDEM_SPAWN_COMM_INPROCESS_INTERNAL_INPROCESS_REDUCE_H_
#define TANDEM_SPAWN_COMM_INPROCESS_INTERNAL_INPROCESS_REDUCE_H_

#include <cstdint>

#include "nn/dtype.h"

namespace tandem::dist::internal {

// op: 0 sum, 1 avg, 2 max (the values of dist::ReduceOp).
// Elements [begin, end) of every out[j] (j < n_out) get the reduction of in[0..n_in).
// An out[j] may be the same buffer as an in[k] (in-place all-reduce): each
// element is read before it is written. Works through [begin, end) in blocks that
// stay in the L1 cache, so the inputs are read from memory once and each output
// written once. Returns false (and writes nothing) for a dtype it does not reduce
// (float32, float64, bfloat16, float16 and int64 are reduced).
bool ReduceCpu(const void* const* in, int n_in, void* const* out, int n_out, int64_t begin,
               int64_t end, nn::DType dtype, int op);

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_INPROCESS_INTERNAL_INPROCESS_REDUCE_H_
