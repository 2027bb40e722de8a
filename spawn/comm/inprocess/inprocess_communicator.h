// The in-process communicator: ranks of one process (CPU ranks, or several ranks
// sharing one GPU) exchange buffer addresses through a shared InProcessGroup and
// each rank reduces its own slice of everyone's buffers, adding ranks in the order
// 0, 1, ..., so the result has the same bits on every rank and every run.
//
// A collective is two barriers on the group: the ranks publish their buffers and
// meet (each then checks that all called the same collective), do their share of
// the copying or reducing straight between the published buffers, and meet again
// before any returns (so no buffer is reused while another rank still reads it).
// Small CPU collectives (at most InProcessGroup::staged_bytes() per rank) and the
// CPU barrier meet once: each rank copies its input into its staging buffer in the
// group, meets the others, and reads every rank's staging buffer into its own
// output (all_reduce: every rank reduces all of them, ranks in order, so the bits
// are the same). The staging buffers and the published slots alternate between
// two halves by barrier parity, so a rank that runs into the next collective
// never overwrites what another rank still reads: a rank writes a half again only
// after the next barrier, which every rank reaches after it is done reading.
//
// CPU tensors: vectorised loops on the calling thread, through the inputs in
// blocks that stay in L1 (spawn/internal/inprocess_reduce.h); all_reduce is a
// reduce-scatter and an all-gather in one pass (rank r reduces slice r of every
// buffer and writes it into every buffer; large ones are cut in 64 KB chunks that
// the ranks claim from a shared counter, so the ranks that run do the work of
// those that wait for a CPU). float32, float64, bfloat16 and float16 (summed
// in float32, rounded once) and int64. CUDA tensors (ranks on one GPU): kernels on
// the rank's compute stream, ordered against the other ranks' streams with
// events; the host does not wait for the GPU (float32, float64, int64, and
// bfloat16 and float16 summed in float32 and rounded once, as on the CPU).
//
// Not capturable in a CUDA graph (nn/graph.h): every collective meets the other
// ranks on the host. A collective called while nn::CudaGraph captures on the
// calling thread throws tandem::Error ("in-process communicator cannot be
// captured in a CUDA graph; use NCCL ...") before touching the group.
#ifndef TANDEM_SPAWN_COMM_INPROCESS_INPROCESS_COMMUNICATOR_H_
#define TANDEM_SPAWN_COMM_INPROCESS_INPROCESS_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spawn/comm/communicator.h"

namespace tandem::dist {

struct InProcessGroupOptions {
  // Collectives of at most this many bytes per rank on CPU ranks meet once,
  // through staging buffers (see the top of this file). -1: automatic: 1 KB, or
  // 4 KB when the group has more ranks than CPUs (those the thread creating it
  // may run on; then every meeting costs a thread switch on each CPU; measured
  // in docs/benchmarks.md, beyond these sizes the extra copy and each rank
  // reducing everything cost more than the second meeting saves). 0: never.
  // Each rank that uses the staging buffers allocates 2 x staged_bytes once.
  int64_t staged_bytes = -1;
  // A waiter asleep in the kernel looks again on its own after this long: a
  // bound against a lost wake-up, not a poll (the arrival that completes a
  // barrier, and Cancel, wake the sleepers). A seam for tests: with it far above
  // a test's time limit, a wake that never comes fails the test instead of
  // passing after this period.
  int64_t sleep_recheck_ns = 50'000'000;
};

// State shared by the ranks of one run. Thread-safe.
//
// Waiting (both barriers below): a waiter first spins on the flags it waits for
// with a pause instruction (no system call, so a hand-over between two running
// ranks costs about one cache-line transfer), then sleeps in the kernel (a futex
// on Linux) until the arrival that completes the barrier or Cancel wakes it (an
// arrival that leaves ranks missing wakes nobody: every needless wake is a
// context switch). The spin is bounded: at most 50 us, less after waits that
// outlasted it. While a rank it waits for last arrived on the waiter's own CPU
// (that rank cannot arrive while the waiter holds the CPU), the waiter does not
// spin. In a group with more ranks than CPUs (those the thread that creates the
// group may run on) it yields the CPU to that rank (sched_yield) instead of
// sleeping: there every meeting needs both ranks of a CPU to run, and a yield
// hands the CPU over in about a microsecond where a sleep costs a wake-up and,
// once every rank of a CPU sleeps, an idle CPU to wake (about 30 us on a VM: 4
// ranks on 2 CPUs, all_reduce up to 512 B 26-28 -> 3.6-3.7 us,
// docs/benchmarks.md). Yields that return at once (nobody else there to run)
// count against the spin budget; a wait sleeps after 200 us of hand-overs. The
// trade-off: a yield can also hand the CPU to a CPU-bound thread outside the
// group for a whole time slice, where a woken sleeper would be let back in at
// once (3 ranks and a busy loop on one CPU: about 0.9 ms per barrier with yields
// alone, 10 us with sleeps). So a yield that keeps the CPU away for more than
// 500 us stops the rank's yielding for 1 ms, doubled up to 1 s while such yields
// keep coming (a rank of the group computing for that long between two
// collectives counts too: its next collectives sleep for that pause). With at
// most as many ranks as CPUs the waiter sleeps at once. Cancel wakes sleepers at
// once; a spinning or yielding waiter sees it at its next look (a yield can last
// a time slice).
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size, InProcessGroupOptions options = {});
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int world_size() const { return world_size_; }

  // A reusable barrier: returns once all world_size callers have arrived (any
  // threads). Throws CancelledError(reason) when the group is or becomes
  // cancelled while waiting; a generation that completed before the cancel
  // returns normally.
  void ArriveAndWait();
  // The same barrier for the thread of rank `rank` (0 <= rank < world_size),
  // over per-rank, cache-line-separated arrival counters (no shared counter that
  // every rank writes): the in-process communicator's barrier. Separate from
  // ArriveAndWait(): at a given point every rank calls the same one of the two.
  void ArriveAndWait(int rank);
  // Wakes every waiter (they throw) and makes every later ArriveAndWait throw.
  // The first reason is kept. Callable from any thread, more than once.
  void Cancel(const std::string& reason);
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // What each rank published for the collective running now. Rank r writes
  // slot(r, parity(r)) before a barrier; all read it after that barrier and
  // before the next; r writes that half again only after the next barrier.
  struct Slot {
    const char* op = "";
    const char* label = nullptr;  // Communicator::Label's, or null
    uint64_t sequence = 0;
    int64_t numel = 0;
    nn::DType dtype = nn::DType::kFloat32;
    int arg = 0;  // ReduceOp or root
    nn::Device device;
    const void* send = nullptr;
    void* recv = nullptr;
    void* event = nullptr;  // CUDA: an event recorded after this rank's inputs are ready
  };
  Slot& slot(int rank, int parity) { return slots_[rank].slot[parity]; }
  // The parity (0 or 1) of the next barrier (ArriveAndWait(rank)) of rank `rank`:
  // which half of its slot and staging buffer it fills before that barrier. The
  // same on every rank at a given barrier. Call from rank's thread only.
  int parity(int rank) const {
    return static_cast<int>((arrived_[rank].value.load(std::memory_order_relaxed) + 1) & 1);
  }

  // Bytes per rank up to which CPU collectives go through staging buffers (0: never).
  int64_t staged_bytes() const { return staged_bytes_; }
  // Half `parity` of rank `rank`'s staging buffer (staged_bytes() bytes). Rank
  // `rank` allocates its buffer on its first call (not per collective), before
  // the barrier after which others read it.
  char* staging(int rank, int parity) {
    PaddedSlot& s = slots_[rank];
    if (s.staging == nullptr) s.staging.reset(new char[2 * static_cast<size_t>(staged_bytes_)]);
    return s.staging.get() + parity * staged_bytes_;
  }

  // How many times a rank's yield lost the CPU for long and paused its yielding
  // (see above): another busy thread shares the ranks' CPUs. For tests and
  // diagnostics.
  uint64_t yield_pauses() const { return yield_pauses_.load(std::memory_order_relaxed); }

  // Work sharing inside a collective: the next value of a counter shared by the
  // ranks (0, 1, 2, ... over the group's life). The in-process communicator
  // hands out chunks of large collectives with it, so the ranks that are running
  // do the work of those that are not (more ranks than CPUs, a busy machine).
  uint64_t ClaimChunk() { return chunks_.value.fetch_add(1, std::memory_order_relaxed); }

 private:
  // A waiter's adaptive state (see Wait), kept across its waits.
  struct WaitState {
    int64_t spin_ns = 0;             // the spin budget
    int64_t no_yield_until_ns = 0;   // no yielding before (after a long yield)
    int64_t yield_pause_ns = 0;      // the last pause of yielding
    int64_t last_long_yield_ns = 0;  // when the last long yield ended
  };
  struct alignas(64) PaddedCounter {
    std::atomic<uint64_t> value{0};
    std::atomic<int> cpu{-1};  // ArriveAndWait(rank): the CPU the rank last arrived on
    WaitState wait;            // ArriveAndWait(rank): the rank's own (its thread only)
  };
  struct alignas(64) PaddedSlot {
    Slot slot[2];
    std::unique_ptr<char[]> staging;
  };

  // Returns once done(order) holds: spins for up to state->spin_ns while
  // !spin_useless() (while spin_useless(), yields the CPU when yield_ and the
  // pause after a long yield allow, else stops spinning; yields that return at
  // once count as spinning), then sleeps; throws
  // CancelledError when the group is cancelled first. Adapts state->spin_ns:
  // doubled (up to 50 us) after a wait that ended before it slept, halved
  // after one whose spinning outlasted it, so a rank whose waits keep outlasting
  // the spin (its peers compute) soon stops spending CPU on it.
  template <typename Done, typename SpinUseless>
  void Wait(const Done& done, const SpinUseless& spin_useless, WaitState* state);
  // One yield of Wait: adds the time to *yielded_ns when the CPU was handed over,
  // starts a pause of yielding (state) when it was away for long. Returns whether
  // the wait may yield again.
  bool YieldTo(WaitState* state, int64_t* yielded_ns);
  // Wakes the sleepers of Wait after an arrival (cheap when nobody sleeps).
  void WakeSleepers();
  [[noreturn]] void ThrowCancelled() const;

  const int world_size_;
  int64_t staged_bytes_;
  const int64_t sleep_recheck_ns_;
  bool yield_ = false;        // more ranks than CPUs: Wait may yield (see above)
  WaitState shared_wait_;     // ArriveAndWait()'s, guarded by mutex_
  std::unique_ptr<PaddedSlot[]> slots_;
  std::unique_ptr<PaddedCounter[]> arrived_;  // per rank: barriers it has arrived at
  PaddedCounter arrivals_;                    // ArriveAndWait(): arrivals since creation
  PaddedCounter chunks_;                      // ClaimChunk()
  alignas(64) std::atomic<bool> cancelled_{false};
  std::atomic<uint64_t> yield_pauses_{0};
  alignas(64) std::atomic<uint32_t> wake_{0};  // the futex word: bumped to wake sleepers
  std::atomic<int> sleepers_{0};
  mutable std::mutex mutex_;  // guards reason_ and shared_wait_
  std::string reason_;
};

class InProcessCommunicator final : public Communicator {
 public:
  // group: shared by all world_size ranks of the run.
  InProcessCommunicator(int rank, nn::Device device, std::shared_ptr<InProcessGroup> group);
  ~InProcessCommunicator() override;
  std::string kind() const override { return "in-process"; }

 protected:
  void AllReduceImpl(nn::Tensor& x, ReduceOp op) override;
  void BroadcastImpl(nn::Tensor& x, int root) override;
  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override;
  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output, ReduceOp op) override;
  void BarrierImpl() override;

 private:
  // Publishes this rank's slot, waits for all, and checks that every rank called
  // the same collective with the same sizes (throws tandem::Error naming both).
  // Returns the barrier's parity: the half of the slots and staging buffers to read.
  int Publish(const char* op, const nn::Tensor* send, nn::Tensor* recv, int arg);
  // Whether a collective of `bytes` per rank meets once, through the staging
  // buffers. The same on every rank for the same collective and sizes.
  bool Staged(int64_t bytes) const;
  // Second half of every collective: waits until no rank still reads or writes
  // another's buffer.
  void Finish();
  // Calls work(begin, end) for chunks of [0, n) (chunk elements each) that this
  // rank claims from the group, until every chunk of the collective is claimed.
  // Every rank of the collective must call it, with the same n and chunk.
  template <typename Work>
  void ShareWork(int64_t n, int64_t chunk, const Work& work);
  // Whether a collective of `bytes` per rank shares its work through ShareWork.
  bool SharesWork(int64_t bytes) const;

  std::shared_ptr<InProcessGroup> group_;
  void* event_ = nullptr;  // CUDA event of this rank (created on first CUDA use)
  // The group's ClaimChunk value at the start of the next ShareWork: the same on
  // every rank, since every rank shares the same collectives and each makes
  // exactly one claim past the end of each.
  uint64_t chunk_base_ = 0;
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_COMM_INPROCESS_INPROCESS_COMMUNICATOR_H_
