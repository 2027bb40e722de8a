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

void FlightRecorder::Reset(int entries) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = std::max(entries, 0);
  ring_.assign(static_cast<size_t>(capacity_), FlightRecord());
  entered_ = 0;
  completed_through_ = 0;
}

void FlightRecorder::set_kind(std::string kind) {
  std::lock_guard<std::mutex> lock(mutex_);
  kind_ = std::move(kind);
}

FlightRecord* FlightRecorder::Slot(uint64_t sequence) {
  if (sequence == 0 || sequence > entered_) return nullptr;
  FlightRecord& r = ring_[(sequence - 1) % static_cast<uint64_t>(capacity_)];
  return r.sequence == sequence ? &r : nullptr;
}

void FlightRecorder::Entered(uint64_t sequence, const char* op, std::optional<nn::DType> dtype,
                             int64_t numel, int64_t now_ns) {
  if (capacity_ == 0) return;  // fixed before any collective: no lock for a disabled ring
  std::lock_guard<std::mutex> lock(mutex_);
  FlightRecord& r = ring_[(sequence - 1) % static_cast<uint64_t>(capacity_)];
  r = {.sequence = sequence, .op = op, .dtype = dtype, .numel = numel, .entered_ns = now_ns};
  entered_ = std::max(entered_, sequence);
}

void FlightRecorder::Started(uint64_t sequence, int64_t now_ns) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (FlightRecord* r = Slot(sequence); r != nullptr && r->started_ns == 0) r->started_ns = now_ns;
}

void FlightRecorder::Completed(uint64_t through_sequence, int64_t now_ns) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  through_sequence = std::min(through_sequence, entered_);
  if (through_sequence <= completed_through_) return;
  const uint64_t capacity = static_cast<uint64_t>(capacity_);
  // Only the last `capacity` can still be in the ring.
  uint64_t s = std::max(completed_through_ + 1,
                        through_sequence > capacity ? through_sequence - capacity + 1 : 1);
  for (; s <= through_sequence; ++s) {
    FlightRecord* r = Slot(s);
    if (r == nullptr || r->state != CollectiveState::kEntered) continue;
    r->state = CollectiveState::kCompleted;
    r->ended_ns = now_ns;
  }
  completed_through_ = through_sequence;
}

void FlightRecorder::Failed(uint64_t sequence, int64_t now_ns) {
  if (capacity_ == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  FlightRecord* r = Slot(sequence);
  if (r == nullptr || r->state != CollectiveState::kEntered) return;
  r->state = CollectiveState::kFailed;
  r->ended_ns = now_ns;
}

std::vector<FlightRecord> FlightRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<FlightRecord> out;
  if (capacity_ == 0) return out;
  const uint64_t capacity = static_cast<uint64_t>(capacity_);
  const uint64_t first = entered_ > capacity ? entered_ - capacity + 1 : 1;
  for (uint64_t s = first; s <= entered_; ++s) {
    const FlightRecord& r = ring_[(s - 1) % capacity];
    if (r.sequence == s) out.push_back(r);
  }
  return out;
}

uint64_t FlightRecorder::entered() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entered_;
}

namespace {

// "#4 all_reduce float32[256]", "#5 barrier".
std::string Describe(const FlightRecord& r) {
  std::string text = absl::StrCat("#", r.sequence, " ", r.op);
  if (r.dtype.has_value()) absl::StrAppend(&text, " ", nn::DTypeName(*r.dtype), "[", r.numel, "]");
  return text;
}

std::string Seconds(int64_t ns) { return absl::StrFormat("%.6f s", static_cast<double>(ns) * 1e-9); }

std::string DescribeTimes(const FlightRecord& r, int64_t now_ns) {
  std::string text = absl::StrCat("entered ", Seconds(now_ns - r.entered_ns), " ago");
  if (r.started_ns != 0 && r.started_ns != r.entered_ns) {
    absl::StrAppend(&text, ", started ", Seconds(r.started_ns - r.entered_ns), " after");
  }
  switch (r.state) {
    case CollectiveState::kEntered:
      absl::StrAppend(&text, ", not completed");
      break;
    case CollectiveState::kCompleted:
      absl::StrAppend(&text, ", took ", Seconds(r.ended_ns - r.entered_ns));
      break;
    case CollectiveState::kFailed:
      absl::StrAppend(&text, ", ended after ", Seconds(r.ended_ns - r.entered_ns));
      break;
  }
  return text;
}

}  // namespace

std::vector<std::string> FlightRecorder::Dump(absl::string_view who, int64_t now_ns) const {
  std::string kind;
  {
    std::lock_guard<std::mutex> lock(mutex_);
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
  for (const auto& [who, ring] : rings) {
    fewest = std::min(fewest, Last(ring));
    most = std::max(most, Last(ring));
  }
  // Sequence numbers every ring entered: compare them where two rings still hold them.
  for (uint64_t s = 1; s <= fewest; ++s) {
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
  return absl::StrCat("flight recorder: the ranks first differ at #", fewest + 1, ": ", ahead,
                      " entered ", next != nullptr ? Describe(*next) : absl::StrCat("#", fewest + 1),
                      "; ", behind, " had entered only ", fewest, " collectives");
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
