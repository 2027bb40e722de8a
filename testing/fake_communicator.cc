#include "testing/fake_communicator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nn/interrupt.h"
#include "spawn/comm/abort_guard.h"

namespace tandem::testing {

using dist::CancelledError;
using dist::ReduceOp;
using dist::AbortGuard;

// --- FakeGroup -----------------------------------------------------------------

FakeGroup::FakeGroup(int world_size, std::chrono::milliseconds delay)
    : world_size_(world_size),
      delay_(delay),
      inprocess_(std::make_shared<dist::InProcessGroup>(world_size)),
      abort_calls_(world_size),
      overlapping_uses_(world_size),
      device_([this] { RunDevice(); }) {}

FakeGroup::~FakeGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutting_down_ = true;
  }
  cv_.notify_all();
  device_.join();
}

void FakeGroup::Hold() {
  std::lock_guard<std::mutex> lock(mu_);
  held_ = true;
}

void FakeGroup::Release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = false;
    hold_from_ = std::numeric_limits<uint64_t>::max();
  }
  cv_.notify_all();
}

void FakeGroup::HoldFrom(uint64_t sequence) {
  std::lock_guard<std::mutex> lock(mu_);
  hold_from_ = sequence;
}

void FakeGroup::SetCompletionValue(float value) {
  std::lock_guard<std::mutex> lock(mu_);
  completion_value_ = value;
  use_completion_value_ = true;
}

void FakeGroup::Enqueue(int rank, std::shared_ptr<FakeOp> op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& entered = entered_[op->sequence];
    entered.resize(world_size_);
    entered[rank] = std::move(op);
  }
  cv_.notify_all();
}

void FakeGroup::Notify() {
  std::lock_guard<std::mutex> lock(mu_);  // a waiter between its check and its wait is not missed
  cv_.notify_all();
}

bool FakeGroup::BlockUntilFinished(const FakeOp& op, std::chrono::seconds limit) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, limit, [&] { return op.finished(); });
}

void FakeGroup::RunDevice() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return shutting_down_ || (!held_ && ReadyLocked()); });
    if (shutting_down_) return;
    auto it = entered_.begin();
    std::vector<std::shared_ptr<FakeOp>> ops = std::move(it->second);
    entered_.erase(it);
    lock.unlock();
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    Complete(ops);
    lock.lock();
    cv_.notify_all();
  }
}

bool FakeGroup::ReadyLocked() const {
  if (entered_.empty() || entered_.begin()->first >= hold_from_) return false;
  for (const auto& op : entered_.begin()->second) {
    if (op == nullptr) return false;
  }
  return true;
}

void FakeGroup::Complete(const std::vector<std::shared_ptr<FakeOp>>& ops) {
  // Pin every storage that still exists while writing; count the ones gone.
  std::vector<std::shared_ptr<nn::Storage>> pinned;
  bool all_alive = true;
  for (const auto& op : ops) {
    pinned.push_back(op->storage.lock());
    if (pinned.back() == nullptr) all_alive = false;
  }
  if (!all_alive) {
    freed_completions_.fetch_add(1);
  } else {
    const int64_t n = ops[0]->numel;
    bool use_value;
    float value;
    {
      std::lock_guard<std::mutex> lock(mu_);
      use_value = use_completion_value_;
      value = completion_value_;
    }
    std::vector<float> result(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      float acc = ops[0]->op == ReduceOp::kMax ? ops[0]->data[i] : 0.0f;
      for (const auto& op : ops) {
        acc = op->op == ReduceOp::kMax ? std::max(acc, op->data[i]) : acc + op->data[i];
      }
      if (ops[0]->op == ReduceOp::kAvg) acc /= static_cast<float>(world_size_);
      result[i] = use_value ? value : acc;
    }
    for (const auto& op : ops) std::copy(result.begin(), result.end(), op->data);
  }
  completed_.fetch_add(1);
  // Unpinned before the ops are marked done: a waiter that wakes on done and
  // drops the last handle must see the storage go.
  pinned.clear();
  for (const auto& op : ops) {
    if (!op->aborted.load()) op->done.store(true, std::memory_order_release);
  }
}

// --- FakeAsyncCommunicator -----------------------------------------------------

class FakeAsyncCommunicator::FakeWork final : public dist::Work {
 public:
  FakeWork(std::shared_ptr<FakeOp> op, int rank, std::shared_ptr<FakeGroup> group)
      : op_(std::move(op)), rank_(rank), group_(std::move(group)) {}
  // Unwaited: the CPU rule of Work's contract, wait for the collective.
  ~FakeWork() override {
    if (!waited_) group_->BlockUntilFinished(*op_, std::chrono::seconds(30));
  }
  // Finished on the fake device, or ended by the abort.
  bool is_completed() const override { return op_->finished(); }
  // Stop-aware host wait, like item() on a stream behind the collective.
  void wait() override {
    waited_ = true;
    nn::internal::WaitUntil([&] { return op_->finished(); });
    if (op_->aborted.load(std::memory_order_acquire) && !op_->done.load()) {
      throw CancelledError(absl::StrCat("rank ", rank_, ": all_reduce #", op_->sequence,
                                        " ended by the abort"));
    }
  }

 private:
  std::shared_ptr<FakeOp> op_;
  int rank_;
  std::shared_ptr<FakeGroup> group_;
  bool waited_ = false;
};

FakeAsyncCommunicator::FakeAsyncCommunicator(int rank, nn::Device device,
                                             std::shared_ptr<FakeGroup> group)
    : Communicator(rank, group->world_size(), device),
      group_(std::move(group)),
      inner_(rank, device, group_->inprocess()),
      guard_(std::make_unique<AbortGuard>()),
      handle_(std::make_unique<int>(rank)) {}

FakeAsyncCommunicator::~FakeAsyncCommunicator() = default;

absl::Status FakeAsyncCommunicator::Abort(std::chrono::nanoseconds deadline) {
  group_->CountAbort(rank());
  std::string in_use;
  const AbortGuard::Outcome outcome = guard_->Abort(
      [&] {
        if (in_use_.load() != 0) group_->CountOverlappingUse(rank());
        handle_.reset();  // as ncclCommAbort frees the communicator
        std::lock_guard<std::mutex> lock(ops_mu_);
        for (auto& op : ops_) op->aborted.store(true, std::memory_order_release);
      },
      deadline, &in_use);
  if (outcome == AbortGuard::Outcome::kTimedOut) {
    return absl::DeadlineExceededError(
        absl::StrCat("fake communicator of rank ", rank(), ": still inside ", in_use));
  }
  group_->inprocess()->Cancel("fake communicator aborted");
  group_->Notify();
  return absl::OkStatus();
}

void FakeAsyncCommunicator::EnqueueUntraced() {
  auto op = std::make_shared<FakeOp>();
  op->sequence = UINT64_MAX;  // after every traced collective
  {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ops_.push_back(op);
  }
  group_->Enqueue(rank(), op);
}

void FakeAsyncCommunicator::FailAsynchronouslyAfter(int after, std::string message) {
  std::lock_guard<std::mutex> lock(ops_mu_);
  async_error_after_ = after;
  async_error_ = std::move(message);
}

absl::Status FakeAsyncCommunicator::PollAsyncError() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  ++async_polls_;
  if (async_error_after_ > 0 && async_polls_ >= async_error_after_) {
    return absl::InternalError(async_error_);
  }
  return absl::OkStatus();
}

bool FakeAsyncCommunicator::BlockingDeviceSync(std::chrono::seconds limit) {
  std::vector<std::shared_ptr<FakeOp>> ops;
  {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ops.assign(ops_.begin(), ops_.end());
  }
  for (const auto& op : ops) {
    if (!group_->BlockUntilFinished(*op, limit)) return false;
  }
  return true;
}

bool FakeAsyncCommunicator::aborted() const { return guard_->aborted(); }

void FakeAsyncCommunicator::PollCompleted() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  for (const auto& op : ops_) {
    if (!op->done.load(std::memory_order_acquire)) break;
    MarkCompleted(op->sequence);
  }
}

void FakeAsyncCommunicator::AllReduceImpl(nn::Tensor& x, ReduceOp op) {
  if (x.dtype() != nn::kFloat32) {
    inner_.all_reduce(x, op);
    return;
  }
  std::shared_ptr<dist::Work> work = AllReduceAsyncImpl(x, op);
  work->wait();
}

void FakeAsyncCommunicator::EnterLibraryCall(const std::shared_ptr<FakeOp>& fake) {
  AbortGuard::Use use(*guard_, "the fake all_reduce");
  if (use.aborted()) {
    throw CancelledError(absl::StrCat("rank ", rank(), ": all_reduce #", sequence(),
                                      " abandoned: the communicator was aborted"));
  }
  in_use_.fetch_add(1);
  volatile int handle = *handle_;  // the library call: reads the communicator
  (void)handle;
  int expected = 1;
  if (stall_.compare_exchange_strong(expected, 2)) {
    // Spins like a library call that checks no abort flag.
    while (stall_.load() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::yield();
  in_use_.fetch_sub(1);
  std::lock_guard<std::mutex> lock(ops_mu_);
  ops_.push_back(fake);
  while (ops_.size() > 64 && ops_.front()->finished()) ops_.pop_front();
}

std::shared_ptr<dist::Work> FakeAsyncCommunicator::AllReduceAsyncImpl(nn::Tensor& x,
                                                                      ReduceOp op) {
  TANDEM_CHECK(x.dtype() == nn::kFloat32, "fake communicator: float32 tensors only, not ",
               x.ToString());
  auto fake = std::make_shared<FakeOp>();
  fake->sequence = sequence();
  fake->data = x.data<float>();
  fake->numel = x.numel();
  fake->op = op;
  fake->storage = x.storage();
  EnterLibraryCall(fake);
  group_->Enqueue(rank(), fake);
  return std::make_shared<FakeWork>(fake, rank(), group_);
}

std::function<absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>>(
    const std::vector<nn::Device>&)>
MakeFakeCommunicators(std::shared_ptr<FakeGroup> group,
                      std::vector<FakeAsyncCommunicator*>* made) {
  return [group, made](const std::vector<nn::Device>& devices)
             -> absl::StatusOr<std::vector<std::unique_ptr<dist::Communicator>>> {
    if (static_cast<int>(devices.size()) != group->world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("fake communicators: the FakeGroup has ", group->world_size(),
                       " ranks, the run ", devices.size()));
    }
    std::vector<std::unique_ptr<dist::Communicator>> comms;
    if (made != nullptr) made->clear();
    for (int r = 0; r < static_cast<int>(devices.size()); ++r) {
      auto comm = std::make_unique<FakeAsyncCommunicator>(r, devices[r], group);
      if (made != nullptr) made->push_back(comm.get());
      comms.push_back(std::move(comm));
    }
    return comms;
  };
}

}  // namespace tandem::testing
