// How the handle of an asynchronous NCCL collective (NcclWork,
// nccl_work.cc) waits for its collective, in wait() or in its
// destructor, from where the call is made, and the host wait's loop. Header
// only and free of CUDA, so that both are tested on the CPU
// (tests/spawn/comm/nccl_work_wait_test.cc).
// Internal to spawn.
//
// The handle has an end event recorded after the collective on the
// communication stream. CUDA's rules for it:
//  - an event recorded inside a capture cannot be queried
//    (cudaErrorCapturedEvent), and a wait on it from another capture merges
//    the two captures (CUDA invalidates the later one);
//  - a stream being captured cannot wait for an event recorded outside its
//    capture (only with cudaEventWaitExternal, which makes every replay wait
//    for whatever was last recorded on the event at that time: a pooled event
//    that later collectives reuse, so no use here); the wait invalidates the
//    capture;
//  - the thread's compute stream is gone from the thread once its streams
//    were given back at its exit (a thread_local holding the handle that was
//    made before the thread's first stream is destroyed after them).
#ifndef TANDEM_SPAWN_COMM_NCCL_INTERNAL_WORK_WAIT_H_
#define TANDEM_SPAWN_COMM_NCCL_INTERNAL_WORK_WAIT_H_

#include <cstdint>

namespace tandem::dist::internal {

enum class WorkWaitPath {
  // The calling thread's compute stream waits for the end event: no host wait.
  kStream,
  // The host waits for the end event (stop-aware): the event was recorded
  // outside any capture, and a query of it is legal in a capture too.
  kHost,
  // Nothing is waited for: the collective was recorded in a capture that has
  // ended (its replays are ordered on the stream that launches the graph).
  kNone,
  // wait() of a collective recorded in a capture that has ended: an error.
  kRefused,
};

// Where the wait is asked for.
struct WorkWaitSite {
  uint64_t made_in = 0;       // nn::CudaGraph::CaptureId() when the handle was made; 0: eager
  uint64_t capture_now = 0;   // nn::CudaGraph::CaptureId() on the calling thread now
  bool stream_captures = false;  // the calling thread's stream of the handle's device captures
  bool streams_gone = false;     // the calling thread's streams were given back (its exit)
};

// `destructor`: the handle is destroyed unwaited (never an error); otherwise
// wait() is called.
inline WorkWaitPath PlanWorkWait(const WorkWaitSite& site, bool destructor) {
  if (site.made_in != 0) {
    // Recorded in a capture: its event can be waited for only inside that
    // capture (the compute stream joins the communication stream back there).
    if (site.made_in == site.capture_now && !site.streams_gone) return WorkWaitPath::kStream;
    return destructor ? WorkWaitPath::kNone : WorkWaitPath::kRefused;
  }
  // Eager: run, or running, on the device. Inside a capture of the calling
  // thread's stream, or once that stream is gone, the host waits: afterwards the
  // collective is over, and nothing queued later can touch its tensor early.
  if (site.streams_gone || site.stream_captures) return WorkWaitPath::kHost;
  return WorkWaitPath::kStream;
}

// The kHost wait's loop, free of CUDA so that the CPU test runs it: `query()`
// asks once whether the end event has completed (`success`: done; `not_ready`:
// still running; anything else: a failure, such as a broken context's), and
// `wait_until(ready)` calls `ready` until it returns true (stop-aware:
// nn::internal::WaitUntil, which may throw). Returns `success` once the event
// has completed, else the failure that ended the wait: never `not_ready`, which
// earlier queries of a collective still running answered.
template <typename Status, typename Query, typename WaitUntil>
Status WaitForEventOnHost(Query query, WaitUntil wait_until, Status success, Status not_ready) {
  Status result = success;
  wait_until([&] {
    const Status status = query();
    if (status == not_ready) return false;
    result = status;
    return true;
  });
  return result;
}

inline const char* WorkWaitPathName(WorkWaitPath path) {
  switch (path) {
    case WorkWaitPath::kStream: return "stream";
    case WorkWaitPath::kHost: return "host";
    case WorkWaitPath::kNone: return "none";
    case WorkWaitPath::kRefused: return "refused";
  }
  return "?";
}

}  // namespace tandem::dist::internal

#endif  // TANDEM_SPAWN_COMM_NCCL_INTERNAL_WORK_WAIT_H_
