#include "testing/seed.h"

#include "nn/ops/matmul.h"

namespace tandem::testing {
namespace {

// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijection that spreads
// every input bit over the output.
uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t DeriveSeed(uint64_t seed, std::initializer_list<uint64_t> parts) {
  uint64_t h = Mix(seed);
  for (uint64_t part : parts) h = Mix(h ^ Mix(part));
  return h;
}

ScopedSeed::ScopedSeed(uint64_t seed, uint64_t stream) : saved_(nn::thread_generator()) {
  nn::manual_seed(seed, stream);
}

ScopedSeed::~ScopedSeed() { nn::thread_generator() = saved_; }

SameOnEveryRank::SameOnEveryRank(uint64_t seed, int64_t step)
    : scope_(DeriveSeed(seed, {static_cast<uint64_t>(step)}), kSharedStream) {}

ScopedDeterminism::ScopedDeterminism() : allow_tf32_(nn::allow_tf32()) {
  nn::set_allow_tf32(false);
}

ScopedDeterminism::~ScopedDeterminism() { nn::set_allow_tf32(allow_tf32_); }

}  // namespace tandem::testing
