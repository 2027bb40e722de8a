// The flight recorder: per rank, a fixed ring of the last N collectives the
// rank's communicator entered (PyTorch c10d's FlightRecorder is the model), for
// finding out after a hang or a failure which rank diverged first.
//
// Every collective a Communicator runs (spawn/comm/communicator.h: all_reduce,
// broadcast, ..., and work it traces itself, such as a CUDA graph's replay)
// leaves one record: its sequence number, op, dtype and element count, when it
// was entered, when its work started (where the communicator knows it), when it
// ended, and its state (entered, completed, failed). Once N collectives have been
// recorded, each new one overwrites the oldest. N = 0 records nothing.
//
// spawn writes every ring of the process to its log with the run's first failure
// (a watchdog timeout included), after the error line, and once per process;
// Communicator::DumpFlightRecorder() and Context::DumpFlightRecorder() give one
// rank's ring on demand. docs/guide.md ("Observing a run") shows the text.
//
// Times are the steady clock's (internal::SteadyNowNs), shown relative to the
// dump. "completed" means the communicator marked it so: for NCCL when the
// watchdog's poll saw its device work finish, so a recent one may still show
// "entered" although it is done.
//
// Thread-safety: every method may be called from any thread (one mutex per
// ring, held for a few stores; the rank thread records, spawn's watchdog and the
// communication threads mark completions, anyone dumps), except Reset, which
// must not race with recording.
#ifndef TANDEM_SPAWN_COMM_FLIGHT_RECORDER_H_
#define TANDEM_SPAWN_COMM_FLIGHT_RECORDER_H_

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "nn/dtype.h"

namespace tandem::dist {

enum class CollectiveState { kEntered, kCompleted, kFailed };
const char* CollectiveStateName(CollectiveState state);  // "entered", "completed", "failed"

// One collective of the ring.
struct FlightRecord {
  uint64_t sequence = 0;     // 1 for the rank's first collective
  const char* op = "";       // "all_reduce", "barrier", "graph replay" (static string)
  std::optional<nn::DType> dtype;  // none: no tensor (barrier, graph replay)
  int64_t numel = 0;         // elements of the tensor it was called with (input)
  int64_t entered_ns = 0;    // steady clock: the call entered it
  int64_t started_ns = 0;    // its work began (0: unknown; the call itself for synchronous ones)
  int64_t ended_ns = 0;      // completed or failed (0: neither yet)
  CollectiveState state = CollectiveState::kEntered;
};

class FlightRecorder {
 public:
  static constexpr int kDefaultEntries = 64;

  explicit FlightRecorder(int entries = kDefaultEntries) { Reset(entries); }
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // Empties the ring and sets its size (0: disabled). Not while collectives run.
  void Reset(int entries);
  int capacity() const { return capacity_; }
  bool enabled() const { return capacity_ > 0; }

  // The communicator's kind (Communicator::kind()), shown in the dump.
  void set_kind(std::string kind);

  // Records the entry of collective `sequence` (consecutive numbers).
  // dtype: none for a collective without a tensor.
  void Entered(uint64_t sequence, const char* op, std::optional<nn::DType> dtype, int64_t numel,
               int64_t now_ns);
  // Its work began now (communicators that run it later than the call).
  void Started(uint64_t sequence, int64_t now_ns);
  // Every collective up to `sequence` still "entered" is complete (they
  // complete in order).
  void Completed(uint64_t through_sequence, int64_t now_ns);
  // Collective `sequence` threw, or its wait did; a later completion leaves it failed.
  void Failed(uint64_t sequence, int64_t now_ns);

  // The records still in the ring, oldest first.
  std::vector<FlightRecord> Snapshot() const;
  // How many collectives were entered in all (the ring holds the last capacity()).
  uint64_t entered() const;

  // The ring as text, one line per collective after a heading, each line
  // starting with "flight recorder: " and `who` ("rank 1 (cpu)"), times
  // relative to now_ns. For a disabled ring, one line saying so.
  std::vector<std::string> Dump(absl::string_view who, int64_t now_ns) const;

 private:
  FlightRecord* Slot(uint64_t sequence);  // null when overwritten or never entered; mutex_ held

  mutable std::mutex mutex_;
  int capacity_ = 0;  // written by Reset only
  std::string kind_;                // mutex_
  std::vector<FlightRecord> ring_;  // record of sequence s at (s - 1) % capacity_; mutex_
  uint64_t entered_ = 0;            // mutex_
  uint64_t completed_through_ = 0;  // mutex_
};

// The rings of several ranks (one process's) as text: each ring's Dump, then
// DescribeDivergence's line when there is one. rings: (who, ring) per rank.
std::vector<std::string> DumpFlightRecorders(
    const std::vector<std::pair<std::string, const FlightRecorder*>>& rings, int64_t now_ns);

// Where the rings of several ranks (one process's) first disagree, oldest
// sequence number first: a collective some rank entered and another did not, or
// one entered with another op, dtype or element count. One line ("flight
// recorder: ..."), or "" when they agree over what the rings still hold.
// rings: (who, Snapshot()) per rank.
std::string DescribeDivergence(
    const std::vector<std::pair<std::string, std::vector<FlightRecord>>>& rings);

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_COMM_FLIGHT_RECORDER_H_
