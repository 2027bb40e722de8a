// oneDNN's engine, per-thread streams, thread count and scratch buffers, shared
// by the files that run oneDNN primitives (conv_dnnl.cc, pool_dnnl.cc,
// matmul_dnnl.cc). Internal to nn; included
// only by files built with TANDEM_WITH_DNNL (it includes dnnl.hpp).
#ifndef TANDEM_NN_OPS_INTERNAL_DNNL_RUNTIME_H_
#define TANDEM_NN_OPS_INTERNAL_DNNL_RUNTIME_H_

#include <dnnl.hpp>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// The process's CPU engine (created on first use, never destroyed).
const dnnl::engine& DnnlEngine();
// The calling thread's in-order CPU stream.
dnnl::stream& DnnlStream();
// Sets the calling thread's OpenMP team size to nn::cpu_blas_threads() and
// returns it (part of every primitive cache key).
int DnnlUseThreads();
// A host buffer of `desc`'s size (a primitive's scratchpad) from the host
// allocator's cache, of float32 elements.
Tensor DnnlBuffer(const dnnl::memory::desc& desc);

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_DNNL_RUNTIME_H_
