// The restart loop (spawn/internal/restart.h) and the snapshot store
// (spawn/restart.h).
#include "spawn/restart.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <new>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "spawn/comm/communicator.h"
#include "spawn/internal/restart.h"
#include "spawn/signals.h"

namespace tandem::dist {

// --- SnapshotStore ------------------------------------------------------------

SnapshotStore::SnapshotStore(int world_size, int64_t max_bytes)
    : max_bytes_(max_bytes), ranks_(world_size) {}

absl::Status SnapshotStore::Put(int rank, int64_t step, std::string bytes) {
  const int64_t size = static_cast<int64_t>(bytes.size());
  if (max_bytes_ > 0 && size > max_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("snapshot of step ", step, " on local rank ", rank, ": ", size,
                     " bytes, more than RestartPolicy::max_snapshot_bytes (", max_bytes_, ")"));
  }
  try {
    auto held = std::make_shared<const std::string>(std::move(bytes));
    std::lock_guard<std::mutex> lock(mu_);
    ranks_[rank][step] = std::move(held);
    // Steps older than the newest one every rank holds can no longer be resumed from.
    if (const std::optional<int64_t> committed = CommittedLocked(); committed.has_value()) {
      for (auto& steps : ranks_) steps.erase(steps.begin(), steps.lower_bound(*committed));
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("snapshot of step ", step, " on local rank ", rank, ": ", size,
                     " bytes could not be allocated in host memory"));
  }
  return absl::OkStatus();
}

std::shared_ptr<const std::string> SnapshotStore::Get(int rank, int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranks_[rank].find(step);
  return it == ranks_[rank].end() ? nullptr : it->second;
}

std::optional<int64_t> SnapshotStore::CommittedStep() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CommittedLocked();
}

std::optional<int64_t> SnapshotStore::CommittedLocked() const {
  // The newest step that every rank holds: walk rank 0's steps from the newest.
  if (ranks_.empty()) return std::nullopt;
  for (auto it = ranks_[0].rbegin(); it != ranks_[0].rend(); ++it) {
    const bool everywhere = std::all_of(
        ranks_.begin(), ranks_.end(), [&](const auto& steps) { return steps.contains(it->first); });
    if (everywhere) return it->first;
  }
  return std::nullopt;
}

void SnapshotStore::DiscardAfter(std::optional<int64_t> step) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& steps : ranks_) {
    if (!step.has_value()) {
      steps.clear();
    } else {
      steps.erase(steps.upper_bound(*step), steps.end());
    }
  }
}

int64_t SnapshotStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& steps : ranks_) {
    for (const auto& [step, held] : steps) total += static_cast<int64_t>(held->size());
  }
  return total;
}

}  // namespace tandem::dist

namespace tandem::dist::internal {
namespace {

constexpr char kCauseUrl[] = "tandem.dist/failure_cause";
constexpr char kLaggingUrl[] = "tandem.dist/lagging_ranks";

// How one rank's function ended in an attempt (written by its thread, read
// after the joins).
enum class RankEnd { kRunning, kReturned, kFailed, kStopped };

struct RankEnding {
  RankEnd end = RankEnd::kRunning;
  int64_t exit_ns = 0;
  uint64_t collectives = 0;  // the collectives its communicator entered in the attempt
};

// What an attempt's ranks did, for the decision to restart.
struct AttemptRecord {
  explicit AttemptRecord(int world_size) : ranks(world_size) {}
  std::vector<RankEnding> ranks;
  std::atomic<int64_t> stop_ns{0};  // when the attempt's stop was requested
};

// The body of one rank in one attempt: the attempt's information into the
// Context, and a record of how the function ended. Exceptions pass through
// (spawn's rank thread reports them).
absl::Status RunRank(const std::function<absl::Status(Context&)>& body, const AttemptInfo& info,
                     AttemptRecord& record, Context& ctx) {
  ctx.set_attempt_info(info);
  RankEnding& ending = record.ranks[ctx.local_rank()];
  std::stop_callback on_stop(ctx.stop_token(), [&record] {
    int64_t none = 0;
    record.stop_ns.compare_exchange_strong(none, SteadyNowNs());
  });
  // A rank that fails before the run is stopping is the failure's origin; one
  // that fails or returns once it is stopping is a consequence.
  auto leave = [&](RankEnd own) {
    ending.end = ctx.stop_requested() ? RankEnd::kStopped : own;
    ending.exit_ns = SteadyNowNs();
    ending.collectives = ctx.communicator().collectives_entered();
  };
  try {
    absl::Status status = body(ctx);
    leave(status.ok() ? RankEnd::kReturned : RankEnd::kFailed);
    return status;
  } catch (const CancelledError&) {  // StoppedError included
    leave(RankEnd::kStopped);
    throw;
  } catch (const PeerFailedError&) {
    leave(RankEnd::kStopped);
    throw;
  } catch (...) {
    leave(RankEnd::kFailed);
    throw;
  }
}

absl::Status WithoutPayloads(absl::Status status) {
  status.ErasePayload(kCauseUrl);
  status.ErasePayload(kLaggingUrl);
  return status;
}

// Why `status` (an attempt's failure) does not restart, or "" when it does.
std::string NoRestartReason(const RestartRun& run, const absl::Status& status,
                            const AttemptRecord& record) {
  if (IsStopped(status) || run.stop_asked()) {
    return "a stop was asked (Ctrl-C or a stop signal)";
  }
  // Not a communicator's error: CUDA keeps a fault on the device (an illegal
  // address, say) in the device's context for the rest of the process, so a
  // new attempt here would fail on it again (its first CUDA call, or the new
  // communicators' init). Restarting the process is what helps.
  if (GetFailureCause(status) == FailureCause::kDevice) {
    return "a CUDA error on a device (a fault on the device: CUDA keeps it in the device's "
           "context for the rest of the process, so an attempt in this process cannot run "
           "there; restart the process)";
  }
  const int64_t stop_ns = record.stop_ns.load();
  const auto timeout_ns = static_cast<int64_t>(run.timeout_s * 1e9);
  // Every rank returned OK: no rank went on past the others. A failure found
  // after that (a communicator's asynchronous error seen at the watchdog's
  // next poll, up to 100 ms after the last collective) is judged by its cause.
  const bool all_returned =
      std::all_of(record.ranks.begin(), record.ranks.end(),
                  [](const RankEnding& e) { return e.end == RankEnd::kReturned; });
  // So is a failure found after SOME ranks returned, the others still in their
  // last code: a communicator's error stopping them (the same error found a
  // little earlier, on a loaded machine), or a rank's own failure after its
  // last collective (an error returned through a join guard's end, which
  // answered the others' steps first). Unless another rank entered a
  // collective that a returned one never entered: the ranks ran different
  // steps (the failure may well come from that collective, which could never
  // complete), whichever of the failure and the watchdog's check came first.
  const std::optional<FailureCause> failure_cause = GetFailureCause(status);
  const bool comm_error = failure_cause == FailureCause::kCommunicator;
  for (size_t r = 0; r < record.ranks.size(); ++r) {
    const RankEnding& e = record.ranks[r];
    const bool judge_steps = e.end == RankEnd::kReturned && (comm_error || !all_returned);
    for (size_t q = 0; judge_steps && q < record.ranks.size(); ++q) {
      if (record.ranks[q].collectives > e.collectives) {
        return absl::StrCat("local rank ", r, "'s function returned after entering ",
                            e.collectives, " collective(s), while local rank ", q, " entered ",
                            record.ranks[q].collectives,
                            " (a program error: every rank must run the same steps)");
      }
    }
    if (stop_ns != 0 && e.exit_ns - stop_ns > timeout_ns) {
      return absl::StrFormat(
          "local rank %d left its function %.1f s after the stop, more than timeout_s (%g s): "
          "it was outside any abortable wait",
          static_cast<int>(r), static_cast<double>(e.exit_ns - stop_ns) * 1e-9, run.timeout_s);
    }
  }
  const RestartPolicy& policy = run.policy;
  if (failure_cause.has_value()) {
    // A collective still in flight after every rank returned is one that some
    // rank never entered (the ranks ran different steps: NCCL's asynchronous
    // collectives let a rank return past it): a new attempt would run the same
    // steps. Only a communicator's own error restarts then.
    if (*failure_cause == FailureCause::kTimeout && all_returned) {
      return "a collective timed out after every rank's function had returned (a collective "
             "some rank never entered: a program error, every rank must run the same steps)";
    }
    if (*failure_cause == FailureCause::kTimeout) {
      return policy.on_timeout ? "" : "a collective timed out and RestartPolicy::on_timeout is off";
    }
    return policy.on_comm_error ? ""
                                : "a communicator error and RestartPolicy::on_comm_error is off";
  }
  const bool rank_failed =
      std::any_of(record.ranks.begin(), record.ranks.end(),
                  [](const RankEnding& e) { return e.end == RankEnd::kFailed; });
  if (rank_failed) {
    return policy.on_exception ? ""
                               : "a rank's function failed and RestartPolicy::on_exception is off";
  }
  return "the failure came from neither a rank's function, nor a communicator, nor a "
         "collective's timeout";
}

void LogRestart(const RestartRun& run, int attempt, const absl::Status& failure,
                std::optional<int64_t> resume_step, int64_t stop_ns, const std::string& shrink) {
  const double recovery_s = stop_ns == 0 ? 0 : static_cast<double>(SteadyNowNs() - stop_ns) * 1e-9;
  run.logger.Write(
      LogLevel::kWarning, -1, nn::Device(),
      absl::StrFormat("spawn: restart %d of %d after: %s; attempt %d resumes %s%s; recovery "
                      "%.3f s (stop, abort, joins, new communicators)",
                      attempt, run.policy.max_restarts, failure.message(), attempt,
                      resume_step.has_value()
                          ? absl::StrCat("from the snapshot of step ", *resume_step)
                          : std::string("from the start (no snapshot every rank holds)"),
                      shrink, recovery_s));
}

// The local ranks listed as "local ranks 1, 2 and 3".
std::string LocalRanks(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "local rank " : "local ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    absl::StrAppend(&text, i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ", ranks[i]);
  }
  return text;
}

// RestartPolicy::leave_out_failed_rank: the local rank to leave out of the
// next attempt, with why in *because; or nullopt with the reason in *why. A
// timeout leaves out the one rank the others waited for (it had not entered
// their collective); any other failure the one rank whose function failed.
std::optional<int> RankToLeaveOut(const AttemptRecord& record, const absl::Status& failure,
                                  std::string* because, std::string* why) {
  const int world = static_cast<int>(record.ranks.size());
  std::optional<int> rank;
  if (GetFailureCause(failure) == FailureCause::kTimeout) {
    const std::vector<int> lagging = GetLaggingRanks(failure);
    if (lagging.size() != 1) {
      *why = lagging.empty()
                 ? "the watchdog's timeout named no rank that the others waited for (every "
                   "rank had entered the collective)"
                 : absl::StrCat("the watchdog's timeout named ", lagging.size(),
                                " ranks that the others waited for (", LocalRanks(lagging),
                                ")");
      return std::nullopt;
    }
    rank = lagging[0];
    *because = "the rank the watchdog's timeout named";
  } else {
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (record.ranks[r].end == RankEnd::kFailed) failed.push_back(r);
    }
    if (failed.size() != 1) {
      *why = failed.empty() ? "no rank's function failed (a communicator's error)"
                            : absl::StrCat(failed.size(), " ranks' functions failed (",
                                           LocalRanks(failed), ")");
      return std::nullopt;
    }
    rank = failed[0];
    *because = "the rank whose function failed";
  }
  if (world < 2) {
    *why = "it is the only rank";
    return std::nullopt;
  }
  if (*rank < 0 || *rank >= world) {  // a payload of another attempt's: never expected
    *why = absl::StrCat("local rank ", *rank, " is not one of the attempt's ", world, " ranks");
    return std::nullopt;
  }
  return rank;
}

// The store for the ranks of the next attempt: the committed step's snapshots
// of every rank but `left_out`, renumbered.
void ShrinkStore(std::optional<SnapshotStore>& store, int world_size, int left_out,
                 std::optional<int64_t> step, int64_t max_bytes) {
  std::vector<std::shared_ptr<const std::string>> kept;
  if (step.has_value()) {
    for (int r = 0; r < world_size; ++r) {
      if (r != left_out) kept.push_back(store->Get(r, *step));
    }
  }
  store.emplace(world_size - 1, max_bytes);
  if (!step.has_value()) return;
  for (size_t r = 0; r < kept.size(); ++r) {
    if (kept[r] != nullptr) {
      // Already within the limit when it was stored; a copy of the bytes.
      (void)store->Put(static_cast<int>(r), *step, std::string(*kept[r]));
    }
  }
}

// Before attempt `attempt` (> 0): the communicators again. An error (or an
// exception) here is a start-up failure: the run ends with it.
absl::Status Rebuild(const RestartRun& run, int attempt, const absl::Status& failure,
                     std::optional<int> leave_out) {
  absl::Status rebuilt;
  try {
    rebuilt = run.rebuild(leave_out);
  } catch (const std::exception& e) {
    rebuilt = absl::InternalError(absl::StrCat("threw: ", e.what()));
  }
  if (rebuilt.ok()) return rebuilt;
  return absl::Status(rebuilt.code(), absl::StrCat("spawn: restart ", attempt,
                                                   ": rebuilding the communicators "
                                                   "failed (the run ends): ",
                                                   rebuilt.message(),
                                                   "; the failure restarted: ", failure.message()));
}

}  // namespace

absl::Status WithDeviceErrorsFound(absl::Status status, const std::vector<std::string>& reports,
                                   const std::vector<std::string>& broken, Logger& logger) {
  if (status.ok() || (reports.empty() && broken.empty())) return status;
  std::string words;
  if (!reports.empty()) {
    words = absl::StrCat("a kernel had also reported, unread before the stop: ",
                         absl::StrJoin(reports, "; "));
  }
  if (!broken.empty()) {
    absl::StrAppend(&words, words.empty() ? "" : "; ", "the CUDA context of ",
                    absl::StrJoin(broken, ", "), " has failed (a fault on the device)");
  }
  if (IsStopped(status)) {
    logger.Write(LogLevel::kWarning, -1, nn::Device(), absl::StrCat("spawn: ", words));
    return status;
  }
  absl::Status with(status.code(), absl::StrCat(status.message(), "; ", words));
  status.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { with.SetPayload(url, payload); });
  if (!broken.empty()) with = WithFailureCause(std::move(with), FailureCause::kDevice);
  return with;
}

absl::Status WithFailureCause(absl::Status status, FailureCause cause) {
  const char* name = cause == FailureCause::kTimeout  ? "timeout"
                     : cause == FailureCause::kDevice ? "device"
                                                      : "communicator";
  status.SetPayload(kCauseUrl, absl::Cord(name));
  return status;
}

std::optional<FailureCause> GetFailureCause(const absl::Status& status) {
  const auto cause = status.GetPayload(kCauseUrl);  // absl::optional in this Abseil
  if (!cause.has_value()) return std::nullopt;
  if (*cause == "timeout") return FailureCause::kTimeout;
  if (*cause == "device") return FailureCause::kDevice;
  return FailureCause::kCommunicator;
}

absl::Status WithLaggingRanks(absl::Status status, const std::vector<int>& ranks) {
  status.SetPayload(kLaggingUrl, absl::Cord(absl::StrJoin(ranks, ",")));
  return status;
}

std::vector<int> GetLaggingRanks(const absl::Status& status) {
  std::vector<int> ranks;
  const auto text = status.GetPayload(kLaggingUrl);
  if (!text.has_value()) return ranks;
  for (const absl::string_view one : absl::StrSplit(std::string(*text), ',', absl::SkipEmpty())) {
    int rank = 0;
    if (absl::SimpleAtoi(one, &rank)) ranks.push_back(rank);
  }
  return ranks;
}

absl::Status CheckRestartPolicy(const RestartPolicy& policy, Processes processes,
                                const LaunchInfo& launch) {
  if (policy.max_restarts < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RestartPolicy::max_restarts must be 0 or more, not ", policy.max_restarts));
  }
  if (policy.max_snapshot_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RestartPolicy::max_snapshot_bytes must be 0 (no limit) or more, not ",
                     policy.max_snapshot_bytes));
  }
  if (policy.max_restarts == 0) return absl::OkStatus();
  const bool several =
      processes == Processes::kOn || (processes == Processes::kAuto && launch.processes > 1);
  if (!several) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "spawn: RestartPolicy::max_restarts = ", policy.max_restarts,
      " in a job of several processes (",
      processes == Processes::kOn ? "SpawnOptions::processes = kOn" : launch.evidence,
      "): restarts work within one process only: OpenMPI cannot cancel an operation in "
      "flight, so the cross-process communicators cannot be aborted and rebuilt. Set "
      "max_restarts = 0 (or Processes::kOff, every process its own job)"));
}

absl::Status RunWithRestarts(const RestartRun& run) {
  const RestartPolicy& policy = run.policy;
  int world = run.world_size;  // this attempt's ranks (fewer after a world shrink)
  std::optional<SnapshotStore> store;
  if (policy.max_restarts > 0) store.emplace(world, policy.max_snapshot_bytes);
  absl::Status failure;  // the previous attempt's
  int64_t stop_ns = 0;   // when the previous attempt stopped
  std::optional<int> leave_out;  // the previous attempt's local rank to leave out
  std::string shrink;            // the restart's log words about it
  std::string leave_out_because;  // why that rank
  bool shrunk = false;
  for (int attempt = 0;; ++attempt) {
    AttemptInfo info{.attempt = attempt, .snapshots = store ? &*store : nullptr};
    if (attempt > 0) {
      info.resume_step = store->CommittedStep();
      store->DiscardAfter(info.resume_step);
      if (leave_out.has_value()) {
        ShrinkStore(store, world, *leave_out, info.resume_step, policy.max_snapshot_bytes);
        info.snapshots = &*store;
        shrink = absl::StrCat(" on ", world - 1, " rank", world - 1 == 1 ? "" : "s",
                              ", without local rank ", *leave_out, " (",
                              run.describe_device(*leave_out), "), ", leave_out_because);
      }
      if (absl::Status rebuilt = Rebuild(run, attempt, failure, leave_out); !rebuilt.ok()) {
        return rebuilt;
      }
      if (leave_out.has_value()) {
        --world;
        shrunk = true;
      }
      LogRestart(run, attempt, failure, info.resume_step, stop_ns, shrink);
    }
    info.first_world_size = run.world_size;
    info.world_shrunk = shrunk;
    AttemptRecord record(world);
    absl::Status status =
        run.run_attempt([&](Context& ctx) { return RunRank(run.body, info, record, ctx); });
    if (status.ok()) return status;
    if (policy.max_restarts == 0) return WithoutPayloads(std::move(status));
    if (const std::string why = NoRestartReason(run, status, record); !why.empty()) {
      run.logger.Write(LogLevel::kInfo, -1, nn::Device(),
                       absl::StrCat("spawn: not restarting: ", why));
      return WithoutPayloads(std::move(status));
    }
    if (attempt == policy.max_restarts) {
      return absl::Status(status.code(), absl::StrCat("spawn: gave up after ", attempt, " restart",
                                                      attempt == 1 ? "" : "s",
                                                      "; the last failure: ", status.message()));
    }
    stop_ns = record.stop_ns.load();
    leave_out.reset();
    shrink.clear();
    if (policy.leave_out_failed_rank) {
      std::string why;
      leave_out = RankToLeaveOut(record, status, &leave_out_because, &why);
      if (!leave_out.has_value()) shrink = absl::StrCat(" on every rank (none left out: ", why, ")");
    }
    failure = WithoutPayloads(std::move(status));
  }
}

}  // namespace tandem::dist::internal
