// The flight recorder: per rank, a fixed ring of the last N collectives the
// rank's communicator entered (PyTorch c10d's FlightRecorder is the model), for
// finding out after a hang or a failure which rank diverged first.
//
// Every collective a Communicator runs (spawn/comm/communicator.h: all_reduce,
// broadcast, ..., and work it traces itself, such as a CUDA graph's replay)
// leaves one record: its sequence number, op, dtype and element count, when it
// was entered, when it ended, and its state (entered, completed, failed). Once N
// collectives have been recorded, each new one overwrites the oldest. N = 0
// records nothing. The communicator's kind is the ring's (one per rank).
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
// Thread-safety: Entered from the rank's thread only; Completed, Failed,
// Snapshot and Dump from any thread (spawn's watchdog and communication threads
// mark completions, anyone dumps; lock-free); Reset not while anything else
// runs. A dump taken while the rank records may leave out the record being
// written.
#ifndef TANDEM_SPAWN_COMM_FLIGHT_RECORDER_H_
#define TANDEM_SPAWN_COMM_FLIGHT_RECORDER_H_

#include <atomic>
#include <cstdint>
#include <memory>
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

  // Records the entry of collective `sequence` (consecutive numbers, one
  // thread: the rank's). dtype: none for a collective without a tensor.
  void Entered(uint64_t sequence, const char* op, std::optional<nn::DType> dtype, int64_t numel,
               int64_t now_ns);
  // Every collective after `after` up to `through` still "entered" is
  // complete (they complete in order).
  void Completed(uint64_t after, uint64_t through, int64_t now_ns);
  // Collective `sequence` threw, or its wait did; a later completion leaves it failed.
  void Failed(uint64_t sequence, int64_t now_ns);

  // The records still in the ring, oldest first.
  std::vector<FlightRecord> Snapshot() const;
  // How many collectives were entered in all (the ring holds the last capacity()).
  uint64_t entered() const { return entered_.load(std::memory_order_acquire); }

  // The ring as text, one line per collective after a heading, each line
  // starting with "flight recorder: " and `who` ("rank 1 (cpu)"), times
  // relative to now_ns. For a disabled ring, one line saying so.
  std::vector<std::string> Dump(absl::string_view who, int64_t now_ns) const;

 private:
  // One record, lock-free: only the rank thread writes a new one (a seqlock on
  // `tag`, which holds (sequence << 2) | state, 0 while it is being written);
  // completions and failures from any thread move the state by compare-and-swap
  // on the tag, so one for a record already overwritten changes nothing. The
  // collective's hot path pays a few plain stores and one compare-and-swap.
  struct Slot {
    std::atomic<uint64_t> tag{0};
    std::atomic<const char*> op{""};
    std::atomic<int64_t> numel{0};
    std::atomic<int> dtype{-1};  // -1: none
    std::atomic<int64_t> entered_ns{0};
    std::atomic<int64_t> ended_ns{0};
  };
  Slot* SlotOf(uint64_t sequence) const { return &slots_[(sequence - 1) % capacity_]; }
  // Moves `sequence` from entered to `state`; false when it is not in the ring
  // or not entered any more.
  bool Transition(uint64_t sequence, CollectiveState state, int64_t now_ns);

  int capacity_ = 0;  // written by Reset only
  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> entered_{0};
  mutable std::mutex kind_mutex_;
  std::string kind_;  // kind_mutex_
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
