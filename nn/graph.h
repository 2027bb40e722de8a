// CudaGraph: capture a whole training step (forward, backward, gradient
// all-reduce, optimizer update) once and replay it with one launch per step.
//
// Typical use:
//   step();                          // warm-up, eager: fills caches, optimizer state, grads
//   nn::CudaGraph graph;             // on the thread's current device
//   graph.Capture([&] { step(); });  // records, runs nothing
//   for (...) { input.copy_(next_batch); graph.Replay(); }   // static input tensors
//
// What a captured step may and may not do (the limits of CUDA graphs):
//  - Static shapes and addresses. The graph replays the exact kernels with the
//    exact pointers it recorded. Inputs must be copied into the tensors the
//    captured step read (input.copy_(batch)) before Replay(); a new tensor made
//    outside the graph is never seen by it. Outputs (the loss tensor the step
//    returned to the caller through a capture, the gradients, the weights) are
//    rewritten in place by each replay.
//  - No host reads inside the step: item(), a copy to the host, ToString() of a
//    CUDA tensor, a stream or device synchronisation. Capture() detects them and
//    throws "CudaGraph::Capture: the step synchronised with the host (...)"; the
//    thread stays usable and the graph stays uncaptured.
//  - No data-dependent control flow on the host: whatever branch the host took
//    while capturing is the branch every replay takes.
//  - Run one eager step first. Lazily built state (cuBLASLt / cuDNN plans,
//    optimizer state and device tables, DataParallel buckets, NCCL
//    communicators) must exist before capture; the optimizer refuses to build
//    its device tables under capture ("run one eager step before capturing").
//  - Memory: every CUDA tensor allocated on the capturing thread during
//    Capture() comes from a private arena owned by the graph (bump allocation
//    from chunks of the device's stream-ordered pool, 256-byte aligned). Memory freed inside the step is
//    NOT reused within the step, so the capture's footprint is the sum of all of
//    the step's temporaries (activations, gradients, workspaces). The arena lives
//    as long as the graph or any tensor allocated from it (the loss returned by
//    the step stays valid after the graph is destroyed). Pool memory allocated
//    before Capture() and released during it (the graph may still read it), by
//    the capturing thread or by another thread (below), is kept with the
//    arena. When the last of them goes, the arena frees it all, stream-ordered
//    after every stream that launched the graph (a replay may be pending) and
//    every stream that owned the released memory: no host wait,
//    no cudaFree and no device synchronisation (which, mid-run, could wait
//    behind other GPUs' NCCL kernels).
//  - Optimizers: the step count, learning rate and bias corrections are not
//    baked into the graph. Under capture an optimizer registers a pre-replay hook
//    (AddPreReplayHook) that advances its step count and uploads the scalars
//    with the group's current lr before each replay, so LR schedules stepped
//    between replays are honoured and state_dict() counts replays.
//  - Communicators: NCCL collectives are captured (the communication stream
//    joins the capture through event waits and joins back before the step ends).
//    The in-process communicator's GPU path (several ranks on one GPU) uses a
//    host rendezvous and cannot be captured: a capture that reaches it fails at
//    once with an error naming the limit. Capture on every rank of a NCCL group;
//    replay on every rank (each rank replays its own graph, like an eager step).
//    An asynchronous collective's handle made before the capture (a warm-up
//    step's) and waited for or dropped inside it makes the host wait for that
//    collective there (the capturing stream may not wait for an event recorded
//    outside the capture).
//  - RNG: a dropout draws its Philox offset from the thread's generator on the
//    host. Under capture dropout reads the offset from device memory that a
//    pre-replay hook writes after reserving the counters on the replaying
//    thread's generator, so each replay draws a fresh mask, the one an eager
//    step would have drawn (see nn/ops/dropout.h). rand() / randn() inside the
//    step are NOT handled so: they draw the same numbers at every replay (and
//    advance the generator once, at capture); make random inputs outside the
//    step and copy them into the step's static tensors.
//  - Only the calling thread's work is captured (cudaStreamCaptureModeThreadLocal):
//    other ranks' threads keep running eagerly while one thread captures. What
//    synchronises a whole device is invalid while any of its streams captures
//    (CUDA then fails the call and invalidates the capture); the release of a
//    graph's memory records events on the streams that launched it, which must
//    not join a capture, so it waits until no capture runs on that device;
//    calls that synchronise a device (a thread's cuDNN teardown at exit)
//    should not overlap another thread's capture of the same GPU.
//  - Another thread may drop or read tensors that the capturing thread's stream
//    owns while it captures (work enqueued on a capturing stream, from any
//    thread, is recorded rather than run, so that work is not done there): a
//    free, with the owner's waits for the streams that used the tensor, is done
//    by the capturing thread once the capture has ended (the memory is kept
//    with the arena), and a first read on another stream waits for the work
//    the capturing stream had queued before the capture began (what the
//    captured work writes exists only at replays). The other way round is a
//    limit: the capturing thread's first use of a tensor that another thread's
//    stream owns makes the capturing stream wait for an event recorded outside
//    the capture, which CUDA refuses: Capture() throws with CUDA's error. The
//    eager warm-up step makes those first uses.
//  - A graph that holds collectives (NCCL) must be replayed on the rank thread
//    that captured it: its replays are traced in that rank's communicator.
//
// Thread-safety: a CudaGraph belongs to the thread that captures it. Replay()
// from another thread whose current device is device() is allowed (it launches
// on that thread's stream, and the pre-replay hooks then run on that thread:
// e.g. dropout advances that thread's generator), but two threads must not call
// Replay() on one graph at once. Such a replay is ordered both ways against the
// capturing thread's stream, which owns the tensors the graph reads and writes:
// it runs after the work queued there, and work queued there later runs after
// it; it throws while a capture runs on the device (those waits would join it),
// and a capture on the device waits for it to be launched (a capture or replay
// on another device does not). The components the step used (module,
// optimizer, DataParallel, communicator) must outlive the replays; an optimizer
// destroyed before a Replay() makes that Replay() throw. So must the capturing
// thread: the graph reads memory of that thread at every replay (its cuBLASLt
// workspace, clip_grad_norm_'s pointer tables), freed when it exits, so its
// exit releases the graphs it captured (waiting for a Replay() under way on
// another thread to be launched), and a later Replay() throws tandem::Error
// naming the exited thread.
#ifndef TANDEM_NN_GRAPH_H_
#define TANDEM_NN_GRAPH_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "nn/device.h"

namespace tandem::nn {

class CudaGraph {
 public:
  // Throws tandem::Error naming `device` if it is not a CUDA device, or if tandem
  // was built without CUDA ("tandem was built without CUDA").
  explicit CudaGraph(Device device = current_device());
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Records `step` on the calling thread's stream for device() and instantiates
  // the graph; none of the recorded GPU work runs (host code in `step` does run,
  // once). Throws tandem::Error if called twice, if the calling thread's current
  // device is not device(), or if the step synchronised with the host. An
  // exception thrown by `step` is rethrown after the capture has been abandoned.
  // In every failure the thread's allocator and capture mode are restored.
  void Capture(const std::function<void()>& step);

  // Runs the pre-replay hooks (in registration order), then launches the graph
  // on the calling thread's stream for device(), then runs the post-replay
  // hooks. Does not wait for the GPU.
  // Cost: one cudaGraphLaunch plus the hooks' work, which with tandem's own
  // components is one one-thread kernel per optimizer launch (one per parameter
  // group and device/dtype) and one per dropout captured in the step.
  // Throws tandem::Error if nothing was captured, if the calling thread's
  // current device is not device(), or if a hook throws (e.g. its optimizer
  // was destroyed); a hook that throws leaves the hooks before it applied.
  void Replay();

  bool captured() const;
  // Kernel + memcpy + memset nodes of the graph (0 before Capture()).
  int64_t num_nodes() const;
  Device device() const;

  // For components that keep host-side state across steps (an optimizer's step
  // count and lr): while a capture runs on the calling thread, registers `hook`
  // to run on the host before every Replay() of that graph. Returns false (and
  // does nothing) when no capture runs on this thread.
  static bool AddPreReplayHook(std::function<void()> hook);
  // For components that follow the GPU work a graph holds (a communicator's
  // watchdog tracking: collectives recorded in a capture run at every replay):
  // while a capture runs on the calling thread, registers `hook` to run on the
  // host right after every Replay() of that graph has launched it (it may
  // enqueue work, such as an event record, behind the graph on the thread's
  // stream). At most one hook per `key` per capture: a later call with the same
  // key does nothing and returns true. Returns false when no capture runs.
  static bool AddPostReplayHook(const void* key, std::function<void()> hook);
  // True while a capture runs on the calling thread and has a post-replay
  // hook registered under `key`.
  static bool HasPostReplayHook(const void* key);
  // For components whose captured work must not outlive them (a
  // communicator's collectives: NCCL's abort and destroy wait until every graph
  // holding them is destroyed): while a capture runs on the calling thread,
  // returns a function that releases that graph's executable graph, so that a
  // later Replay() throws tandem::Error with `reason`, and returns a
  // description of the graph ("CUDA graph of cuda:0 (42 nodes)"), or "" when
  // there was nothing to release (the graph was destroyed, not captured, or
  // released before). Call it on the thread that replays the graph. Returns an
  // empty function when no capture runs.
  static std::function<std::string(const std::string& reason)> ReleaserOfCurrentCapture();
  // True while a CudaGraph capture runs on the calling thread.
  static bool IsCapturing();
  // The capture running on the calling thread: a number unique in the process
  // (never reused), 0 when none runs. For handles made inside a capture (an
  // asynchronous collective's) that must tell their capture from a later one
  // on the same thread.
  static uint64_t CaptureId();

 private:
  struct Impl;
  Device device_;
  std::shared_ptr<Impl> impl_;  // shared: a releaser (below) holds it weakly
};

}  // namespace tandem::nn

#endif  // TANDEM_NN_GRAPH_H_
