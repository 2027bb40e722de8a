#include "spawn/comm/mpi/hierarchical_communicator.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace tandem::dist::internal {
namespace {

// out[i] = in[0][i] (op) in[1][i] (op) ..., in order; kAvg divides by `divisor`
// at the end (divisor 0: no division). The in-process communicator's fold.
template <typename T>
void FoldTyped(const std::vector<const void*>& in, void* out, int64_t n, ReduceOp op,
               int divisor) {
  T* o = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) {
    T acc = static_cast<const T*>(in[0])[i];
    for (size_t k = 1; k < in.size(); ++k) {
      const T v = static_cast<const T*>(in[k])[i];
      acc = op == ReduceOp::kMax ? (v > acc ? v : acc) : static_cast<T>(acc + v);
    }
    if (op == ReduceOp::kAvg && divisor > 0) acc = static_cast<T>(acc / static_cast<T>(divisor));
    o[i] = acc;
  }
}

// bfloat16 and float16 (T: nn::BFloat16, nn::Float16): added (or compared) in
// float32 and rounded once, after kAvg's division: the in-process
// communicator's rule, so only the wire is 16-bit.
template <typename T>
void Fold16(const std::vector<const void*>& in, void* out, int64_t n, ReduceOp op, int divisor) {
  T* o = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(static_cast<const T*>(in[0])[i]);
    for (size_t k = 1; k < in.size(); ++k) {
      const float v = static_cast<float>(static_cast<const T*>(in[k])[i]);
      acc = op == ReduceOp::kMax ? (v > acc ? v : acc) : acc + v;
    }
    if (op == ReduceOp::kAvg && divisor > 0) acc = acc / static_cast<float>(divisor);
    o[i] = T(acc);
  }
}

void Fold(const std::vector<const void*>& in, void* out, int64_t n, nn::DType dtype, ReduceOp op,
          int divisor) {
  switch (dtype) {
    case nn::DType::kFloat32: return FoldTyped<float>(in, out, n, op, divisor);
    case nn::DType::kFloat64: return FoldTyped<double>(in, out, n, op, divisor);
    case nn::DType::kInt64: return FoldTyped<int64_t>(in, out, n, op, divisor);
    case nn::DType::kBFloat16: return Fold16<nn::BFloat16>(in, out, n, op, divisor);
    case nn::DType::kFloat16: return Fold16<nn::Float16>(in, out, n, op, divisor);
    default:
      Fail("cross-process reduction: dtype ", nn::DTypeName(dtype),
           " is not supported (float32, float64, bfloat16, float16, int64)");
  }
}

// Two processes, messages up to this size: MPI's all-reduce (measured faster
// than the all-to-all + all-gather below up to 16 MB, slower at 64 MB on one
// host, `scripts/bench.sh mpi`).
constexpr int64_t kMpiAllReduceMaxBytes = 32 << 20;

// x[i] = x[i] / divisor: Fold's kAvg division on its own, in a loop the compiler
// vectorises (the same IEEE division per element, so the same bits).
template <typename T>
void DivideTyped(T* __restrict x, int64_t n, T divisor) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(x[i] / divisor);
}

void DivideInPlace(void* x, int64_t n, nn::DType dtype, int divisor) {
  switch (dtype) {
    case nn::DType::kFloat32: return DivideTyped(static_cast<float*>(x), n, static_cast<float>(divisor));
    case nn::DType::kFloat64: return DivideTyped(static_cast<double*>(x), n, static_cast<double>(divisor));
    case nn::DType::kInt64: return DivideTyped(static_cast<int64_t*>(x), n, static_cast<int64_t>(divisor));
    default:
      Fail("cross-process reduction: dtype ", nn::DTypeName(dtype),
           " is not supported (float32, float64, int64)");
  }
}

// Element range [begin, end) of n owned by process q of P.
std::pair<int64_t, int64_t> Slice(int64_t n, int q, int processes) {
  return {n * q / processes, n * (q + 1) / processes};
}

class FinishedWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() const override { return true; }
};

}  // namespace

HierarchicalExchange::HierarchicalExchange(int process_index, std::vector<int> ranks_per_process,
                                           ProcessTransport* transport)
    : process_index_(process_index),
      ranks_per_process_(std::move(ranks_per_process)),
      transport_(transport),
      queues_(ranks_per_process_[process_index]),
      completed_(new std::atomic<uint64_t>[ranks_per_process_[process_index]]) {
  for (int p = 0; p < static_cast<int>(ranks_per_process_.size()); ++p) {
    if (p < process_index_) rank_offset_ += ranks_per_process_[p];
    world_size_ += ranks_per_process_[p];
  }
  for (int l = 0; l < local_size(); ++l) completed_[l].store(0);
}

std::shared_ptr<HierarchicalExchange::Request> HierarchicalExchange::Post(int local_rank,
                                                                          Request request) {
  auto shared = std::make_shared<Request>(std::move(request));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) {
      shared->done = true;
      shared->cancelled = true;
      shared->error = broken_reason_;
    } else {
      queues_[local_rank].push_back(shared);
    }
  }
  comm_cv_.notify_one();
  return shared;
}

void HierarchicalExchange::Wait(const Request& request) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!request.done) {
    waiting_.fetch_add(1, std::memory_order_relaxed);
    rank_cv_.wait(lock, [&] { return request.done; });
    waiting_.fetch_sub(1, std::memory_order_relaxed);
  }
  if (request.cancelled) {
    throw CancelledError(absl::StrCat(request.op, " #", request.sequence,
                                      " across processes cancelled: ", request.error));
  }
  if (!request.error.empty()) throw Error(request.error);
}

bool HierarchicalExchange::IsDone(const Request& request) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return request.done;
}

void HierarchicalExchange::RankExited(int local_rank) {
  (void)local_rank;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++exited_;
  }
  comm_cv_.notify_one();
}

void HierarchicalExchange::CancelLocked(const std::string& reason) {
  if (!broken_) {
    broken_ = true;
    broken_reason_ = reason;
  }
  for (auto& queue : queues_) {
    for (auto& r : queue) {
      r->done = true;
      r->cancelled = true;
      r->error = broken_reason_;
    }
    queue.clear();
  }
  rank_cv_.notify_all();
}

void HierarchicalExchange::Serve(std::stop_token stop, BackgroundRounds* control) {
  std::stop_callback wake(stop, [this] { comm_cv_.notify_all(); });
  control_ = control;
  std::unique_lock<std::mutex> lock(mutex_);
  // Without rounds the loop ends when the local ranks exited; with them, when a
  // round says every process's ranks did (the processes end together).
  bool rounds = control != nullptr;
  while (rounds || exited_ < local_size()) {
    std::chrono::microseconds wait(5000);
    if (stop.stop_requested()) {
      CancelLocked("the run is stopping");
      rounds = false;  // the job ends with Abort: no more rounds
    } else {
      if (rounds) {
        lock.unlock();
        rounds = control->Tick(stop);
        wait = control->NextWait();
        lock.lock();
        if (!rounds) continue;  // the last round, or a failed one (the run then stops)
      }
      bool ready = true;
      for (const auto& queue : queues_) ready = ready && !queue.empty();
      if (ready) {
        std::vector<std::shared_ptr<Request>> batch;
        for (auto& queue : queues_) {
          batch.push_back(queue.front());
          queue.pop_front();
        }
        lock.unlock();
        std::string error;
        bool finished = false;
        try {
          finished = Execute(batch, stop);
        } catch (const std::exception& e) {
          error = e.what();
          finished = true;
        }
        lock.lock();
        const auto finished_at = std::chrono::steady_clock::now();
        for (size_t l = 0; l < batch.size(); ++l) {
          batch[l]->finished = finished_at;
          batch[l]->done = true;
          batch[l]->cancelled = !finished;
          batch[l]->error = finished ? error : "the run is stopping";
          completed_[l].store(batch[l]->sequence, std::memory_order_release);
        }
        if (!finished) CancelLocked("the run is stopping");
        // A transport error leaves the processes out of step: nothing more can run.
        if (!error.empty()) CancelLocked(error);
        rank_cv_.notify_all();
        continue;
      }
    }
    comm_cv_.wait_for(lock, wait);
  }
  control_ = nullptr;
}

std::optional<Fingerprint> HierarchicalExchange::FingerprintOf(uint64_t sequence) const {
  if (sequence == 0 || sequence > started_ || started_ - sequence >= kFingerprintHistory) {
    return std::nullopt;
  }
  return fingerprints_[sequence % kFingerprintHistory];
}

const char* HierarchicalExchange::LabelOf(uint64_t sequence) const {
  if (!FingerprintOf(sequence).has_value()) return nullptr;
  return labels_[sequence % kFingerprintHistory];
}

bool HierarchicalExchange::AwaitVerdict(const std::stop_token& stop) {
  const auto deadline = std::chrono::steady_clock::now() + kVerdictWait;
  while (!stop.stop_requested() && std::chrono::steady_clock::now() < deadline) {
    if (!control_->Tick(stop)) break;
    std::this_thread::sleep_for(control_->NextWait());
  }
  return stop.stop_requested();
}

bool HierarchicalExchange::Poll(PendingOp* op, const std::stop_token& stop) {
  try {
    return PollUntilDone(op, stop);
  } catch (const std::exception&) {
    // A transport error: with rounds, let them say first whether the
    // processes called different collectives (then they stop the run).
    if (control_ == nullptr || !AwaitVerdict(stop)) throw;
    return false;
  }
}

bool HierarchicalExchange::PollUntilDone(PendingOp* op, const std::stop_token& stop) {
  // MPI progresses inside MPI_Test only (a non-blocking collective's fragments
  // move when it is tested). While every local rank waits for a collective
  // (nothing else to run), poll hot with a yield: sleeping between tests halved
  // the bandwidth of 16-64 MB messages. While a rank computes (DataParallel's
  // backward, the bucket's all-reduce overlapping it), test every 50 us and
  // sleep in between: spinning took the core from the backward it should hide
  // under (measured: overlapped steps slower than reducing after backward). A
  // peer that has not come for 100 ms is late, not slow: then sleep 50 us as
  // well, so that a stuck job does not burn a core until the watchdog fires.
  // The agreement's rounds go on meanwhile: a peer process may hold its ranks
  // (and so this collective) until a round completes.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  bool late = false;
  for (uint64_t spins = 1; !op->Test(); ++spins) {
    if (stop.stop_requested()) return false;
    if (control_ != nullptr && spins % 64 == 0) control_->Tick(stop);
    if (spins < 1000) continue;
    if (!late && spins % 1024 == 0) late = Clock::now() - start > std::chrono::milliseconds(100);
    if (late || waiting_.load(std::memory_order_relaxed) < local_size()) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      std::this_thread::yield();
    }
  }
  return true;
}

bool HierarchicalExchange::AllReduceInto(const std::vector<const void*>& inputs, void* result,
                                         int64_t n, nn::DType dtype, ReduceOp op,
                                         const std::stop_token& stop) {
  const int64_t es = nn::ElementSize(dtype);
  const int processes = static_cast<int>(ranks_per_process_.size());
  const void* partial = inputs[0];
  if (inputs.size() > 1) {  // in-process step, local order; kAvg sums here
    partial_.resize(static_cast<size_t>(n * es));
    Fold(inputs, partial_.data(), n, dtype, op == ReduceOp::kMax ? op : ReduceOp::kSum, 0);
    partial = partial_.data();
  }
  // bfloat16 and float16 take the all-to-all below: MPI has no type to sum
  // them in float32.
  if (processes == 2 && n * es <= kMpiAllReduceMaxBytes && dtype != nn::DType::kBFloat16 &&
      dtype != nn::DType::kFloat16) {
    // Two processes: the cross-process step is one two-operand sum (or max),
    // commutative in IEEE arithmetic, so MPI's own all-reduce cannot change the
    // bits of the tree below (partial_0 + partial_1), and it is faster.
    if (result != partial) std::memcpy(result, partial, static_cast<size_t>(n * es));
    if (!Poll(transport_->AllReduceInPlace(result, n, dtype,
                                           op == ReduceOp::kMax ? op : ReduceOp::kSum).get(),
              stop)) {
      return false;
    }
    if (op == ReduceOp::kAvg) DivideInPlace(result, n, dtype, world_size_);  // the tree's last step
    return true;
  }
  const auto [begin, end] = Slice(n, process_index_, processes);
  std::vector<int64_t> send_counts(processes), recv_counts(processes, (end - begin) * es);
  for (int q = 0; q < processes; ++q) {
    const auto [b, e] = Slice(n, q, processes);
    send_counts[q] = (e - b) * es;
  }
  recv_.resize(static_cast<size_t>(processes * (end - begin) * es));
  if (!Poll(transport_->AllToAll(partial, send_counts, recv_.data(), recv_counts).get(), stop)) {
    return false;
  }
  std::vector<const void*> blocks;
  for (int q = 0; q < processes; ++q) blocks.push_back(recv_.data() + q * (end - begin) * es);
  Fold(blocks, static_cast<char*>(result) + begin * es, end - begin, dtype, op, world_size_);
  return Poll(transport_->AllGatherInPlace(result, send_counts).get(), stop);
}

namespace {

// The fingerprint of a request's collective (op, reduction, root, dtype, size).
Fingerprint FingerprintOfRequest(const HierarchicalExchange::Request& r) {
  return PackFingerprint({.op = r.op, .reduce = r.reduce, .root = r.root,
                          .dtype = r.in.defined() ? r.in.dtype() : nn::DType::kFloat32,
                          .numel = r.in.defined() ? r.in.numel() : 0});
}

// The request's collective and size as the fingerprint describes it
// ("all_reduce #4 (1530 float32, sum)"), then its label, if any.
std::string Describe(const HierarchicalExchange::Request& r) {
  return DescribeFingerprint(FingerprintOfRequest(r), r.sequence) + FromLabel(r.label);
}

}  // namespace

void HierarchicalExchange::CheckSameCollective(const Batch& batch) const {
  const Request& first = *batch[0];
  for (size_t l = 1; l < batch.size(); ++l) {
    const Request& other = *batch[l];
    const bool same = std::strcmp(first.op, other.op) == 0 && first.reduce == other.reduce &&
                      first.root == other.root &&
                      first.in.defined() == other.in.defined() &&
                      (!first.in.defined() || (first.in.numel() == other.in.numel() &&
                                               first.in.dtype() == other.in.dtype()));
    TANDEM_CHECK(same, "collective mismatch: rank ", rank_offset_, " called ", Describe(first),
                 " while rank ", rank_offset_ + static_cast<int>(l), " called ", Describe(other),
                 " (op, size, dtype, reduction or root differ)");
  }
}

namespace {

// Copies `bytes` from `src` into every request's output that is not `src` itself.
void CopyToOtherOutputs(const std::vector<std::shared_ptr<HierarchicalExchange::Request>>& batch,
                        const void* src, int64_t bytes) {
  for (const auto& r : batch) {
    void* dst = r->out.host_ptr();
    if (dst != src) std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
}

std::vector<const void*> Inputs(
    const std::vector<std::shared_ptr<HierarchicalExchange::Request>>& batch) {
  std::vector<const void*> inputs;
  for (const auto& r : batch) inputs.push_back(r->in.host_ptr());
  return inputs;
}

}  // namespace

bool HierarchicalExchange::ExecuteAllReduce(const Batch& batch, const std::stop_token& stop) {
  const Request& first = *batch[0];
  void* result = first.out.host_ptr();
  if (!AllReduceInto(Inputs(batch), result, first.in.numel(), first.in.dtype(), first.reduce,
                     stop)) {
    return false;
  }
  CopyToOtherOutputs(batch, result, first.in.nbytes());
  return true;
}

bool HierarchicalExchange::ExecuteReduceScatter(const Batch& batch, const std::stop_token& stop) {
  const Request& first = *batch[0];
  result_.resize(static_cast<size_t>(first.in.nbytes()));
  if (!AllReduceInto(Inputs(batch), result_.data(), first.in.numel(), first.in.dtype(),
                     first.reduce, stop)) {
    return false;
  }
  const int64_t out_bytes = first.out.nbytes();
  for (size_t l = 0; l < batch.size(); ++l) {
    std::memcpy(batch[l]->out.host_ptr(),
                result_.data() + (rank_offset_ + static_cast<int64_t>(l)) * out_bytes,
                static_cast<size_t>(out_bytes));
  }
  return true;
}

bool HierarchicalExchange::ExecuteBroadcast(const Batch& batch, const std::stop_token& stop) {
  const Request& first = *batch[0];
  int owner = 0, offset = 0;
  while (first.root >= offset + ranks_per_process_[owner]) offset += ranks_per_process_[owner++];
  void* data = owner == process_index_ ? batch[first.root - offset]->out.host_ptr()
                                       : first.out.host_ptr();
  if (!Poll(transport_->Broadcast(data, first.in.nbytes(), owner).get(), stop)) return false;
  CopyToOtherOutputs(batch, data, first.in.nbytes());
  return true;
}

bool HierarchicalExchange::ExecuteAllGather(const Batch& batch, const std::stop_token& stop) {
  const int64_t bytes = batch[0]->in.nbytes();
  char* out = static_cast<char*>(batch[0]->out.host_ptr());
  for (size_t l = 0; l < batch.size(); ++l) {
    std::memcpy(out + (rank_offset_ + static_cast<int64_t>(l)) * bytes, batch[l]->in.host_ptr(),
                static_cast<size_t>(bytes));
  }
  std::vector<int64_t> counts;
  for (int ranks : ranks_per_process_) counts.push_back(ranks * bytes);
  if (!Poll(transport_->AllGatherInPlace(out, counts).get(), stop)) return false;
  CopyToOtherOutputs(batch, out, world_size_ * bytes);
  return true;
}

bool HierarchicalExchange::CompareBeforehand(const Fingerprint& fingerprint, const char* label,
                                             uint64_t sequence, const std::stop_token& stop) {
  const int processes = static_cast<int>(ranks_per_process_.size());
  constexpr int kWords = Fingerprint::kWords;
  check_slots_.assign(static_cast<size_t>(processes) * kWords, Fingerprint::kNone);
  check_slots_[process_index_ * kWords] = fingerprint.shape;
  check_slots_[process_index_ * kWords + 1] = fingerprint.numel;
  if (!Poll(transport_->AllReduceInPlace(check_slots_.data(), processes * kWords,
                                         nn::DType::kInt64, ReduceOp::kMax).get(),
            stop)) {
    return false;
  }
  std::vector<Fingerprint> fingerprints(processes);
  for (int p = 0; p < processes; ++p) {
    fingerprints[p] = {.shape = check_slots_[p * kWords], .numel = check_slots_[p * kWords + 1]};
  }
  if (CollectiveMismatch(fingerprints, sequence, check_each_name_).empty()) return true;
  // Every process found the mismatch in the same slots, so every process makes
  // this all-reduce too: it brings each process's label of the collective.
  check_slots_.assign(static_cast<size_t>(processes) * kLabelWords, Fingerprint::kNone);
  PackLabel(label, check_slots_.data() + static_cast<size_t>(process_index_) * kLabelWords);
  if (!Poll(transport_->AllReduceInPlace(check_slots_.data(), processes * kLabelWords,
                                         nn::DType::kInt64, ReduceOp::kMax).get(),
            stop)) {
    return false;
  }
  std::vector<std::string> labels(processes);
  for (int p = 0; p < processes; ++p) {
    labels[p] = UnpackLabel(check_slots_.data() + static_cast<size_t>(p) * kLabelWords);
  }
  Fail(CollectiveMismatch(fingerprints, sequence, check_each_name_, labels));
}

bool HierarchicalExchange::Execute(const Batch& batch, const std::stop_token& stop) {
  const Request& first = *batch[0];
  if (fingerprints_.empty()) {
    fingerprints_.resize(kFingerprintHistory);
    labels_.resize(kFingerprintHistory);
  }
  const Fingerprint fingerprint = FingerprintOfRequest(first);
  const char* label = nullptr;
  for (size_t l = 0; l < batch.size() && label == nullptr; ++l) label = batch[l]->label;
  CheckSameCollective(batch);
  // With the check before each collective, the collective counts as started
  // (and the rounds, which go on while the check waits, compare it) only once
  // the check passed: a mismatch is always the ranks' own error, never a race
  // between the check and a round that found it too.
  const uint64_t sequence = started_ + 1;
  if (check_each_name_ && !CompareBeforehand(fingerprint, label, sequence, stop)) return false;
  fingerprints_[sequence % kFingerprintHistory] = fingerprint;
  labels_[sequence % kFingerprintHistory] = label;
  started_ = sequence;
  const std::string op = batch[0]->op;
  if (op == "barrier") return Poll(transport_->Barrier().get(), stop);
  if (op == "all_reduce") return ExecuteAllReduce(batch, stop);
  if (op == "reduce_scatter") return ExecuteReduceScatter(batch, stop);
  if (op == "broadcast") return ExecuteBroadcast(batch, stop);
  if (op == "all_gather") return ExecuteAllGather(batch, stop);
  Fail("cross-process collective ", op, " is not implemented");
}

// --- HierarchicalCommunicator --------------------------------------------------------

HierarchicalCommunicator::HierarchicalCommunicator(int local_rank, nn::Device device,
                                                   std::shared_ptr<HierarchicalExchange> exchange)
    : Communicator(exchange->rank_offset() + local_rank, exchange->world_size(), device),
      local_rank_(local_rank),
      exchange_(std::move(exchange)) {
  TANDEM_CHECK(device.is_cpu(), "cross-process collectives of ", device.ToString(),
               " ranks: only CPU ranks go through MPI (GPU ranks use NCCL)");
}

void HierarchicalCommunicator::PollCompleted() {
  // Nothing done yet: the rank may still be attaching its trace. Once a request
  // is done, the acquire load orders this after the rank's Attach (the rank
  // posted after attaching; the communication thread stored after taking it).
  const uint64_t done = exchange_->completed_through(local_rank_);
  if (done > 0) MarkCompleted(done);
}

void HierarchicalCommunicator::Run(const char* op, ReduceOp reduce, int root, const nn::Tensor& in,
                                   const nn::Tensor& out) {
  auto request = exchange_->Post(
      local_rank_, {.op = op, .reduce = reduce, .root = root, .label = label(), .in = in,
                    .out = out, .sequence = sequence()});
  exchange_->Wait(*request);
}

void HierarchicalCommunicator::AllReduceImpl(nn::Tensor& x, ReduceOp op) {
  Run("all_reduce", op, 0, x, x);
}

std::shared_ptr<Work> HierarchicalCommunicator::Start(const char* op, ReduceOp reduce,
                                                     const nn::Tensor& in, const nn::Tensor& out) {
  class PendingWork final : public Work {
   public:
    PendingWork(HierarchicalCommunicator* comm, std::shared_ptr<HierarchicalExchange::Request> r)
        : comm_(comm), request_(std::move(r)) {}
    void wait() override {
      comm_->exchange_->Wait(*request_);
      comm_->MarkCompleted(request_->sequence);
      waited_ = true;
    }
    bool is_completed() const override { return comm_->exchange_->IsDone(*request_); }
    std::optional<std::chrono::steady_clock::time_point> finished_at() const override {
      // Written under the exchange's mutex before done; Wait read done under it.
      if (!waited_) return std::nullopt;
      return request_->finished;
    }

   private:
    HierarchicalCommunicator* comm_;
    std::shared_ptr<HierarchicalExchange::Request> request_;
    bool waited_ = false;
  };
  auto request = exchange_->Post(
      local_rank_, {.op = op, .reduce = reduce, .root = 0, .label = label(), .in = in,
                    .out = out, .sequence = sequence()});
  return std::make_shared<PendingWork>(this, std::move(request));
}

std::shared_ptr<Work> HierarchicalCommunicator::AllReduceAsyncImpl(nn::Tensor& x, ReduceOp op) {
  return Start("all_reduce", op, x, x);
}

std::shared_ptr<Work> HierarchicalCommunicator::ReduceScatterAsyncImpl(const nn::Tensor& input,
                                                                       nn::Tensor& output,
                                                                       ReduceOp op) {
  return Start("reduce_scatter", op, input, output);
}

void HierarchicalCommunicator::BroadcastImpl(nn::Tensor& x, int root) {
  Run("broadcast", ReduceOp::kSum, root, x, x);
}

void HierarchicalCommunicator::AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) {
  Run("all_gather", ReduceOp::kSum, 0, input, output);
}

void HierarchicalCommunicator::ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output,
                                                 ReduceOp op) {
  Run("reduce_scatter", op, 0, input, output);
}

void HierarchicalCommunicator::BarrierImpl() { Run("barrier", ReduceOp::kSum, 0, {}, {}); }

}  // namespace tandem::dist::internal
