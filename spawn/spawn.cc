#include "spawn/spawn.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nn/random.h"
#include "nn/status_macros.h"
#include "spawn/inprocess_communicator.h"
#include "spawn/internal/process_world.h"
#if TANDEM_WITH_CUDA
#include "spawn/internal/nccl.h"
#endif

namespace tandem::dist::internal {
namespace {

// --- SIGINT ---------------------------------------------------------------------
// The handler only bumps a counter (async-signal-safe); each run's watchdog polls
// it. Installed by the first concurrent run, restored by the last.
std::atomic<uint64_t> g_sigint_count{0};
std::mutex g_sigint_mutex;
int g_sigint_users = 0;
struct sigaction g_previous_sigint;

extern "C" void OnSigint(int) { g_sigint_count.fetch_add(1, std::memory_order_relaxed); }

class SigintScope {
 public:
  explicit SigintScope(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(g_sigint_mutex);
    if (g_sigint_users++ == 0) {
      struct sigaction action {};
      action.sa_handler = OnSigint;
      sigemptyset(&action.sa_mask);
      sigaction(SIGINT, &action, &g_previous_sigint);
    }
  }
  ~SigintScope() {
    if (!enabled_) return;
    std::lock_guard<std::mutex> lock(g_sigint_mutex);
    if (--g_sigint_users == 0) sigaction(SIGINT, &g_previous_sigint, nullptr);
  }

 private:
  bool enabled_;
};

enum class RankState : int { kRunning, kFinished, kFailed };

// The state of one run shared by spawn's thread, the rank threads and the watchdog.
class Run {
 public:
  Run(std::vector<nn::Device> devices, Logger* logger, std::shared_ptr<InProcessGroup> group,
      const std::vector<std::unique_ptr<Communicator>>* comms, int rank_offset = 0,
      std::string where = "")
      : rank_offset_(rank_offset),
        where_(std::move(where)),
        devices_(std::move(devices)),
        logger_(logger),
        group_(std::move(group)),
        comms_(comms),
        traces_(devices_.size()),
        states_(devices_.size()) {
    for (auto& s : states_) s.store(RankState::kRunning);
  }

  std::stop_token stop_token() const { return stop_.get_token(); }
  CollectiveTrace* trace(int rank) { return &traces_[rank]; }
  int world_size() const { return static_cast<int>(devices_.size()); }

  std::string RankName(int rank) const {
    // Several processes: the global rank, and where it runs.
    return absl::StrCat("rank ", rank_offset_ + rank, " (", devices_[rank].ToString(),
                        where_.empty() ? "" : ", ", where_, ")");
  }

  // Records a failure. The first one wins and stops the run; later ones are
  // logged as consequences. `cancelled`: the rank only noticed the stop.
  void Fail(int rank, absl::Status status, bool cancelled) {
    if (rank >= 0) states_[rank].store(RankState::kFailed);
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (first_.ok()) {
        first_ = std::move(status);
        first = true;
      }
    }
    if (first) {
      logger_->Write(LogLevel::kError, -1, nn::Device(), first_message());
      stop_.request_stop();
      if (group_) group_->Cancel(absl::StrCat("the run is stopping: ", first_message()));
    } else {
      logger_->Write(LogLevel::kError, rank, rank >= 0 ? devices_[rank] : nn::Device(),
                     absl::StrCat(cancelled ? "stopped as a consequence of the first failure: "
                                            : "failed after the first failure (consequence): ",
                                  status.message()));
    }
  }

  void Finish(int rank) {
    RankState running = RankState::kRunning;
    states_[rank].compare_exchange_strong(running, RankState::kFinished);
    std::lock_guard<std::mutex> lock(mutex_);
    ++finished_;
    cv_.notify_all();
  }

  absl::Status result() {
    std::lock_guard<std::mutex> lock(mutex_);
    return first_;
  }

  // Watches for SIGINT and collectives that take longer than timeout_s until
  // every rank thread has returned.
  void Watch(double timeout_s, uint64_t sigint_at_start) {
    const int64_t timeout_ns = static_cast<int64_t>(timeout_s * 1e9);
    const auto poll = std::chrono::milliseconds(
        std::clamp<int64_t>(static_cast<int64_t>(timeout_s * 1000 / 10), 1, 100));
    std::unique_lock<std::mutex> lock(mutex_);
    while (finished_ < world_size()) {
      cv_.wait_for(lock, poll);
      if (finished_ == world_size()) break;
      lock.unlock();
      if (g_sigint_count.load(std::memory_order_relaxed) != sigint_at_start &&
          !stop_.stop_requested()) {
        Fail(-1,
             absl::CancelledError("spawn: interrupted (SIGINT); every rank stopped at its next "
                                  "collective or step boundary"),
             false);
      }
      for (const auto& comm : *comms_) comm->PollCompleted();
      if (!stop_.stop_requested()) CheckTimeouts(timeout_s, timeout_ns);
      lock.lock();
    }
  }

 private:
  void CheckTimeouts(double timeout_s, int64_t timeout_ns) {
    const int64_t now = SteadyNowNs();
    bool stuck = false;
    for (auto& t : traces_) {
      const uint64_t entered = t.entered.load(std::memory_order_acquire);
      if (entered > t.completed.load(std::memory_order_acquire) &&
          now - t.entered_ns.load(std::memory_order_relaxed) > timeout_ns) {
        stuck = true;
      }
    }
    if (!stuck) return;
    std::string text =
        absl::StrCat("watchdog: a collective did not complete within ", timeout_s, " s;");
    for (int r = 0; r < world_size(); ++r) {
      const CollectiveTrace& t = traces_[r];
      const uint64_t entered = t.entered.load(std::memory_order_acquire);
      const uint64_t completed = t.completed.load(std::memory_order_acquire);
      const RankState state = states_[r].load();
      absl::StrAppend(&text, " ", RankName(r), ": ");
      if (entered == 0) {
        absl::StrAppend(&text, "entered no collective");
      } else {
        absl::StrAppend(&text, entered > completed ? "waiting in " : "last completed ",
                        t.op.load(std::memory_order_relaxed), " #", entered);
        if (entered > completed) {
          absl::StrAppendFormat(
              &text, " for %.2f s",
              (now - t.entered_ns.load(std::memory_order_relaxed)) * 1e-9);
        }
      }
      absl::StrAppend(&text, state == RankState::kFinished ? " (fn returned)"
                             : state == RankState::kFailed ? " (failed)"
                                                           : " (running)",
                      r + 1 < world_size() ? ";" : "");
    }
    Fail(-1, absl::DeadlineExceededError(text), false);
  }

  std::string first_message() const { return std::string(first_.message()); }

  const int rank_offset_;
  const std::string where_;
  const std::vector<nn::Device> devices_;
  Logger* logger_;
  std::shared_ptr<InProcessGroup> group_;
  const std::vector<std::unique_ptr<Communicator>>* comms_;
  std::vector<CollectiveTrace> traces_;
  std::vector<std::atomic<RankState>> states_;
  std::stop_source stop_;
  std::mutex mutex_;
  std::condition_variable cv_;
  absl::Status first_;
  int finished_ = 0;
};

std::string CommunicatorKind(const std::vector<nn::Device>& devices) {
  if (devices[0].is_cpu()) return "in-process (CPU ranks)";
  if (HasSharedGpu(devices)) return "in-process (ranks share GPUs)";
  return "NCCL";
}

void LogEnvironment(Logger& logger, const std::vector<nn::Device>& devices,
                    const SpawnOptions& options, absl::string_view gpus, int visible_gpus,
                    const ProcessWorld* procs) {
  auto line = [&](absl::string_view key, absl::string_view value) {
    logger.Write(LogLevel::kInfo, -1, nn::Device(), absl::StrFormat("  %-16s %s", key, value));
  };
  logger.Write(LogLevel::kInfo, -1, nn::Device(), "distributed environment");
  line("world_size", absl::StrCat(procs ? procs->world_size() : devices.size()));
  line("gpus", absl::StrCat("\"", gpus, "\""));
  line("visible", DescribeVisibleGpus(visible_gpus));
  line("communicator", procs == nullptr   ? CommunicatorKind(devices)
                       : devices[0].is_cpu() ? "hierarchical: in-process + MPI (CPU ranks)"
                                             : "NCCL across processes");
#if TANDEM_WITH_CUDA
  line("versions", CudaNcclVersions());
#else
  line("versions", "built without CUDA");
#endif
  line("timeout_s", absl::StrCat(options.timeout_s));
  line("seed", absl::StrCat(options.seed));
  line("log_dir", options.log_dir.empty() ? "(none)" : options.log_dir);
  if (procs != nullptr) {
    for (const auto& [key, value] : procs->Describe()) line(key, value);
  } else {
    for (size_t r = 0; r < devices.size(); ++r) {
      line(absl::StrCat("rank ", r), devices[r].ToString());
    }
  }
  if (devices[0].is_cpu() && gpus.empty()) {
    logger.Write(LogLevel::kWarning, -1, nn::Device(),
                 "no GPU is visible: running on CPU ranks");
  }
}

// More rank threads than one process runs (a typo such as --nprocs=100000) is
// an error before any thread starts.
constexpr int kMaxRanksPerProcess = 1024;

absl::Status CheckRankCount(int ranks) {
  if (ranks > kMaxRanksPerProcess) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spawn: ", ranks, " ranks in one process: at most ", kMaxRanksPerProcess,
        " rank threads per process (check nprocs / --nprocs; use several processes for more)"));
  }
  return absl::OkStatus();
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
  if (current_or_null() != nullptr) {
    return absl::FailedPreconditionError(
        "spawn called from a rank thread of another spawn: runs do not nest");
  }
  if (!(options.timeout_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SpawnOptions::timeout_s must be positive, not ", options.timeout_s));
  }
  const int visible_gpus = nn::cuda_device_count();
  ASSIGN_OR_RETURN(std::vector<nn::Device> devices,
                   SelectDevices(gpus, nprocs, visible_gpus, options.share_devices));
  const int world = static_cast<int>(devices.size());  // this process's ranks
  RETURN_IF_ERROR(CheckRankCount(world));
  // Several processes (mpirun, srun): agree with the others, or stop here.
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessWorld> procs, JoinProcesses(options, devices, gpus));
  const int rank_offset = procs ? procs->rank_offset() : 0;
  const int global_world = procs ? procs->world_size() : world;
  ASSIGN_OR_RETURN(std::unique_ptr<Logger> logger,
                   Logger::Create(world, {.console = options.console,
                                          .all_ranks_to_console = options.log_all_ranks,
                                          .log_dir = options.log_dir,
                                          .first_rank = rank_offset,
                                          .first_process = !procs || procs->process_index() == 0,
                                          .process_tag = procs ? procs->Where() : ""}));
  LogEnvironment(*logger, devices, options, gpus, visible_gpus, procs.get());

  std::vector<std::unique_ptr<Communicator>> comms;
  std::shared_ptr<InProcessGroup> group;
  const bool use_nccl = devices[0].is_cuda() && !HasSharedGpu(devices);
  if (procs != nullptr && use_nccl) {
    ASSIGN_OR_RETURN(comms, procs->MakeNcclCommunicators(devices));
  } else if (procs != nullptr) {
    if (!devices[0].is_cpu()) {
      return absl::UnimplementedError(
          "spawn: ranks sharing a GPU across processes are not supported (give each process "
          "its own GPUs, or use CPU ranks)");
    }
    comms = procs->MakeCommunicators(devices);
  } else if (use_nccl) {
#if TANDEM_WITH_CUDA
    ASSIGN_OR_RETURN(comms, CreateNcclCommunicators(devices));
#else
    return absl::FailedPreconditionError("spawn: CUDA devices selected in a build without CUDA");
#endif
  } else {
    group = std::make_shared<InProcessGroup>(world);
    for (int r = 0; r < world; ++r) {
      comms.push_back(std::make_unique<InProcessCommunicator>(r, devices[r], group));
    }
  }

  on_world_size(world);
  Run run(devices, logger.get(), group, &comms, rank_offset, procs ? procs->Where() : "");
  SigintScope sigint(options.handle_sigint);
  const uint64_t sigint_at_start = g_sigint_count.load();

  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    auto rank_main = [&, r] {
      // Nothing escapes this thread: every outcome is reported to `run`.
      try {
        nn::DeviceGuard device_guard(devices[r]);
        nn::manual_seed(options.seed, static_cast<uint64_t>(rank_offset + r));
        comms[r]->Attach(run.stop_token(), run.trace(r));
        Context ctx(rank_offset + r, global_world, devices[r], comms[r].get(),
                    logger->ForRank(rank_offset + r, devices[r]), run.stop_token(),
                    {.local_rank = r,
                     .process_index = procs ? procs->process_index() : 0,
                     .process_count = procs ? procs->process_count() : 1,
                     .host = procs ? procs->host() : ""});
        CurrentContextGuard current(&ctx);
        absl::Status status = body(ctx);
        if (!status.ok()) {
          run.Fail(r,
                   absl::Status(status.code(), absl::StrCat(run.RankName(r), " returned: ",
                                                            status.ToString())),
                   false);
        }
      } catch (const CancelledError& e) {
        run.Fail(r, absl::CancelledError(absl::StrCat(run.RankName(r), ": ", e.what())), true);
      } catch (const std::exception& e) {
        run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r), " threw: ", e.what())),
                 false);
      } catch (...) {
        run.Fail(r, absl::InternalError(absl::StrCat(run.RankName(r),
                                                     " threw an exception of unknown type")),
                 false);
      }
      if (procs) procs->RankExited(r);
      run.Finish(r);
    };
    // A thread the system cannot start is a failure like any other, not std::terminate.
    absl::Status started = StartThread(threads, rank_main);
    if (!started.ok()) {
      run.Fail(-1, absl::Status(started.code(), absl::StrCat("spawn: ", run.RankName(r), ": ",
                                                              started.message())), false);
      for (int u = r; u < world; ++u) {
        if (procs) procs->RankExited(u);
        run.Finish(u);
      }
      break;
    }
  }
  std::thread watchdog([&] { run.Watch(options.timeout_s, sigint_at_start); });
  // Several processes: this thread is the process's MPI thread until every rank exited.
  if (procs) procs->Serve(run.stop_token());
  for (std::thread& t : threads) t.join();
  watchdog.join();

  absl::Status status = run.result();
#if TANDEM_WITH_CUDA
  if (use_nccl && !status.ok()) AbortNcclCommunicators(comms);
#endif
  comms.clear();
  // Several processes: the other processes may wait in a collective for this
  // one; the error line is written, now the launcher ends them all.
  if (procs && !status.ok()) procs->Abort(status);
  if (status.ok()) logger->Write(LogLevel::kInfo, -1, nn::Device(), "all ranks finished");
  return status;
}

}  // namespace tandem::dist::internal
