#include "spawn/internal/startup.h"

#include <csignal>
#include <cstdlib>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "spawn/internal/process_world.h"

namespace tandem::dist::internal {

absl::StatusOr<StartupFault> StartupFaultAt(absl::string_view point, int process_index) {
  static constexpr char kName[] = "TANDEM_TEST_STARTUP_FAULT";
  const char* value = std::getenv(kName);
  if (value == nullptr || *value == '\0') return StartupFault::kNone;
  const std::vector<std::string> parts = absl::StrSplit(value, ':');
  int process = -1;
  if (parts.size() != 3 ||
      (parts[0] != "joined" && parts[0] != "logger" && parts[0] != "communicators") ||
      !absl::SimpleAtoi(parts[1], &process) ||
      (parts[2] != "fail" && parts[2] != "stall" && parts[2] != "stop")) {
    return absl::InvalidArgumentError(absl::StrCat(
        kName, "=", value, " (test only): expected <point>:<process>:<fail|stall|stop>, point "
        "one of joined, logger, communicators"));
  }
  if (parts[0] != point || process != process_index) return StartupFault::kNone;
  if (parts[2] == "fail") return StartupFault::kFail;
  return parts[2] == "stall" ? StartupFault::kStall : StartupFault::kStop;
}

StartupGuard::StartupGuard(ProcessWorld* world, double timeout_s, std::ostream* console)
    : world_(world), timeout_s_(timeout_s), start_(std::chrono::steady_clock::now()) {
  // Never fails without a log_dir.
  console_ = *Logger::Create(1, {.console = console,
                                 .log_dir = "",
                                 .first_rank = world->rank_offset(),
                                 .first_process = world->process_index() == 0,
                                 .process_tag = world->Where()});
  logger_ = console_.get();
  world_->set_startup(this);
  timer_ = std::thread([this] { Watch(); });
}

StartupGuard::~StartupGuard() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    cv_.notify_all();
  }
  timer_.join();
  world_->set_startup(nullptr);
}

std::string StartupGuard::Self() const {
  return absl::StrCat("process ", world_->process_index(), " (", world_->Where(), ")");
}

absl::Status StartupGuard::Enter(absl::string_view point, std::string what,
                                 bool waits_for_others) {
  absl::StatusOr<StartupFault> fault = StartupFaultAt(point, world_->process_index());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    step_ = std::move(what);
    waits_for_others_ = waits_for_others;
    if (fault.ok() && *fault == StartupFault::kStall) {
      absl::StrAppend(&step_, " (test stall at start-up point ", point, ")");
    }
    cv_.notify_all();
  }
  if (!fault.ok()) return fault.status();
  if (*fault == StartupFault::kFail) {
    return absl::InternalError(absl::StrCat("test fault at start-up point ", point,
                                            " (TANDEM_TEST_STARTUP_FAULT)"));
  }
  if (*fault == StartupFault::kStall) AwaitEnd();  // the deadline ends the job
  if (*fault == StartupFault::kStop) {
    std::raise(SIGSTOP);  // every thread, the timer's included: the others must name it
    AwaitEnd();
  }
  return absl::OkStatus();
}

void StartupGuard::set_logger(Logger* logger) {
  std::lock_guard<std::mutex> lock(mutex_);
  logger_ = logger;
}

bool StartupGuard::ClaimLocked() {
  if (ending_) return false;
  ending_ = true;
  return true;
}

void StartupGuard::End(const absl::Status& status) {
  Logger* logger;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    logger = logger_;
  }
  logger->Write(LogLevel::kError, -1, nn::Device(), status.message());
  world_->Abort(status);
  AwaitEnd();  // Abort does not return
}

void StartupGuard::AwaitEnd() {
  // Another thread is ending the job (MPI_Abort): this one has nothing left to do.
  while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
}

void StartupGuard::Fail(const absl::Status& status) {
  std::string step;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!ClaimLocked()) AwaitEnd();
    step = step_;
  }
  End(absl::Status(status.code(), absl::StrCat("spawn: start-up failed on ", Self(), " while ",
                                               step, ": ", status.message())));
}

void StartupGuard::Watch() {
  const auto deadline = start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                     std::chrono::duration<double>(timeout_s_));
  const auto margin = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(kPeerMarginS));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!done_) {
    if (in_mpi_ || ending_) {  // WaitForOthers keeps the deadline itself
      cv_.wait(lock);
      continue;
    }
    const auto due = waits_for_others_ ? deadline + margin : deadline;
    if (std::chrono::steady_clock::now() < due) {
      cv_.wait_until(lock, due);
      continue;
    }
    ClaimLocked();
    const std::string step = step_;
    const bool waits = waits_for_others_;
    lock.unlock();
    // The spawn thread is outside MPI (local work or NCCL): MPI_Abort from here.
    End(absl::DeadlineExceededError(absl::StrCat(
        "spawn: start-up did not finish within ", timeout_s_, " s: ", Self(), " is still ", step,
        waits ? absl::StrCat(world_->DescribeLocalPeers(), " (a process stalled or failed "
                             "during start-up)")
              : " (raise timeout_s / --timeout_s if this step can take longer)")));
  }
}

void StartupGuard::WaitForOthers(const std::function<std::unique_ptr<PendingOp>()>& start,
                                 absl::string_view what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ending_) AwaitEnd();
    in_mpi_ = true;
    step_ = absl::StrCat("waiting for the other processes ", what);
  }
  const auto due = start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(timeout_s_ + kPeerMarginS));
  try {
    const std::unique_ptr<PendingOp> op = start();
    while (!op->Test()) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= due) {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!ClaimLocked()) AwaitEnd();
        }
        End(absl::DeadlineExceededError(absl::StrFormat(
            "spawn: start-up did not finish within %g s: %s has waited %.2f s for the other "
            "processes %s: a process stalled or failed during start-up%s",
            timeout_s_, Self(), std::chrono::duration<double>(now - start_).count(), what,
            world_->DescribeLocalPeers())));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  } catch (const std::exception& e) {
    Fail(absl::InternalError(absl::StrCat("the exchange failed: ", e.what())));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  in_mpi_ = false;
  cv_.notify_all();
}

void StartupGuard::Finish() {
  if (absl::Status fault = Enter("", "finishing start-up"); !fault.ok()) Fail(fault);
  WaitForOthers([this] { return world_->StartBarrier(); }, "to finish start-up (a barrier)");
  std::lock_guard<std::mutex> lock(mutex_);
  done_ = true;
  cv_.notify_all();
}

}  // namespace tandem::dist::internal
