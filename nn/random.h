// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// Element i of a draw uses the counter (offset + i), so a tensor's values do not
// depend on which device or how many threads produce them: one seed gives the
// same numbers on the CPU and on a GPU. Each thread owns its generator
// (spawn seeds rank r's with (seed, stream = r)), so ranks never share state.
#ifndef TANDEM_NN_RANDOM_H_
#define TANDEM_NN_RANDOM_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TANDEM_HOST_DEVICE inline
#endif

namespace tandem::nn {

struct Philox4x32 {
  uint32_t out[4];
};

// Philox4x32-10 of counter (c0..c3) under key (k0, k1).
TANDEM_HOST_DEVICE Philox4x32 Philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                     uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// The four words for element `index` of a draw starting at `offset` on `stream`.
TANDEM_HOST_DEVICE Philox4x32 PhiloxAt(uint64_t seed, uint64_t stream, uint64_t offset,
                                       uint64_t index) {
  const uint64_t counter = offset + index;
  return Philox(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32),
                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Uniform in [0, 1) with 24 random bits (exactly representable in float).
TANDEM_HOST_DEVICE float UniformFromBits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// Standard normal by Box-Muller from two words, computed in double so CPU and GPU agree.
TANDEM_HOST_DEVICE double NormalFromBits(uint32_t a, uint32_t b) {
  const double u1 = (static_cast<double>(a >> 8) + 1.0) * (1.0 / 16777217.0);  // (0, 1]
  const double u2 = static_cast<double>(b >> 8) * (1.0 / 16777216.0);
  return ::sqrt(-2.0 * ::log(u1)) * ::cos(6.283185307179586 * u2);
}

// A thread's random stream: (seed, stream) fixed, offset advanced by each draw.
struct Generator {
  uint64_t seed = 0;
  uint64_t stream = 0;
  uint64_t offset = 0;

  // Reserves `count` counters and returns the first.
  uint64_t Advance(uint64_t count) {
    const uint64_t first = offset;
    offset += count;
    return first;
  }
};

// The calling thread's generator (seed 0, stream 0 until seeded).
Generator& thread_generator();
// Seeds the calling thread's generator (offset reset to 0).
void manual_seed(uint64_t seed, uint64_t stream = 0);

}  // namespace tandem::nn

#endif  // TANDEM_NN_RANDOM_H_
