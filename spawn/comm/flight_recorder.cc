#include "spawn/comm/flight_recorder.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace tandem::dist {

const char* CollectiveStateName(CollectiveState state) {
  switch (state) {
    case CollectiveState::kEntered: return "entered";
    case CollectiveState::kCompleted: return "completed";
    case CollectiveState::kFailed: return "failed";
  }
  return "?";
}

namespace {
constexpr uint64_t kStateBits = 2;
constexpr uint64_t Tag(uint64_t sequence, CollectiveState state) {
  return sequence << kStateBits | static_cast<uint64_t>(state);
}
}  // namespace

void FlightRecorder::Reset(int entries) {
  capacity_ = std::max(entries, 0);
  slots_ = capacity_ > 0 ? std::make_unique<Slot[]>(static_cast<size_t>(capacity_)) : nullptr;
  entered_.store(0, std::memory_order_relaxed);
}

void FlightRecorder::set_kind(std::string kind) {
  std::lock_guard<std::mutex> lock(kind_mutex_);
  kind_ = std::move(kind);
}

void FlightRecorder::Entered(uint64_t sequence, const char* op, std::optional<nn::DType> dtype,
                             int64_t numel, int64_t now_ns) {
  if (capacity_ == 0) return;
  Slot& slot = *SlotOf(sequence);
  // Seqlock writer: invalid while written, then published with its sequence.
  slot.tag.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  slot.op.store(op, std::memory_order_relaxed);
  slot.numel.store(numel, std::memory_order_relaxed);
  slot.dtype.store(dtype.has_value() ? static_cast<int>(*dtype) : -1, std::memory_order_relaxed);
  slot.entered_ns.store(now_ns, std::memory_order_relaxed);
  slot.ended_ns.store(0, std::memory_order_relaxed);
  slot.tag.store(Tag(sequence, CollectiveState::kEntered), std::memory_order_release);
  entered_.store(sequence, std::memory_order_release);
}

bool FlightRecorder::Transition(uint64_t sequence, CollectiveState state, int64_t now_ns) {
  Slot& slot = *SlotOf(sequence);
  uint64_t expected = Tag(sequence, CollectiveState::kEntered);
  // The end time first, so that a reader that sees the new state sees it too;
  // a record overwritten meanwhile rewrites it before it is published.
  if (slot.tag.load(std::memory_order_relaxed) != expected) return false;
  slot.ended_ns.store(now_ns, std::memory_order_relaxed);
  return slot.tag.compare_exchange_strong(expected, Tag(sequence, state),
                                          std::memory_order_acq_rel);
}

void FlightRecorder::Completed(uint64_t after, uint64_t through, int64_t now_ns) {
  if (capacity_ == 0) return;
  const uint64_t capacity = static_cast<uint64_t>(capacity_);
  // Only the last `capacity` can still be in the ring.
  uint64_t s = std::max(after + 1, through > capacity ? through - capacity + 1 : 1);
  for (; s <= through; ++s) Transition(s, CollectiveState::kCompleted, now_ns);
}

void FlightRecorder::Failed(uint64_t sequence, int64_t now_ns) {
  if (capacity_ == 0 || sequence == 0) return;
  Transition(sequence, CollectiveState::kFailed, now_ns);
}

std::vector<FlightRecord> FlightRecorder::Snapshot() const {
  std::vector<FlightRecord> out;
  if (capacity_ == 0) return out;
  const uint64_t capacity = static_cast<uint64_t>(capacity_);
  const uint64_t last = entered();
  const uint64_t first = last > capacity ? last - capacity + 1 : 1;
  for (uint64_t s = first; s <= last; ++s) {
    const Slot& slot = *SlotOf(s);
    // Seqlock reader: the fields count only when the tag names s before and after.
    const uint64_t before = slot.tag.load(std::memory_order_acquire);
    FlightRecord r{.sequence = s,
                   .op = slot.op.load(std::memory_order_relaxed),
                   .numel = slot.numel.load(std::memory_order_relaxed),
                   .entered_ns = slot.entered_ns.load(std::memory_order_relaxed),
                   .ended_ns = slot.ended_ns.load(std::memory_order_relaxed)};
    const int dtype = slot.dtype.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t after = slot.tag.load(std::memory_order_relaxed);
    if (before >> kStateBits != s || after >> kStateBits != s) continue;
    if (dtype >= 0) r.dtype = static_cast<nn::DType>(dtype);
    r.state = static_cast<CollectiveState>(after & ((1u << kStateBits) - 1));
    if (r.state == CollectiveState::kEntered) r.ended_ns = 0;
    out.push_back(r);
  }
  return out;
}

namespace {

// "#4 all_reduce float32[256]", "#5 barrier".
std::string Describe(const FlightRecord& r) {
  std::string text = absl::StrCat("#", r.sequence, " ", r.op);
  if (r.dtype.has_value()) absl::StrAppend(&text, " ", nn::DTypeName(*r.dtype), "[", r.numel, "]");
  return text;
}

std::string Seconds(int64_t ns) {
  return absl::StrFormat("%.6f s", static_cast<double>(ns) * 1e-9);
}

std::string DescribeTimes(const FlightRecord& r, int64_t now_ns) {
  std::string text = absl::StrCat("entered ", Seconds(now_ns - r.entered_ns), " ago");
  switch (r.state) {
    case CollectiveState::kEntered:
      absl::StrAppend(&text, ", not completed");
      break;
    case CollectiveState::kCompleted:  // ended_ns 0: the end was being recorded
      if (r.ended_ns != 0) absl::StrAppend(&text, ", took ", Seconds(r.ended_ns - r.entered_ns));
      break;
    case CollectiveState::kFailed:
      if (r.ended_ns != 0) {
        absl::StrAppend(&text, ", ended after ", Seconds(r.ended_ns - r.entered_ns));
      }
      break;
  }
  return text;
}

}  // namespace

std::vector<std::string> FlightRecorder::Dump(absl::string_view who, int64_t now_ns) const {
  std::string kind;
  {
    std::lock_guard<std::mutex> lock(kind_mutex_);
    kind = kind_;
  }
  const std::string prefix = absl::StrCat("flight recorder: ", who);
  if (capacity_ == 0) {
    return {absl::StrCat(prefix, ": disabled (SpawnOptions::flight_recorder_entries = 0)")};
  }
  const std::vector<FlightRecord> records = Snapshot();
  const uint64_t total = records.empty() ? 0 : records.back().sequence;
  std::vector<std::string> lines;
  lines.push_back(absl::StrCat(prefix, kind.empty() ? "" : absl::StrCat(" [", kind, "]"), ": ",
                               total, " collectives entered",
                               records.empty() ? "" : absl::StrCat(", the last ", records.size(),
                                                                   " (oldest first):")));
  for (const FlightRecord& r : records) {
    lines.push_back(absl::StrCat(prefix, " ", Describe(r), " ", CollectiveStateName(r.state),
                                 ": ", DescribeTimes(r, now_ns)));
  }
  return lines;
}

namespace {

// all_reduce and all_reduce_async are the same collective to the peers.
bool SameCollective(const FlightRecord& a, const FlightRecord& b) {
  return absl::StripSuffix(a.op, "_async") == absl::StripSuffix(b.op, "_async") &&
         a.dtype == b.dtype && a.numel == b.numel;
}

const FlightRecord* Find(const std::vector<FlightRecord>& ring, uint64_t sequence) {
  if (ring.empty() || sequence < ring.front().sequence || sequence > ring.back().sequence) {
    return nullptr;
  }
  const FlightRecord& r = ring[sequence - ring.front().sequence];
  return r.sequence == sequence ? &r : nullptr;
}

uint64_t Last(const std::vector<FlightRecord>& ring) {
  return ring.empty() ? 0 : ring.back().sequence;
}

}  // namespace

std::string DescribeDivergence(
    const std::vector<std::pair<std::string, std::vector<FlightRecord>>>& rings) {
  if (rings.size() < 2) return "";
  uint64_t fewest = UINT64_MAX;
  uint64_t most = 0;
  uint64_t oldest = UINT64_MAX;  // the oldest record any ring still holds
  for (const auto& [who, ring] : rings) {
    fewest = std::min(fewest, Last(ring));
    most = std::max(most, Last(ring));
    if (!ring.empty()) oldest = std::min(oldest, ring.front().sequence);
  }
  // Sequence numbers every ring entered: compare them where two rings still hold them.
  for (uint64_t s = oldest; s <= fewest; ++s) {
    const FlightRecord* reference = nullptr;
    const std::string* reference_who = nullptr;
    for (const auto& [who, ring] : rings) {
      const FlightRecord* r = Find(ring, s);
      if (r == nullptr) continue;
      if (reference == nullptr) {
        reference = r;
        reference_who = &who;
      } else if (!SameCollective(*reference, *r)) {
        return absl::StrCat("flight recorder: the ranks first differ at #", s, ": ",
                            *reference_who, " entered ", Describe(*reference), ", ", who,
                            " entered ", Describe(*r));
      }
    }
  }
  if (fewest == most) return "";
  std::string ahead;
  std::string behind;
  const FlightRecord* next = nullptr;
  for (const auto& [who, ring] : rings) {
    if (Last(ring) == fewest) {
      absl::StrAppend(&behind, behind.empty() ? "" : ", ", who);
    } else {
      absl::StrAppend(&ahead, ahead.empty() ? "" : ", ", who);
      if (next == nullptr) next = Find(ring, fewest + 1);
    }
  }
  const std::string entered =
      next != nullptr ? Describe(*next) : absl::StrCat("#", fewest + 1);
  return absl::StrCat("flight recorder: the ranks first differ at #", fewest + 1, ": ", ahead,
                      " entered ", entered, "; ", behind, " had entered only ", fewest,
                      " collectives");
}

std::vector<std::string> DumpFlightRecorders(
    const std::vector<std::pair<std::string, const FlightRecorder*>>& rings, int64_t now_ns) {
  std::vector<std::string> lines;
  std::vector<std::pair<std::string, std::vector<FlightRecord>>> snapshots;
  for (const auto& [who, ring] : rings) {
    std::vector<std::string> one = ring->Dump(who, now_ns);
    lines.insert(lines.end(), one.begin(), one.end());
    if (ring->enabled()) snapshots.emplace_back(who, ring->Snapshot());
  }
  if (std::string divergence = DescribeDivergence(snapshots); !divergence.empty()) {
    lines.push_back(std::move(divergence));
  }
  return lines;
}

}  // namespace tandem::dist
