// Deterministic seeding for tests of training functions.
//
// spawn seeds rank r's generator with (SpawnOptions::seed, stream r), so a
// model built on rank 0 starts from the same weights in a run of 1 rank and of
// N ranks (DataParallel then broadcasts rank 0's). Data that every rank must
// see alike (one global batch per step, which each rank then cuts with
// ctx.split) is drawn under SameOnEveryRank, which leaves the rank's own stream
// (dropout, its own augmentations) where it was:
//
//   nn::Tensor x, y;
//   {
//     testing::SameOnEveryRank shared(/*seed=*/1, /*step=*/step);
//     x = nn::randn({64, 10});
//     y = nn::randn({64, 1});
//   }
//   nn::Tensor loss = loss_fn(dp(ctx.split(x)), ctx.split(y));
//
// Thread-safety: each function acts on the calling thread's generator only
// (nn/random.h); ScopedDeterminism changes process-wide switches (below).
#ifndef TANDEM_TESTING_SEED_H_
#define TANDEM_TESTING_SEED_H_

#include <cstdint>
#include <initializer_list>

#include "nn/random.h"

namespace tandem::testing {

// One 64-bit seed from `seed` and `parts` (SplitMix64 over each part in turn):
// distinct parts give unrelated seeds, the same parts the same seed, on every
// machine.
uint64_t DeriveSeed(uint64_t seed, std::initializer_list<uint64_t> parts);

// Sets the calling thread's generator to (seed, stream, offset 0) for the
// object's lifetime and puts the previous generator back, offset included,
// when it goes. Not copyable; destroy it on the thread that made it.
class ScopedSeed {
 public:
  explicit ScopedSeed(uint64_t seed, uint64_t stream = 0);
  ~ScopedSeed();
  ScopedSeed(const ScopedSeed&) = delete;
  ScopedSeed& operator=(const ScopedSeed&) = delete;

 private:
  nn::Generator saved_;
};

// The stream that SameOnEveryRank draws from: far above any rank's stream
// (spawn gives rank r stream r), so shared draws never repeat a rank's own.
inline constexpr uint64_t kSharedStream = uint64_t{1} << 62;

// ScopedSeed(DeriveSeed(seed, {step}), kSharedStream): every rank (and a run of
// any number of ranks) draws the same numbers for the same (seed, step).
class SameOnEveryRank {
 public:
  SameOnEveryRank(uint64_t seed, int64_t step);

 private:
  ScopedSeed scope_;
};

// For the lifetime of the object: TF32 off for float32 GEMMs and convolutions
// on the GPU (nn::set_allow_tf32), so that a run's float32 results depend on
// the data and not on the tensor cores' rounding; the previous setting comes
// back after. Process-wide: make it outside spawn (testing::RunRanks does, with
// RunOptions::deterministic), not on a rank thread.
class ScopedDeterminism {
 public:
  ScopedDeterminism();
  ~ScopedDeterminism();
  ScopedDeterminism(const ScopedDeterminism&) = delete;
  ScopedDeterminism& operator=(const ScopedDeterminism&) = delete;

 private:
  bool allow_tf32_;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTING_SEED_H_
