// dist::CheckpointManager (see checkpoint_manager.h).
#include "spawn/train/checkpoint_manager.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nn/checkpoint.h"
#include "nn/error.h"

namespace tandem::dist {
namespace {

// The number in <prefix><N>.ckpt, or -1.
int64_t NumberIn(const std::string& name, const std::string& prefix) {
  if (!absl::StartsWith(name, prefix) || !absl::EndsWith(name, ".ckpt")) return -1;
  int64_t n = -1;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - 5);
  if (digits.empty() || !absl::SimpleAtoi(digits, &n) || n < 0) return -1;
  return n;
}

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// A temporary file of nn::WriteCheckpointBytes (<path>.tmp.<pid>.<n>) whose
// process no longer runs.
bool IsStaleTemporary(const std::string& name) {
  const size_t at = name.find(".ckpt.tmp.");
  if (at == std::string::npos) return false;
  std::vector<std::string> parts = absl::StrSplit(name.substr(at + 10), '.');
  int pid = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0) return false;
  if (pid == ::getpid()) return false;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

// The writer threads of rank threads' managers (rank 0's), by the thread that
// made the manager. When a rank thread ends (after its function, before spawn
// joins it and ends the run's logger), a write still in flight of a manager
// that outlives the function (held by the caller past spawn's return)
// finishes here, so that its log line reaches a logger that still exists; its
// outcome stays with the manager. A manager destroyed first, on any thread,
// takes itself out.
std::mutex writers_mutex;
std::vector<std::pair<std::thread::id, std::thread*>>& Writers() {  // under writers_mutex
  static auto* writers = new std::vector<std::pair<std::thread::id, std::thread*>>();
  return *writers;
}
struct RankThreadEnd {
  bool armed = false;
  ~RankThreadEnd() {
    if (!armed) return;
    const std::thread::id me = std::this_thread::get_id();
    std::lock_guard<std::mutex> lock(writers_mutex);
    std::erase_if(Writers(), [&](const std::pair<std::thread::id, std::thread*>& entry) {
      if (entry.first != me) return false;
      if (entry.second->joinable()) entry.second->join();
      return true;
    });
  }
};
thread_local RankThreadEnd t_rank_thread_end;

}  // namespace

absl::Status CheckpointManager::Validate(const CheckpointManagerOptions& o) {
  if (o.dir.empty()) return absl::InvalidArgumentError("CheckpointManagerOptions::dir is empty");
  if (o.keep < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CheckpointManagerOptions::keep is ", o.keep, ", must be >= 0 (0: all)"));
  }
  if (o.every_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CheckpointManagerOptions::every_steps is ",
                                                   o.every_steps, ", must be >= 0 (0: never)"));
  }
  if (!(o.every_minutes >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("CheckpointManagerOptions::every_minutes is ",
                                                   o.every_minutes, ", must be >= 0 (0: never)"));
  }
  return absl::OkStatus();
}

CheckpointManager::CheckpointManager(Context& ctx, CheckpointManagerOptions options)
    : ctx_(ctx), options_(std::move(options)), last_save_(Clock::now()) {
  const absl::Status valid = Validate(options_);
  TANDEM_CHECK(valid.ok(), valid.ToString());
  if (ctx_.rank() != 0) return;
  std::error_code ec;
  std::filesystem::create_directories(options_.dir, ec);
  TANDEM_CHECK(!ec, "checkpoint directory \"", options_.dir, "\": cannot create it: ", ec.message());
  for (const auto& entry : std::filesystem::directory_iterator(options_.dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!IsStaleTemporary(name)) continue;
    std::error_code rm;
    if (std::filesystem::remove(entry.path(), rm)) {
      ctx_.log().Info("removed {}: the temporary file of a checkpoint write cut short",
                      entry.path().string());
    }
  }
  t_rank_thread_end.armed = true;
  std::lock_guard<std::mutex> lock(writers_mutex);
  Writers().emplace_back(std::this_thread::get_id(), &writer_);
}

CheckpointManager::~CheckpointManager() {
  {
    // Out of the list (gone already if its rank thread ended and joined it).
    std::lock_guard<std::mutex> lock(writers_mutex);
    std::erase_if(Writers(), [&](const std::pair<std::thread::id, std::thread*>& entry) {
      return entry.second == &writer_;
    });
  }
  const absl::Status status = JoinWriter();
  if (status.ok()) return;
  // Destroyed off its rank's thread (held past spawn's return), the manager
  // outlives its Context and the run's logger: the error goes to stderr.
  if (current_or_null() == &ctx_) {
    ctx_.log().Error("checkpoint write failed: {}", status.message());
  } else {
    std::fprintf(stderr,
                 "CheckpointManager of rank 0, destroyed after its rank's run: checkpoint %s: "
                 "write failed: %s\n",
                 writing_path_.c_str(), std::string(status.message()).c_str());
  }
}

std::vector<std::string> CheckpointManager::List(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> steps;
  std::vector<std::pair<int64_t, std::string>> epochs;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (const int64_t s = NumberIn(name, "step-"); s >= 0) {
      steps.emplace_back(s, entry.path().string());
    } else if (const int64_t e = NumberIn(name, "epoch-"); e >= 0) {
      epochs.emplace_back(e, entry.path().string());
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  std::sort(epochs.rbegin(), epochs.rend());
  std::vector<std::string> out;
  for (const auto& [n, path] : steps) out.push_back(path);
  for (const auto& [n, path] : epochs) out.push_back(path);
  return out;
}

std::string CheckpointManager::PathFor(const std::string& dir, int64_t step) {
  return (std::filesystem::path(dir) / absl::StrCat("step-", step, ".ckpt")).string();
}

absl::StatusOr<std::string> CheckpointManager::Restore(TrainingState& state,
                                                        const LoadOptions& options) {
  std::vector<std::string> files = List(options_.dir);
  if (ctx_.process_count() > 1) {
    // Rank 0's listing on every rank: the directory need not be shared between
    // hosts (LoadTrainingCheckpoint's rank 0 reads the file and broadcasts it).
    files = absl::StrSplit(BroadcastString(ctx_, ctx_.rank() == 0 ? absl::StrJoin(files, "\n")
                                                                  : std::string()),
                           '\n', absl::SkipEmpty());
  }
  absl::Status newest_error;
  for (const std::string& path : files) {
    const absl::Status status = LoadTrainingCheckpoint(ctx_, path, state, options);
    if (status.ok()) return path;
    if (ctx_.rank() == 0) {
      const std::string message = absl::StrReplaceAll(status.message(), {{"\n", " "}});
      absl::string_view reason = message;
      const std::string prefix = absl::StrCat("checkpoint ", path, ": ");
      absl::ConsumePrefix(&reason, prefix);  // the path is said once
      ctx_.log().Warning("skipping checkpoint {}: {}; trying the next older one", path,
                         std::string(reason));
    }
    if (newest_error.ok()) newest_error = status;
  }
  if (files.empty()) return std::string();
  return absl::Status(newest_error.code(),
                      absl::StrCat("no checkpoint of ", options_.dir, " could be loaded (",
                                   files.size(), " tried); the newest: ", newest_error.message()));
}

absl::Status CheckpointManager::JoinWriter() {
  if (writer_.joinable()) writer_.join();
  absl::Status status = std::move(writer_status_);
  writer_status_ = absl::OkStatus();
  return status;
}

absl::Status CheckpointManager::Share(const absl::Status& status, const std::string& path) {
  nn::Tensor code = nn::from_vector<int64_t>({static_cast<int64_t>(status.code())}, {1},
                                             {.dtype = nn::kInt64, .device = ctx_.device()});
  ctx_.communicator().broadcast(code, 0);
  const auto root = static_cast<absl::StatusCode>(code.to_vector<int64_t>()[0]);
  if (ctx_.rank() == 0 || root == absl::StatusCode::kOk) return status;
  return MarkPeerFailure(absl::Status(root, absl::StrCat("checkpoint ", path,
                                                        ": rank 0 could not save it (rank 0's "
                                                        "error names the cause)")));
}

absl::Status CheckpointManager::Save(const TrainingState& state) {
  TANDEM_CHECK(state.step != nullptr, "CheckpointManager: TrainingState::step is null");
  const int64_t step = *state.step;
  const std::string path = PathFor(options_.dir, step);
  const Clock::time_point start = Clock::now();
  // The previous write's outcome travels with this save's.
  std::string previous_path = writing_path_;
  absl::Status previous = ctx_.rank() == 0 ? JoinWriter() : absl::OkStatus();
  const double wait_ms = MsSince(start);
  absl::StatusOr<std::string> bytes = SnapshotTrainingCheckpoint(ctx_, path, state);
  absl::Status status = Share(!previous.ok() ? previous : bytes.status(),
                              !previous.ok() ? previous_path : path);
  last_path_ = path;
  if (ctx_.rank() == 0) last_save_ = Clock::now();
  if (!status.ok() || ctx_.rank() != 0) return status;

  const double snapshot_ms = MsSince(start) - wait_ms;
  writing_path_ = path;
  const RankLogger log = ctx_.log();
  std::string buffers = DescribeSavedBuffers(SavedBuffersFor(state, ctx_.world_size()));
  auto write = [this, log, path, step, snapshot_ms, wait_ms, buffers = std::move(buffers),
                bytes = std::move(bytes).value()]() {
    if (options_.write_delay_s > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(options_.write_delay_s));
    }
    const Clock::time_point write_start = Clock::now();
    writer_status_ = nn::WriteCheckpointBytes(path, bytes);
    if (writer_status_.ok()) {
      log.Info("checkpoint {} written ({} KiB; the step waited {} ms for the snapshot{}, the "
               "write took {} ms {}); model buffers: {}",
               path, bytes.size() / 1024, absl::StrFormat("%.1f", snapshot_ms),
               wait_ms >= 0.1 ? absl::StrFormat(" and %.1f ms for the previous write", wait_ms)
                              : std::string(),
               absl::StrFormat("%.1f", MsSince(write_start)),
               options_.background ? "in the background" : "on the rank thread", buffers);
      Rotate(step, log);
    }
    writer_busy_.store(false);
  };
  writer_busy_.store(true);
  if (options_.background) {
    writer_ = std::thread(std::move(write));
    return absl::OkStatus();
  }
  write();  // its status waits in writer_status_ for the next save or Finish
  return absl::OkStatus();
}

absl::Status CheckpointManager::Finish() {
  const absl::Status status = ctx_.rank() == 0 ? JoinWriter() : absl::OkStatus();
  return Share(status, writing_path_.empty() ? last_path_ : writing_path_);
}

absl::Status CheckpointManager::AtStepBoundary(
    TrainingState& state, const std::function<void(TrainingState&)>& before_save) {
  TANDEM_CHECK(state.step != nullptr, "CheckpointManager: TrainingState::step is null");
  const int64_t step = *state.step;
  const bool propose = ctx_.rank() == 0 && options_.every_minutes > 0 &&
                       Clock::now() - last_save_ >=
                           std::chrono::duration<double>(options_.every_minutes * 60);
  const StepDecision decision = ctx_.AtStepBoundary(step, propose);
  if (decision.stop) {
    if (ctx_.rank() == 0) {
      ctx_.log().Info("stop requested: every rank stops at step {}; writing {}{}", step,
                      PathFor(options_.dir, step),
                      writer_busy_.load() ? absl::StrCat(" after the write of ", writing_path_,
                                                         " in flight")
                                          : std::string());
    }
    if (before_save) before_save(state);
    absl::Status status = Save(state);
    const absl::Status finished = Finish();
    if (status.ok()) status = finished;
    if (!status.ok()) return status;
    throw StoppedError(absl::StrCat("stopped at step ", step, " (stop signal); checkpoint ",
                                    last_path_, " written"),
                       step);
  }
  const bool due = decision.save || (options_.every_steps > 0 && step % options_.every_steps == 0);
  if (!due) return absl::OkStatus();
  if (before_save) before_save(state);
  return Save(state);
}

void CheckpointManager::Rotate(int64_t written_step, const RankLogger& log) const {
  if (options_.keep <= 0) return;
  std::vector<std::pair<int64_t, std::string>> older;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.dir, ec)) {
    const int64_t s = NumberIn(entry.path().filename().string(), "step-");
    if (s >= 0 && s < written_step) older.emplace_back(s, entry.path().string());
  }
  std::sort(older.rbegin(), older.rend());
  for (size_t i = static_cast<size_t>(options_.keep - 1); i < older.size(); ++i) {
    std::error_code rm;
    std::filesystem::remove(older[i].second, rm);
    if (rm) {
      log.Warning("checkpoint rotation: cannot remove {}: {}", older[i].second,
                         rm.message());
    }
  }
}

}  // namespace tandem::dist
