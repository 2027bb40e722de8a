// dist::spawn: runs fn(ctx, args...) on one thread per selected device.
//
//   absl::Status s = dist::spawn(train);                                  // all visible GPUs
//   absl::Status s = dist::spawn(train, std::make_tuple(true), 2, "0,1"); // args, nprocs, gpus
//   absl::Status s = dist::spawn(train, /*nprocs=*/1, "0,1");             // fewer than listed
//   auto losses = dist::spawn(eval, 4, "cpu");  // fn returns double: StatusOr<vector<double>>
//
// fn(dist::Context&, Args...) may return void, absl::Status, a value R or
// absl::StatusOr<R>; spawn returns absl::Status for the first two and
// absl::StatusOr<std::vector<R>> (one value per rank of this process, in local
// rank order) for the others. Each rank
// gets its own copy of `args`.
//
// Devices come from `gpus` and `nprocs` (spawn/devices.h); a bad string is an
// error before any CUDA or NCCL call. Distinct GPUs talk through NCCL (one
// ncclCommInitAll before the rank threads start; across processes,
// ncclCommInitRankConfig per device in one group); CPU ranks and ranks sharing a
// GPU (share_devices) through the in-process communicator.
//
// Failure: the first failure on any rank (an exception, a non-OK status) wins.
// spawn sets the stop flag and wakes every in-process wait; its watchdog thread
// then aborts every communicator at once (Communicator::Abort, before any join:
// an NCCL collective that a failed rank never joined would otherwise block the
// other ranks' streams for good). Every host wait of a rank thread on the GPU
// (item(), to(cpu), nn::Synchronize, the fused optimizer's, barrier()) polls
// against the stop flag (nn/interrupt.h) and throws CancelledError; a rank
// thread's CUDA teardown at exit runs after the abort. spawn joins every thread
// and returns a Status naming the rank, its device and the original message;
// the other ranks' errors are logged as consequences. A rank that throws
// dist::PeerFailedError reports another rank's failure (dist::ThrowIfError on
// a status the checkpoint functions marked so): when that rank's own error
// follows, it is the one returned, even though the report came first.
// A watchdog ends a run whose collective has not completed within timeout_s with
// DeadlineExceeded, listing each rank's last collective (sequence number, op)
// (a rank-0 checkpoint write longer than timeout_s while the others wait in a
// collective ends the run this way, rather than hanging it). With that and any
// other first failure the log gets, after the error line, every local rank's
// flight recorder: its last collectives (spawn/comm/flight_recorder.h).
// Ctrl-C (SIGINT, handled while spawn runs) stops every rank at its next
// collective, stop-aware wait or check_stop() and spawn returns Cancelled. A rank
// that reaches none of them cannot be stopped (threads are not killed): timeout_s
// after the stop the watchdog logs which ranks spawn still waits for, and a
// second Ctrl-C exits the process at once with status 130 (128 + SIGINT). In a
// job of several processes (a launcher that passes SIGINT on to the processes,
// or `kill -INT` on one of them) Ctrl-C asks for the agreed stop instead, as
// SIGTERM does (below): cancelling one process's ranks at once would leave the
// others waiting in collectives with them, and the job would end as a failure.
// SIGTERM and SIGUSR1 (stop_signals) stop every rank at one agreed step after it
// saved, see spawn/signals.h and spawn/train/checkpoint_manager.h; across processes
// (mpirun, srun) a stop signal sent to any one process stops every process.
//
// Restarts (SpawnOptions::restart, spawn/restart.h): a failure that the policy
// restarts stops the run as above, then spawn joins every rank thread, rebuilds
// the communicators and calls fn again on every rank (Context::attempt() says
// which call), up to max_restarts times; each restart logs one line.
//
// Thread-safety: spawn may be called from any thread; runs may not nest inside a
// rank thread.
#ifndef TANDEM_SPAWN_LAUNCH_H_
#define TANDEM_SPAWN_LAUNCH_H_

#include <csignal>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spawn/comm/communicator.h"
#include "spawn/context.h"
#include "spawn/devices.h"
#include "spawn/logger.h"
#include "spawn/options.h"
#include "spawn/restart.h"
#include "spawn/signals.h"

namespace tandem::dist {

// MPI settings spawn applies before it initializes MPI itself (tuning of
// OpenMPI's non-blocking all-reduce for two processes, which tandem's
// cross-process all_reduce uses; spawn/comm/mpi/mpi_transport.cc says which, when and why).
// A program that calls MPI_Init itself before spawn should call this first,
// before it starts other threads (it may setenv). Values already in the
// environment are kept. Nothing in a build without MPI.
void PrepareMpiInit();

// Seams of a run, for test harnesses: tandem::testing (testing/run.h) injects
// faults and fake communicators through them, and tests/spawn/shutdown_test.cc
// drives them directly. A supported interface; each field defaults to none.
struct SpawnHooks {
  // Makes the run's communicators (rank r's at index r) instead of NCCL or
  // in-process ones; called on spawn's thread before the rank threads start.
  // The watchdog aborts them (Communicator::Abort) when the run stops; an
  // implementation must end its waits there.
  std::function<absl::StatusOr<std::vector<std::unique_ptr<Communicator>>>(
      const std::vector<nn::Device>& devices)>
      make_communicators;
  // Replaces the run's communicators (spawn's own or make_communicators') by
  // ones that wrap them, on spawn's thread before the rank threads start: it
  // gets rank r's at index r and must return as many, each with the rank,
  // world size and device of the one it replaces (spawn checks). The wrapper
  // owns the wrapped communicator and forwards Abort, PollCompleted,
  // PollAsyncError, PollDeviceError and ReleaseGraphs to it.
  std::function<absl::StatusOr<std::vector<std::unique_ptr<Communicator>>>(
      std::vector<std::unique_ptr<Communicator>> communicators)>
      wrap_communicators;
  // Called instead of _exit, with the exit status: from the SIGINT handler on
  // the second Ctrl-C (so it must be async-signal-safe), and from the watchdog
  // when a communicator cannot be aborted because a rank stays inside a library
  // call (status 1). If it returns, the watchdog tries the abort again at its
  // next poll.
  void (*exit_process)(int status) = nullptr;
};

// dist::spawn with hooks: runs body on every rank of this process and returns
// the run's outcome, as spawn does. on_world_size is called once, before the
// rank threads start, with the number of ranks of this process (indexed by
// Context::local_rank()).
absl::Status RunSpawnWithHooks(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                               const SpawnHooks& hooks,
                               const std::function<void(int world_size)>& on_world_size,
                               const std::function<absl::Status(Context&)>& body);

namespace internal {

// Runs body on every rank of this process. on_world_size is called once, before
// the rank threads start, with the number of ranks of this process (indexed by
// Context::local_rank()).
absl::Status RunSpawn(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                      const std::function<void(int world_size)>& on_world_size,
                      const std::function<absl::Status(Context&)>& body);

template <typename T>
struct IsStatusOr : std::false_type {};
template <typename T>
struct IsStatusOr<absl::StatusOr<T>> : std::true_type {
  using value_type = T;
};

template <typename R>
struct SpawnValue {
  using type = R;
};
template <typename T>
struct SpawnValue<absl::StatusOr<T>> {
  using type = T;
};

}  // namespace internal

template <typename Fn, typename... Args>
auto spawn(Fn&& fn, std::tuple<Args...> args, int nprocs = -1, absl::string_view gpus = "",
           const SpawnOptions& options = {}) {
  using R = std::invoke_result_t<Fn&, Context&, Args&...>;
  auto call = [&](Context& ctx) -> R {
    std::tuple<Args...> own = args;  // each rank gets its own copy
    return std::apply([&](Args&... xs) -> R { return fn(ctx, xs...); }, own);
  };
  if constexpr (std::is_void_v<R>) {
    return internal::RunSpawn(gpus, nprocs, options, [](int) {}, [&](Context& ctx) {
      call(ctx);
      return absl::OkStatus();
    });
  } else if constexpr (std::is_same_v<R, absl::Status>) {
    return internal::RunSpawn(gpus, nprocs, options, [](int) {}, call);
  } else {
    using V = typename internal::SpawnValue<R>::type;
    std::vector<std::optional<V>> values;
    absl::Status status = internal::RunSpawn(
        gpus, nprocs, options, [&](int local_ranks) { values.resize(local_ranks); },
        [&](Context& ctx) -> absl::Status {
          if constexpr (internal::IsStatusOr<R>::value) {
            R result = call(ctx);
            if (!result.ok()) return result.status();
            values[ctx.local_rank()].emplace(std::move(result).value());
          } else {
            values[ctx.local_rank()].emplace(call(ctx));
          }
          return absl::OkStatus();
        });
    absl::StatusOr<std::vector<V>> out;
    if (!status.ok()) {
      out = status;
    } else {
      std::vector<V> plain;
      plain.reserve(values.size());
      for (auto& v : values) plain.push_back(std::move(*v));
      out = std::move(plain);
    }
    return out;
  }
}

template <typename Fn>
auto spawn(Fn&& fn, int nprocs = -1, absl::string_view gpus = "",
           const SpawnOptions& options = {}) {
  return spawn(std::forward<Fn>(fn), std::tuple<>(), nprocs, gpus, options);
}

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_LAUNCH_H_
