// Winograd F(4x4, 3x3) convolutions on the CPU (internal/conv_kernels.h).
//
// A 3x3 convolution at stride 1 computes each 4x4 block of outputs from a 6x6
// input patch. In the transformed domain that is one product per position of a
// 6x6 grid instead of 9 per output: per position p, the output channels of
// every tile are a matrix product over the input channels,
//   M[p] (o, tiles) = U[p] (o, c) V[p] (c, tiles),
// 36 GEMMs with a quarter of the direct convolution's multiply-adds (36 instead
// of 144 per tile and channel pair), between transforms that are passes over
// memory (the filters' transform U is 4x the weights, V 2.25x the input).
// The data gradient is the same convolution of dy with the filters turned by
// 180 degrees and their channels swapped (padding 2 - p); the filter gradient
// is the adjoint: dU[p] (o, c) = dM[p] (o, tiles) V[p]^T, then G^T dU G.
//
// Images go in chunks whose transformed tiles (V and M) stay within a few MiB, so the
// GEMMs read what the transforms wrote while it is still in cache. The transforms split
// channels over the rank's OpenMP team (ParallelFor); the 36 GEMMs (GemmRaw<float>:
// oneDNN's sgemm where tandem is built with it, else OpenBLAS's) split the positions
// over the team where that pays (ForPositions). Rounding: F(4x4, 3x3)'s transforms
// multiply by up to 8 and divide by 24, so results carry roughly ten times the float32
// error of a direct convolution (about 1e-5 of the largest value against float64 on
// ResNet's layers; conv_winograd_test bounds it at 2e-5). A non-finite input value can
// make non-finite the whole 4x4 block of outputs of each tile whose 6x6 patch holds it
// (the transforms mix the patch), more than the 3x3 window around it that a direct
// convolution spoils.
// Results repeat bit for bit at a fixed instruction set and thread count.
#include <algorithm>
#include <atomic>
#include <exception>
#include <new>
#include <utility>
#include <vector>

#include "nn/error.h"
#include "nn/ops/cpu_settings.h"  // cpu_blas_threads
#include "nn/ops/internal/conv_kernels.h"
#include "nn/ops/internal/cpu_isa.h"
#include "nn/ops/internal/cpu_parallel.h"
#include "nn/ops/internal/elementwise_kernels.h"  // ApplyUnary (relu)
#include "nn/ops/internal/matmul_kernels.h"

namespace tandem::nn::ops::internal {
namespace {

// Sizes of one transform: a plane (h, w) read or written, the padding of the
// tiles' origin, the tile grid (th, tw) of 4x4 outputs, `count` images.
struct TileGrid {
  int64_t h, w, ph, pw, th, tw, count;
};

#define TANDEM_CPU_ISA_KERNELS "nn/ops/conv_winograd_kernels.inc"
#include "nn/ops/internal/cpu_isa_builds.inc"

constexpr int64_t kPositions = 36;  // the 6x6 transformed tile

// Bytes of the larger of V and M per chunk of images: 4 MiB, about what the
// transforms and the GEMMs of a chunk share through the caches.
constexpr int64_t kChunkBytes = int64_t{4} << 20;

// The tile grid of an (oh, ow) output and the chunks of n images its
// transforms go in, for `channels` (the larger side's) transformed rows.
struct Chunks {
  int64_t th, tw;  // tiles per column and row of an image
  int64_t images;  // images per chunk
  int64_t ld;      // rows of V and M: one chunk's tiles
};
Chunks ChunksOf(int64_t n, int64_t channels, int64_t oh, int64_t ow) {
  Chunks c{.th = (oh + 3) / 4, .tw = (ow + 3) / 4};
  const int64_t per_image = kPositions * channels * c.th * c.tw * int64_t{sizeof(float)};
  c.images = std::clamp<int64_t>(kChunkBytes / std::max<int64_t>(per_image, 1), 1,
                                 std::max<int64_t>(n, 1));
  c.ld = c.images * c.th * c.tw;
  return c;
}

// Channels per ParallelFor range: enough work per thread to pay for the split.
constexpr int64_t kMinChannelsPerRange = 4;

// ParallelFor for work that may throw (a scratch buffer that fails to allocate,
// a failed GEMM): an exception cannot leave the OpenMP region, so the first one
// is kept there and rethrown after it.
template <typename Fn>
void ParallelForRethrow(int64_t n, int64_t min_per_range, Fn&& fn) {
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  ParallelFor(n, min_per_range, [&](int64_t begin, int64_t end) {
    try {
      fn(begin, end);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  });
  if (!error) return;
  try {
    std::rethrow_exception(error);
  } catch (const std::bad_alloc&) {
    TANDEM_CHECK(false, "conv2d: out of host memory for the Winograd kernels' scratch buffers");
  }
}

// A transform over n channels, split over the rank's threads.
template <typename Fn>
void ForChannels(int64_t n, Fn&& fn) {
  ParallelForRethrow(n, kMinChannelsPerRange, std::forward<Fn>(fn));
}

// Up to this many threads the 36 GEMMs are split by position (at least 75% of
// the threads busy: 36 = 12 x 3); beyond it each GEMM is split over the team.
// Measured at 2 threads only.
constexpr int kMaxThreadsForPositionSplit = 12;

// fn(p) for the 36 positions' GEMMs. Where GemmRaw<float> runs on oneDNN and the
// rank has 2 to kMaxThreadsForPositionSplit threads, the positions are split
// over them, each GEMM whole on one thread (dnnl_sgemm inside an OpenMP region
// runs on the calling thread): one fork and join per chunk instead of one per
// GEMM, 1-10% faster per ResNet-18 layer at 2 threads (docs/benchmarks.md).
// Elsewhere (OpenBLAS, whose pthread build would start its own threads in every
// team thread) the GEMMs run one after the other, each on all the threads.
template <typename Fn>
void ForPositions(Fn&& fn) {
  const int threads = cpu_blas_threads();
  if (!CpuGemmUsesDnnl() || threads < 2 || threads > kMaxThreadsForPositionSplit) {
    for (int64_t p = 0; p < kPositions; ++p) fn(p);
    return;
  }
  ParallelForRethrow(kPositions, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) fn(p);
  });
}

const float* F32(const Tensor& t) { return t.defined() ? t.host_data<float>() : nullptr; }

// y (n, out_channels, oh, ow) = the convolution of x (n, in_channels, h, w) at
// padding (ph, pw) whose filters are u (36, out_channels, in_channels), plus
// bias (out_channels, or null), relu'd where `relu`.
void Convolve(const float* x, int64_t n, int64_t in_channels, int64_t h, int64_t w, int64_t ph,
              int64_t pw, const float* u, int64_t out_channels, int64_t oh, int64_t ow,
              const float* bias, bool relu, float* y) {
  // Named copies, not structured bindings: the lambdas below capture them, which
  // C++20 allows but clang before 16 rejects.
  const Chunks chunks = ChunksOf(n, std::max(in_channels, out_channels), oh, ow);
  const int64_t th = chunks.th, tw = chunks.tw, chunk = chunks.images, ld = chunks.ld;
  const TensorOptions host{.dtype = kFloat32, .device = Device::CPU()};
  const Tensor v_buffer = empty({kPositions * in_channels * ld}, host);
  const Tensor m_buffer = empty({kPositions * out_channels * ld}, host);
  float* v = v_buffer.host_data<float>();
  float* m = m_buffer.host_data<float>();
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t count = std::min(chunk, n - first), tiles = count * th * tw;
    const TileGrid in{h, w, ph, pw, th, tw, count};
    const float* x_chunk = x + first * in_channels * h * w;
    ForChannels(in_channels, [&](int64_t begin, int64_t end) {
      TANDEM_CPU_ISA_KERNEL(InputTransform)(x_chunk, in_channels, in, begin, end, v, ld);
    });
    ForPositions([&](int64_t p) {
      GemmRaw<float>(false, false, out_channels, tiles, in_channels, 1.0f,
                     u + p * out_channels * in_channels, in_channels, v + p * in_channels * ld, ld,
                     0.0f, m + p * out_channels * ld, ld);
    });
    const TileGrid out{oh, ow, 0, 0, th, tw, count};
    float* y_chunk = y + first * out_channels * oh * ow;
    ForChannels(out_channels, [&](int64_t begin, int64_t end) {
      TANDEM_CPU_ISA_KERNEL(OutputTransform)(m, ld, out_channels, out, bias, relu, begin, end,
                                             y_chunk);
    });
  }
}

// u (36, rows, cols) from weight (o, c, 3, 3): flip as WeightTransform's.
Tensor TransformedWeights(const Tensor& weight, const Conv2dGeometry& g, bool flip) {
  Tensor u = empty({kPositions * g.o * g.c}, {.dtype = kFloat32, .device = Device::CPU()});
  const float* w = weight.host_data<float>();
  float* pu = u.host_data<float>();
  ParallelFor(flip ? g.c : g.o, kMinChannelsPerRange, [&](int64_t begin, int64_t end) {
    TANDEM_CPU_ISA_KERNEL(WeightTransform)(w, g.o, g.c, flip, begin, end, pu);
  });
  return u;
}

}  // namespace

bool WinogradApplies(const Conv2dGeometry& g) {
  const Conv2dParams& p = g.params;
  return g.kh == 3 && g.kw == 3 && p.stride[0] == 1 && p.stride[1] == 1 &&
         p.dilation[0] == 1 && p.dilation[1] == 1 && p.groups == 1 && p.padding[0] <= 2 &&
         p.padding[1] <= 2 && g.n > 0 && g.c > 0 && g.o > 0 && g.h > 0 && g.w > 0 && g.oh > 0 &&
         g.ow > 0;
}

void Conv2dForwardWinograd(const Tensor& x, const Tensor& weight, const Tensor& bias,
                           const Conv2dGeometry& g, const Tensor& y, bool relu) {
  TANDEM_CHECK(WinogradApplies(g) && x.dtype() == kFloat32,
               "conv2d: the Winograd kernel takes float32 3x3 convolutions at stride 1");
  const Tensor u = TransformedWeights(weight, g, /*flip=*/false);
  Convolve(x.host_data<float>(), g.n, g.c, g.h, g.w, g.params.padding[0], g.params.padding[1],
           u.host_data<float>(), g.o, g.oh, g.ow, F32(bias), relu, y.host_data<float>());
}

void Conv2dBackwardDataWinograd(const Tensor& dy, const Tensor& weight, const Conv2dGeometry& g,
                                const Tensor& dx) {
  TANDEM_CHECK(WinogradApplies(g) && dy.dtype() == kFloat32,
               "conv2d backward: the Winograd kernel takes float32 3x3 convolutions at stride 1");
  const Tensor u = TransformedWeights(weight, g, /*flip=*/true);
  // dx = dy convolved with the turned filters at padding 2 - p: its output is (h, w).
  Convolve(dy.host_data<float>(), g.n, g.o, g.oh, g.ow, 2 - g.params.padding[0],
           2 - g.params.padding[1], u.host_data<float>(), g.c, g.h, g.w, nullptr,
           /*relu=*/false, dx.host_data<float>());
}

void Conv2dBackwardFilterWinograd(const Tensor& dy, const Tensor& x, const Conv2dGeometry& g,
                                  const Tensor& dweight) {
  TANDEM_CHECK(WinogradApplies(g) && dy.dtype() == kFloat32,
               "conv2d backward: the Winograd kernel takes float32 3x3 convolutions at stride 1");
  // Named copies, not structured bindings (captured below; see Convolve).
  const Chunks chunks = ChunksOf(g.n, std::max(g.c, g.o), g.oh, g.ow);
  const int64_t th = chunks.th, tw = chunks.tw, chunk = chunks.images, ld = chunks.ld;
  const TensorOptions host{.dtype = kFloat32, .device = Device::CPU()};
  const Tensor v_buffer = empty({kPositions * g.c * ld}, host);
  const Tensor dm_buffer = empty({kPositions * g.o * ld}, host);
  const Tensor du_buffer = empty({kPositions * g.o * g.c}, host);
  float* v = v_buffer.host_data<float>();
  float* dm = dm_buffer.host_data<float>();
  float* du = du_buffer.host_data<float>();
  const float* px = x.host_data<float>();
  const float* pdy = dy.host_data<float>();
  for (int64_t first = 0; first < g.n; first += chunk) {
    const int64_t count = std::min(chunk, g.n - first), tiles = count * th * tw;
    const TileGrid in{g.h, g.w, g.params.padding[0], g.params.padding[1], th, tw, count};
    const TileGrid out{g.oh, g.ow, 0, 0, th, tw, count};
    const float* x_chunk = px + first * g.c * g.h * g.w;
    const float* dy_chunk = pdy + first * g.o * g.oh * g.ow;
    ForChannels(g.c, [&](int64_t begin, int64_t end) {
      TANDEM_CPU_ISA_KERNEL(InputTransform)(x_chunk, g.c, in, begin, end, v, ld);
    });
    ForChannels(g.o, [&](int64_t begin, int64_t end) {
      TANDEM_CPU_ISA_KERNEL(OutputGradTransform)(dy_chunk, g.o, out, begin, end, dm, ld);
    });
    // dU[p] (o, c) (+)= dM[p] (o, tiles) V[p]^T (tiles, c).
    ForPositions([&](int64_t p) {
      GemmRaw<float>(false, true, g.o, g.c, tiles, 1.0f, dm + p * g.o * ld, ld,
                     v + p * g.c * ld, ld, first == 0 ? 0.0f : 1.0f, du + p * g.o * g.c, g.c);
    });
  }
  float* pdw = dweight.host_data<float>();
  ForChannels(g.o, [&](int64_t begin, int64_t end) {
    TANDEM_CPU_ISA_KERNEL(WeightGradTransform)(du, g.o, g.c, begin, end, pdw);
  });
}

}  // namespace tandem::nn::ops::internal
