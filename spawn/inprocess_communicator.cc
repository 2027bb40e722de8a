#include "spawn/inprocess_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "nn/graph.h"
#if TANDEM_WITH_CUDA
#include "spawn/internal/inprocess_cuda.h"
#endif

namespace tandem::dist {
namespace {

template <typename T>
void ReduceSliceCpu(const std::vector<const void*>& in, const std::vector<void*>& out,
                    int64_t begin, int64_t end, ReduceOp op) {
  const size_t n = in.size();
  for (int64_t i = begin; i < end; ++i) {
    T acc = static_cast<const T*>(in[0])[i];
    for (size_t k = 1; k < n; ++k) {
      const T v = static_cast<const T*>(in[k])[i];
      acc = op == ReduceOp::kMax ? (v > acc ? v : acc) : static_cast<T>(acc + v);
    }
    if (op == ReduceOp::kAvg) acc = static_cast<T>(acc / static_cast<T>(n));
    for (void* o : out) static_cast<T*>(o)[i] = acc;
  }
}

// Reduces in[0..n) element-wise over [begin, end) into every out[j], ranks in order.
void ReduceSlice(const std::vector<const void*>& in, const std::vector<void*>& out,
                 int64_t begin, int64_t end, nn::DType dtype, ReduceOp op, nn::Device device,
                 const char* name) {
  if (begin >= end) return;
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) {
    internal::ReduceSliceCuda(in, out, begin, end, dtype, static_cast<int>(op), device);
    return;
  }
#endif
  (void)device;
  switch (dtype) {
    case nn::DType::kFloat32: return ReduceSliceCpu<float>(in, out, begin, end, op);
    case nn::DType::kFloat64: return ReduceSliceCpu<double>(in, out, begin, end, op);
    case nn::DType::kInt64: return ReduceSliceCpu<int64_t>(in, out, begin, end, op);
    default:
      Fail(name, ": dtype ", nn::DTypeName(dtype), " is not supported (float32, float64, int64)");
  }
}

void Copy(void* dst, const void* src, int64_t bytes, nn::Device device) {
#if TANDEM_WITH_CUDA
  if (device.is_cuda()) return internal::CopyCuda(dst, src, bytes, device);
#endif
  (void)device;
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// This rank's slice [begin, end) of n elements.
std::pair<int64_t, int64_t> Chunk(int64_t n, int rank, int world) {
  return {n * rank / world, n * (rank + 1) / world};
}

}  // namespace

// --- InProcessGroup ---------------------------------------------------------------

InProcessGroup::InProcessGroup(int world_size) : world_size_(world_size), slots_(world_size) {
  TANDEM_CHECK(world_size >= 1, "InProcessGroup: world size ", world_size);
}

InProcessGroup::~InProcessGroup() = default;

void InProcessGroup::ArriveAndWait() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (cancelled_) throw CancelledError(reason_);
  const uint64_t generation = generation_;
  if (++arrived_ == world_size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != generation || cancelled_; });
  if (generation_ == generation) throw CancelledError(reason_);
}

void InProcessGroup::Cancel(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cancelled_) {
    cancelled_ = true;
    reason_ = reason;
  }
  cv_.notify_all();
}

bool InProcessGroup::cancelled() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cancelled_;
}

// --- InProcessCommunicator ----------------------------------------------------------

InProcessCommunicator::InProcessCommunicator(int rank, nn::Device device,
                                             std::shared_ptr<InProcessGroup> group)
    : Communicator(rank, group->world_size(), device), group_(std::move(group)) {}

InProcessCommunicator::~InProcessCommunicator() {
#if TANDEM_WITH_CUDA
  if (event_ != nullptr) internal::DestroyEvent(event_, device());
#endif
}

void InProcessCommunicator::CheckDevice(const nn::Tensor& t, const char* op) const {
  TANDEM_CHECK(t.device() == device(), op, ": tensor ", t.ToString(), " is not on rank ", rank(),
               "'s device ", device().ToString());
}

void InProcessCommunicator::Publish(const char* op, const nn::Tensor* send, nn::Tensor* recv,
                                    int arg) {
  // The rendezvous is on the host: recorded into a graph it would never happen
  // again at replay (and the other ranks would wait for a capture to finish).
  TANDEM_CHECK(!nn::CudaGraph::IsCapturing(), "in-process communicator cannot be captured in a "
               "CUDA graph (", op, " #", sequence(), " on rank ", rank(), ", ",
               device().ToString(), "): its ranks meet on the host; use NCCL (ranks on distinct "
               "GPUs) to capture a step with collectives, or run this step eagerly");
  InProcessGroup::Slot& s = group_->slot(rank());
  s.op = op;
  s.sequence = sequence();
  s.numel = send != nullptr ? send->numel() : 0;
  s.dtype = send != nullptr ? send->dtype() : nn::DType::kFloat32;
  s.arg = arg;
  s.device = device();
  s.send = send != nullptr ? send->data_ptr() : nullptr;
  s.recv = recv != nullptr ? recv->data_ptr() : nullptr;
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    if (event_ == nullptr) event_ = internal::CreateEvent(device());
    internal::RecordEvent(event_, device());
  }
#endif
  s.event = event_;
  group_->ArriveAndWait();
  // Every rank makes the same comparison over the same slots, so either all
  // ranks throw here or none does.
  const InProcessGroup::Slot& first = group_->slot(0);
  for (int k = 1; k < world_size(); ++k) {
    const InProcessGroup::Slot& other = group_->slot(k);
    const bool same = std::strcmp(other.op, first.op) == 0 && other.numel == first.numel &&
                      other.dtype == first.dtype && other.arg == first.arg &&
                      other.sequence == first.sequence;
    TANDEM_CHECK(same, "collective mismatch: rank 0 called ", first.op, " #", first.sequence,
                 " (", first.numel, " ", nn::DTypeName(first.dtype), ", arg ", first.arg,
                 ") while rank ", k, " called ", other.op, " #", other.sequence, " (", other.numel,
                 " ", nn::DTypeName(other.dtype), ", arg ", other.arg, ")");
    TANDEM_CHECK(other.device == first.device, "in-process ", first.op, ": rank 0 is on ",
                 first.device.ToString(), " but rank ", k, " on ", other.device.ToString(),
                 " (ranks on different GPUs use NCCL)");
  }
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    std::vector<void*> events;
    for (int k = 0; k < world_size(); ++k) events.push_back(group_->slot(k).event);
    internal::WaitEvents(events, device());
  }
#endif
}

void InProcessCommunicator::AllReduceImpl(nn::Tensor& x, ReduceOp op) {
  CheckDevice(x, "all_reduce");
  Publish("all_reduce", &x, &x, static_cast<int>(op));
  std::vector<const void*> in;
  std::vector<void*> out;
  for (int k = 0; k < world_size(); ++k) {
    in.push_back(group_->slot(k).send);
    out.push_back(group_->slot(k).recv);
  }
  const auto [begin, end] = Chunk(x.numel(), rank(), world_size());
  ReduceSlice(in, out, begin, end, x.dtype(), op, device(), "all_reduce");
  Finish();
}

void InProcessCommunicator::BroadcastImpl(nn::Tensor& x, int root) {
  CheckDevice(x, "broadcast");
  Publish("broadcast", &x, &x, root);
  if (rank() != root) Copy(x.data_ptr(), group_->slot(root).send, x.nbytes(), device());
  Finish();
}

void InProcessCommunicator::AllGatherImpl(const nn::Tensor& input, nn::Tensor& output) {
  CheckDevice(input, "all_gather");
  Publish("all_gather", &input, &output, 0);
  char* dst = static_cast<char*>(output.data_ptr());
  for (int k = 0; k < world_size(); ++k) {
    Copy(dst + k * input.nbytes(), group_->slot(k).send, input.nbytes(), device());
  }
  Finish();
}

void InProcessCommunicator::ReduceScatterImpl(const nn::Tensor& input, nn::Tensor& output,
                                              ReduceOp op) {
  CheckDevice(input, "reduce_scatter");
  Publish("reduce_scatter", &input, &output, static_cast<int>(op));
  const int64_t offset_bytes = rank() * output.nbytes();
  std::vector<const void*> in;
  for (int k = 0; k < world_size(); ++k) {
    in.push_back(static_cast<const char*>(group_->slot(k).send) + offset_bytes);
  }
  ReduceSlice(in, {output.data_ptr()}, 0, output.numel(), input.dtype(), op, device(),
              "reduce_scatter");
  Finish();
}

void InProcessCommunicator::BarrierImpl() {
  Publish("barrier", nullptr, nullptr, 0);
  Finish();
}

// The closing half of every collective: nobody returns (and reuses or frees a
// buffer) while another rank may still read or write it.
void InProcessCommunicator::Finish() {
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) internal::RecordEvent(event_, device());
#endif
  group_->ArriveAndWait();
#if TANDEM_WITH_CUDA
  if (device().is_cuda()) {
    std::vector<void*> events;
    for (int k = 0; k < world_size(); ++k) events.push_back(group_->slot(k).event);
    internal::WaitEvents(events, device());
  }
#endif
}

}  // namespace tandem::dist
