// Faults that testing::RunRanks (testing/run.h) injects into a training function at
// a chosen rank, at a step it reports or at one of its collectives: for testing
// how a training program fails, stops and reports.
//
//   testing::RunOptions options{.ranks = 2};
//   options.spawn.timeout_s = 1;
//   options.faults = {{.action = testing::FaultAction::kHang, .rank = 1, .step = 2}};
//   absl::Status s = testing::RunRanks(train, options);   // DeadlineExceeded naming rank 1
//
// Where a fault fires (exactly one of the two):
//   step        when the rank reports step `step` (StepLog::EndStep; 0 for the
//               first step), after the step's record.
//   collective  in the rank's collective number `collective` (1 for the first),
//               counted as spawn's watchdog counts them: every all_reduce,
//               all_reduce_async, broadcast, all_gather, all_gather_into,
//               reduce_scatter, reduce_scatter_async and barrier of the rank's
//               communicator (DataParallel's bucket
//               all-reduces and its initial broadcasts included). The fault
//               fires after the rank entered the collective and before its
//               communicator runs it.
//
// What it does:
//   kThrow        throws tandem::Error with error.message(): spawn reports
//                 "rank R (...) threw: <message>".
//   kReturnError  at a step: EndStep returns `error`, which the training
//                 function returns (spawn reports "rank R returned: ...").
//                 At a collective: the rank's communicator reports `error` as an
//                 asynchronous library error from then on (as NCCL's
//                 ncclCommGetAsyncError after a network failure); the
//                 collective itself completes, and the watchdog fails the run
//                 with the error's code and message, naming the rank.
//   kHang         waits until the run stops (another rank failed, the watchdog's
//                 timeout, Ctrl-C) and then throws dist::CancelledError: a rank
//                 stuck without end, which only spawn's stop ends. With no
//                 other failure the watchdog ends the run after
//                 SpawnOptions::timeout_s with DeadlineExceeded, naming each
//                 rank's last collective.
//   kSlow         sleeps `delay`, then goes on (a straggler).
//
// Faults are checked by RunRanks before anything starts (ValidateFaults); each fires
// at most once. RunReport::faults says which fired and how each ended.
#ifndef TANDEM_TESTING_FAULTS_H_
#define TANDEM_TESTING_FAULTS_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tandem::testing {

enum class FaultAction { kThrow, kReturnError, kHang, kSlow };
const char* FaultActionName(FaultAction action);  // "throw", "return an error", "hang", "slow"

struct Fault {
  FaultAction action = FaultAction::kThrow;
  int rank = 0;
  std::optional<int64_t> step;         // >= 0
  std::optional<uint64_t> collective;  // >= 1
  // kThrow: the exception's message; kReturnError: the status (not OK).
  absl::Status error = absl::InternalError("injected fault");
  // kSlow: how long (> 0).
  std::chrono::milliseconds delay{0};

  // "hang at rank 1, step 2", "throw at rank 0, collective 3".
  std::string Describe() const;
};

// A fault that fired, and how it ended.
struct FaultEvent {
  Fault fault;
  // "rank 1: step 2", "rank 0: all_reduce #3".
  std::string where;
  // "threw", "returned the error", "reported the error asynchronously",
  // "cancelled by the stop", "slept".
  std::string outcome;
  // From the fault firing to its end (a hang: until the stop ended it).
  double seconds = 0;
};

// OK when every fault names a rank below `ranks`, exactly one of step
// (>= 0) and collective (>= 1), a non-OK error for kThrow and kReturnError
// and a positive delay for kSlow, and no two faults share a rank and a point;
// otherwise InvalidArgument naming the fault and the bad value.
absl::Status ValidateFaults(const std::vector<Fault>& faults, int ranks);

}  // namespace tandem::testing

#endif  // TANDEM_TESTING_FAULTS_H_
