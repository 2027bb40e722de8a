#include "spawn/comm/communicator.h"

#include <chrono>
#include <string>
#include <utility>

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

std::string FromLabel(const char* label) {
  return label != nullptr && *label != '\0' ? absl::StrCat(" from ", label) : std::string();
}

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
  bool is_completed() const override { return true; }
};
}  // namespace

// Holds the collective's tensor until the implementation's work is done: after
// wait() returns, or when the handle is destroyed, after the implementation's
// handle (whose destructor orders the calling thread's stream after the
// collective, or waits for it) has gone. Carries the sequence number, and marks
// the collective failed in the flight recorder when its wait throws.
class Communicator::HeldWork final : public Work {
 public:
  HeldWork(std::shared_ptr<Work> work, uint64_t sequence, nn::Tensor tensor, Communicator* comm,
           nn::Tensor second = nn::Tensor())
      : work_(std::move(work)), sequence_(sequence), tensor_(std::move(tensor)),
        second_(std::move(second)), comm_(comm) {}
  ~HeldWork() override {
    work_.reset();
    tensor_ = nn::Tensor();
    second_ = nn::Tensor();
  }
  std::optional<std::chrono::steady_clock::time_point> finished_at() const override {
    return work_ ? work_->finished_at() : std::nullopt;
  }
  bool is_completed() const override { return work_->is_completed(); }
  uint64_t sequence() const override { return sequence_; }
  void wait() override {
    const auto start = std::chrono::steady_clock::now();
    try {
      work_->wait();
    } catch (...) {
      comm_->MarkFailed(sequence_);
      comm_->AddWaitedSince(start);
      throw;
    }
    tensor_ = nn::Tensor();
    second_ = nn::Tensor();
    comm_->AddWaitedSince(start);
  }

 private:
  std::shared_ptr<Work> work_;
  const uint64_t sequence_;
  nn::Tensor tensor_;
  nn::Tensor second_;  // reduce_scatter_async: the output
  Communicator* comm_;  // outlives the handles of its collectives (a run's)
};

// Marks a synchronous collective complete when it returns normally, failed
// when it throws. Two clock reads in all: the entry's (Enter's) and the end's,
// shared by the trace, the flight recorder and waited_seconds().
class Communicator::Scope {
 public:
  Scope(Communicator* comm, const char* op, const nn::Tensor* x = nullptr)
      : comm_(comm), sequence_(comm->EnterAt(op, x, &start_ns_)) {}
  ~Scope() {
    const int64_t end_ns = done_ ? end_ns_ : internal::SteadyNowNs();
    if (!done_) comm_->MarkFailed(sequence_);
    comm_->waited_ns_.fetch_add(end_ns - start_ns_, std::memory_order_relaxed);
  }
  void Done() {
    done_ = true;
    end_ns_ = internal::SteadyNowNs();
    if (comm_->CompletesOnReturn()) comm_->MarkCompletedAt(sequence_, end_ns_);
  }

 private:
  Communicator* comm_;
  int64_t start_ns_ = 0;
  uint64_t sequence_;
  int64_t end_ns_ = 0;
  bool done_ = false;
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
  trace_->flight.set_kind(kind());
}

void Communicator::DeferError(absl::Status error) {
  if (deferred_.ok()) deferred_ = std::move(error);
}

absl::Status Communicator::TakeDeferredError() { return std::exchange(deferred_, absl::OkStatus()); }

uint64_t Communicator::Enter(const char* op, const nn::Tensor* x) {
  int64_t now_ns;
  return EnterAt(op, x, &now_ns);
}

uint64_t Communicator::EnterAt(const char* op, const nn::Tensor* x, int64_t* now_ns_out) {
  const uint64_t next = sequence_ + 1;
  if (!deferred_.ok()) {
    const absl::Status error = TakeDeferredError();
    const std::string what = absl::StrCat("rank ", rank_, ": ", op, " #", next,
                                          " not started: an earlier failure on this rank: ",
                                          error.message());
    if (absl::IsCancelled(error)) throw CancelledError(what);
    if (IsPeerFailure(error)) throw PeerFailedError(what);
    throw Error(what);
  }
  if (stop_.stop_requested()) {
    throw CancelledError(absl::StrCat("rank ", rank_, ": ", op, " #", next,
                                      " not started: the run is stopping"));
  }
  sequence_ = next;
  const int64_t now_ns = internal::SteadyNowNs();
  *now_ns_out = now_ns;
  // Recorded before the trace says entered: a dump that sees #next in the
  // trace finds it in the ring.
  const std::optional<nn::DType> dtype =
      x != nullptr ? std::optional<nn::DType>(x->dtype()) : std::nullopt;
  trace_->flight.Entered(next, op, dtype, x != nullptr ? x->numel() : 0, now_ns);
  trace_->op.store(op, std::memory_order_relaxed);
  trace_->label.store(label_, std::memory_order_relaxed);
  trace_->entered_ns.store(now_ns, std::memory_order_relaxed);
  trace_->entered.store(next, std::memory_order_release);
  return next;
}

void Communicator::MarkCompleted(uint64_t sequence) {
  MarkCompletedAt(sequence, internal::SteadyNowNs());
}

void Communicator::MarkCompletedAt(uint64_t sequence, int64_t now_ns) {
  uint64_t seen = trace_->completed.load(std::memory_order_relaxed);
  if (seen >= sequence) return;
  trace_->flight.Completed(seen, sequence, now_ns);
  while (seen < sequence &&
         !trace_->completed.compare_exchange_weak(seen, sequence, std::memory_order_release)) {
  }
}

void Communicator::MarkFailed(uint64_t sequence) {
  trace_->flight.Failed(sequence, internal::SteadyNowNs());
}

std::string Communicator::DumpFlightRecorder() const {
  std::string text;
  for (const std::string& line : trace_->flight.Dump(
           absl::StrCat("rank ", rank_, " (", device_.ToString(), ")"), internal::SteadyNowNs())) {
    absl::StrAppend(&text, line, "\n");
  }
  return text;
}

void Communicator::all_reduce(nn::Tensor& x, ReduceOp op) {
  nn::CheckDefined(x, "all_reduce", "x");
  CheckOnDevice(x, "all_reduce", "x");
  Scope scope(this, "all_reduce", &x);
  AllReduceImpl(x, op);
  scope.Done();
}

std::shared_ptr<Work> Communicator::all_reduce_async(nn::Tensor& x, ReduceOp op) {
  nn::CheckDefined(x, "all_reduce_async", "x");
  CheckOnDevice(x, "all_reduce_async", "x");
  const uint64_t sequence = Enter("all_reduce_async", &x);
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<Work> work;
  try {
    work = AllReduceAsyncImpl(x, op);  // a synchronous one waits here
  } catch (...) {
    MarkFailed(sequence);
    AddWaitedSince(start);
    throw;
  }
  AddWaitedSince(start);
  return std::make_shared<HeldWork>(std::move(work), sequence, x, this);
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
  Scope scope(this, "broadcast", &x);
  BroadcastImpl(x, root);
  scope.Done();
}

nn::Tensor Communicator::all_gather(const nn::Tensor& input) {
  nn::CheckDefined(input, "all_gather", "input");
  CheckOnDevice(input, "all_gather", "input");
  nn::Shape shape = input.shape();
  shape.insert(shape.begin(), world_size_);
  nn::Tensor output = nn::empty(shape, {.dtype = input.dtype(), .device = input.device()});
  Scope scope(this, "all_gather", &input);
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
  Scope scope(this, "all_gather", &input);
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
  Scope scope(this, "reduce_scatter", &input);
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
  const uint64_t sequence = Enter("reduce_scatter_async", &input);
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<Work> work;
  try {
    work = ReduceScatterAsyncImpl(input, output, op);
  } catch (...) {
    MarkFailed(sequence);
    AddWaitedSince(start);
    throw;
  }
  AddWaitedSince(start);
  return std::make_shared<HeldWork>(std::move(work), sequence, input, this, output);
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
