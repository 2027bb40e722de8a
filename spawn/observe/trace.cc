#include "spawn/observe/trace.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "nn/graph.h"
#include "nn/interrupt.h"
#include "spawn/context.h"
#if TANDEM_WITH_CUDA
#include <cuda_runtime_api.h>

#include "nn/cuda/context.h"
#endif

namespace tandem::dist {
namespace {

// Microseconds of the steady clock since its epoch (boot on Linux): the same
// origin for every process of a host, so their tracks line up.
int64_t Micros(TraceRecorder::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

#if TANDEM_WITH_CUDA
// Waits on the host for `event` as a rank's other host waits do (nn/interrupt.h):
// the rank's stream may sit behind a collective that a failed peer never joins,
// and the rank's stop must end the wait. False when the event failed or the wait
// was abandoned (the span then has no device time); never throws.
bool WaitForEvent(cudaEvent_t event) {
  bool ok = true;
  try {
    nn::internal::WaitUntil([&] {
      const cudaError_t status = cudaEventQuery(event);
      if (status == cudaErrorNotReady) {
        cudaGetLastError();  // "not ready" is no error: not for the next launch check to see
        return false;
      }
      if (status != cudaSuccess) {
        cudaGetLastError();
        ok = false;
      }
      return true;
    });
  } catch (...) {  // the rank's interrupt check: it is stopping
    return false;
  }
  return ok;
}
#endif

// A JSON string literal's body: quotes, backslashes and control characters escaped.
std::string Escape(absl::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
    } else {
      out.push_back(c);
    }
  }
  return out;
}

// Every rank's string, in rank order (two all_gathers: the lengths, then the
// bytes padded to the longest).
std::vector<std::string> AllGatherStrings(Context& ctx, const std::string& mine) {
  Communicator& comm = ctx.communicator();
  const nn::Tensor length = nn::from_vector<int64_t>(
      {static_cast<int64_t>(mine.size())}, {1}, {.dtype = nn::kInt64, .device = ctx.device()});
  const std::vector<int64_t> lengths = comm.all_gather(length).to_vector<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  nn::Tensor bytes = nn::zeros({longest}, {.dtype = nn::kUInt8});
  std::memcpy(bytes.host_ptr(), mine.data(), mine.size());
  const nn::Tensor all = comm.all_gather(bytes.to(ctx.device())).to(nn::Device::CPU());
  std::vector<std::string> out;
  const char* data = static_cast<const char*>(all.host_ptr());
  for (size_t r = 0; r < lengths.size(); ++r) {
    out.emplace_back(data + r * longest, static_cast<size_t>(lengths[r]));
  }
  return out;
}

// Appends one complete ("X") event to a track's comma-separated events; the
// process id is left as PID until EventsJson knows it.
void AppendCompleteEvent(std::string* events, absl::string_view name, int64_t ts_us,
                         int64_t dur_us, int tid, const std::string& args) {
  absl::StrAppendFormat(events,
                        "%s{\"name\": \"%s\", \"ph\": \"X\", \"ts\": %d, \"dur\": %d, "
                        "\"pid\": PID, \"tid\": %d%s}",
                        events->empty() ? "" : ",\n", Escape(name), ts_us,
                        std::max<int64_t>(0, dur_us), tid,
                        args.empty() ? "" : absl::StrCat(", \"args\": {", args, "}"));
}

}  // namespace

TraceRecorder::TraceRecorder(Window window) : window_(window) {}

TraceRecorder::Rank& TraceRecorder::At(int rank) {
  std::lock_guard<std::mutex> lock(ranks_mutex_);
  for (auto& [r, state] : ranks_) {
    if (r == rank) return *state;
  }
  ranks_.emplace_back(rank, std::make_unique<Rank>());
  return *ranks_.back().second;
}

const TraceRecorder::Rank* TraceRecorder::Find(int rank) const {
  std::lock_guard<std::mutex> lock(ranks_mutex_);
  for (const auto& [r, state] : ranks_) {
    if (r == rank) return state.get();
  }
  return nullptr;
}

void TraceRecorder::BeginStep(int rank, int64_t step) {
  const bool inside = step >= window_.first_step &&
                      (window_.steps == INT64_MAX || step - window_.first_step < window_.steps);
  At(rank).recording.store(inside, std::memory_order_relaxed);
}

bool TraceRecorder::recording(int rank) const {
  const Rank* r = Find(rank);
  return r != nullptr && r->recording.load(std::memory_order_relaxed);
}

void TraceRecorder::Span(int rank, absl::string_view name, Clock::time_point start,
                         Clock::time_point end, const std::string& args) {
  Rank& r = At(rank);
  if (!r.recording.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  AppendCompleteEvent(&r.events, name, Micros(start), Micros(end) - Micros(start), rank, args);
}

std::string TraceRecorder::EventsJson(int process_index) const {
  std::string out;
  std::lock_guard<std::mutex> lock(ranks_mutex_);
  for (const auto& [rank, state] : ranks_) {
    std::lock_guard<std::mutex> rank_lock(state->mutex);
    if (state->events.empty()) continue;
    if (!out.empty()) out += ",\n";
    out += state->events;
  }
  // The process id is known only now (one recorder may outlive a run).
  return absl::StrReplaceAll(out, {{"\"pid\": PID", absl::StrCat("\"pid\": ", process_index)}});
}

TraceSpan::TraceSpan(const Context& ctx, const char* name, std::string args)
    : recorder_(ctx.trace()), rank_(ctx.rank()), name_(name), args_(std::move(args)),
      device_(ctx.device()) {
  if (recorder_ != nullptr && !recorder_->recording(rank_)) recorder_ = nullptr;
  if (recorder_ == nullptr) return;
  start_ = TraceRecorder::Clock::now();
#if TANDEM_WITH_CUDA
  // Inside a CUDA graph capture an event record would become a node of the
  // graph, not a time: such a span records host time only.
  if (device_.is_cuda() && !nn::CudaGraph::IsCapturing()) {
    // Never throws: a span that cannot get its events records host time only.
    cudaEvent_t event = nullptr;
    nn::internal::CudaDeviceScope scope(device_, std::nothrow);
    try {
      if (cudaEventCreate(&event) == cudaSuccess &&
          cudaEventRecord(event, nn::internal::ThreadStream(device_)) == cudaSuccess) {
        device_start_ = event;
        event = nullptr;
      }
    } catch (const std::exception&) {  // ThreadStream could not make a stream
    }
    if (event != nullptr) cudaEventDestroy(event);
  }
#endif
}

TraceSpan::~TraceSpan() {
  if (recorder_ == nullptr) return;
  try {
    recorder_->Span(rank_, name_, start_, TraceRecorder::Clock::now(), args_);
  } catch (const std::exception&) {  // out of memory for the text: the span is lost
  }
#if TANDEM_WITH_CUDA
  if (device_start_ != nullptr) {
    cudaEvent_t end = nullptr;
    nn::internal::CudaDeviceScope scope(device_, std::nothrow);
    bool kept = false;
    try {
      if (cudaEventCreate(&end) == cudaSuccess &&
          cudaEventRecord(end, nn::internal::ThreadStream(device_)) == cudaSuccess) {
        recorder_->DeviceSpan(rank_, device_, name_, device_start_, end);
        kept = true;
      }
    } catch (const std::exception&) {
    }
    if (!kept) {
      cudaEventDestroy(static_cast<cudaEvent_t>(device_start_));
      if (end != nullptr) cudaEventDestroy(end);
    }
  }
#endif
}

void TraceRecorder::DeviceSpan(int rank, nn::Device device, absl::string_view name,
                               void* start_event, void* end_event) {
  Rank& r = At(rank);
  bool take_reference = false;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.device_spans.push_back({std::string(name), start_event, end_event});
#if TANDEM_WITH_CUDA
    take_reference = r.reference == nullptr && !r.reference_failed && !r.reference_pending;
    r.reference_pending = r.reference_pending || take_reference;
#endif
  }
#if TANDEM_WITH_CUDA
  if (!take_reference) return;
  // The device's origin: an event on the rank's stream that the host waits for
  // once, so that its device time is (about) the host time right after the wait.
  // One host sync per run, at the first traced span; a failure is not retried.
  // The wait holds no lock: the rank's other threads keep recording meanwhile
  // (reference_pending keeps a second thread from starting another).
  // Never throws: the span is already kept, and reference_pending must be
  // cleared below whatever happens here.
  cudaEvent_t reference = nullptr;
  bool ok = false;
  try {
    nn::internal::CudaDeviceScope scope(device, std::nothrow);
    ok = cudaEventCreate(&reference) == cudaSuccess &&
         cudaEventRecord(reference, nn::internal::ThreadStream(device)) == cudaSuccess &&
         WaitForEvent(reference);
  } catch (const std::exception&) {  // ThreadStream could not make a stream
    ok = false;
  }
  const int64_t reference_us = Micros(Clock::now());
  if (!ok && reference != nullptr) cudaEventDestroy(reference);
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (ok) {
      r.reference = reference;
      r.reference_us = reference_us;
    } else {
      r.reference_failed = true;
    }
    r.reference_pending = false;
  }
  r.reference_settled.notify_all();
#else
  (void)device;
#endif
}

void TraceRecorder::ResolveDeviceSpans(int rank) {
  Rank& r = At(rank);
  // The spans are taken out under the lock and waited for without it, so that
  // the rank's other threads (and its own later spans) never queue behind a
  // device wait; their events are appended under the lock again.
  std::vector<PendingDeviceSpan> spans;
  void* reference = nullptr;
  int64_t reference_us = 0;
  {
    std::unique_lock<std::mutex> lock(r.mutex);
    // A reference another thread is waiting for (without the lock) is needed here.
    r.reference_settled.wait(lock, [&] { return !r.reference_pending; });
    spans.swap(r.device_spans);
    reference = r.reference;
    reference_us = r.reference_us;
  }
  std::string events;
#if TANDEM_WITH_CUDA
  for (const PendingDeviceSpan& span : spans) {
    auto start = static_cast<cudaEvent_t>(span.start);
    auto end = static_cast<cudaEvent_t>(span.end);
    float offset_ms = 0, duration_ms = 0;
    // The offset from the reference (the reference is recorded after the first
    // span: earlier events have negative offsets, which is fine); the duration
    // from the span's own pair, so that it keeps full float precision however
    // long after the reference the span ran.
    if (reference != nullptr && WaitForEvent(end) &&
        cudaEventElapsedTime(&offset_ms, static_cast<cudaEvent_t>(reference), start) ==
            cudaSuccess &&
        cudaEventElapsedTime(&duration_ms, start, end) == cudaSuccess) {
      AppendCompleteEvent(&events, span.name,
                          reference_us + static_cast<int64_t>(offset_ms * 1000.0),
                          static_cast<int64_t>(duration_ms * 1000.0), kDeviceTrack + rank, "");
    }
  }
#else
  (void)reference_us;
#endif
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!events.empty()) absl::StrAppend(&r.events, r.events.empty() ? "" : ",\n", events);
  ReleaseEvents(spans);
  // The reference goes with the spans it measured, unless spans recorded
  // meanwhile still need it.
  if (r.device_spans.empty() && r.reference == reference) ReleaseDeviceSpansLocked(r);
}

void TraceRecorder::ReleaseEvents(std::vector<PendingDeviceSpan>& spans) {
#if TANDEM_WITH_CUDA
  for (const PendingDeviceSpan& span : spans) {
    cudaEventDestroy(static_cast<cudaEvent_t>(span.start));
    cudaEventDestroy(static_cast<cudaEvent_t>(span.end));
  }
#endif
  spans.clear();
}

void TraceRecorder::ReleaseDeviceSpansLocked(Rank& r) {
  ReleaseEvents(r.device_spans);
#if TANDEM_WITH_CUDA
  if (r.reference != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(r.reference));
#endif
  r.reference = nullptr;
}

TraceRecorder::~TraceRecorder() {
  // A run that ended without WriteTrace (a failure) leaves its events here.
  for (auto& [rank, state] : ranks_) {
    std::lock_guard<std::mutex> lock(state->mutex);
    ReleaseDeviceSpansLocked(*state);
  }
}

absl::Status WriteTrace(Context& ctx, TraceRecorder& trace, const std::string& path) {
  // Every rank has stopped recording (and turned its device spans into events)
  // before local rank 0 reads its process's recorder.
  trace.ResolveDeviceSpans(ctx.rank());
  ctx.communicator().barrier();
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  std::string mine;
  {
    // This rank's events only: a recorder shared by local ranks holds them all,
    // and local rank 0 sends them for its process (the others send nothing).
    if (ctx.local_rank() == 0) mine = trace.EventsJson(ctx.process_index());
    std::string names = absl::StrFormat(
        "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": "
        "\"rank %d (%s)\"}}",
        ctx.process_index(), ctx.rank(), ctx.rank(), Escape(ctx.device().ToString()));
    if (ctx.device().is_cuda()) {
      absl::StrAppendFormat(&names,
                            ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
                            "\"args\": {\"name\": \"rank %d (%s) stream\"}}",
                            ctx.process_index(), TraceRecorder::kDeviceTrack + ctx.rank(),
                            ctx.rank(), Escape(ctx.device().ToString()));
    }
    mine = mine.empty() ? names : absl::StrCat(names, ",\n", mine);
    if (ctx.local_rank() == 0) {
      mine = absl::StrCat(
          absl::StrFormat("{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": "
                          "{\"name\": \"process %d (host %s, pid %d)\"}}",
                          ctx.process_index(), ctx.process_index(), Escape(host), ::getpid()),
          ",\n", mine);
    }
  }
  const std::vector<std::string> all = AllGatherStrings(ctx, mine);
  if (ctx.rank() != 0) return absl::OkStatus();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return absl::InvalidArgumentError(absl::StrCat("--trace \"", path, "\": cannot create ", tmp));
    out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
    bool first = true;
    for (const std::string& part : all) {
      if (part.empty()) continue;
      out << (first ? "" : ",\n") << part;
      first = false;
    }
    out << "\n]}\n";
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("--trace \"", path, "\": write failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("--trace \"", path, "\": rename failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status ParseTraceWindow(absl::string_view text, TraceRecorder::Window* window) {
  const size_t colon = text.find(':');
  int64_t first = 0, steps = INT64_MAX;
  const absl::string_view a = text.substr(0, colon);
  const absl::string_view b = colon == absl::string_view::npos ? "" : text.substr(colon + 1);
  const bool ok = colon != absl::string_view::npos && absl::SimpleAtoi(a, &first) && first >= 0 &&
                  (b.empty() || (absl::SimpleAtoi(b, &steps) && steps >= 1));
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--trace_steps \"", text, "\": expected K:N (N steps from step K, K >= 0, N >= 1) or K:"));
  }
  *window = {.first_step = first, .steps = steps};
  return absl::OkStatus();
}

}  // namespace tandem::dist
