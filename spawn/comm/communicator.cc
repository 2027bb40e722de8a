#include "spawn/comm/communicator.h"

#include <chrono>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace tandem::dist {

namespace {
constexpr char kPeerFailure[] = "tandem.dist/peer-failure";
}  // namespace

absl::Status MarkPeerFailure(absl::Status status) {
  if (!status.ok()) status.SetPayload(kPeerFailure, absl::Cord("1"));
  return status;
}

bool IsPeerFailure(const absl::Status& status) {
  return status.GetPayload(kPeerFailure).has_value();
}

void ThrowIfError(const absl::Status& status, const std::string& context) {
  if (status.ok()) return;
  const std::string what = absl::StrCat(context, status.ToString(absl::StatusToStringMode::kWithNoExtraData));
  if (IsPeerFailure(status)) throw PeerFailedError(what);
  throw Error(what);
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

namespace internal {
int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace internal

namespace {
class DoneWork final : public Work {
 public:
  void wait() override {}
};

// Holds the collective's tensor until the implementation's work is done: after
// wait() returns, or when the handle is destroyed, after the implementation's
// handle (whose destructor orders the calling thread's stream after the
// collective, or waits for it) has gone.
class TensorHoldingWork final : public Work {
 public:
  TensorHoldingWork(std::shared_ptr<Work> work, nn::Tensor tensor, Communicator* comm,
                    nn::Tensor second = nn::Tensor())
      : work_(std::move(work)), tensor_(std::move(tensor)), second_(std::move(second)),
        comm_(comm) {}
  ~TensorHoldingWork() override {
    work_.reset();
    tensor_ = nn::Tensor();
    second_ = nn::Tensor();
  }
  std::optional<std::chrono::steady_clock::time_point> finished_at() const override {
    return work_ ? work_->finished_at() : std::nullopt;
  }
  void wait() override {
    const auto start = std::chrono::steady_clock::now();
    work_->wait();
    tensor_ = nn::Tensor();
    second_ = nn::Tensor();
    comm_->AddWaitedSince(start);
  }

 private:
  std::shared_ptr<Work> work_;
  nn::Tensor tensor_;
  nn::Tensor second_;  // reduce_scatter_async: the output
  Communicator* comm_;  // outlives the handles of its collectives (a run's)
};
}  // namespace

// Marks a synchronous collective complete when it returns normally.
class Communicator::Scope {
 public:
  Scope(Communicator* comm, const char* op)
      : comm_(comm), sequence_(comm->Enter(op)), start_(std::chrono::steady_clock::now()) {}
  ~Scope() { comm_->AddWaitedSince(start_); }
  void Done() {
    if (comm_->CompletesOnReturn()) comm_->MarkCompleted(sequence_);
  }

 private:
  Communicator* comm_;
  uint64_t sequence_;
  std::chrono::steady_clock::time_point start_;
};

// Before Enter: a collective refused here was never entered, so the watchdog
// does not follow a phantom that no rank runs (a caller that catches the error
// and goes on would otherwise see it time out, or take the next collective's
// completion for it).
void Communicator::CheckOnDevice(const nn::Tensor& t, const char* op, const char* name) const {
  TANDEM_CHECK(t.device() == device_, op, ": ", name, " ", t.ToString(), " is not on rank ", rank_,
               "'s device ", device_.ToString());
}

Communicator::Communicator(int rank, int world_size, nn::Device device)
    : rank_(rank), world_size_(world_size), device_(device) {
  TANDEM_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "Communicator: rank ", rank,
               " of world size ", world_size);
}

void Communicator::Attach(std::stop_token stop, internal::CollectiveTrace* trace) {
  stop_ = std::move(stop);
  trace_ = trace != nullptr ? trace : &own_trace_;
}

uint64_t Communicator::Enter(const char* op) {
  const uint64_t next = sequence_ + 1;
  if (stop_.stop_requested()) {
    throw CancelledError(absl::StrCat("rank ", rank_, ": ", op, " #", next,
                                      " not started: the run is stopping"));
  }
  sequence_ = next;
  trace_->op.store(op, std::memory_order_relaxed);
  trace_->entered_ns.store(internal::SteadyNowNs(), std::memory_order_relaxed);
  trace_->entered.store(next, std::memory_order_release);
  return next;
}

void Communicator::MarkCompleted(uint64_t sequence) {
  uint64_t seen = trace_->completed.load(std::memory_order_relaxed);
  while (seen < sequence &&
         !trace_->completed.compare_exchange_weak(seen, sequence, std::memory_order_release)) {
  }
}

void Communicator::all_reduce(nn::Tensor& x, ReduceOp op) {
  nn::CheckDefined(x, "all_reduce", "x");
  CheckOnDevice(x, "all_reduce", "x");
  Scope scope(this, "all_reduce");
  AllReduceImpl(x, op);
  scope.Done();
}

std::shared_ptr<Work> Communicator::all_reduce_async(nn::Tensor& x, ReduceOp op) {
  nn::CheckDefined(x, "all_reduce_async", "x");
  CheckOnDevice(x, "all_reduce_async", "x");
  Enter("all_reduce_async");
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<Work> work = AllReduceAsyncImpl(x, op);  // a synchronous one waits here
  AddWaitedSince(start);
  return std::make_shared<TensorHoldingWork>(std::move(work), x, this);
}

std::shared_ptr<Work> Communicator::AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op) {
  AllReduceImpl(x, op);
  if (CompletesOnReturn()) MarkCompleted(sequence());
  return std::make_shared<DoneWork>();
}

void Communicator::broadcast(nn::Tensor& x, int root) {
  nn::CheckDefined(x, "broadcast", "x");
  CheckOnDevice(x, "broadcast", "x");
  TANDEM_CHECK(root >= 0 && root < world_size_, "broadcast: root ", root,
               " is not a rank of world size ", world_size_);
  Scope scope(this, "broadcast");
  BroadcastImpl(x, root);
  scope.Done();
}

nn::Tensor Communicator::all_gather(const nn::Tensor& input) {
  nn::CheckDefined(input, "all_gather", "input");
  CheckOnDevice(input, "all_gather", "input");
  nn::Shape shape = input.shape();
  shape.insert(shape.begin(), world_size_);
  nn::Tensor output = nn::empty(shape, {.dtype = input.dtype(), .device = input.device()});
  Scope scope(this, "all_gather");
  AllGatherImpl(input, output);
  scope.Done();
  return output;
}

void Communicator::all_gather_into(const nn::Tensor& input, nn::Tensor& output) {
  nn::CheckDefined(input, "all_gather_into", "input");
  nn::CheckDefined(output, "all_gather_into", "output");
  CheckOnDevice(input, "all_gather_into", "input");
  TANDEM_CHECK(output.numel() == input.numel() * world_size_ && output.dtype() == input.dtype() &&
                   output.device() == input.device(),
               "all_gather_into: output ", output.ToString(), " must hold ", world_size_, " x ",
               input.numel(), " elements of ", nn::DTypeName(input.dtype()), " on ",
               input.device().ToString(), " for input ", input.ToString());
  const char* in = static_cast<const char*>(input.data_ptr());
  const char* out = static_cast<const char*>(output.data_ptr());
  TANDEM_CHECK(in + input.nbytes() <= out || out + output.nbytes() <= in,
               "all_gather_into: output ", output.ToString(), " overlaps input ", input.ToString());
  Scope scope(this, "all_gather");
  AllGatherImpl(input, output);
  scope.Done();
}

nn::Tensor Communicator::reduce_scatter(const nn::Tensor& input, ReduceOp op) {
  nn::CheckDefined(input, "reduce_scatter", "input");
  CheckOnDevice(input, "reduce_scatter", "input");
  TANDEM_CHECK(input.dim() >= 1 && input.size(0) % world_size_ == 0, "reduce_scatter: input ",
               input.ToString(), " must have a first dimension divisible by the world size ",
               world_size_);
  nn::Shape shape = input.shape();
  shape[0] /= world_size_;
  nn::Tensor output = nn::empty(shape, {.dtype = input.dtype(), .device = input.device()});
  Scope scope(this, "reduce_scatter");
  ReduceScatterImpl(input, output, op);
  scope.Done();
  return output;
}

std::shared_ptr<Work> Communicator::reduce_scatter_async(const nn::Tensor& input,
                                                         nn::Tensor& output, ReduceOp op) {
  nn::CheckDefined(input, "reduce_scatter_async", "input");
  nn::CheckDefined(output, "reduce_scatter_async", "output");
  CheckOnDevice(input, "reduce_scatter_async", "input");
  TANDEM_CHECK(input.dim() >= 1 && input.size(0) % world_size_ == 0,
               "reduce_scatter_async: input ", input.ToString(),
               " must have a first dimension divisible by the world size ",
               world_size_);
  nn::Shape shape = input.shape();
  shape[0] /= world_size_;
  TANDEM_CHECK(output.shape() == shape && output.dtype() == input.dtype() &&
                   output.device() == input.device(),
               "reduce_scatter_async: output ", output.ToString(), " must be ",
               nn::ShapeToString(shape), " ", nn::DTypeName(input.dtype()), " on ",
               input.device().ToString(), " for input ", input.ToString());
  Enter("reduce_scatter_async");
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<Work> work = ReduceScatterAsyncImpl(input, output, op);
  AddWaitedSince(start);
  return std::make_shared<TensorHoldingWork>(std::move(work), input, this, output);
}

std::shared_ptr<Work> Communicator::ReduceScatterAsyncImpl(const nn::Tensor& input,
                                                           nn::Tensor& output, ReduceOp op) {
  ReduceScatterImpl(input, output, op);
  if (CompletesOnReturn()) MarkCompleted(sequence());
  return std::make_shared<DoneWork>();
}

void Communicator::barrier() {
  Scope scope(this, "barrier");
  BarrierImpl();
  scope.Done();
}

}  // namespace tandem::dist
