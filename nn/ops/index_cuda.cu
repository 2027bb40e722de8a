// CUDA kernels of the index family. index_select moves rows as raw words (the
// widest of 16/8/4/2/1 bytes that divides the row size and both base
// addresses), so one kernel serves every dtype; index_add (its backward) adds
// with atomicAdd. One launch each, int64 indexing, grid-stride loops, on the
// thread's stream, no host synchronisation. Indices are not range-checked on
// the device (see index.h).
#include <cstdint>

#include "nn/cuda/context.h"
#include "nn/ops/internal/index_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride beyond this
int64_t Blocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

// Word w of output row b is word w of source row indices[b].
template <typename Word>
__global__ void IndexSelectKernel(const Word* __restrict__ source,
                                  const int64_t* __restrict__ indices, Word* __restrict__ out,
                                  int64_t total_words, int64_t row_words) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total_words;
       i += stride) {
    const int64_t b = i / row_words;
    const int64_t w = i - b * row_words;
    out[i] = source[indices[b] * row_words + w];
  }
}

template <typename T>
__global__ void IndexAddKernel(const T* __restrict__ grad_out, const int64_t* __restrict__ indices,
                               T* grad_source, int64_t total, int64_t row) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += stride) {
    const int64_t b = i / row;
    const int64_t c = i - b * row;
    atomicAdd(grad_source + indices[b] * row + c, grad_out[i]);
  }
}

template <typename Word>
void LaunchSelect(const Tensor& source, const Tensor& indices, const Tensor& out,
                  int64_t row_bytes, cudaStream_t stream) {
  const int64_t row_words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t total_words = indices.size(0) * row_words;
  IndexSelectKernel<Word><<<Blocks(total_words), kThreads, 0, stream>>>(
      static_cast<const Word*>(source.data_ptr()), indices.data<int64_t>(),
      static_cast<Word*>(out.data_ptr()), total_words, row_words);
}

}  // namespace

void IndexSelectCuda(const Tensor& source, const Tensor& indices, const Tensor& out) {
  const int64_t count = indices.size(0);
  const int64_t row_bytes = out.nbytes() / count;  // out.numel() > 0, so count > 0
  cudaStream_t stream = nn::internal::ThreadStream(source.device());
  const uintptr_t bits = reinterpret_cast<uintptr_t>(source.data_ptr()) |
                         reinterpret_cast<uintptr_t>(out.data_ptr()) |
                         static_cast<uintptr_t>(row_bytes);
  if (bits % 16 == 0) {
    LaunchSelect<uint4>(source, indices, out, row_bytes, stream);
  } else if (bits % 8 == 0) {
    LaunchSelect<uint2>(source, indices, out, row_bytes, stream);
  } else if (bits % 4 == 0) {
    LaunchSelect<uint32_t>(source, indices, out, row_bytes, stream);
  } else if (bits % 2 == 0) {
    LaunchSelect<uint16_t>(source, indices, out, row_bytes, stream);
  } else {
    LaunchSelect<uint8_t>(source, indices, out, row_bytes, stream);
  }
  TANDEM_CHECK_LAUNCH("IndexSelectKernel", source.device());
}

void IndexAddCuda(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_source) {
  const int64_t total = grad_out.numel();
  const int64_t row = total / indices.size(0);  // total > 0, so indices is not empty
  cudaStream_t stream = nn::internal::ThreadStream(grad_out.device());
  TANDEM_DISPATCH_FLOAT(grad_out.dtype(), "index_select backward", [&]<typename T>() {
    IndexAddKernel<T><<<Blocks(total), kThreads, 0, stream>>>(
        grad_out.data<T>(), indices.data<int64_t>(), grad_source.data<T>(), total, row);
  });
  TANDEM_CHECK_LAUNCH("IndexAddKernel", grad_out.device());
}

}  // namespace tandem::nn::ops::internal
