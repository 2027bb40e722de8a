#include "testing/faults.h"

#include <chrono>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nn/error.h"
#include "testing/internal/fault_plan.h"

namespace tandem::testing {

const char* FaultActionName(FaultAction action) {
  switch (action) {
    case FaultAction::kThrow: return "throw";
    case FaultAction::kReturnError: return "return an error";
    case FaultAction::kHang: return "hang";
    case FaultAction::kSlow: return "slow";
  }
  return "?";
}

std::string Fault::Describe() const {
  std::string where = step.has_value()         ? absl::StrCat("step ", *step)
                      : collective.has_value() ? absl::StrCat("collective ", *collective)
                                               : "no step or collective";
  return absl::StrCat(FaultActionName(action), " at rank ", rank, ", ", where);
}

absl::Status ValidateFaults(const std::vector<Fault>& faults, int ranks) {
  for (size_t i = 0; i < faults.size(); ++i) {
    const Fault& f = faults[i];
    const std::string name = absl::StrCat("fault ", i, " (", f.Describe(), ")");
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", why));
    };
    if (f.rank < 0 || f.rank >= ranks) {
      return bad(absl::StrCat("rank ", f.rank, " is not a rank of a run of ", ranks));
    }
    if (f.step.has_value() == f.collective.has_value()) {
      return bad("set exactly one of step and collective");
    }
    if (f.step.has_value() && *f.step < 0) return bad(absl::StrCat("step ", *f.step, " < 0"));
    if (f.collective.has_value() && *f.collective < 1) {
      return bad("collective 0: collectives count from 1");
    }
    if ((f.action == FaultAction::kThrow || f.action == FaultAction::kReturnError) &&
        f.error.ok()) {
      return bad("its error is OK; a thrown or returned fault needs a non-OK status");
    }
    if (f.action == FaultAction::kSlow && f.delay.count() <= 0) {
      return bad(absl::StrCat("delay ", f.delay.count(), " ms: a slow fault needs a delay > 0"));
    }
    for (size_t j = 0; j < i; ++j) {
      const Fault& g = faults[j];
      if (g.rank == f.rank && g.step == f.step && g.collective == f.collective) {
        return bad(absl::StrCat("fault ", j, " (", g.Describe(), ") is at the same point"));
      }
    }
  }
  return absl::OkStatus();
}

namespace internal {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A rank's communicator with the plan's collective faults in front of each
// collective. The wrapped communicator keeps its own trace, attached on the
// rank's first collective; this one's trace (the one spawn's watchdog reads)
// marks a collective complete when the wrapped one has completed it.
class FaultyCommunicator final : public dist::Communicator {
 public:
  FaultyCommunicator(std::unique_ptr<dist::Communicator> inner, FaultPlan* plan)
      : Communicator(inner->rank(), inner->world_size(), inner->device()),
        inner_(std::move(inner)),
        plan_(plan) {}

  std::string kind() const override { return absl::StrCat(inner_->kind(), " (faults injected)"); }
  absl::Status Abort(std::chrono::nanoseconds deadline) override {
    return inner_->Abort(deadline);
  }
  void PollCompleted() override {
    if (!attached_.load(std::memory_order_acquire)) return;
    inner_->PollCompleted();
    Propagate();
  }
  absl::Status PollAsyncError() override {
    absl::Status injected = plan_->AsyncError(rank());
    if (!injected.ok()) return injected;
    return inner_->PollAsyncError();
  }
  absl::Status PollDeviceError() override { return inner_->PollDeviceError(); }
  std::vector<std::string> ReleaseGraphs(const std::string& reason) override {
    return inner_->ReleaseGraphs(reason);
  }

 protected:
  bool CompletesOnReturn() const override { return false; }
  void AllReduceImpl(nn::Tensor& x, dist::ReduceOp op) override {
    Before("all_reduce");
    inner_->all_reduce(x, op);
    After();
  }
  std::shared_ptr<dist::Work> AllReduceAsyncImpl(nn::Tensor& x, dist::ReduceOp op) override {
    Before("all_reduce_async");
    std::shared_ptr<dist::Work> work = inner_->all_reduce_async(x, op);
    After();
    return work;
  }
  void BroadcastImpl(nn::Tensor& x, int root) override {
    Before("broadcast");
    inner_->broadcast(x, root);
    After();
  }
  void AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) override {
    Before("all_gather");
    output.copy_(inner_->all_gather(input));
    After();
  }
  void ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output,
                         dist::ReduceOp op) override {
    Before("reduce_scatter");
    output.copy_(inner_->reduce_scatter(input, op));
    After();
  }
  void BarrierImpl() override {
    Before("barrier");
    inner_->barrier();
    After();
  }

 private:
  void Before(const char* op) {
    if (!attached_.load(std::memory_order_relaxed)) {
      // Before the flag: the watchdog polls the wrapped one only once its
      // trace pointer is set.
      inner_->Attach(stop_token(), &inner_trace_);
      attached_.store(true, std::memory_order_release);
    }
    plan_->AtCollective(rank(), sequence(), op, stop_token());
  }
  // The wrapped communicator's number for the collective just issued, to mark
  // ours complete once it completes.
  void After() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({sequence(), inner_trace_.entered.load(std::memory_order_acquire)});
    }
    Propagate();
  }
  void Propagate() {
    const uint64_t done = inner_trace_.completed.load(std::memory_order_acquire);
    std::lock_guard<std::mutex> lock(mu_);
    while (!pending_.empty() && pending_.front().second <= done) {
      MarkCompleted(pending_.front().first);
      pending_.pop_front();
    }
  }

  std::unique_ptr<dist::Communicator> inner_;
  FaultPlan* plan_;
  dist::internal::CollectiveTrace inner_trace_;
  std::atomic<bool> attached_{false};
  std::mutex mu_;
  std::deque<std::pair<uint64_t, uint64_t>> pending_;  // (ours, the wrapped one's); mu_
};

}  // namespace

FaultPlan::FaultPlan(std::vector<Fault> faults, int world_size, double hang_limit_s)
    : hang_limit_(hang_limit_s), pending_(std::move(faults)), async_error_(world_size) {}

std::optional<Fault> FaultPlan::Take(int rank, std::optional<int64_t> step,
                                     std::optional<uint64_t> collective) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->rank == rank && it->step == step && it->collective == collective) {
      Fault fault = std::move(*it);
      pending_.erase(it);
      return fault;
    }
  }
  return std::nullopt;
}

void FaultPlan::Record(const Fault& fault, std::string where, std::string outcome,
                       double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({fault, std::move(where), std::move(outcome), seconds});
}

absl::Status FaultPlan::Fire(const Fault& fault, const std::string& where,
                             const std::stop_token& stop) {
  const Clock::time_point start = Clock::now();
  std::mutex m;
  std::condition_variable_any cv;
  std::unique_lock<std::mutex> lock(m);
  switch (fault.action) {
    case FaultAction::kThrow:
      Record(fault, where, "threw", 0);
      throw Error(std::string(fault.error.message()));
    case FaultAction::kReturnError:
      Record(fault, where, "returned the error", 0);
      return fault.error;
    case FaultAction::kHang:
      if (!cv.wait_for(lock, stop, hang_limit_, [] { return false; }) && !stop.stop_requested()) {
        Record(fault, where, "not cancelled", SecondsSince(start));
        throw Error(absl::StrCat("injected hang (", where, ") was not cancelled within ",
                                 hang_limit_.count(), " s (RunOptions::hang_limit_s): no stop "
                                 "came, so nothing in the run waited for this rank"));
      }
      Record(fault, where, "cancelled by the stop", SecondsSince(start));
      throw dist::CancelledError(absl::StrCat("injected hang (", where,
                                              ") ended by the stop after ", SecondsSince(start),
                                              " s"));
    case FaultAction::kSlow:
      cv.wait_for(lock, stop, fault.delay, [] { return false; });
      Record(fault, where, stop.stop_requested() ? "slept, cut short by the stop" : "slept",
             SecondsSince(start));
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status FaultPlan::AtStep(int rank, int64_t step, const std::stop_token& stop) {
  std::optional<Fault> fault = Take(rank, step, std::nullopt);
  if (!fault.has_value()) return absl::OkStatus();
  return Fire(*fault, absl::StrCat("rank ", rank, ": step ", step), stop);
}

void FaultPlan::AtCollective(int rank, uint64_t sequence, const char* op,
                             const std::stop_token& stop) {
  std::optional<Fault> fault = Take(rank, std::nullopt, sequence);
  if (!fault.has_value()) return;
  const std::string where = absl::StrCat("rank ", rank, ": ", op, " #", sequence);
  if (fault->action == FaultAction::kReturnError) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      async_error_[rank] = fault->error;
    }
    Record(*fault, where, "reported the error asynchronously", 0);
    return;
  }
  (void)Fire(*fault, where, stop);
}

absl::Status FaultPlan::AsyncError(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  return async_error_[rank];
}

absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> FaultPlan::Wrap(
    std::vector<std::unique_ptr<dist::Communicator>> communicators) {
  {
    // New communicators (a restart rebuilds them): no error reported yet.
    std::lock_guard<std::mutex> lock(mu_);
    for (absl::Status& error : async_error_) error = absl::OkStatus();
  }
  std::vector<std::unique_ptr<dist::Communicator>> wrapped;
  for (auto& comm : communicators) {
    wrapped.push_back(std::make_unique<FaultyCommunicator>(std::move(comm), this));
  }
  return wrapped;
}

std::vector<FaultEvent> FaultPlan::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

}  // namespace internal
}  // namespace tandem::testing
