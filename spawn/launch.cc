#include "spawn/launch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include <unistd.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nn/interrupt.h"
#include "nn/random.h"
#include "nn/status_macros.h"
#include "spawn/comm/inprocess/inprocess_communicator.h"
#include "spawn/signals.h"
#include "spawn/internal/watchdog.h"
#include "spawn/internal/process_world.h"
#include "spawn/internal/restart.h"
#include "spawn/internal/startup.h"
#if TANDEM_WITH_CUDA
#include "nn/internal/device_error.h"
#include "spawn/comm/nccl/nccl_communicator.h"
#endif

namespace tandem::dist::internal {
namespace {

// --- SIGINT ---------------------------------------------------------------------
// The first SIGINT only bumps a counter (async-signal-safe); each run's watchdog
// polls it and stops the run. The second one since the handler was installed
// exits the process at once, from the handler (write and _exit are
// async-signal-safe), with status 128 + SIGINT: the run is stopped, and a rank
// that never reaches a stop-aware point cannot hold the process. Installed by the
// first concurrent run, restored by the last.
std::atomic<uint64_t> g_sigint_count{0};
std::atomic<uint64_t> g_sigint_base{0};  // g_sigint_count when the handler was installed
constexpr int kSecondSigintExitStatus = 128 + SIGINT;

void ExitProcessNow(int status) { _exit(status); }
std::atomic<void (*)(int)> g_exit_process{&ExitProcessNow};
std::mutex g_sigint_mutex;
int g_sigint_users = 0;
struct sigaction g_previous_sigint;

extern "C" void OnSigint(int) {
  const uint64_t count = g_sigint_count.fetch_add(1, std::memory_order_relaxed) + 1;
  if (count - g_sigint_base.load(std::memory_order_relaxed) >= 2) {
    static const char kMessage[] =
        "\nspawn: second SIGINT: exiting now (the run is cancelled; exit status 130)\n";
    [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    g_exit_process.load(std::memory_order_relaxed)(kSecondSigintExitStatus);
  }
}

static_assert(std::atomic<void (*)(int)>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the SIGINT handler's atomics must be lock-free to be async-signal-safe");

class SigintScope {
 public:
  SigintScope(bool enabled, void (*exit_process)(int)) : enabled_(enabled) {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(g_sigint_mutex);
    if (g_sigint_users++ == 0) {
      g_exit_process.store(exit_process != nullptr ? exit_process : &ExitProcessNow);
      g_sigint_base.store(g_sigint_count.load());
      struct sigaction action {};
      action.sa_handler = OnSigint;
      sigemptyset(&action.sa_mask);
      sigaction(SIGINT, &action, &g_previous_sigint);
    }
  }
  ~SigintScope() {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(g_sigint_mutex);
    if (--g_sigint_users == 0) {
      sigaction(SIGINT, &g_previous_sigint, nullptr);
      g_exit_process.store(&ExitProcessNow);
    }
  }

 private:
  bool enabled_;
};


std::string CommunicatorKind(const std::vector<nn::Device>& devices) {
  if (devices[0].is_cpu()) return "in-process (CPU ranks)";
  if (HasSharedGpu(devices)) return "in-process (ranks share GPUs)";
  return "NCCL";
}

// The environment table: (key, value) rows, the way the verbose banner and a
// failed run print them.
using EnvironmentTable = std::vector<std::pair<std::string, std::string>>;

EnvironmentTable DescribeEnvironment(const std::vector<nn::Device>& devices,
                                     const SpawnOptions& options, absl::string_view gpus,
                                     int visible_gpus, const ProcessWorld* procs) {
  EnvironmentTable table;
  table.emplace_back("world_size", absl::StrCat(procs ? procs->world_size() : devices.size()));
  table.emplace_back("gpus", absl::StrCat("\"", gpus, "\""));
  table.emplace_back("visible", DescribeVisibleGpus(visible_gpus));
  table.emplace_back("communicator", procs == nullptr     ? CommunicatorKind(devices)
                                     : devices[0].is_cpu() ? "hierarchical: in-process + MPI (CPU ranks)"
                                                           : "NCCL across processes");
#if TANDEM_WITH_CUDA
  table.emplace_back("versions", CudaNcclVersions());
#else
  table.emplace_back("versions", "built without CUDA");
#endif
  table.emplace_back("timeout_s", absl::StrCat(options.timeout_s));
  table.emplace_back("seed", absl::StrCat(options.seed));
  table.emplace_back("log_dir", options.log_dir.empty() ? "(none)" : options.log_dir);
  if (procs != nullptr) {
    for (const auto& [key, value] : procs->Describe()) table.emplace_back(key, value);
  } else {
    for (size_t r = 0; r < devices.size(); ++r) {
      table.emplace_back(absl::StrCat("rank ", r), devices[r].ToString());
    }
  }
  return table;
}

// To the console and the workerlogs, or (files_only) to the workerlogs alone.
void LogEnvironmentTable(Logger& logger, const EnvironmentTable& table, bool files_only = false) {
  auto write = [&](const std::string& text) {
    if (files_only) {
      logger.WriteToFiles(LogLevel::kInfo, text);
    } else {
      logger.Write(LogLevel::kInfo, -1, nn::Device(), text);
    }
  };
  write("distributed environment");
  for (const auto& [key, value] : table) write(absl::StrFormat("  %-16s %s", key, value));
}

// "cpu x2, cuda:1": this process's devices in rank order, repeats counted.
std::string DescribeDevices(const std::vector<nn::Device>& devices) {
  std::string text;
  for (size_t r = 0; r < devices.size();) {
    size_t same = r + 1;
    while (same < devices.size() && devices[same] == devices[r]) ++same;
    absl::StrAppend(&text, text.empty() ? "" : ", ", devices[r].ToString());
    if (same - r > 1) absl::StrAppend(&text, " x", same - r);
    r = same;
  }
  return text;
}

// The start of a run: one line (world size, devices, processes, communicator),
// or with options.verbose the whole table; the workerlogs get the table either
// way, and a failed run prints it after its error, so a report always carries it.
void LogEnvironment(Logger& logger, const EnvironmentTable& table,
                    const std::vector<nn::Device>& devices, const SpawnOptions& options,
                    absl::string_view gpus, const ProcessWorld* procs) {
  const bool cpu_fallback = devices[0].is_cpu() && gpus.empty();
  if (options.verbose) {
    LogEnvironmentTable(logger, table);
    if (cpu_fallback) {
      logger.Write(LogLevel::kWarning, -1, nn::Device(), "no GPU is visible: running on CPU ranks");
    }
    return;
  }
  const std::string processes =
      procs ? absl::StrCat(procs->process_count(), " processes (this is process ",
                           procs->process_index(), ")")
            : "1 process";
  logger.Write(LogLevel::kInfo, -1, nn::Device(),
               absl::StrCat("distributed environment: world_size ", table[0].second, ", ",
                            processes, ", ranks here on ", DescribeDevices(devices), ", ",
                            table[3].second,
                            cpu_fallback ? "; no GPU is visible: running on CPU ranks" : ""));
  LogEnvironmentTable(logger, table, /*files_only=*/true);  // a workerlog keeps it all
}

// Rank thread, once its function has returned or thrown: CUDA graphs that
// still hold the rank's collectives (kept in a thread_local, a static or
// outside the function) would make NCCL's abort and destroy wait for good.
// They are released, and keeping one is the rank's failure, naming them.
void ReleaseGraphsOnReturn(Watchdog& run, int rank, Communicator& comm) {
  std::vector<std::string> graphs;
  try {
    graphs = comm.ReleaseGraphs(
        "it held NCCL collectives of a spawn run whose training function returned (destroy "
        "such graphs before it returns)");
  } catch (const std::exception& e) {
    graphs.push_back(absl::StrCat("(releasing them failed: ", e.what(), ")"));
  }
  if (graphs.empty()) return;
  run.Fail(rank,
           absl::FailedPreconditionError(absl::StrCat(
               run.RankName(rank), " returned while ", graphs.size(), " CUDA graph",
               graphs.size() == 1 ? "" : "s", " holding its NCCL collectives ",
               graphs.size() == 1 ? "was" : "were", " still alive: ", absl::StrJoin(graphs, ", "),
               "; released (a later replay throws). NCCL's abort and destroy wait until every "
               "such graph is gone: destroy them before the training function returns")),
           false);
}

absl::Status StartThread(std::vector<std::thread>& threads, const std::function<void()>& main) {
  try {
    threads.emplace_back(main);
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("could not start its thread (", threads.size(), " running): ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSpawn(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                      const std::function<void(int world_size)>& on_world_size,
                      const std::function<absl::Status(Context&)>& body) {
  return dist::RunSpawnWithHooks(gpus, nprocs, options, SpawnHooks(), on_world_size, body);
}

namespace {

absl::Status ValidateOptions(const SpawnOptions& options) {
  if (current_or_null() != nullptr) {
    return absl::FailedPreconditionError(
        "spawn called from a rank thread of another spawn: runs do not nest");
  }
  if (!(options.timeout_s > 0) || !(options.timeout_s <= kMaxTimeoutS)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SpawnOptions::timeout_s must be positive and at most ", kMaxTimeoutS,
        " s (finite: the watchdog counts in int64 nanoseconds), not ", options.timeout_s));
  }
  RETURN_IF_ERROR(CheckRestartPolicy(options.restart, options.processes, DetectLaunch()));
  if (options.flight_recorder_entries < 0 || options.flight_recorder_entries > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SpawnOptions::flight_recorder_entries must be in [0, 1048576], not ",
                     options.flight_recorder_entries));
  }
  return StopSignalScope::Validate(options.stop_signals);
}

// The run's communicators, rank r's at index r: the hook's, NCCL's (distinct
// GPUs, one process or several), the hierarchical ones (CPU ranks across
// processes) or in-process ones over *group (CPU ranks, ranks sharing a GPU).
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeUnwrappedCommunicators(
    const std::vector<nn::Device>& devices, ProcessWorld* procs, const SpawnHooks& hooks,
    std::shared_ptr<InProcessGroup>* group) {
  const bool use_nccl = devices[0].is_cuda() && !HasSharedGpu(devices);
  if (hooks.make_communicators) return hooks.make_communicators(devices);
  if (procs != nullptr && use_nccl) return procs->MakeNcclCommunicators(devices);
  if (procs != nullptr) {
    if (!devices[0].is_cpu()) {
      return absl::UnimplementedError(
          "spawn: ranks sharing a GPU across processes are not supported (give each process "
          "its own GPUs, or use CPU ranks)");
    }
    return procs->MakeCommunicators(devices);
  }
  if (use_nccl) {
#if TANDEM_WITH_CUDA
    return CreateNcclCommunicators(devices);
#else
    return absl::FailedPreconditionError("spawn: CUDA devices selected in a build without CUDA");
#endif
  }
  const int world = static_cast<int>(devices.size());
  *group = std::make_shared<InProcessGroup>(world);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < world; ++r) {
    comms.push_back(std::make_unique<InProcessCommunicator>(r, devices[r], *group));
  }
  return comms;
}

// The communicators of MakeUnwrappedCommunicators, through the wrap hook when
// there is one; a wrapper that does not stand for the rank it replaces is an
// error before any thread starts.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> MakeCommunicators(
    const std::vector<nn::Device>& devices, ProcessWorld* procs, const SpawnHooks& hooks,
    std::shared_ptr<InProcessGroup>* group) {
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> comms,
                   MakeUnwrappedCommunicators(devices, procs, hooks, group));
  if (!hooks.wrap_communicators) return comms;
  std::vector<std::pair<int, int>> expected;  // (rank, world size) of each
  for (const auto& comm : comms) expected.emplace_back(comm->rank(), comm->world_size());
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> wrapped,
                   hooks.wrap_communicators(std::move(comms)));
  if (wrapped.size() != devices.size()) {
    return absl::InvalidArgumentError(absl::StrCat("SpawnHooks::wrap_communicators returned ",
                                                   wrapped.size(), " communicators for ",
                                                   devices.size(), " ranks"));
  }
  for (size_t r = 0; r < wrapped.size(); ++r) {
    const Communicator* c = wrapped[r].get();
    if (c == nullptr || c->rank() != expected[r].first ||
        c->world_size() != expected[r].second || c->device() != devices[r]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SpawnHooks::wrap_communicators: the communicator at index ", r,
          c == nullptr ? " is null"
                       : absl::StrCat(" is rank ", c->rank(), " of ", c->world_size(), " on ",
                                      c->device().ToString()),
          "; it replaces rank ", expected[r].first, " of ", expected[r].second, " on ",
          devices[r].ToString()));
    }
  }
  return wrapped;
}

// What every rank thread of one run shares (owned by RunSpawnWithHooks).
struct RankThreadEnv {
  const std::vector<nn::Device>& devices;
  const SpawnOptions& options;
  const std::vector<std::unique_ptr<Communicator>>& comms;
  Logger& logger;
  ProcessWorld* procs;
  Watchdog& run;
  StepAgreement& agreement;
  const std::function<absl::Status(Context&)>& body;
  int rank_offset;
  int global_world;
};

// Runs body(ctx) for local rank r; nothing escapes: every outcome is reported
// to the watchdog.
void RunRankBody(const RankThreadEnv& env, int r) {
  Watchdog& run = env.run;
  try {
    nn::DeviceGuard device_guard(env.devices[r]);
    nn::manual_seed(env.options.seed, static_cast<uint64_t>(env.rank_offset + r));
    env.comms[r]->Attach(run.stop_token(), run.trace(r));
    // Host waits on the GPU (item(), to(cpu), Synchronize...) end with the stop.
    nn::ScopedInterruptCheck interrupt([&run] {
      if (run.stop_requested()) {
        throw CancelledError("host wait on the device abandoned: the run is stopping");
      }
    });
    Context ctx(env.rank_offset + r, env.global_world, env.devices[r], env.comms[r].get(),
                env.logger.ForRank(env.rank_offset + r, env.devices[r]), run.stop_token(),
                {.local_rank = r,
                 .process_index = env.procs ? env.procs->process_index() : 0,
                 .process_count = env.procs ? env.procs->process_count() : 1,
                 .host = env.procs ? env.procs->host() : ""},
                &env.agreement);
    CurrentContextGuard current(&ctx);
    absl::Status status = env.body(ctx);
    if (status.ok()) {
      // A failure a guard's destructor found and no later collective threw.
      const absl::Status deferred = env.comms[r]->TakeDeferredError();
      if (absl::IsCancelled(deferred)) throw CancelledError(std::string(deferred.message()));
      if (IsPeerFailure(deferred)) throw PeerFailedError(std::string(deferred.message()));
      if (!deferred.ok()) throw Error(std::string(deferred.message()));
    }
    if (!status.ok()) {
      run.Fail(r,
               absl::Status(status.code(),
                            absl::StrCat(run.RankName(r), " returned: ", status.ToString())),
               false);
    }
  } catch (const StoppedError&) {  // the agreed stop: not a failure
    env.agreement.RankStopped(r);
  } catch (const PeerFailedError& e) {
    run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r), ": ", e.what())), false,
             /*peer=*/true);
  } catch (const CancelledError& e) {
    run.Fail(r, absl::CancelledError(absl::StrCat(run.RankName(r), ": ", e.what())), true);
  } catch (const DeviceError& e) {  // the device's own failure: never restarted
    run.Fail(r,
             WithFailureCause(absl::InternalError(absl::StrCat(run.RankName(r), " threw: ",
                                                               e.what())),
                              FailureCause::kDevice),
             false);
  } catch (const std::exception& e) {
    run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r), " threw: ", e.what())), false);
  } catch (...) {
    run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r),
                                                 " threw an exception of unknown type")),
             false);
  }
}

// A rank thread: the body, then the exit protocol (graphs released, the
// process world told, the watchdog told, the abort awaited before this
// thread's thread-local CUDA teardown).
void RankMain(const RankThreadEnv& env, int r) {
  RunRankBody(env, r);
  ReleaseGraphsOnReturn(env.run, r, *env.comms[r]);
  if (env.procs) env.procs->RankExited(r);
  env.run.Finish(r);
  env.run.AwaitAbortIfStopping();
}

// Starts one thread per local rank. A thread the system cannot start is a
// failure like any other (not std::terminate): the ranks not started are
// finished at once.
std::vector<std::thread> StartRankThreads(const RankThreadEnv& env) {
  const int world = static_cast<int>(env.devices.size());
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    absl::Status started = StartThread(threads, [&env, r] { RankMain(env, r); });
    if (started.ok()) continue;
    env.run.Fail(-1, absl::Status(started.code(), absl::StrCat("spawn: ", env.run.RankName(r),
                                                                ": ", started.message())),
                 false);
    for (int u = r; u < world; ++u) {
      if (env.procs) env.procs->RankExited(u);
      env.run.Finish(u);
    }
    break;
  }
  return threads;
}

// After the joins: the run's outcome, logged; several processes: a failure
// ends the whole job (the error line is written first).
absl::Status FinishRun(Watchdog& run, StepAgreement& agreement, ProcessWorld* procs,
                       std::vector<std::unique_ptr<Communicator>>& comms, Logger& logger) {
  absl::Status status = run.result();
  comms.clear();  // aborted by the watchdog if the run stopped; finalized otherwise
  if (status.ok()) status = agreement.Outcome();  // an agreed stop is not a failure
  // Several processes: the other processes may wait in a collective for this
  // one; the error line is written, now the launcher ends them all. An agreed
  // stop at a step is no failure: every process stopped at that step, saved,
  // and returns it (Serve's last round ended them together).
  if (procs && !status.ok() && !StoppedAtStep(status).has_value()) procs->Abort(status);
  if (status.ok()) logger.Write(LogLevel::kInfo, -1, nn::Device(), "all ranks finished");
  if (IsStopped(status)) logger.Write(LogLevel::kInfo, -1, nn::Device(), status.message());
  return status;
}

// After a failed attempt's joins: the deferred device errors (a kernel's report
// of bad input, nn/internal/device_error.h) that its kernels raised and no host
// wait read before the stop. They belong to this attempt: added to its failure
// (logged, for a stop), and cleared, so that none surfaces in the next attempt
// (SpawnOptions::restart), or in the caller's next host wait, and fails it. An
// attempt that succeeded leaves the word alone: a report its ranks did not wait
// for surfaces at the next host wait on the device, as anywhere in nn.
// A CUDA error that the attempt's streams return (a fault on the device: CUDA
// keeps it in the device's context for the rest of the process) marks the
// failure as the device's (FailureCause::kDevice: no restart), naming the
// device, whatever the failure that came first (a rank's launch check, a
// collective) said (WithDeviceErrorsFound, spawn/internal/restart.h).
absl::Status WithDeviceErrorsLeft(absl::Status status, const std::vector<nn::Device>& devices,
                                  Logger& logger) {
#if TANDEM_WITH_CUDA
  if (status.ok()) return status;
  std::vector<std::string> reports;
  std::vector<std::string> broken;  // "cuda:0 (cudaErrorIllegalAddress (...))"
  std::vector<nn::Device> seen;
  // One bound for the whole wait: a collective stuck on every GPU costs 5 s, not
  // 5 s a device.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (const nn::Device& d : devices) {
    if (!d.is_cuda() || std::find(seen.begin(), seen.end(), d) != seen.end()) continue;
    seen.push_back(d);
    std::string context_error;
    std::string report = nn::internal::TakeDeviceErrorOfEndedThreads(d, deadline, &context_error);
    if (!report.empty()) reports.push_back(std::move(report));
    if (!context_error.empty()) broken.push_back(absl::StrCat(d.ToString(), " (", context_error, ")"));
  }
  return WithDeviceErrorsFound(std::move(status), reports, broken, logger);
#else
  (void)devices;
  (void)logger;
  return status;
#endif
}

// The run itself: dist::RunSpawnWithHooks.
// The run's logger: this process's ranks, numbered from the process's first rank.
absl::StatusOr<std::unique_ptr<Logger>> CreateLogger(int world, const SpawnOptions& options,
                                                     const ProcessWorld* procs) {
  return Logger::Create(world, {.console = options.console,
                                .all_ranks_to_console = options.log_all_ranks,
                                .log_dir = options.log_dir,
                                .first_rank = procs ? procs->rank_offset() : 0,
                                .first_process = !procs || procs->process_index() == 0,
                                .process_tag = procs ? procs->Where() : ""});
}

// Starts the rank threads and the watchdog; across processes this thread then
// serves MPI until every rank exited. Returns when every rank and the watchdog
// have been joined.
void RunRanksUnderWatch(const RankThreadEnv& env, const SpawnHooks& hooks,
                        uint64_t sigint_at_start) {
  Watchdog& run = env.run;
  std::vector<std::thread> threads = StartRankThreads(env);
  if (env.procs) {
    run.set_describe_remote(
        [p = env.procs](uint64_t waiting_for) { return p->DescribeProgress(waiting_for); });
    run.set_sigint_agreed();
    run.set_returned_elsewhere([p = env.procs] {
      std::vector<std::pair<std::string, uint64_t>> returned;
      for (ReturnedElsewhere& r : p->ReturnedRanksElsewhere()) {
        returned.emplace_back(std::move(r.name), r.entered);
      }
      return returned;
    });
  }
  std::thread watchdog([&] {
    run.Watch(env.options.timeout_s, g_sigint_count, sigint_at_start, env.agreement,
              hooks.exit_process != nullptr ? hooks.exit_process : &ExitProcessNow);
  });
  // Several processes: this thread is the process's MPI thread until every rank exited.
  if (env.procs) {
    env.procs->Serve(
        run.stop_token(),
        {.agreement = &env.agreement,
         .fail = [&run](absl::Status failure) { run.Fail(-1, std::move(failure), false); },
         .collectives_entered = [&run] { return run.FewestCollectivesEntered(); },
         .returned_rank = [&run] { return run.FewestEnteredByReturnedRank(); },
         .exits_polled = [&run] { return run.PolledAfterEveryRankFinished(); }});
  }
  for (std::thread& t : threads) t.join();
  run.Joined();
  watchdog.join();
}

// What a run is made of before its ranks start.
struct RunParts {
  EnvironmentTable environment;  // logged again after a failed run
  std::unique_ptr<Logger> logger;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::shared_ptr<InProcessGroup> group;
};

// Makes *parts: the logger (with the environment's lines), then the
// communicators. Several processes: each step is entered through `startup`
// (its deadline, and the test-only fault points), which writes to the logger
// once it exists (so *parts outlives the guard's use, errors included).
absl::Status StartRun(const std::vector<nn::Device>& devices, const SpawnOptions& options,
                      absl::string_view gpus, int visible_gpus, const SpawnHooks& hooks,
                      ProcessWorld* procs, StartupGuard* startup, RunParts* parts) {
  auto enter = [startup](absl::string_view point, std::string what) {
    return startup ? startup->Enter(point, std::move(what)) : absl::OkStatus();
  };
  RETURN_IF_ERROR(enter("joined", "setting up after the join"));
  RETURN_IF_ERROR(enter("logger", "creating the logger"));
  ASSIGN_OR_RETURN(parts->logger,
                   CreateLogger(static_cast<int>(devices.size()), options, procs));
  if (startup) startup->set_logger(parts->logger.get());
  parts->environment = DescribeEnvironment(devices, options, gpus, visible_gpus, procs);
  LogEnvironment(*parts->logger, parts->environment, devices, options, gpus, procs);
  RETURN_IF_ERROR(enter("communicators", "building the communicators"));
  ASSIGN_OR_RETURN(parts->comms, MakeCommunicators(devices, procs, hooks, &parts->group));
  return absl::OkStatus();
}

// StartRun. Several processes: under the start-up guard (its deadline), where
// every error, an exception included, ends the job through the world's abort,
// and closed by a barrier of every process; so it returns OK or not at all.
absl::Status StartRunOnEveryProcess(const std::vector<nn::Device>& devices,
                                    const SpawnOptions& options, absl::string_view gpus,
                                    int visible_gpus, const SpawnHooks& hooks,
                                    ProcessWorld* procs, RunParts* parts) {
  if (procs == nullptr) {
    return StartRun(devices, options, gpus, visible_gpus, hooks, nullptr, nullptr, parts);
  }
  StartupGuard startup(procs, options.timeout_s, options.console);
  absl::Status started;
  try {
    started = StartRun(devices, options, gpus, visible_gpus, hooks, procs, &startup, parts);
  } catch (const std::exception& e) {
    started = absl::InternalError(absl::StrCat("threw: ", e.what()));
  }
  if (!started.ok()) startup.Fail(started);
  startup.Finish();
  return absl::OkStatus();
}

absl::Status RunWithHooks(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                          const SpawnHooks& hooks,
                          const std::function<void(int world_size)>& on_world_size,
                          const std::function<absl::Status(Context&)>& body) {
  RETURN_IF_ERROR(ValidateOptions(options));
  const int visible_gpus = nn::cuda_device_count();
  ASSIGN_OR_RETURN(std::vector<nn::Device> devices,
                   SelectDevices(gpus, nprocs, visible_gpus, options.share_devices));
  const int world = static_cast<int>(devices.size());  // this process's ranks
  // Several processes (mpirun, srun): agree with the others, or stop here.
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessWorld> procs, JoinProcesses(options, devices, gpus));
  const int rank_offset = procs ? procs->rank_offset() : 0;
  // From here on, several processes: an error ends every process through the
  // world's abort, and start-up has timeout_s (spawn/internal/startup.h).
  RunParts parts;
  RETURN_IF_ERROR(
      StartRunOnEveryProcess(devices, options, gpus, visible_gpus, hooks, procs.get(), &parts));
  std::unique_ptr<Logger> logger = std::move(parts.logger);
  std::vector<std::unique_ptr<Communicator>> comms = std::move(parts.comms);
  std::shared_ptr<InProcessGroup> group = std::move(parts.group);

  on_world_size(world);
  SigintScope sigint(options.handle_sigint, hooks.exit_process);
  // The graceful stop (stop_signals): the ranks agree on the step at which they
  // stop; across processes through the communication thread's rounds
  // (spawn/signals.h), so a signal to any one process stops the whole job.
  StopSignalScope stop_signals(options.stop_signals);
  const StopSignalScope* signal_source =
      options.stop_signal_source != nullptr ? options.stop_signal_source : &stop_signals;
  const uint64_t sigint_at_start = g_sigint_count.load();

  // One attempt: a watchdog and a step agreement of its own over `comms`,
  // which FinishRun destroys. Without restarts the run is one attempt.
  auto run_attempt = [&](const std::function<absl::Status(Context&)>& attempt_body) {
    Watchdog run(devices, logger.get(), group, &comms, rank_offset, procs ? procs->Where() : "");
    run.SetFlightRecorderEntries(options.flight_recorder_entries);
    // The attempt's ranks: fewer than `world` after a world shrink.
    const int ranks = static_cast<int>(devices.size());
    StepAgreement agreement(ranks, signal_source, options.stop_grace_s,
                            /*cross_process=*/procs != nullptr);
    const RankThreadEnv env{.devices = devices,
                            .options = options,
                            .comms = comms,
                            .logger = *logger,
                            .procs = procs.get(),
                            .run = run,
                            .agreement = agreement,
                            .body = attempt_body,
                            .rank_offset = rank_offset,
                            .global_world = procs ? procs->world_size() : ranks};
    RunRanksUnderWatch(env, hooks, sigint_at_start);
    return WithDeviceErrorsLeft(FinishRun(run, agreement, procs.get(), comms, *logger), devices,
                                *logger);
  };
  // Restarts run in one process only (CheckRestartPolicy): procs is null there.
  absl::Status status = RunWithRestarts(
      {.policy = options.restart,
       .world_size = world,
       .timeout_s = options.timeout_s,
       .logger = *logger,
       .body = body,
       .run_attempt = run_attempt,
       .rebuild =
           [&](std::optional<int> leave_out) {
             // World shrink (one process only): the next attempts without that device.
             if (leave_out.has_value()) devices.erase(devices.begin() + *leave_out);
             ASSIGN_OR_RETURN(comms, MakeCommunicators(devices, procs.get(), hooks, &group));
             return absl::OkStatus();
           },
       .describe_device = [&](int rank) { return devices[rank].ToString(); },
       .stop_asked =
           [&] {
             return g_sigint_count.load() != sigint_at_start || signal_source->Received() != 0;
           }});
  // A failure's report carries the whole environment table (the start printed one line).
  if (!status.ok() && !IsStopped(status) && !options.verbose) {
    LogEnvironmentTable(*logger, parts.environment);
  }
  return status;
}

}  // namespace
}  // namespace tandem::dist::internal

namespace tandem::dist {

absl::Status RunSpawnWithHooks(absl::string_view gpus, int nprocs, const SpawnOptions& options,
                               const SpawnHooks& hooks,
                               const std::function<void(int world_size)>& on_world_size,
                               const std::function<absl::Status(Context&)>& body) {
  return internal::RunWithHooks(gpus, nprocs, options, hooks, on_world_size, body);
}

}  // namespace tandem::dist

#if !TANDEM_WITH_MPI
namespace tandem::dist {
void PrepareMpiInit() {}  // spawn/comm/mpi/mpi_transport.cc: the MPI build's
}  // namespace tandem::dist
#endif
