// Where the time of a training step goes: a Chrome trace-event file (JSON; opens
// in Perfetto, ui.perfetto.dev, and in chrome://tracing), one track per rank,
// grouped by process (host and pid) under mpirun.
//
//   dist::TraceRecorder trace({.first_step = 10, .steps = 5});  // steps 10..14
//   ... in each rank (spawn):
//   ctx.set_trace(&trace);                  // DataParallel records its buckets
//   trace.BeginStep(ctx.rank(), step);      // before each step's work
//   { dist::TraceSpan s(ctx, "forward"); ... }
//   ...
//   absl::Status s = dist::WriteTrace(ctx, trace, "trace.json");  // every rank; rank 0 writes
//
// Spans are host time (steady clock, microseconds): on a GPU they show when the
// host issued the work. On a CUDA rank each TraceSpan also records a pair of
// CUDA events on the rank's stream, and WriteTrace places those device spans on
// a second track per rank ("rank R (cuda:N) stream"), aligned with the host
// timeline through a reference event waited for once, at the first span. Those
// host waits (the reference, and each span's end event in WriteTrace) are
// stop-aware polls (nn/interrupt.h), as a rank's other host waits: a rank whose
// stream sits behind a collective a failed peer never joins still stops. An
// abandoned wait for the reference leaves every device span of the rank out; one
// for a span's end, that span.
// (Written and compiled; not yet run on a GPU: no GPU test or GPU run records a trace.) DataParallel adds one
// span per bucket all-reduce, with the bucket's bytes, from its launch in
// backward to when it finished (Work::finished_at; the end of its wait where the
// communicator does not say): the part before the backward span ends overlapped
// backward.
//
// Outside the window nothing is recorded (a lookup of the rank's state under a
// mutex per span); without a recorder (ctx.trace() null) nothing at all (a null
// check). The default window of the programs' --trace_steps is bounded (10:20).
// Thread-safety: a rank's spans are recorded by its own thread (and the threads
// it hands work to) under a per-rank mutex, which no device wait holds: the
// reference's wait and WriteTrace's waits for the spans' end events run with
// the mutex released, so a thread recording into the rank meanwhile never
// queues behind the device. WriteTrace is collective.
#ifndef TANDEM_SPAWN_OBSERVE_TRACE_H_
#define TANDEM_SPAWN_OBSERVE_TRACE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "nn/device.h"

namespace tandem::dist {

class Context;

// The steps a TraceRecorder records.
struct TraceWindow {
  int64_t first_step = 0;     // the first step recorded
  int64_t steps = INT64_MAX;  // how many
};

class TraceRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  using Window = TraceWindow;
  // One recorder serves every rank of a process (each has its own track).
  explicit TraceRecorder(Window window = {});

  // Rank `rank` (global) starts step `step`: spans are recorded while the step
  // is inside the window.
  void BeginStep(int rank, int64_t step);
  bool recording(int rank) const;
  // A complete span on the rank's track. args: the body of a JSON object
  // ("\"bytes\": 4096") or empty.
  void Span(int rank, absl::string_view name, Clock::time_point start, Clock::time_point end,
            const std::string& args = "");

  // This process's events as JSON array elements (comma-separated, no brackets),
  // with pid = process_index and tid = rank (device spans: kDeviceTrack + rank).
  std::string EventsJson(int process_index) const;

  // Turns the rank's recorded device spans into events (waits for them on the
  // device). Called by WriteTrace on each rank's own thread. Without CUDA: nothing.
  void ResolveDeviceSpans(int rank);
  static constexpr int kDeviceTrack = 1'000'000;

  ~TraceRecorder();  // releases the CUDA events of spans never written

 private:
  struct PendingDeviceSpan {
    std::string name;
    void* start = nullptr;  // cudaEvent_t
    void* end = nullptr;
  };
  struct Rank {
    mutable std::mutex mutex;
    std::atomic<bool> recording{false};
    std::string events;  // JSON objects, comma-separated
    std::vector<PendingDeviceSpan> device_spans;
    void* reference = nullptr;      // cudaEvent_t synchronised once: the device's origin
    int64_t reference_us = 0;       // host steady-clock microseconds at it
    bool reference_failed = false;  // not retried (each try is a host sync)
    bool reference_pending = false;  // a thread waits for it (without the mutex)
    std::condition_variable reference_settled;  // pending -> false
  };
  friend class TraceSpan;
  // CUDA ranks: a device span's events (cudaEvent_t, recorded by TraceSpan on the
  // rank's stream of `device`).
  void DeviceSpan(int rank, nn::Device device, absl::string_view name, void* start_event,
                  void* end_event);
  // Destroys the spans' events (CUDA) and empties `spans`.
  static void ReleaseEvents(std::vector<PendingDeviceSpan>& spans);
  // The rank's pending spans and its reference (r.mutex held).
  void ReleaseDeviceSpansLocked(Rank& r);
  Rank& At(int rank);
  const Rank* Find(int rank) const;

  const Window window_;
  mutable std::mutex ranks_mutex_;
  std::vector<std::pair<int, std::unique_ptr<Rank>>> ranks_;
};

// RAII span on ctx's recorder (nothing without one, or outside the window).
class TraceSpan {
 public:
  TraceSpan(const Context& ctx, const char* name, std::string args = "");
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  TraceRecorder* recorder_;
  int rank_;
  const char* name_;
  std::string args_;
  TraceRecorder::Clock::time_point start_;
  nn::Device device_;             // the rank's device
  void* device_start_ = nullptr;  // cudaEvent_t on a CUDA rank, else null
};

// Collective: every rank of the run calls it; global rank 0 writes `path` with
// every process's events and the track names ("process p (host h, pid n)",
// "rank r (device)"). Steady clocks of different hosts are not aligned: a
// multi-host trace shows each host's timeline from its own origin.
absl::Status WriteTrace(Context& ctx, TraceRecorder& trace, const std::string& path);

// "K:N" (steps K..K+N-1) or "K:" (from K on); errors name the value.
absl::Status ParseTraceWindow(absl::string_view text, TraceRecorder::Window* window);

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_OBSERVE_TRACE_H_
