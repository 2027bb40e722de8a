#include "spawn/comm/inprocess/inprocess_communicator.h"

#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <thread>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "nn/graph.h"
#include "spawn/comm/inprocess/internal/inprocess_reduce.h"
#if TANDEM_WITH_CUDA
#include "spawn/comm/inprocess/internal/inprocess_cuda.h"
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tandem::dist {
namespace {

// Broadcasts of at least this many bytes are copied by every rank (each a part
// of every receiver's buffer) rather than by the receivers alone.
constexpr int64_t kSplitBroadcastBytes = int64_t{64} << 10;
// CPU collectives of at least kShareMinChunks chunks per rank of this many bytes
// share their work by claiming chunks (InProcessGroup::ClaimChunk) instead of
// splitting it in fixed slices: whichever ranks run do the work.
constexpr int64_t kShareChunkBytes = int64_t{64} << 10;
constexpr int64_t kShareMinChunks = 2;
// InProcessGroupOptions::staged_bytes when automatic, with at most as many ranks
// as CPUs and with more.
constexpr int64_t kStagedBytes = int64_t{1} << 10;
constexpr int64_t kStagedBytesOversubscribed = int64_t{4} << 10;

// Sleeps while *word == expected (or until woken, or after timeout_ns: callers loop).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
#ifdef __linux__
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  // A bound, not a poll: wakes come from WakeSleepers/Cancel.
  timespec timeout{static_cast<time_t>(timeout_ns / 1'000'000'000),
                   static_cast<long>(timeout_ns % 1'000'000'000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &timeout,
          nullptr, 0);
#else
  (void)timeout_ns;
  word->wait(expected, std::memory_order_acquire);
#endif
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  word->notify_all();
#endif
}

// The shortest and longest spin budgets of a wait (see InProcessGroup::Wait).
constexpr int64_t kMinSpinNs = 1'000;
constexpr int64_t kMaxSpinNs = 50'000;
// Yielding (see InProcessGroup::Wait): a yield that took at least kHandOverNs
// gave the CPU to another thread (one that returns sooner found nobody to run);
// one that took more than kLongYieldNs ends the yielding for a pause of
// kMinYieldPauseNs, doubled (up to kMaxYieldPauseNs) when the last long yield
// was less than four pauses ago; a wait stops yielding after kMaxYieldNs of
// hand-overs (quick yields count against its spin budget)
// before it sleeps.
constexpr int64_t kHandOverNs = 500;
constexpr int64_t kLongYieldNs = 500'000;
constexpr int64_t kMinYieldPauseNs = 1'000'000;
constexpr int64_t kMaxYieldPauseNs = 1'000'000'000;
constexpr int64_t kMaxYieldNs = 200'000;

// The CPU the calling thread runs on now, or -1.
int CurrentCpu() {
#ifdef __linux__
  return sched_getcpu();
#else
  return -1;
#endif
}

// CPUs this process may run on.
int UsableCpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

using PtrList = absl::InlinedVector<const void*, 8>;
using MutPtrList = absl::InlinedVector<void*, 8>;

// Reduces in[0..n) element-wise over [begin, end) into every out[j], ranks in order.
void ReduceSlice(const PtrList& in, const MutPtrList& out, int64_t begin, int64_t end,
                 nn::DType dtype, ReduceOp op, nn::Device device, const char* name) {
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) {
    // Checked here, not only in the kernel launch, so a rank with an empty slice rejects it too.
    TANDEM_CHECK(dtype == nn::kFloat32 || dtype == nn::kFloat64 || dtype == nn::kBFloat16 ||
                     dtype == nn::kFloat16 || dtype == nn::kInt64,
                 name, " on ", device.ToString(), ": dtype ", nn::DTypeName(dtype),
                 " is not supported (float32, float64, bfloat16, float16, int64)");
    if (begin >= end) return;
    internal::ReduceSliceCuda(std::vector<const void*>(in.begin(), in.end()),
                              std::vector<void*>(out.begin(), out.end()), begin, end, dtype,
                              static_cast<int>(op), device);
    return;
  }
#endif
  (void)device;
  const bool supported =
      internal::ReduceCpu(in.data(), static_cast<int>(in.size()), out.data(),
                          static_cast<int>(out.size()), begin, end, dtype, static_cast<int>(op));
  TANDEM_CHECK(supported, name, ": dtype ", nn::DTypeName(dtype),
               " is not supported (float32, float64, bfloat16, float16, int64)");
}

void Copy(void* dst, const void* src, int64_t bytes, nn::Device device) {
  if (bytes <= 0) return;
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) return internal::CopyCuda(dst, src, bytes, device);
#endif
  (void)device;
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// Part `part` [begin, end) of n elements split in `parts`, with boundaries on
// 64-byte lines so that ranks writing neighbouring parts share no cache line.
std::pair<int64_t, int64_t> Chunk(int64_t n, int part, int parts, int64_t element_size) {
  const int64_t per_line = std::max<int64_t>(1, 64 / element_size);
  const int64_t lines = (n + per_line - 1) / per_line;
  return {std::min(n, lines * part / parts * per_line),
          std::min(n, lines * (part + 1) / parts * per_line)};
}

}  // namespace

// --- InProcessGroup ---------------------------------------------------------------

InProcessGroup::InProcessGroup(int world_size, InProcessGroupOptions options)
    : world_size_(world_size),
      sleep_recheck_ns_(std::max<int64_t>(1, options.sleep_recheck_ns)),
      slots_(new PaddedSlot[std::max(world_size, 1)]),
      arrived_(new PaddedCounter[std::max(world_size, 1)]) {
  TANDEM_CHECK(world_size >= 1, "InProcessGroup: world size ", world_size);
  const bool oversubscribed = world_size > UsableCpus();
  yield_ = oversubscribed;
  staged_bytes_ = options.staged_bytes >= 0 ? options.staged_bytes
                  : oversubscribed          ? kStagedBytesOversubscribed
                                            : kStagedBytes;
  // Both halves of a staging buffer aligned for any element type (and a cache line).
  staged_bytes_ = (staged_bytes_ + 63) / 64 * 64;
  shared_wait_.spin_ns = kMaxSpinNs;
  for (int r = 0; r < world_size; ++r) arrived_[r].wait.spin_ns = kMaxSpinNs;
}

InProcessGroup::~InProcessGroup() = default;

template <typename Done, typename SpinUseless>
void InProcessGroup::Wait(const Done& done, const SpinUseless& spin_useless, WaitState* state) {
  // Spin: no system call while the others are about to arrive. A rank still
  // missing that last ran on this CPU cannot arrive while we spin: in a group
  // with more ranks than CPUs we yield the CPU to it (a same-CPU hand-over of
  // about a microsecond, where a sleep costs a wake-up and, once every rank of a
  // CPU sleeps, an idle CPU to wake); otherwise we sleep at once. Yields that
  // hand the CPU over do not count against the spin budget (the waiter spends no
  // CPU while the other rank runs); yields that return at once (nobody else
  // could run here) do. A yield that keeps the CPU away for long means that
  // another thread got a time slice: a CPU-bound thread outside the group (then
  // every later yield would cost a slice too, where a woken sleeper is let back
  // in at once) or the missing rank computing. It ends the yielding for a pause
  // that doubles while long yields keep coming.
  const int64_t start_ns = internal::SteadyNowNs();
  const int64_t budget_ns = state->spin_ns;
  bool may_yield = yield_ && start_ns >= state->no_yield_until_ns;
  int64_t yielded_ns = 0;
  bool spun_out = false;
  for (uint32_t i = 0;; ++i) {
    if (done(std::memory_order_acquire)) {
      state->spin_ns = std::min(kMaxSpinNs, std::max(kMinSpinNs, budget_ns * 2));
      return;
    }
    if (cancelled_.load(std::memory_order_relaxed)) ThrowCancelled();
    if (i % 64 == 0) {
      if (i > 0 && internal::SteadyNowNs() - start_ns - yielded_ns > budget_ns) {
        spun_out = true;
        break;
      }
      if (spin_useless()) {
        if (!may_yield) break;
        may_yield = YieldTo(state, &yielded_ns);
        i = 63;  // next: look at once (done, cancelled, the budget, the missing ranks)
        continue;
      }
    }
    internal::CpuRelax();
  }
  // Only a wait the spin budget ended shortens it (halved, see the header).
  if (spun_out) state->spin_ns = std::max(kMinSpinNs, budget_ns / 2);
  // Sleep. Against a lost wake-up: an arriving rank stores its flag, then reads
  // sleepers_; a waiter counts itself in sleepers_, then reads the flags (all
  // seq_cst), so one of the two sees the other. The ticket is read before either,
  // so a wake that lands between the check and the futex call makes it return.
  for (;;) {
    const uint32_t ticket = wake_.load(std::memory_order_acquire);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    const bool ready = done(std::memory_order_seq_cst);
    const bool cancel = cancelled_.load(std::memory_order_seq_cst);
    if (!ready && !cancel) FutexWait(&wake_, ticket, sleep_recheck_ns_);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    if (ready) return;
    if (cancel) ThrowCancelled();
  }
}

bool InProcessGroup::YieldTo(WaitState* state, int64_t* yielded_ns) {
  const int64_t before_ns = internal::SteadyNowNs();
  sched_yield();
  const int64_t after_ns = internal::SteadyNowNs();
  const int64_t took_ns = after_ns - before_ns;
  if (took_ns >= kHandOverNs) *yielded_ns += took_ns;
  if (took_ns > kLongYieldNs) {
    state->yield_pause_ns = after_ns - state->last_long_yield_ns > 4 * state->yield_pause_ns
                                ? kMinYieldPauseNs
                                : std::min(kMaxYieldPauseNs, 2 * state->yield_pause_ns);
    state->last_long_yield_ns = after_ns;
    state->no_yield_until_ns = after_ns + state->yield_pause_ns;
    yield_pauses_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  return *yielded_ns <= kMaxYieldNs;
}

void InProcessGroup::WakeSleepers() {
  if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
  wake_.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&wake_);
}

void InProcessGroup::ThrowCancelled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  throw CancelledError(reason_);
}

void InProcessGroup::ArriveAndWait() {
  if (cancelled()) ThrowCancelled();
  const uint64_t n = arrivals_.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  const uint64_t w = static_cast<uint64_t>(world_size_);
  const uint64_t target = (n + w - 1) / w * w;  // the last arrival of this generation
  if (n == target) {
    WakeSleepers();
    return;
  }
  WaitState state;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state = shared_wait_;
  }
  Wait([&](std::memory_order order) { return arrivals_.value.load(order) >= target; },
       [] { return false; }, &state);
  std::lock_guard<std::mutex> lock(mutex_);
  shared_wait_ = state;
}

void InProcessGroup::ArriveAndWait(int rank) {
  if (cancelled()) ThrowCancelled();
  PaddedCounter& mine = arrived_[rank];
  const int cpu = CurrentCpu();
  mine.cpu.store(cpu, std::memory_order_relaxed);
  const uint64_t n = mine.value.load(std::memory_order_relaxed) + 1;
  mine.value.store(n, std::memory_order_seq_cst);
  auto all_arrived = [&](std::memory_order order) {
    for (int k = 0; k < world_size_; ++k) {
      if (arrived_[k].value.load(order) < n) return false;
    }
    return true;
  };
  // Only the arrival that completes the barrier wakes the sleepers: the last
  // rank to store its counter (in the seq_cst order) sees every other counter
  // and then every sleeper that counted itself in before missing that store (see
  // Wait). An earlier arrival's wake would only send sleepers back to sleep.
  if (all_arrived(std::memory_order_seq_cst)) {
    WakeSleepers();
    return;
  }
  Wait(
      all_arrived,
      [&] {
        // A rank still missing that last ran on this CPU cannot arrive while we
        // spin. (This CPU: read again, the waiter may have been moved.)
        const int here = CurrentCpu();
        if (here < 0) return false;
        for (int k = 0; k < world_size_; ++k) {
          if (arrived_[k].value.load(std::memory_order_relaxed) < n &&
              arrived_[k].cpu.load(std::memory_order_relaxed) == here) {
            return true;
          }
        }
        return false;
      },
      &mine.wait);
}

void InProcessGroup::Cancel(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!cancelled_.load(std::memory_order_relaxed)) {
      reason_ = reason;
      cancelled_.store(true, std::memory_order_seq_cst);
    }
  }
  wake_.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&wake_);
}

// --- InProcessCommunicator ----------------------------------------------------------

InProcessCommunicator::InProcessCommunicator(int rank, nn::Device device,
                                             std::shared_ptr<InProcessGroup> group)
    : Communicator(rank, group->world_size(), device), group_(std::move(group)) {}

InProcessCommunicator::~InProcessCommunicator() {
#if TANDEM_WITH_CUDA
  if (event_ != nullptr) internal::DestroyEvent(event_, device());
#endif
}

int InProcessCommunicator::Publish(const char* op, const nn::Tensor* send, nn::Tensor* recv,
                                   int arg) {
  // The rendezvous is on the host: recorded into a graph it would never happen
  // again at replay (and the other ranks would wait for a capture to finish).
  TANDEM_CHECK(!nn::CudaGraph::IsCapturing(), "in-process communicator cannot be captured in a "
               "CUDA graph (", op, " #", sequence(), " on rank ", rank(), ", ",
               device().ToString(), "): its ranks meet on the host; use NCCL (ranks on distinct "
               "GPUs) to capture a step with collectives, or run this step eagerly");
  const int parity = group_->parity(rank());
  InProcessGroup::Slot& s = group_->slot(rank(), parity);
  s.op = op;
  s.label = label();
  s.sequence = sequence();
  s.numel = send != nullptr ? send->numel() : 0;
  s.dtype = send != nullptr ? send->dtype() : nn::DType::kFloat32;
  s.arg = arg;
  s.device = device();
  s.send = send != nullptr ? send->data_ptr() : nullptr;
  s.recv = recv != nullptr ? recv->data_ptr() : nullptr;
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    if (event_ == nullptr) event_ = internal::CreateEvent(device());
    internal::RecordEvent(event_, device());
  }
#endif
  s.event = event_;
  group_->ArriveAndWait(rank());
  // Every rank makes the same comparison over the same slots, so either all
  // ranks throw here or none does.
  const InProcessGroup::Slot& first = group_->slot(0, parity);
  for (int k = 1; k < world_size(); ++k) {
    const InProcessGroup::Slot& other = group_->slot(k, parity);
    const bool same = (other.op == first.op || std::strcmp(other.op, first.op) == 0) &&
                      other.numel == first.numel && other.dtype == first.dtype &&
                      other.arg == first.arg && other.sequence == first.sequence;
    TANDEM_CHECK(same, "collective mismatch: rank 0 called ", first.op, " #", first.sequence,
                 " (", first.numel, " ", nn::DTypeName(first.dtype), ", arg ", first.arg, ")",
                 internal::FromLabel(first.label), " while rank ", k, " called ", other.op, " #",
                 other.sequence, " (", other.numel, " ", nn::DTypeName(other.dtype), ", arg ",
                 other.arg, ")", internal::FromLabel(other.label));
    TANDEM_CHECK(other.device == first.device, "in-process ", first.op, ": rank 0 is on ",
                 first.device.ToString(), " but rank ", k, " on ", other.device.ToString(),
                 " (ranks on different GPUs use NCCL)");
  }
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    std::vector<void*> events;
    for (int k = 0; k < world_size(); ++k) events.push_back(group_->slot(k, parity).event);
    internal::WaitEvents(events, device());
  }
#endif
  return parity;
}

bool InProcessCommunicator::Staged(int64_t bytes) const {
  return !device().is_cuda() && group_->staged_bytes() > 0 && bytes <= group_->staged_bytes();
}

// Reduce-scatter and all-gather in one pass: rank r reduces its slice of every
// rank's buffer (ranks in order) and writes the result straight into that slice
// of every rank's buffer, so each element is read once and written once per
// rank. The slices split the work evenly; their bounds do not change any bit.
template <typename Work>
void InProcessCommunicator::ShareWork(int64_t n, int64_t chunk, const Work& work) {
  const uint64_t chunks = static_cast<uint64_t>((n + chunk - 1) / chunk);
  const uint64_t base = chunk_base_;
  chunk_base_ += chunks + static_cast<uint64_t>(world_size());
  for (;;) {
    const uint64_t c = group_->ClaimChunk() - base;
    if (c >= chunks) return;
    const int64_t begin = static_cast<int64_t>(c) * chunk;
    work(begin, std::min(n, begin + chunk));
  }
}

bool InProcessCommunicator::SharesWork(int64_t bytes) const {
  return !device().is_cuda() && world_size() > 1 &&
         bytes >= kShareChunkBytes * kShareMinChunks * world_size();
}

// Reduce-scatter and all-gather in one pass: each piece of the buffer is reduced
// by one rank (ranks in order) and written straight into every rank's buffer, so
// each element is read once and written once per rank. Small: rank r does slice
// r; large (CPU): the ranks claim 64 KB chunks until none is left. Who reduces a
// piece does not change any bit. Staged (small, CPU): every rank reduces every
// rank's staged copy into its own buffer, in the same order: the same bits.
void InProcessCommunicator::AllReduceImpl(nn::Tensor& x, ReduceOp op) {
  const nn::DType dtype = x.dtype();
  if (Staged(x.nbytes())) {
    const int parity = group_->parity(rank());
    Copy(group_->staging(rank(), parity), x.data_ptr(), x.nbytes(), device());
    Publish("all_reduce", &x, &x, static_cast<int>(op));
    PtrList in;
    for (int k = 0; k < world_size(); ++k) in.push_back(group_->staging(k, parity));
    // An unsupported dtype throws on every rank (here, even for 0 elements).
    ReduceSlice(in, {x.data_ptr()}, 0, x.numel(), dtype, op, device(), "all_reduce");
    return;
  }
  const int parity = Publish("all_reduce", &x, &x, static_cast<int>(op));
  // One rank's sum or max is its own x: nothing to do (avg still divides).
  if (world_size() > 1 || op == ReduceOp::kAvg) {
    PtrList in;
    MutPtrList out;
    for (int k = 0; k < world_size(); ++k) {
      in.push_back(group_->slot(k, parity).send);
      out.push_back(group_->slot(k, parity).recv);
    }
    const int64_t element = nn::ElementSize(dtype);
    // An unsupported dtype throws here on every rank, before any claim.
    ReduceSlice(in, out, 0, 0, dtype, op, device(), "all_reduce");
    if (SharesWork(x.nbytes())) {
      ShareWork(x.numel(), kShareChunkBytes / element, [&](int64_t begin, int64_t end) {
        ReduceSlice(in, out, begin, end, dtype, op, device(), "all_reduce");
      });
    } else {
      const auto [begin, end] = Chunk(x.numel(), rank(), world_size(), element);
      ReduceSlice(in, out, begin, end, dtype, op, device(), "all_reduce");
    }
  }
  Finish();
}

// Small: every receiver copies root's buffer (staged, CPU: root's staged copy).
// Large: every rank, root included, copies parts of every receiver's buffer
// (claimed chunks on the CPU).
void InProcessCommunicator::BroadcastImpl(nn::Tensor& x, int root) {
  const int64_t bytes = x.nbytes();
  if (Staged(bytes)) {
    const int parity = group_->parity(rank());
    if (rank() == root) Copy(group_->staging(rank(), parity), x.data_ptr(), bytes, device());
    Publish("broadcast", &x, &x, root);
    if (rank() != root) Copy(x.data_ptr(), group_->staging(root, parity), bytes, device());
    return;
  }
  const int parity = Publish("broadcast", &x, &x, root);
  const char* src = static_cast<const char*>(group_->slot(root, parity).send);
  auto copy_part = [&](int64_t begin, int64_t end) {
    for (int k = 0; k < world_size(); ++k) {
      if (k == root) continue;
      char* dst = static_cast<char*>(group_->slot(k, parity).recv);
      Copy(dst + begin, src + begin, end - begin, device());
    }
  };
  if (SharesWork(bytes)) {
    ShareWork(bytes, kShareChunkBytes, copy_part);
  } else if (bytes >= kSplitBroadcastBytes && world_size() > 1 && !device().is_cuda()) {
    const auto [begin, end] = Chunk(bytes, rank(), world_size(), 1);
    copy_part(begin, end);
  } else if (rank() != root) {
    Copy(x.data_ptr(), src, bytes, device());
  }
  Finish();
}

// Every rank copies every rank's input (or staged copy) into its own output
// (reads spread over the ranks; each output written once, by the rank that
// reads it next).
void InProcessCommunicator::AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) {
  const int64_t bytes = input.nbytes();
  const bool staged = Staged(bytes);
  const int next_parity = group_->parity(rank());
  if (staged) Copy(group_->staging(rank(), next_parity), input.data_ptr(), bytes, device());
  const int parity = Publish("all_gather", &input, &output, 0);
  char* dst = static_cast<char*>(output.data_ptr());
  for (int k = 0; k < world_size(); ++k) {
    const void* src = staged ? group_->staging(k, parity) : group_->slot(k, parity).send;
    Copy(dst + k * bytes, src, bytes, device());
  }
  if (!staged) Finish();
}

void InProcessCommunicator::ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output,
                                              ReduceOp op) {
  const bool staged = Staged(input.nbytes());
  const int next_parity = group_->parity(rank());
  if (staged) {
    Copy(group_->staging(rank(), next_parity), input.data_ptr(), input.nbytes(), device());
  }
  const int parity = Publish("reduce_scatter", &input, &output, static_cast<int>(op));
  const int64_t offset_bytes = rank() * output.nbytes();
  PtrList in;
  for (int k = 0; k < world_size(); ++k) {
    const char* src = staged ? group_->staging(k, parity)
                             : static_cast<const char*>(group_->slot(k, parity).send);
    in.push_back(src + offset_bytes);
  }
  ReduceSlice(in, {output.data_ptr()}, 0, output.numel(), input.dtype(), op, device(),
              "reduce_scatter");
  if (!staged) Finish();
}

// CPU: one meeting (the slots alternate halves, so nothing needs a second one).
void InProcessCommunicator::BarrierImpl() {
  Publish("barrier", nullptr, nullptr, 0);
  if (device().is_cuda()) Finish();
}

// The closing half of every collective: nobody returns (and reuses or frees a
// buffer) while another rank may still read or write it.
void InProcessCommunicator::Finish() {
  const int parity = group_->parity(rank());
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    internal::RecordEvent(event_, device());
    group_->slot(rank(), parity).event = event_;
  }
#endif
  group_->ArriveAndWait(rank());
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    std::vector<void*> events;
    for (int k = 0; k < world_size(); ++k) events.push_back(group_->slot(k, parity).event);
    internal::WaitEvents(events, device());
  }
#endif
}

}  // namespace tandem::dist
