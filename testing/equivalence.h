// N ranks against one: a data-parallel training function must end where the
// same function ends on one rank that sees the whole batch (N ranks with batch
// B each, one rank with N*B). CheckEquivalence runs it both ways (testing::RunRanks)
// and compares, step by step, the losses and every parameter of every rank.
//
//   absl::Status s = testing::CheckEquivalence(Train, {.ranks = 4});
//   // OK, or: "4 ranks differ from 1 rank at step 3: parameter l2.bias[0] on
//   //          rank 1: 0.5213 (4 ranks) vs 0.5203 (1 rank), |difference| ..."
//
// The function decides how it splits the data: the usual way draws one
// global batch per step alike on every rank (testing::SameOnEveryRank) and
// trains on ctx.split(x); with one rank split returns all of x. Rank 0's
// model starts from the same weights in both runs (spawn seeds rank r with
// (seed, stream r)) and DataParallel broadcasts them.
//
// Losses: each rank reports its own (the loss of its part of the batch). With
// a mean loss over equal parts the one-rank loss is the mean of the ranks'
// (LossCombine::kMean); with a sum, their sum (kSum).
//
// Values agree when |n_ranks - one_rank| <= atol + rtol * |one_rank| (NaN only
// with NaN); atol = rtol = 0 asks for equality. Parameters on N ranks are
// float32 sums in a different order than on one rank, so exact equality is
// the exception: the defaults allow a few float32 roundings per step.
#ifndef TANDEM_TESTING_EQUIVALENCE_H_
#define TANDEM_TESTING_EQUIVALENCE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "spawn/launch.h"
#include "testing/run.h"

namespace tandem::testing {

struct Tolerance {
  double rtol = 1e-5;
  double atol = 1e-6;
};

enum class LossCombine { kMean, kSum };

struct EquivalenceOptions {
  // The N-rank run: `ranks` ranks on `gpus`. The one-rank run: one rank on the
  // first device of `gpus`.
  int ranks = 2;
  std::string gpus = "cpu";
  // Both runs' spawn options (the seed, the watchdog's timeout_s, ...).
  dist::SpawnOptions spawn = DefaultTestSpawnOptions();
  Tolerance parameters;
  Tolerance losses;
  LossCombine combine_losses = LossCombine::kMean;
};

// The first place where the runs differ.
struct Difference {
  int64_t step = 0;
  // "loss", a parameter's name, or what did not match: "step count",
  // "parameter names", "parameter shapes".
  std::string what;
  int rank = -1;        // the N-rank run's rank (-1: the ranks' combined loss)
  int64_t element = -1;  // row-major index in the parameter (-1: none)
  double n_ranks = 0;
  double one_rank = 0;
  std::string message;  // all of the above in one sentence
};

struct EquivalenceReport {
  RunReport one_rank;
  RunReport n_ranks;
  std::optional<Difference> first_difference;
  int64_t steps_compared = 0;
};

// Compares two runs' records (see the top of this file): the first
// difference, step by step (in a step: the loss, then each parameter in
// parameters() order, each rank, each element), or nullopt.
std::optional<Difference> CompareRuns(const RunReport& one_rank, const RunReport& n_ranks,
                                      const EquivalenceOptions& options);

// Runs `fn` on one rank and on options.ranks ranks and compares them. OK when
// they agree within the tolerances at every step. Otherwise: InvalidArgument
// for bad options; a run's own failure with "the N-rank run: " or "the
// one-rank run: " in front (the code kept); Internal naming the first
// difference (Difference::message). `report` (may be null) receives both runs'
// records and the difference.
absl::Status CheckEquivalence(const TrainingFunction& fn, const EquivalenceOptions& options = {},
                              EquivalenceReport* report = nullptr);

}  // namespace tandem::testing

#endif  // TANDEM_TESTING_EQUIVALENCE_H_
