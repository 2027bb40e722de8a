// oneDNN's runtime for the CPU primitives (internal/dnnl_runtime.h): the engine,
// the per-thread streams and OpenMP team size, execution through the C API, and
// the per-thread scratch buffers of the calls' temporaries. Built only with
// TANDEM_WITH_DNNL.
#include "nn/ops/internal/dnnl_runtime.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdlib>

#include "nn/error.h"
#include "nn/ops/matmul.h"

namespace tandem::nn::ops::internal {
namespace {

// The calling thread's kept scratch buffers, a stack: blocks[0, top) are
// handed out to the live DnnlScratch scopes.
struct ScratchStack {
  struct Block {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::array<Block, DnnlScratch::kKeptBuffers> blocks;
  int top = 0;
  const DnnlScratch* innermost = nullptr;

  ScratchStack() = default;
  ScratchStack(const ScratchStack&) = delete;
  ScratchStack& operator=(const ScratchStack&) = delete;
  ~ScratchStack() {
    for (Block& block : blocks) std::free(block.data);
  }
};

ScratchStack& ThreadScratch() {
  thread_local ScratchStack stack;
  return stack;
}

}  // namespace

const dnnl::engine& DnnlEngine() {
  static const dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// oneDNN CPU streams are in-order and cheap; one per thread keeps rank threads
// independent.
dnnl::stream& DnnlStream() {
  thread_local dnnl::stream stream(DnnlEngine());
  return stream;
}

int DnnlUseThreads() {
  const int threads = std::max(1, cpu_blas_threads());
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
  return threads;
}

Tensor DnnlBuffer(const dnnl::memory::desc& desc, DType dtype) {
  const int64_t bytes = static_cast<int64_t>(desc.get_size());
  const int64_t size = ElementSize(dtype);
  return empty({(bytes + size - 1) / size}, {.dtype = dtype, .device = Device::CPU()});
}

void DnnlExecute(const dnnl::primitive& primitive, std::span<const dnnl_exec_arg_t> args,
                 const char* what) {
  const dnnl_status_t status = dnnl_primitive_execute(
      primitive.get(), DnnlStream().get(), static_cast<int>(args.size()), args.data());
  TANDEM_CHECK(status == dnnl_success, what, ": oneDNN failed to execute a primitive (status ",
               static_cast<int>(status), ")");
}

DnnlScratch::DnnlScratch() : base_(ThreadScratch().top), outer_(ThreadScratch().innermost) {
  ThreadScratch().innermost = this;
}

DnnlScratch::~DnnlScratch() {
  ScratchStack& stack = ThreadScratch();
  stack.top = base_;
  stack.innermost = outer_;
}

void* DnnlScratch::Get(size_t bytes) {
  ScratchStack& stack = ThreadScratch();
  TANDEM_CHECK(stack.innermost == this,
               "DnnlScratch::Get on a scope that is not the thread's innermost one");
  if (bytes == 0) return nullptr;
  if (bytes > kKeptBytes || stack.top >= kKeptBuffers) {
    const int64_t floats = static_cast<int64_t>((bytes + 3) / 4);
    own_.push_back(empty({floats}, {.dtype = kFloat32, .device = Device::CPU()}));
    return own_.back().host_ptr();
  }
  ScratchStack::Block& block = stack.blocks[stack.top];
  if (block.bytes < bytes) {
    // Powers of two from 4 KiB: a block that serves several shapes' temporaries
    // is reallocated a few times, not on every larger request.
    size_t rounded = 4096;
    while (rounded < bytes) rounded *= 2;
    void* data = std::aligned_alloc(64, rounded);
    TANDEM_CHECK(data != nullptr, "out of host memory allocating ", rounded,
                 " bytes of oneDNN scratch");
    std::free(block.data);
    block = {data, rounded};
  }
  ++stack.top;
  return block.data;
}

}  // namespace tandem::nn::ops::internal
