#include "spawn/train/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "nn/autograd.h"
#include "nn/ops/elementwise.h"
#include "spawn/observe/trace.h"
#include "spawn/train/sync_batch_norm.h"

namespace tandem::dist {
namespace {

// One line per parameter, then per buffer: "param l1.weight (10, 10) float32".
std::vector<std::string> Describe(const nn::Module& module) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : module.named_parameters()) {
    lines.push_back(absl::StrCat("parameter '", name, "' ", nn::ShapeToString(t.shape()), " ",
                                 nn::DTypeName(t.dtype())));
  }
  for (const auto& [name, t] : module.named_buffers()) {
    lines.push_back(absl::StrCat("buffer '", name, "' ", nn::ShapeToString(t.shape()), " ",
                                 nn::DTypeName(t.dtype())));
  }
  return lines;
}

// Live DataParallels by module (at most one each), for BroadcastBuffersOf and
// the refusal of overlapping wrappers; each with the thread that made it (the
// module's rank thread: only its own modules are walked).
struct LiveWrapper {
  const DataParallelOptions* options;
  std::thread::id thread;
};
std::mutex& RegistryMutex() {
  static std::mutex mutex;
  return mutex;
}
std::map<const nn::Module*, LiveWrapper>& Registry() {
  static auto* registry = new std::map<const nn::Module*, LiveWrapper>();
  return *registry;
}

// Whether `inner` is `outer` or one of its descendants.
bool Within(const nn::Module& inner, const nn::Module& outer) {
  if (&inner == &outer) return true;
  for (const auto& [name, child] : outer.named_children()) {
    if (child != nullptr && Within(inner, *child)) return true;
  }
  return false;
}

}  // namespace

namespace internal {
std::optional<bool> BroadcastBuffersOf(const nn::Module* module) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(module);
  if (it == Registry().end()) return std::nullopt;
  return it->second.options->broadcast_buffers;
}
}  // namespace internal

DataParallel::DataParallel(nn::Module& module, Context& ctx, DataParallelOptions options)
    : module_(module), ctx_(ctx), options_(std::move(options)) {
  {
    // Two live wrappers of one parameter (the same module, or one module inside
    // the other) would each reduce its gradient: twice the traffic, and on NCCL
    // the second's hook would read the first's bucket while it is reduced.
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (const auto& [wrapped, live] : Registry()) {
      if (live.thread != std::this_thread::get_id()) continue;
      TANDEM_CHECK(wrapped != &module_, "DataParallel: this ", module_.type_name(),
                   " is already wrapped by a live DataParallel on rank ", ctx_.rank(),
                   "; destroy that one before wrapping the module again");
      TANDEM_CHECK(!Within(*wrapped, module_) && !Within(module_, *wrapped),
                   "DataParallel: this ", module_.type_name(), " and a ", wrapped->type_name(),
                   " wrapped by a live DataParallel on rank ", ctx_.rank(),
                   " contain one another (their shared parameters would be reduced twice); "
                   "wrap only the outer module");
    }
  }
  TANDEM_CHECK(options_.bucket_bytes > 0 && options_.first_bucket_bytes > 0,
               "DataParallel: bucket sizes must be positive, not ", options_.first_bucket_bytes,
               " and ", options_.bucket_bytes);
  TANDEM_CHECK(options_.global_batch_size >= 0, "DataParallel: negative global_batch_size ",
               options_.global_batch_size);
  TANDEM_CHECK(options_.global_batch_size == 0 || options_.reduce_in_backward,
               "DataParallel: global_batch_size ", options_.global_batch_size,
               " weighs the gradients reduced in backward; with reduce_in_backward off the "
               "caller reduces them (scale_loss, apply_collective_grads)");
  CheckSameModelOnEveryRank();
  {
    nn::NoGradGuard no_grad;
    Communicator& comm = ctx_.communicator();
    for (nn::Tensor& p : module_.parameters()) comm.broadcast(p, 0);
    for (nn::Tensor& b : module_.buffers()) comm.broadcast(b, 0);
  }
  for (const auto& [name, p] : module_.named_parameters()) {
    if (!p.requires_grad()) continue;
    params_.push_back({.name = name, .param = p});
  }
  BuildBuckets();
  sync_batch_norm_layers_ = ConnectSyncBatchNorm(&join_);
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    params_[i].hook =
        params_[i].param.register_grad_ready_hook([this, i](nn::Tensor&) { OnGradReady(i); });
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());  // last: a throw above leaves no entry
  Registry()[&module_] = {&options_, std::this_thread::get_id()};
}

DataParallel::~DataParallel() {
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto it = Registry().find(&module_);
    if (it != Registry().end() && it->second.options == &options_) {
      Registry().erase(it);
    }
  }
  for (Slot& s : params_) {
    if (s.hook >= 0) s.param.remove_grad_ready_hook(s.hook);
  }
  ConnectSyncBatchNorm(nullptr);
}

int DataParallel::ConnectSyncBatchNorm(internal::JoinState* join) {
  int connected = 0;
  std::vector<nn::Module*> pending = {&module_};
  while (!pending.empty()) {
    nn::Module* m = pending.back();
    pending.pop_back();
    if (auto* bn = dynamic_cast<nn::BatchNorm2dImpl*>(m)) {
      if (auto* sync = dynamic_cast<SyncBatchNormReducer*>(bn->reducer.get())) {
        sync->set_join(join);
        sync->set_row_weight(join != nullptr && options_.global_batch_size > 0 ? &step_weight_
                                                                               : nullptr);
        ++connected;
      }
    }
    for (const std::shared_ptr<nn::Module>& child : m->children()) pending.push_back(child.get());
  }
  return connected;
}

DataParallel::NoSyncGuard::NoSyncGuard(DataParallel* dp) : dp_(dp), previous_(dp->sync_) {
  TANDEM_CHECK(!dp->join_.joining() || dp->sync_batch_norm_layers_ == 0,
               "DataParallel: no_sync() (gradient accumulation) inside join() with ",
               dp->sync_batch_norm_layers_, " SyncBatchNorm layer(s): their forward is a "
               "collective that a rank whose data ran out cannot answer before the step "
               "agreement; accumulate without join(), or use BatchNorm2d");
  dp->sync_ = false;
}

DataParallel::JoinGuard::JoinGuard(DataParallel* dp)
    : dp_(dp), exceptions_(std::uncaught_exceptions()) {
  TANDEM_CHECK(!dp->join_.joining(), "DataParallel: join() inside join()");
  TANDEM_CHECK(dp->options_.global_batch_size == 0,
               "DataParallel: join() with DataParallelOptions::global_batch_size ",
               dp->options_.global_batch_size,
               ": join() weighs each rank's gradient by the rows it counts; leave "
               "global_batch_size 0");
  TANDEM_CHECK(dp->sync_ && dp->options_.reduce_in_backward,
               "DataParallel: join() needs gradients reduced in backward (not inside no_sync(), "
               "not with reduce_in_backward off)");
  dp->step_rows_ = 0;
  dp->join_.Begin(dp->ctx_.communicator(), dp->ctx_.attempt_info().resume_step);
}

DataParallel::JoinGuard::~JoinGuard() {
  if (finished_.has_value()) return;
  if (std::uncaught_exceptions() > exceptions_) {
    dp_->join_.Abandon();  // the rank fails; spawn stops the others
    return;
  }
  absl::Status status = finish();
  // The failure goes to this rank's next collective, or to spawn when the rank
  // returns without one: a destructor never throws.
  if (!status.ok()) dp_->ctx_.communicator().DeferError(std::move(status));
}

absl::Status DataParallel::JoinGuard::finish() {
  if (finished_.has_value()) return *finished_;
  try {
    // Before answering: this rank's last backward may still have buckets in flight.
    dp_->DropUnwaitedWork();
    const int trained = dp_->join_.Shadow();
    // Ranks that joined early skipped the last updates: every rank takes the
    // model (parameters and buffers) of a rank that ran to the end.
    nn::NoGradGuard no_grad;
    Communicator& comm = dp_->ctx_.communicator();
    for (nn::Tensor& p : dp_->module_.parameters()) comm.broadcast(p, trained);
    for (nn::Tensor& b : dp_->module_.buffers()) comm.broadcast(b, trained);
    finished_ = absl::OkStatus();
  } catch (const CancelledError& e) {
    finished_ = absl::CancelledError(e.what());
  } catch (const PeerFailedError& e) {
    finished_ = MarkPeerFailure(absl::InternalError(e.what()));
  } catch (const std::exception& e) {
    finished_ = absl::InternalError(e.what());
  }
  dp_->join_.Abandon();  // out of join mode whatever happened
  return *finished_;
}

void DataParallel::JoinGuard::all_reduce(nn::Tensor& x, ReduceOp op) {
  TANDEM_CHECK(op == ReduceOp::kSum, "JoinGuard::all_reduce: only a sum is joinable (a rank "
               "whose data ran out adds zeros), not ", ReduceOpName(op));
  dp_->ctx_.communicator().all_reduce(x, op);
  dp_->join_.Record(internal::JoinState::Kind::kAllReduce, x);
}

void DataParallel::CheckSameModelOnEveryRank() {
  Communicator& comm = ctx_.communicator();
  const std::string mine = absl::StrJoin(Describe(module_), "\n");
  // Every rank learns every rank's description (padded to the longest), then all
  // make the same comparison, so they all throw the same error or none does.
  nn::Tensor length = nn::from_vector(std::vector<int64_t>{static_cast<int64_t>(mine.size())},
                                      {1}, {.device = nn::Device::CPU()})
                          .to(ctx_.device());
  comm.all_reduce(length, ReduceOp::kMax);
  const int64_t longest = length.item<int64_t>();
  std::vector<uint8_t> bytes(longest, 0);
  std::copy(mine.begin(), mine.end(), bytes.begin());
  nn::Tensor all =
      comm.all_gather(nn::from_vector(bytes, {longest}, {.device = ctx_.device()}))
          .to(nn::Device::CPU());
  const std::vector<uint8_t> gathered = all.to_vector<uint8_t>();
  auto text_of = [&](int rank) {
    const char* begin = reinterpret_cast<const char*>(gathered.data()) + rank * longest;
    return std::string(begin, strnlen(begin, longest));
  };
  const std::vector<std::string> first = absl::StrSplit(text_of(0), '\n', absl::SkipEmpty());
  for (int r = 1; r < ctx_.world_size(); ++r) {
    const std::vector<std::string> other = absl::StrSplit(text_of(r), '\n', absl::SkipEmpty());
    for (size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
      const std::string a = i < first.size() ? first[i] : "nothing";
      const std::string b = i < other.size() ? other[i] : "nothing";
      TANDEM_CHECK(a == b, "DataParallel: the model differs across ranks; entry ", i, ": rank 0 has ",
                   a, ", rank ", r, " has ", b);
    }
  }
}

void DataParallel::BuildBuckets() {
  // Reverse registration order: backward produces the last layers' gradients first.
  int64_t bytes = 0;
  std::vector<std::vector<int>> groups;
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
    const nn::Tensor& p = params_[i].param;
    const int64_t cap = groups.size() <= 1 ? options_.first_bucket_bytes : options_.bucket_bytes;
    const bool same_dtype =
        !groups.empty() && params_[groups.back().front()].param.dtype() == p.dtype();
    if (groups.empty() || !same_dtype || (bytes + p.nbytes() > cap && bytes > 0)) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(i);
    bytes += p.nbytes();
  }
  for (const std::vector<int>& group : groups) {
    Bucket bucket;
    int64_t numel = 0;
    for (int i : group) numel += params_[i].param.numel();
    // Zeros up to a multiple of the world size: a reduce-scatter splits it evenly.
    numel = (numel + ctx_.world_size() - 1) / ctx_.world_size() * ctx_.world_size();
    const nn::Tensor& first = params_[group.front()].param;
    bucket.buffer = nn::zeros({numel}, {.dtype = first.dtype(), .device = first.device()});
    int64_t offset = 0;
    for (int i : group) {
      const nn::Tensor& p = params_[i].param;
      params_[i].bucket = static_cast<int>(buckets_.size());
      params_[i].view = bucket.buffer.slice(offset, offset + p.numel()).reshape(p.shape());
      offset += p.numel();
    }
    bucket.params = group;
    buckets_.push_back(std::move(bucket));
  }
}

std::vector<std::string> DataParallel::bucket_parameter_names(int b) const {
  std::vector<std::string> names;
  for (int i : buckets_.at(b).params) names.push_back(params_[i].name);
  return names;
}

GradBucket DataParallel::bucket(int b) const {
  GradBucket view{.index = b, .buffer = buckets_.at(b).buffer, .comm = &ctx_.communicator()};
  int64_t offset = 0;
  for (int i : buckets_[b].params) {
    view.params.push_back(params_[i].param);
    view.offsets.push_back(offset);
    offset += params_[i].param.numel();
  }
  return view;
}

void DataParallel::PlaceGrad(int i, bool zero_if_undefined) {
  Slot& s = params_[i];
  const nn::Tensor grad = s.param.grad();
  if (grad.defined() && grad.storage() == s.view.storage() &&
      grad.storage_offset() == s.view.storage_offset()) {
    return;  // already in place
  }
  nn::NoGradGuard no_grad;
  if (grad.defined()) {
    s.view.copy_(grad);
  } else if (zero_if_undefined) {
    s.view.zero_();
  } else {
    return;
  }
  s.param.set_grad(s.view);
}

void DataParallel::DropUnwaitedWork() {
  // Work's contract: destroying an unwaited handle orders the compute stream
  // after its collective (CUDA) or waits for it (CPU), so the zeroing and copies
  // that follow on the compute stream cannot touch a bucket NCCL still reduces.
  for (Bucket& b : buckets_) b.work.reset();
}

nn::Tensor DataParallel::forward(const nn::Tensor& x) {
  // A backward pass that threw never reached FinishBackward: its buckets'
  // collectives may still run. Start afresh, after them.
  DropUnwaitedWork();
  pass_started_ = false;
  const int64_t rows = x.dim() > 0 ? x.size(0) : 1;
  // A finished rank replays the last step's collectives: a step must look like
  // the others, and an evaluation's forward would be a step of its own.
  TANDEM_CHECK(!join_.joining() || nn::grad_mode_enabled(),
               "DataParallel: a forward with autograd off (an evaluation) inside join(): it "
               "would be a step of its own, which a rank whose data ran out cannot answer; "
               "evaluate through the module (dp.module()) inside a training step, summing "
               "through JoinGuard::all_reduce, or outside the join");
  if (join_.joining() && !sync_) {
    // An accumulating micro-batch inside join(): no collective before the step
    // agreement, which the step's synchronised forward makes for all its rows.
    step_rows_ += rows;
  } else if (join_.joining()) {
    join_.BeginStep(std::exchange(step_rows_, 0) + rows);
  } else if (options_.global_batch_size > 0 && nn::grad_mode_enabled()) {
    WeighStepRows(rows);  // a training step's (an evaluation's forward has no backward)
  }
  // PyTorch's rule: at a synchronised forward with autograd on (not under
  // no_sync(), not in an evaluation under NoGradGuard).
  if (options_.broadcast_buffers && sync_ && nn::grad_mode_enabled() && ctx_.world_size() > 1) {
    BroadcastBuffers();
  }
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) PlaceGrad(i, true);
  return module_.forward(x);
}

void DataParallel::BroadcastBuffers() {
  // From rank 0, or inside join() from the step's lowest active rank (a rank
  // that ran out of data replays the broadcast as a receiver). One broadcast per
  // dtype (BatchNorm: the float statistics, the int64 counts), not per buffer.
  const int root = join_.joining() ? join_.lowest_active() : 0;
  nn::NoGradGuard no_grad;
  std::map<nn::DType, std::vector<nn::Tensor>> by_dtype;
  for (nn::Tensor& b : module_.buffers()) by_dtype[b.dtype()].push_back(b);
  Communicator& comm = ctx_.communicator();
  for (auto& [dtype, buffers] : by_dtype) {
    int64_t numel = 0;
    for (const nn::Tensor& b : buffers) numel += b.numel();
    nn::Tensor flat = nn::empty({numel}, {.dtype = dtype, .device = buffers.front().device()});
    int64_t offset = 0;
    for (const nn::Tensor& b : buffers) {
      flat.slice(offset, offset + b.numel()).copy_(b.reshape({b.numel()}));
      offset += b.numel();
    }
    comm.broadcast(flat, root);
    join_.Record(internal::JoinState::Kind::kBroadcast, flat);
    if (ctx_.rank() == root) continue;
    offset = 0;
    for (nn::Tensor& b : buffers) {
      b.copy_(flat.slice(offset, offset + b.numel()).reshape(b.shape()));
      offset += b.numel();
    }
  }
}

void DataParallel::OnGradReady(int i) {
  if (!sync_ || !options_.reduce_in_backward) return;
  if (!pass_started_) {
    DropUnwaitedWork();  // a pass that threw without a forward since
    pass_started_ = true;
    next_bucket_ = 0;
    for (Bucket& b : buckets_) b.pending = static_cast<int>(b.params.size());
    for (Slot& s : params_) s.ready = false;
    // If the pass throws, autograd drops its callbacks unrun: `pass_end` then
    // goes as the exception leaves backward, and with it the handles of the
    // buckets launched so far, before the caller can touch their gradients
    // (zero_grad): the compute stream then waits for those collectives.
    struct PassEnd {
      DataParallel* dp;
      ~PassEnd() { dp->DropUnwaitedWork(); }
    };
    // (made in place: a PassEnd temporary would run its destructor right here)
    const std::shared_ptr<PassEnd> pass_end(new PassEnd{this});
    nn::autograd::QueueCallback([this, pass_end] { FinishBackward(); });
  }
  Slot& s = params_[i];
  PlaceGrad(i, false);
  TANDEM_CHECK(!s.ready, "DataParallel: gradient of '", s.name,
               "' became ready twice in one backward pass");
  s.ready = true;
  --buckets_[s.bucket].pending;
  LaunchReadyBuckets();
}

void DataParallel::LaunchReadyBuckets() {
  while (next_bucket_ < num_buckets() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_];
    if (options_.on_bucket_launch) {
      options_.on_bucket_launch(next_bucket_, static_cast<int>(b.params.size()));
    }
    b.launched = std::chrono::steady_clock::now();
    if (join_.joining() && options_.comm_hook) {
      LaunchHookedBucketInJoin(next_bucket_);
    } else if (join_.joining()) {
      // Weighted by this rank's share of the step's samples, then summed: a
      // joined rank adds zeros.
      {
        nn::NoGradGuard no_grad;
        b.buffer.mul_(join_.sample_weight());
      }
      b.work = ctx_.communicator().all_reduce_async(b.buffer, ReduceOp::kSum);
      b.wire_bytes = b.buffer.nbytes();
      join_.Record(internal::JoinState::Kind::kAllReduceAsync, b.buffer);
    } else {
      LaunchBucket(b);
    }
    b.returned = std::chrono::steady_clock::now();
    ++next_bucket_;
  }
}

void DataParallel::WeighStepRows(int64_t rows) {
  const int64_t global = options_.global_batch_size;
  // SyncBatchNorm's gradient sums in this forward's backward (set_row_weight):
  // weighed on every rank by the forward's own rows, n N / G (1 with even
  // shares), no_sync() micro-batches included; only proportions matter.
  step_weight_ = static_cast<double>(rows * ctx_.world_size()) / static_cast<double>(global);
  if (!sync_) {  // a no_sync() micro-batch: the step's synchronised forward weighs them all
    step_rows_ += rows;
    return;
  }
  const int64_t step_rows = std::exchange(step_rows_, 0) + rows;
  TANDEM_CHECK(step_rows <= global, "DataParallel: rank ", ctx_.rank(), "'s step has ",
               step_rows, " rows, more than global_batch_size ", global);
  step_scale_ = static_cast<double>(step_rows * ctx_.world_size()) / static_cast<double>(global);
}

void DataParallel::LaunchBucket(Bucket& b) {
  // Outside join(): scaled to this rank's share of the global batch, if set
  // and uneven, then averaged (or the hook's reduction).
  if (options_.global_batch_size > 0 && step_scale_ != 1.0) {
    nn::NoGradGuard no_grad;
    b.buffer.mul_(step_scale_);
  }
  if (options_.comm_hook) {
    GradBucket view = bucket(next_bucket_);
    b.work = internal::LaunchCommHook(options_.comm_hook, view, &b.wire_bytes);
  } else {
    b.work = ctx_.communicator().all_reduce_async(b.buffer, ReduceOp::kAvg);
    b.wire_bytes = b.buffer.nbytes();
  }
}

void DataParallel::LaunchHookedBucketInJoin(int index) {
  // The hook's result is the mean over the ranks of what it was given (it
  // averaged, or DataParallel divides its sum by N): given n_r N / sum n times
  // this rank's gradient, that mean is the sample-weighted sum, and a joined
  // rank (factor 0) gives zeros. With equal batches the factor is exactly 1.
  Bucket& b = buckets_[index];
  {
    nn::NoGradGuard no_grad;
    b.buffer.mul_(join_.sample_scale());
  }
  const uint64_t before = ctx_.communicator().collectives_entered();
  GradBucket view = bucket(index);
  b.work = internal::LaunchCommHook(options_.comm_hook, view, &b.wire_bytes);
  // A joined rank runs the same hook (the one of this step) on its zeroed bucket.
  join_.RecordReplay(before, [this, index, hook = options_.comm_hook] {
    nn::NoGradGuard no_grad;
    buckets_[index].buffer.zero_();
    GradBucket zeros = bucket(index);
    int64_t wire_bytes = 0;
    internal::LaunchCommHook(hook, zeros, &wire_bytes)->wait();
  });
}

void DataParallel::FinishBackward() {
  pass_started_ = false;
  std::vector<std::string> unused;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    Slot& s = params_[i];
    if (s.ready) continue;
    if (!options_.find_unused_parameters) {
      unused.push_back(s.name);
      continue;
    }
    PlaceGrad(i, true);
    s.ready = true;
    --buckets_[s.bucket].pending;
  }
  TANDEM_CHECK(unused.empty(), "DataParallel (rank ", ctx_.rank(), "): parameter",
               unused.size() > 1 ? "s '" : " '", absl::StrJoin(unused, "', '"),
               "' got no gradient in this backward pass; use them in the loss or set "
               "DataParallelOptions::find_unused_parameters");
  LaunchReadyBuckets();
  const auto backward_end = std::chrono::steady_clock::now();
  TraceRecorder* trace = ctx_.trace();
  const bool tracing = trace != nullptr && trace->recording(ctx_.rank());
  // The buckets run one after another on the communication thread: a bucket's
  // work starts at its launch or when the previous one finished, whichever is later.
  std::chrono::steady_clock::time_point previous_finished{};
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    if (!b.work) continue;
    const auto wait_start = std::chrono::steady_clock::now();
    b.work->wait();
    const auto done = std::chrono::steady_clock::now();
    // Exposed: the rank was blocked by it (inside the launch call, in the wait).
    // Hidden: the part of its run on another thread (when the communicator
    // reports when it finished) that lay before the end of backward.
    const std::optional<std::chrono::steady_clock::time_point> finished = b.work->finished_at();
    const double exposed = std::chrono::duration<double>(b.returned - b.launched).count() +
                           std::chrono::duration<double>(done - wait_start).count();
    double hidden = 0;
    if (finished) {
      const auto began = std::max(b.returned, previous_finished);
      hidden = std::max(
          0.0, std::chrono::duration<double>(std::min(*finished, backward_end) - began).count());
      previous_finished = *finished;
    }
    overlap_.comm_s += exposed + hidden;
    overlap_.hidden_s += hidden;
    if (tracing) {
      // From the launch in backward to when it finished (or, not known, to the
      // end of its wait).
      trace->Span(ctx_.rank(), "all_reduce bucket", b.launched, finished ? *finished : done,
                  absl::StrCat("\"bucket\": ", i, ", \"bytes\": ", b.wire_bytes,
                               ", \"params\": ", b.params.size()));
    }
    b.work.reset();
  }
}

nn::Tensor DataParallel::scale_loss(const nn::Tensor& loss) const {
  return loss / static_cast<double>(ctx_.world_size());
}

void DataParallel::apply_collective_grads() {
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) PlaceGrad(i, true);
  for (Bucket& b : buckets_) ctx_.communicator().all_reduce(b.buffer, ReduceOp::kSum);
}

}  // namespace tandem::dist
