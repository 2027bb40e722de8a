// oneDNN's engine, per-thread streams, thread count, scratch buffers and
// primitive execution, shared by the files that run oneDNN primitives
// (conv_dnnl.cc, pool_dnnl.cc, matmul_dnnl.cc; defined in dnnl_runtime.cc).
// Internal to nn; included only by files built with TANDEM_WITH_DNNL (it
// includes dnnl.hpp).
#ifndef TANDEM_NN_OPS_INTERNAL_DNNL_RUNTIME_H_
#define TANDEM_NN_OPS_INTERNAL_DNNL_RUNTIME_H_

#include <cstddef>
#include <dnnl.hpp>
#include <span>
#include <vector>

#include "nn/tensor.h"

namespace tandem::nn::ops::internal {

// The process's CPU engine (created on first use, never destroyed).
const dnnl::engine& DnnlEngine();
// The calling thread's in-order CPU stream.
dnnl::stream& DnnlStream();
// Sets the calling thread's OpenMP team size to nn::cpu_blas_threads() and
// returns it (part of every primitive cache key).
int DnnlUseThreads();
// A host buffer of `desc`'s size from the host allocator's cache, of float32
// elements (or `dtype`'s): for data that outlives a call (a copy kept for
// backward).
Tensor DnnlBuffer(const dnnl::memory::desc& desc, DType dtype = kFloat32);

// Executes `primitive` on the calling thread's stream with `args` (DNNL_ARG_*
// and memory handles), through the C API: primitive::execute builds a map and a
// vector of the arguments on every call. Does not wait (the caller waits on
// DnnlStream() once its primitives are queued). Throws tandem::Error naming
// `what` and oneDNN's status when the execution fails.
void DnnlExecute(const dnnl::primitive& primitive, std::span<const dnnl_exec_arg_t> args,
                 const char* what);

// The temporaries of one call (a primitive's scratchpad, reordered copies no
// later call reads) in host buffers the calling thread keeps from call to call,
// instead of a tensor allocated per call: what Get hands out while a scope lives
// is the thread's next free buffers, taken back when the scope ends. Scopes
// nest as automatic objects do; Get may be called on the innermost live scope
// of the thread only (checked). Bounded: a thread keeps at most kKeptBuffers
// buffers of at most kKeptBytes each; a larger request, or one past
// kKeptBuffers, gets a host tensor of its own, freed with the scope. One
// thread's object: not to be shared or moved between threads.
class DnnlScratch {
 public:
  static constexpr int kKeptBuffers = 12;
  static constexpr size_t kKeptBytes = size_t{1} << 20;

  DnnlScratch();
  ~DnnlScratch();
  DnnlScratch(const DnnlScratch&) = delete;
  DnnlScratch& operator=(const DnnlScratch&) = delete;

  // 64-byte aligned room for `bytes` bytes (contents undefined) until the
  // scope ends; nullptr for 0 bytes.
  void* Get(size_t bytes);

 private:
  int base_;                         // the thread's first free buffer when the scope began
  const DnnlScratch* outer_;         // the scope this one nests in, or null
  std::vector<Tensor> own_;          // requests beyond the bounds
};

}  // namespace tandem::nn::ops::internal

#endif  // TANDEM_NN_OPS_INTERNAL_DNNL_RUNTIME_H_
