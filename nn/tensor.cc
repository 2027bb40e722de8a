#include "nn/tensor.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nn/autograd.h"
#include "nn/internal/allocator.h"
#include "nn/internal/cuda_runtime.h"
#include "nn/ops/internal/fill_kernels.h"
#include "nn/random.h"

namespace tandem::nn {

std::string ShapeToString(const Shape& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    TANDEM_CHECK(d >= 0, "shape ", ShapeToString(shape), " has a negative dimension");
    TANDEM_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d, "shape ",
                 ShapeToString(shape), " has more elements than int64 can count");
    n *= d;
  }
  return n;
}

// --- Storage ---------------------------------------------------------------------
namespace {

thread_local std::shared_ptr<Allocator> thread_cuda_allocator;
thread_local internal::DeferredCudaFrees* thread_deferred_frees = nullptr;

// 64-byte aligned host memory. Blocks of kCachedMinBytes and more are kept on
// free and handed out again for the same rounded size: a training step
// allocates the same activation and gradient sizes every step, and glibc
// serves such sizes with mmap/munmap, so without the cache every step pays the
// page faults of zero-filling fresh pages (measured: over 40% of an MLP step
// on the CPU). At most kMaxCachedBytes stay cached; beyond that blocks go back
// to the system. Thread-safe.
class HostAllocator final : public Allocator {
 public:
  static constexpr size_t kCachedMinBytes = size_t{64} << 10;
  static constexpr size_t kMaxCachedBytes = size_t{2} << 30;

  ~HostAllocator() override {
    for (auto& [bytes, blocks] : cached_) {
      for (void* ptr : blocks) std::free(ptr);
    }
  }

  void* Allocate(int64_t bytes, Device) override {
    const size_t rounded = Rounded(static_cast<size_t>(bytes));
    if (rounded >= kCachedMinBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cached_.find(rounded);
      if (it != cached_.end() && !it->second.empty()) {
        void* ptr = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= rounded;
        return ptr;
      }
    }
    void* ptr = std::aligned_alloc(64, rounded);
    TANDEM_CHECK(ptr != nullptr, "out of host memory allocating ", bytes, " bytes");
    return ptr;
  }

  void Free(void* ptr, int64_t bytes, Device) noexcept override {
    const size_t rounded = Rounded(static_cast<size_t>(bytes));
    if (rounded >= kCachedMinBytes) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_bytes_ + rounded <= kMaxCachedBytes) {
        try {
          cached_[rounded].push_back(ptr);
          cached_bytes_ += rounded;
          return;
        } catch (...) {  // no memory for the list: give the block back instead
        }
      }
    }
    std::free(ptr);
  }

 private:
  // Multiples of 64 bytes; cached sizes rounded up to a multiple of 1/8 of
  // their power of two (at most 12.5% slack), so near sizes share blocks.
  static size_t Rounded(size_t bytes) {
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded < kCachedMinBytes) return rounded;
    size_t power = kCachedMinBytes;
    while (power * 2 <= rounded) power *= 2;
    const size_t step = power / 8;
    return (rounded + step - 1) / step * step;
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> cached_;  // by rounded size; guarded by mu_
  size_t cached_bytes_ = 0;                                // guarded by mu_
};

class CudaPoolAllocator final : public Allocator {
 public:
  void* Allocate(int64_t bytes, Device device) override {
#if TANDEM_WITH_CUDA
    return internal::CudaAllocate(bytes, device);
#else
    Fail("cannot allocate on ", device.ToString(), ": tandem was built without CUDA");
#endif
  }
  // Pool memory always has an owning stream (Storage::stream()): Storage calls
  // FreeOnStream. Free is for memory handed back without one.
  void Free(void* ptr, int64_t bytes, Device device) noexcept override {
#if TANDEM_WITH_CUDA
    FreeOnStream(ptr, bytes, device, nullptr);
#else
    (void)ptr;
    (void)bytes;
    (void)device;
#endif
  }
  void FreeOnStream(void* ptr, int64_t, Device device, CUstream_st* stream) noexcept override {
#if TANDEM_WITH_CUDA
    if (internal::DeferredCudaFrees* deferred = thread_deferred_frees) {
      deferred->push_back({ptr, device, stream});  // a capture is running on this thread
      return;
    }
    if (stream == nullptr) {
      try {
        stream = internal::CudaThreadStream(device);
      } catch (...) {
        return;  // no stream to be had: the context is broken; leak rather than throw
      }
    }
    internal::CudaFree(ptr, device, stream);
#else
    (void)ptr;
    (void)device;
    (void)stream;
#endif
  }
};

// The owner of a new storage's memory: the allocating thread's stream for a
// CUDA device (the stream CudaAllocate and the capture arena allocate on).
internal::StreamRef OwnerOf(int64_t bytes, Device device) {
#if TANDEM_WITH_CUDA
  if (device.is_cuda() && bytes > 0) return {internal::CudaThreadStream(device), device.index};
#else
  (void)bytes;
  (void)device;
#endif
  return {};
}

}  // namespace

namespace internal {
DeferredCudaFrees* SetThreadDeferredCudaFrees(DeferredCudaFrees* frees) {
  std::swap(thread_deferred_frees, frees);
  return frees;
}
}  // namespace internal

std::shared_ptr<Allocator> DefaultAllocator(Device device) {
  static const auto host = std::make_shared<HostAllocator>();
  static const auto cuda = std::make_shared<CudaPoolAllocator>();
  if (device.is_cpu()) return host;
  return thread_cuda_allocator ? thread_cuda_allocator : cuda;
}

std::shared_ptr<Allocator> SetThreadCudaAllocator(std::shared_ptr<Allocator> allocator) {
  std::swap(thread_cuda_allocator, allocator);
  return allocator;
}

Storage::Storage(int64_t bytes, Device device) : Storage(bytes, device, DefaultAllocator(device)) {}

Storage::Storage(int64_t bytes, Device device, std::shared_ptr<Allocator> allocator)
    : bytes_(bytes),
      device_(device),
      allocator_(std::move(allocator)),
      uses_(OwnerOf(bytes, device)) {
  TANDEM_CHECK(allocator_ != nullptr, "Storage: no allocator for ", device.ToString());
  if (bytes > 0) data_ = allocator_->Allocate(bytes, device);
}

Storage::~Storage() {
  if (data_ == nullptr) return;
  CUstream_st* owner = uses_.owner().stream;
  if (owner == nullptr) {
    allocator_->Free(data_, bytes_, device_);
    return;
  }
#if TANDEM_WITH_CUDA
  // Other streams that used the memory: the owner waits for their work so far,
  // so the free (on the owner) comes after it.
  std::vector<internal::StreamRef> users = uses_.TakeUsers();
  // The common case: the owner is the calling thread's stream (no other thread
  // captures it; if this one does, the free goes to its capture's deferred
  // list) and no other stream used the memory. Otherwise a capture may run on
  // the owner (another thread's, or this one's, where the waits for the users
  // would invalidate it) or on a user stream: through the capture registry.
  if (!users.empty() || owner != internal::CudaThreadStreamIfAny(device_)) {
    internal::FreeOnOwnerUnlessCaptured(allocator_, data_, bytes_, device_, owner,
                                        std::move(users));
    return;
  }
#endif
  allocator_->FreeOnStream(data_, bytes_, device_, owner);
}

void Storage::PrepareUse() const {
#if TANDEM_WITH_CUDA
  CUstream_st* owner = uses_.owner().stream;
  if (owner == nullptr) return;
  CUstream_st* mine = internal::CudaThreadStream(device_);
  if (!uses_.NeedsWait(mine)) return;
  internal::WaitForOwner(mine, owner, device_);  // another thread may capture the owner
  uses_.AddUser({mine, device_.index});
#endif
}

void Storage::RecordStream(CUstream_st* stream, Device device) const {
  TANDEM_CHECK(device.is_cuda(), "Storage::RecordStream: ", device.ToString(),
               " is not a CUDA device");
  if (uses_.owner().stream == nullptr) return;  // host memory: nothing to order
  uses_.AddUser({stream, device.index});
}

// --- Tensor accessors ------------------------------------------------------------------
namespace {
const TensorImpl& Impl(const std::shared_ptr<TensorImpl>& impl, const char* what) {
  TANDEM_CHECK(impl != nullptr, what, ": undefined tensor");
  return *impl;
}
std::shared_ptr<TensorImpl> NewImpl(const Shape& shape, DType dtype, Device device,
                                    std::shared_ptr<Allocator> allocator) {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(NumElements(shape) * ElementSize(dtype), device,
                                            std::move(allocator));
  return impl;
}
// The pinned host allocator for a tensor on `device`, or an error saying why not.
std::shared_ptr<Allocator> PinnedAllocatorFor(Device device) {
  TANDEM_CHECK(device.is_cpu(), "TensorOptions::pinned: pinned memory is host memory, but the ",
               "device is ", device.ToString(), "; make a pinned cpu tensor and copy it with to(",
               device.ToString(), ")");
  static const int visible_gpus = cuda_device_count();
#if TANDEM_WITH_CUDA
  if (visible_gpus > 0) return internal::PinnedHostAllocator();
#endif
  Fail("pinned memory needs tandem built with CUDA and a visible GPU (built with CUDA: ",
       cuda_built() ? "yes" : "no", ", visible GPUs: ", visible_gpus, ")");
}
// A view of `t`'s storage with another shape and offset, no autograd state.
Tensor View(const Tensor& t, const Shape& shape, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.storage();
  impl->offset = offset;
  impl->shape = shape;
  impl->dtype = t.dtype();
  return Tensor(impl);
}
}  // namespace

const Shape& Tensor::shape() const { return Impl(impl_, "shape()").shape; }
int64_t Tensor::size(int64_t d) const {
  const int64_t n = dim();
  const int64_t k = d < 0 ? d + n : d;
  TANDEM_CHECK(k >= 0 && k < n, "size(", d, "): tensor of shape ", ShapeToString(shape()),
               " has ", n, " dims");
  return shape()[k];
}
int64_t Tensor::numel() const {
  // The shape was checked (NumElements) when the tensor was made: a plain product.
  int64_t n = 1;
  for (int64_t d : shape()) n *= d;
  return n;
}
DType Tensor::dtype() const { return Impl(impl_, "dtype()").dtype; }
Device Tensor::device() const { return Impl(impl_, "device()").storage->device(); }
std::string Tensor::ToString() const {
  if (!defined()) return "undefined";
  return absl::StrCat(DTypeName(dtype()), ShapeToString(shape()), " on ", device().ToString());
}
void* Tensor::data_ptr() const {
  const TensorImpl& impl = Impl(impl_, "data_ptr()");
  if (impl.storage->stream() != nullptr) impl.storage->PrepareUse();
  return static_cast<char*>(impl.storage->data()) + impl.offset * ElementSize(impl.dtype);
}
void* Tensor::host_ptr() const {
  const TensorImpl& impl = Impl(impl_, "host_ptr()");
  TANDEM_CHECK(!impl.storage->device().is_cuda(), "host access to ", ToString(),
               ": its elements are in device memory (copy the tensor to the host first: "
               "to(Device::CPU()))");
  return static_cast<char*>(impl.storage->data()) + impl.offset * ElementSize(impl.dtype);
}
const std::shared_ptr<Storage>& Tensor::storage() const { return Impl(impl_, "storage()").storage; }
bool Tensor::is_pinned() const {
  const TensorImpl& impl = Impl(impl_, "is_pinned()");
#if TANDEM_WITH_CUDA
  return impl.storage->allocator() == internal::PinnedHostAllocator();
#else
  (void)impl;
  return false;
#endif
}
int64_t Tensor::storage_offset() const { return Impl(impl_, "storage_offset()").offset; }

// --- Autograd state ------------------------------------------------------------------
bool Tensor::requires_grad() const { return Impl(impl_, "requires_grad()").requires_grad; }
Tensor& Tensor::set_requires_grad(bool requires_grad) {
  TANDEM_CHECK(is_leaf(), "set_requires_grad on a non-leaf tensor (output of ",
               "an op); use detach() first");
  TANDEM_CHECK(!requires_grad || IsFloating(dtype()), "set_requires_grad: a ",
               DTypeName(dtype()), " tensor cannot require a gradient");
  impl_->requires_grad = requires_grad;
  return *this;
}
bool Tensor::is_leaf() const { return Impl(impl_, "is_leaf()").grad_fn == nullptr; }
Tensor Tensor::grad() const { return Impl(impl_, "grad()").grad; }
void Tensor::set_grad(const Tensor& grad) const {
  Impl(impl_, "set_grad()");
  if (grad.defined()) {
    TANDEM_CHECK(grad.shape() == shape() && grad.dtype() == dtype() && grad.device() == device(),
                 "set_grad: gradient ", grad.ToString(), " does not match tensor ", ToString());
  }
  impl_->grad = grad;
}
const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const { return Impl(impl_, "grad_fn()").grad_fn; }
void Tensor::backward() const {
  TANDEM_CHECK(numel() == 1, "backward(): the loss must have one element, but has shape ",
               ShapeToString(shape()), "; pass a gradient of that shape");
  autograd::Backward(*this, ones(shape(), {.dtype = dtype(), .device = device()}));
}
void Tensor::backward(const Tensor& grad) const { autograd::Backward(*this, grad); }
Tensor Tensor::detach() const { return View(*this, shape(), storage_offset()); }
int Tensor::register_grad_ready_hook(GradReadyHook hook) const {
  Impl(impl_, "register_grad_ready_hook()");
  TANDEM_CHECK(is_leaf(), "register_grad_ready_hook: only leaves (parameters) have hooks");
  const int handle = impl_->next_hook_handle++;
  impl_->grad_ready_hooks.emplace_back(handle, std::move(hook));
  return handle;
}
void Tensor::remove_grad_ready_hook(int handle) const {
  auto& hooks = impl_->grad_ready_hooks;
  std::erase_if(hooks, [handle](const auto& h) { return h.first == handle; });
}
const std::string& Tensor::name() const { return Impl(impl_, "name()").name; }
void Tensor::set_name(std::string name) const { impl_->name = std::move(name); }

// --- Copies and conversions ---------------------------------------------------------------
namespace {

// dst[i] = src[i] converted, on the host.
void ConvertHost(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n * ElementSize(src_dtype)));
    return;
  }
  TANDEM_DISPATCH_ALL(src_dtype, [&]<typename S>() {
    TANDEM_DISPATCH_ALL(dst_dtype, [&]<typename D>() {
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        // The 16-bit floats convert through float32, as the CUDA kernel does.
        if constexpr (std::is_same_v<D, BFloat16> || std::is_same_v<D, Float16>) {
          d[i] = D(static_cast<float>(s[i]));
        } else if constexpr (std::is_same_v<S, BFloat16> || std::is_same_v<S, Float16>) {
          d[i] = static_cast<D>(static_cast<float>(s[i]));
        } else {
          d[i] = static_cast<D>(s[i]);
        }
      }
    });
  });
}

// Copies src's elements into dst (same numel), converting dtype and crossing devices.
void CopyInto(const Tensor& dst, const Tensor& src) {
  const int64_t n = src.numel();
  if (n == 0) return;
  const bool same_dtype = dst.dtype() == src.dtype();
  if (dst.device().is_cpu() && src.device().is_cpu()) {
    ConvertHost(src.host_ptr(), src.dtype(), dst.host_ptr(), dst.dtype(), n);
    return;
  }
#if TANDEM_WITH_CUDA
  if (same_dtype) {
    internal::CudaCopy(dst.data_ptr(), dst.device(), src.data_ptr(), src.device(), src.nbytes());
    if (dst.device().is_cuda() && src.device().is_cuda() && dst.device() != src.device()) {
      // The copy reads the source on the destination's stream: the source's
      // free waits for it.
      src.storage()->RecordStream(internal::CudaThreadStream(dst.device()), dst.device());
    }
    return;
  }
  if (dst.device() == src.device()) {
    ops::internal::ConvertCuda(src, dst);
    return;
  }
  // Different device and dtype: convert where the data is, then move it.
  Tensor converted = empty(src.shape(), {.dtype = dst.dtype(), .device = src.device()});
  CopyInto(converted, src);
  CopyInto(dst, converted);
#else
  (void)same_dtype;
  Fail("copy between ", src.device().ToString(), " and ", dst.device().ToString(),
       ": tandem was built without CUDA");
#endif
}

void CheckMutable(const Tensor& t, const char* op) {
  TANDEM_CHECK(t.defined(), op, ": undefined tensor");
  TANDEM_CHECK(!(grad_mode_enabled() && t.requires_grad()), op, " on ", t.ToString(),
               " that requires grad while grad mode is on; wrap it in NoGradGuard");
}

}  // namespace

Tensor Tensor::to(Device device) const {
  if (this->device() == device) return *this;
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device});
  CopyInto(out, *this);
  const Device from = this->device();
  return autograd::Record("to(device)", {*this}, out, [from](const Tensor& g) {
    return std::vector<Tensor>{g.to(from)};
  });
}

Tensor Tensor::to(DType dtype) const {
  if (this->dtype() == dtype) return *this;
  Tensor out = empty(shape(), {.dtype = dtype, .device = device()});
  CopyInto(out, *this);
  if (!IsFloating(dtype)) return out;
  const DType from = this->dtype();
  return autograd::Record("to(dtype)", {*this}, out, [from](const Tensor& g) {
    return std::vector<Tensor>{g.to(from)};
  });
}

Tensor Tensor::pin_memory() const {
  TANDEM_CHECK(defined(), "pin_memory(): undefined tensor");
  if (is_pinned()) return *this;
  TANDEM_CHECK(device().is_cpu(), "pin_memory(): ", ToString(),
               " is not a host tensor; only cpu tensors can be pinned");
  Tensor out = empty(shape(), {.dtype = dtype(), .device = Device::CPU(), .pinned = true});
  CopyInto(out, *this);
  return autograd::Record("pin_memory", {*this}, out,
                          [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device()});
  CopyInto(out, *this);
  return autograd::Record("clone", {*this}, out,
                          [](const Tensor& g) { return std::vector<Tensor>{g}; });
}

double Tensor::item() const {
  TANDEM_CHECK(numel() == 1, "item(): tensor of shape ", ShapeToString(shape()),
               " has ", numel(), " elements, not 1");
  double value = 0;
  if (is_cuda()) {
#if TANDEM_WITH_CUDA
    // The element goes straight into a small pinned buffer of this thread (one
    // stream synchronisation, no staging), then is converted on the host.
    thread_local std::unique_ptr<Storage> buffer;
    if (buffer == nullptr) {
      buffer = std::make_unique<Storage>(16, Device::CPU(), internal::PinnedHostAllocator());
    }
    try {
      internal::CudaCopy(buffer->data(), Device::CPU(), data_ptr(), device(),
                         ElementSize(dtype()));
    } catch (...) {
      // The wait was abandoned (the run is stopping) or failed: the copy may
      // still land in the buffer later, behind whatever held the stream, and
      // the next item() (on another device's stream, say) must not read that
      // late write. The 16 bytes are left to the copy, never reused.
      static_cast<void>(buffer.release());
      throw;
    }
    ConvertHost(buffer->data(), dtype(), &value, kFloat64, 1);
    return value;
#endif
  }
  ConvertHost(host_ptr(), dtype(), &value, kFloat64, 1);
  return value;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  std::vector<T> out(static_cast<size_t>(numel()));
  // From a device, copy into pinned memory (no staging copy on the way).
  Tensor host = empty(shape(), {.dtype = DTypeOf<T>::value, .device = Device::CPU(),
                                .pinned = is_cuda() && numel() > 0});
  CopyInto(host, *this);
  if (!out.empty()) std::memcpy(out.data(), host.host_ptr(), out.size() * sizeof(T));
  return out;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<uint8_t> Tensor::to_vector<uint8_t>() const;

// --- Views -----------------------------------------------------------------------------------
Tensor Tensor::reshape(const Shape& new_shape) const {
  Shape shape_out = new_shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape_out.size(); ++i) {
    if (shape_out[i] == -1) {
      TANDEM_CHECK(infer < 0, "reshape ", ShapeToString(shape()), " to ",
                   ShapeToString(new_shape), ": more than one -1");
      infer = static_cast<int64_t>(i);
    } else {
      TANDEM_CHECK(shape_out[i] >= 0, "reshape to ", ShapeToString(new_shape), ": negative size");
      known *= shape_out[i];
    }
  }
  if (infer >= 0) {
    TANDEM_CHECK(known != 0 && numel() % known == 0, "reshape ", ShapeToString(shape()),
                 " to ", ShapeToString(new_shape), ": ", numel(), " elements do not divide");
    shape_out[infer] = numel() / known;
  }
  TANDEM_CHECK(NumElements(shape_out) == numel(), "reshape ", ShapeToString(shape()), " to ",
               ShapeToString(new_shape), ": element counts differ (", numel(), " vs ",
               NumElements(shape_out), ")");
  Tensor out = View(*this, shape_out, storage_offset());
  const Shape in_shape = shape();
  return autograd::Record("reshape", {*this}, out, [in_shape](const Tensor& g) {
    return std::vector<Tensor>{g.reshape(in_shape)};
  });
}

Tensor Tensor::flatten(int64_t start_dim) const {
  const int64_t n = dim();
  const int64_t s = start_dim < 0 ? start_dim + n : start_dim;
  TANDEM_CHECK(s >= 0 && (s < n || (n == 0 && s == 0)), "flatten(", start_dim,
               "): tensor of shape ", ShapeToString(shape()));
  Shape out(shape().begin(), shape().begin() + s);
  int64_t rest = 1;
  for (int64_t i = s; i < n; ++i) rest *= shape()[i];
  out.push_back(rest);
  return reshape(out);
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  TANDEM_CHECK(dim() >= 1, "slice on a 0-dim tensor");
  const int64_t rows = shape()[0];
  TANDEM_CHECK(0 <= begin && begin <= end && end <= rows, "slice [", begin, ", ", end,
               ") out of range for dim 0 of size ", rows);
  Shape out_shape = shape();
  out_shape[0] = end - begin;
  const int64_t row = rows == 0 ? 0 : numel() / rows;
  Tensor out = View(*this, out_shape, storage_offset() + begin * row);
  const Shape in_shape = shape();
  return autograd::Record("slice", {*this}, out, [in_shape, begin, end](const Tensor& g) {
    Tensor full = zeros(in_shape, {.dtype = g.dtype(), .device = g.device()});
    full.slice(begin, end).copy_(g);
    return std::vector<Tensor>{full};
  });
}

Tensor Tensor::operator[](int64_t i) const {
  TANDEM_CHECK(dim() >= 1, "operator[] on a 0-dim tensor");
  TANDEM_CHECK(i >= 0 && i < shape()[0], "index ", i, " out of range for dim 0 of size ", shape()[0]);
  Shape rest(shape().begin() + 1, shape().end());
  return slice(i, i + 1).reshape(rest);
}

// --- In-place ----------------------------------------------------------------------------------
Tensor& Tensor::zero_() {
  CheckMutable(*this, "zero_");
  if (device().is_cpu()) {
    std::memset(host_ptr(), 0, static_cast<size_t>(nbytes()));
  } else {
#if TANDEM_WITH_CUDA
    internal::CudaMemsetZero(data_ptr(), device(), nbytes());
#endif
  }
  return *this;
}

Tensor& Tensor::fill_(double value) {
  CheckMutable(*this, "fill_");
  ops::internal::Fill(*this, value);
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  CheckMutable(*this, "copy_");
  TANDEM_CHECK(src.defined() && src.numel() == numel(), "copy_: source ", src.ToString(),
               " does not match destination ", ToString());
  CopyInto(*this, src);
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  CheckMutable(*this, "add_");
  TANDEM_CHECK(other.defined() && other.shape() == shape() && other.dtype() == dtype() &&
                   other.device() == device(),
               "add_: ", other.ToString(), " does not match ", ToString());
  ops::internal::Axpy(*this, other, alpha);
  return *this;
}

Tensor& Tensor::mul_(double value) {
  CheckMutable(*this, "mul_");
  ops::internal::Scale(*this, value);
  return *this;
}

// --- Factories --------------------------------------------------------------------------------
Tensor empty(const Shape& shape, TensorOptions options) {
  const Device device = options.device_or_default();
  Tensor t(NewImpl(shape, options.dtype_or_default(), device,
                   options.pinned ? PinnedAllocatorFor(device) : DefaultAllocator(device)));
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

Tensor zeros(const Shape& shape, TensorOptions options) {
  const bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  t.zero_();
  if (rg) t.set_requires_grad(true);
  return t;
}

Tensor full(const Shape& shape, double value, TensorOptions options) {
  const bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  t.fill_(value);
  if (rg) t.set_requires_grad(true);
  return t;
}

Tensor ones(const Shape& shape, TensorOptions options) { return full(shape, 1.0, options); }

Tensor arange(int64_t end, TensorOptions options) {
  if (!options.dtype) options.dtype = kInt64;
  return arange(0.0, static_cast<double>(end), 1.0, options);
}

Tensor arange(double start, double end, double step, TensorOptions options) {
  TANDEM_CHECK(step != 0 && (end - start) / step >= 0, "arange(", start, ", ", end, ", ", step,
               "): empty or infinite range");
  const int64_t n = static_cast<int64_t>(std::ceil((end - start) / step));
  std::vector<double> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[i] = start + static_cast<double>(i) * step;
  if (!options.dtype) options.dtype = kFloat32;
  return from_vector(values, {n}, options);
}

namespace {
Tensor Random(const Shape& shape, TensorOptions options, bool normal) {
  const bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  CheckFloating(t, normal ? "randn" : "rand");
  Generator& gen = thread_generator();
  const uint64_t offset = gen.Advance(static_cast<uint64_t>(t.numel()));
  ops::internal::FillRandom(t, gen.seed, gen.stream, offset, normal);
  if (rg) t.set_requires_grad(true);
  return t;
}
}  // namespace

Tensor randn(const Shape& shape, TensorOptions options) { return Random(shape, options, true); }
Tensor rand(const Shape& shape, TensorOptions options) { return Random(shape, options, false); }

Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options) {
  TANDEM_CHECK(low < high, "randint: empty range [", low, ", ", high, ")");
  const int64_t n = NumElements(shape);
  const auto range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  Generator& gen = thread_generator();
  const uint64_t offset = gen.Advance(static_cast<uint64_t>(n));
  std::vector<int64_t> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Philox4x32 r = PhiloxAt(gen.seed, gen.stream, offset, static_cast<uint64_t>(i));
    const uint64_t bits = (static_cast<uint64_t>(r.out[0]) << 32) | r.out[1];
    // bits * range / 2^64: uniform to within range / 2^64 of exact.
    const auto scaled = static_cast<uint64_t>((static_cast<unsigned __int128>(bits) * range) >> 64);
    values[static_cast<size_t>(i)] = static_cast<int64_t>(static_cast<uint64_t>(low) + scaled);
  }
  if (!options.dtype) options.dtype = kInt64;
  return from_vector(values, shape, options);
}
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), {.dtype = t.dtype(), .device = t.device()}); }

template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, TensorOptions options) {
  TANDEM_CHECK(static_cast<int64_t>(values.size()) == NumElements(shape), "from_vector: ",
               values.size(), " values for shape ", ShapeToString(shape));
  if (!options.dtype) options.dtype = DTypeOf<T>::value;
  const bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor host = empty(shape, {.dtype = DTypeOf<T>::value, .device = Device::CPU()});
  if (!values.empty()) std::memcpy(host.host_ptr(), values.data(), values.size() * sizeof(T));
  Tensor out = empty(shape, options);
  CopyInto(out, host);
  if (rg) out.set_requires_grad(true);
  return out;
}
template Tensor from_vector<float>(const std::vector<float>&, const Shape&, TensorOptions);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, TensorOptions);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, TensorOptions);
template Tensor from_vector<uint8_t>(const std::vector<uint8_t>&, const Shape&, TensorOptions);

Tensor scalar_tensor(double value, TensorOptions options) { return full({}, value, options); }

// --- Grad mode -------------------------------------------------------------------------------
namespace {
thread_local bool t_grad_mode = true;
}
bool grad_mode_enabled() { return t_grad_mode; }
NoGradGuard::NoGradGuard() : previous_(t_grad_mode) { t_grad_mode = false; }
NoGradGuard::~NoGradGuard() { t_grad_mode = previous_; }

// --- Checks ------------------------------------------------------------------------------------
void CheckDefined(const Tensor& t, const char* op, const char* what) {
  TANDEM_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
}
void CheckSameDevice(const Tensor& a, const Tensor& b, const char* op) {
  TANDEM_CHECK(a.device() == b.device(), op, ": tensors on different devices: ", a.ToString(),
               " and ", b.ToString());
}
void CheckSameDType(const Tensor& a, const Tensor& b, const char* op) {
  TANDEM_CHECK(a.dtype() == b.dtype(), op, ": dtypes differ: ", a.ToString(), " and ", b.ToString());
}
void CheckFloating(const Tensor& t, const char* op) {
  TANDEM_CHECK(t.dtype() == kFloat32 || t.dtype() == kFloat64, op, ": expected a float32 or float64 tensor, got ",
               t.ToString());
}
void CheckDim(const Tensor& t, int64_t dim, const char* op, const char* what) {
  TANDEM_CHECK(t.dim() == dim, op, ": ", what, " must have ", dim, " dims, got shape ",
               ShapeToString(t.shape()));
}

}  // namespace tandem::nn
