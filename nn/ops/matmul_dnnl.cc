// bfloat16 CPU GEMMs on oneDNN's matmul primitive (bfloat16 operands, float32
// accumulation and a float32 result, which matmul_cpu.cc rounds to bfloat16 once
// after the bias and relu), where CpuBf16Native(): the CPU has avx512_bf16 or
// AMX and tandem is built with oneDNN. Every GEMM of the matmul family goes
// through it: matmul, linear's forward (x W^T) and both of its gradients (dy W,
// dy^T x). Transposed operands are strided views (no copies); one primitive per
// shape, transposition and thread count, cached per thread as conv_dnnl.cc's,
// with the memory objects of its operands (a call creates no oneDNN objects).
// Determinism: the primitive is chosen from the shape, the ISA and the thread
// count, and oneDNN 2.6's CPU matmul splits work statically, so the same inputs
// and thread count give the same bits.
#include <dnnl.hpp>
#include <tuple>

#include "nn/error.h"
#include "nn/ops/internal/dnnl_runtime.h"
#include "nn/ops/internal/lru_cache.h"
#include "nn/ops/internal/matmul_kernels.h"
#include "nn/ops/matmul.h"

namespace tandem::nn::ops::internal {
namespace {

using dnnl::memory;
using DataType = memory::data_type;

struct Key {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  int threads;
  auto Tie() const { return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldc, threads); }
  bool operator<(const Key& other) const { return Tie() < other.Tie(); }
};

// The primitive with its operands' memory objects, pointed at each call's
// buffers (set_data_handle), so that a call creates no oneDNN objects.
struct Entry {
  dnnl::matmul primitive;
  memory::desc a, b, c, scratchpad;
  memory a_memory, b_memory, c_memory, scratchpad_memory;
  size_t scratchpad_bytes = 0;
};

// Row-major a (m x k, or k x m stored when trans_a), b (k x n, or n x k stored
// when trans_b) and c (m x n), as oneDNN's strided descriptions.
Entry MakeEntry(const Key& key) {
  Entry e;
  e.a = memory::desc({key.m, key.k}, DataType::bf16,
                     key.trans_a ? memory::dims{1, key.lda} : memory::dims{key.lda, 1});
  e.b = memory::desc({key.k, key.n}, DataType::bf16,
                     key.trans_b ? memory::dims{1, key.ldb} : memory::dims{key.ldb, 1});
  e.c = memory::desc({key.m, key.n}, DataType::f32, memory::dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e.a, e.b, e.c), attr, DnnlEngine());
  e.primitive = dnnl::matmul(pd);
  e.scratchpad = pd.scratchpad_desc();
  e.scratchpad_bytes = e.scratchpad.get_size();
  const dnnl::engine& engine = DnnlEngine();
  e.a_memory = memory(e.a, engine, DNNL_MEMORY_NONE);
  e.b_memory = memory(e.b, engine, DNNL_MEMORY_NONE);
  e.c_memory = memory(e.c, engine, DNNL_MEMORY_NONE);
  e.scratchpad_memory = memory(e.scratchpad, engine, DNNL_MEMORY_NONE);
  return e;
}

// One JIT-compiled primitive per shape (~9 ms and ~70 KB each): a network's few
// shapes stay; a stream of distinct row counts (variable batches) drops the
// least recently used. No lock: one cache per thread.
LruCache<Key, Entry>& ThreadCache() {
  thread_local LruCache<Key, Entry> cache;
  return cache;
}

}  // namespace

size_t GemmBf16DnnlCacheSize() { return ThreadCache().size(); }

void GemmBf16Dnnl(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const BFloat16* a,
                  int64_t lda, const BFloat16* b, int64_t ldb, float* c, int64_t ldc) {
  TANDEM_CHECK(m > 0 && n > 0 && k > 0, "gemm: bfloat16 oneDNN GEMM needs m, n, k > 0, got m ",
               m, ", n ", n, ", k ", k);
  const Key key{trans_a, trans_b, m, n, k, lda, ldb, ldc, DnnlUseThreads()};
  Entry& e = *ThreadCache().Get(key, cpu_primitive_cache_capacity, [&] { return MakeEntry(key); });
  DnnlScratch scratch;
  e.a_memory.set_data_handle(const_cast<BFloat16*>(a));
  e.b_memory.set_data_handle(const_cast<BFloat16*>(b));
  e.c_memory.set_data_handle(c);
  e.scratchpad_memory.set_data_handle(scratch.Get(e.scratchpad_bytes));
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, e.a_memory.get()},
                                  {DNNL_ARG_WEIGHTS, e.b_memory.get()},
                                  {DNNL_ARG_DST, e.c_memory.get()},
                                  {DNNL_ARG_SCRATCHPAD, e.scratchpad_memory.get()}};
  DnnlExecute(e.primitive, args, "gemm: bfloat16 oneDNN matmul");
  DnnlStream().wait();
}

}  // namespace tandem::nn::ops::internal
