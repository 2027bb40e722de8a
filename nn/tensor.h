// Tensor: a shared handle over a contiguous block of typed memory on one device,
// with the autograd state of a define-by-run tape.
//
// Copies of a Tensor share the same data and autograd state (like torch.Tensor).
// All tensors are contiguous (row-major); views (reshape, flatten, slice along
// dim 0) share storage with an element offset.
//
// Thread-safety: a Tensor may be read from several threads; mutating one (its
// data, grad or requires_grad) from two threads at once is a data race. Ops run
// on the calling thread (CPU) or enqueue on the thread's stream (CUDA).
#ifndef TANDEM_NN_TENSOR_H_
#define TANDEM_NN_TENSOR_H_

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/device.h"
#include "nn/dtype.h"
#include "nn/error.h"
#include "nn/internal/stream_uses.h"

namespace tandem::nn {

using Shape = std::vector<int64_t>;
std::string ShapeToString(const Shape& shape);  // "(2, 3)"
int64_t NumElements(const Shape& shape);        // throws on negative dims or overflow

namespace autograd {
class Node;
}

// Where a Storage's bytes come from and go back to. The defaults (see
// DefaultAllocator) are 64-byte aligned host memory and the CUDA device's
// stream-ordered pool; others are the pinned host cache and the private arena
// of a CUDA graph capture. A Storage keeps its allocator alive until it is freed.
class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns `bytes` (> 0) of memory on `device`, or throws tandem::Error.
  virtual void* Allocate(int64_t bytes, Device device) = 0;
  // Takes back memory from Allocate. Must not throw (called from destructors).
  virtual void Free(void* ptr, int64_t bytes, Device device) noexcept = 0;
  // Takes back the memory of a CUDA storage whose owning stream is `stream`
  // (Storage::stream(); the storage has already made that stream wait for every
  // other stream that used it). Stream-ordered allocators free on `stream`; the
  // default calls Free. Must not throw.
  virtual void FreeOnStream(void* ptr, int64_t bytes, Device device, CUstream_st* stream) noexcept {
    (void)stream;
    Free(ptr, bytes, device);
  }
};

// The allocator a new Storage on `device` gets on the calling thread: the
// thread's override for CUDA devices if one is set (SetThreadCudaAllocator),
// else the default for the device type.
std::shared_ptr<Allocator> DefaultAllocator(Device device);
// Sets (nullptr: clears) the calling thread's allocator for CUDA storages and
// returns the previous one. Used by CUDA graph capture to route a captured
// step's allocations to its private arena.
std::shared_ptr<Allocator> SetThreadCudaAllocator(std::shared_ptr<Allocator> allocator);

// Raw memory of one device, freed by the allocator that made it.
//
// Streams (CUDA storages; see nn/internal/stream_uses.h): the stream the memory
// was allocated on owns it (the allocating thread's stream for the device). A use
// from another thread's stream (any data_ptr() on that thread) first makes that
// stream wait for the work enqueued on the owner so far, once per stream, and is
// recorded; the free, from whichever thread drops the last reference, runs on
// the owner after the owner has waited for every recorded stream. So a CUDA
// tensor may be made on one thread and read, or dropped, on another: the owner's
// kernels that produced it come first, and its memory is not reused while
// another stream may still read it. Not covered: a write by the owner after
// another stream's first use (shared tensors are written before they are
// shared; later writes need the owner's own synchronisation), and a first use
// from a stream that is being captured into a CUDA graph (CUDA refuses its
// wait; nn/graph.h). A first use while the owner is being captured waits for
// the owner's work queued before the capture began.
// The owner's own uses cost nothing: a pointer comparison.
class Storage {
 public:
  // Allocates `bytes` on `device` from DefaultAllocator(device).
  Storage(int64_t bytes, Device device);
  // Allocates `bytes` on `device` from `allocator`.
  Storage(int64_t bytes, Device device, std::shared_ptr<Allocator> allocator);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  const std::shared_ptr<Allocator>& allocator() const { return allocator_; }

  // The owning stream of CUDA memory (a cudaStream_t); nullptr for host memory
  // and empty storages. Streams are never destroyed while the process runs
  // (nn/cuda/context.h), so the owner outlives the storage even when its thread
  // has ended.
  CUstream_st* stream() const { return uses_.owner().stream; }
  // Orders a use on the calling thread's stream for device() after the owner's
  // work (see the class comment). Called by Tensor::data_ptr(); a no-op for host
  // memory and on the owner's thread. Throws tandem::Error if CUDA fails.
  void PrepareUse() const;
  // Records that `stream` (of CUDA device `device`) reads or writes this memory
  // in work enqueued so far, without waiting for the owner: the free waits for
  // it (PyTorch's recordStream). For work that the caller has already ordered
  // after the owner, such as a peer copy on the destination device's stream.
  void RecordStream(CUstream_st* stream, Device device) const;

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  Device device_;
  std::shared_ptr<Allocator> allocator_;
  mutable internal::StreamUses uses_;
};

class Tensor;
using GradReadyHook = std::function<void(Tensor& param)>;

struct TensorImpl;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const;
  DType dtype() const;
  Device device() const;
  bool is_cuda() const { return device().is_cuda(); }
  std::string ToString() const;  // "float32(2, 3) on cpu"

  // Typed pointer to the first element; throws if T does not match dtype().
  // For a CUDA tensor whose storage another thread's stream owns, the first call
  // on this thread also makes this thread's stream wait for the owner's work
  // (Storage::PrepareUse), so kernels enqueued after it see the data.
  //
  // data<T>() and data_ptr() are the raw pointers that kernel launches and
  // communicators take, on any device. Host code that reads or writes the
  // elements itself (CPU kernels, readers, checkpoints, staging buffers) uses
  // host_data<T>() / host_ptr() instead.
  template <typename T> T* data() const;
  void* data_ptr() const;
  // The elements for the host to read or write: as data<T>() / data_ptr(), but
  // throws tandem::Error naming the tensor when it is in device memory, where a
  // host access would crash or read garbage (copy it with to(Device::CPU()) first).
  template <typename T> T* host_data() const;
  void* host_ptr() const;
  int64_t nbytes() const { return numel() * ElementSize(dtype()); }
  const std::shared_ptr<Storage>& storage() const;
  int64_t storage_offset() const;  // in elements
  // True when the data is in pinned (page-locked) host memory from the pinned
  // host cache (TensorOptions::pinned, pin_memory()). Always false for CUDA
  // tensors and in a build without CUDA.
  bool is_pinned() const;

  // --- Autograd ------------------------------------------------------------
  bool requires_grad() const;
  // Marks a leaf as needing a gradient. Throws on a non-leaf.
  Tensor& set_requires_grad(bool requires_grad);
  bool is_leaf() const;
  // Accumulated gradient (undefined until a backward pass reaches this leaf).
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  // Runs the backward pass from this scalar tensor (gradient 1).
  void backward() const;
  // Runs the backward pass with `grad` (same shape) as the output gradient.
  void backward(const Tensor& grad) const;
  // The same data without autograd history.
  Tensor detach() const;
  // Hooks fired, in registration order, on the backward thread once this leaf's
  // gradient is final for the current backward pass (after accumulation into
  // grad()). Returns a handle for remove_grad_ready_hook.
  int register_grad_ready_hook(GradReadyHook hook) const;
  void remove_grad_ready_hook(int handle) const;
  // Optional debugging name (Module sets parameter names).
  const std::string& name() const;
  void set_name(std::string name) const;

  // --- Conversions and copies ----------------------------------------------
  // Same tensor if already there; differentiable. Copies run on the calling
  // thread's stream of the CUDA device involved:
  //  - to a CUDA device from a pinned host tensor: asynchronous, no host wait.
  //    The source may be dropped at once (its block is not reused before the
  //    copy is done) but must not be written to until the stream has passed
  //    the copy (after a synchronising call such as item() or nn::Synchronize).
  //  - to a CUDA device from pageable host memory: staged through pinned
  //    memory on the host; returns without waiting for the device, and the
  //    source may be modified at once.
  //  - to the host: returns when the data is there; raises a pending deferred
  //    device error of the source device (see nn::Synchronize).
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;    // same tensor if already that dtype; differentiable between floats
  Tensor clone() const;            // new storage, differentiable
  // A copy of this host tensor in pinned memory (the same tensor if is_pinned()),
  // so that copies to a CUDA device are asynchronous. Differentiable. Throws for
  // a CUDA tensor, and "pinned memory needs tandem built with CUDA and a visible
  // GPU" where there is no pinned memory to be had.
  Tensor pin_memory() const;
  // One element, as double. For a CUDA tensor, reads it through a small pinned
  // buffer of the calling thread: synchronises the thread's stream and raises a
  // pending deferred device error (e.g. a bad cross_entropy target).
  double item() const;
  template <typename T> T item() const { return static_cast<T>(item()); }
  // All elements copied to the host, converted to T (as to(cpu) for a CUDA tensor).
  template <typename T> std::vector<T> to_vector() const;

  // --- Views (share storage; differentiable) ---------------------------------
  Tensor reshape(const Shape& shape) const;  // one dim may be -1
  Tensor flatten(int64_t start_dim = 0) const;  // dims start_dim.. collapsed into one
  Tensor slice(int64_t begin, int64_t end) const;  // rows [begin, end) of dim 0
  Tensor operator[](int64_t i) const;  // row i of dim 0, one dim fewer

  // --- In-place (data only, not recorded by autograd) --------------------------
  // Throw when applied to a tensor that requires grad while grad mode is on.
  Tensor& zero_();
  Tensor& fill_(double value);
  Tensor& copy_(const Tensor& src);  // same numel; converts dtype and device (copies as to() does)
  Tensor& add_(const Tensor& other, double alpha = 1.0);  // same shape; floats and int64
  Tensor& mul_(double value);

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  // True when both handles share one TensorImpl.
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // elements
  Shape shape;
  DType dtype = DType::kFloat32;
  // Autograd.
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;          // set on outputs of recorded ops
  std::weak_ptr<autograd::Node> grad_accumulator;   // leaves: the node that accumulates grad
  std::vector<std::pair<int, GradReadyHook>> grad_ready_hooks;
  int next_hook_handle = 0;
  std::string name;
};

// --- Factories --------------------------------------------------------------
// Unset fields default to float32 and the calling thread's current device (the
// cpu for a pinned tensor).
struct TensorOptions {
  std::optional<DType> dtype;
  std::optional<Device> device;
  bool requires_grad = false;
  // Allocate in pinned (page-locked) host memory from the process-wide pinned
  // cache, so copies to a CUDA device are asynchronous (see Tensor::to). CPU
  // tensors only: a CUDA device throws naming it; without CUDA built or a
  // visible GPU it throws "pinned memory needs tandem built with CUDA and a
  // visible GPU". zeros_like / empty_like do not carry it over. With no device
  // given, a pinned tensor is on the cpu (not the thread's current device).
  bool pinned = false;

  DType dtype_or_default() const { return dtype.value_or(DType::kFloat32); }
  Device device_or_default() const {
    return device.value_or(pinned ? Device::CPU() : current_device());
  }
};

Tensor empty(const Shape& shape, TensorOptions options = {});
Tensor zeros(const Shape& shape, TensorOptions options = {});
Tensor ones(const Shape& shape, TensorOptions options = {});
Tensor full(const Shape& shape, double value, TensorOptions options = {});
Tensor arange(int64_t end, TensorOptions options = {});  // 0, 1, ..., end-1
Tensor arange(double start, double end, double step, TensorOptions options = {});
// Standard normal / uniform [0, 1) from the calling thread's generator (see random.h):
// the same seed gives the same numbers on the CPU and on a GPU.
Tensor randn(const Shape& shape, TensorOptions options = {});
Tensor rand(const Shape& shape, TensorOptions options = {});
// Integers drawn uniformly from [low, high) (throws unless low < high), int64
// unless options.dtype says otherwise, from the calling thread's generator as
// rand and randn draw (drawn on the host: the same values on every device).
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options = {});
Tensor zeros_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
// Copies `values` into a new tensor of that shape (numel must match).
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, TensorOptions options = {});
// A scalar (0-dim) tensor.
Tensor scalar_tensor(double value, TensorOptions options = {});

// --- Grad mode --------------------------------------------------------------
// Thread-local switch: while a NoGradGuard lives on a thread, ops on that thread
// record nothing.
bool grad_mode_enabled();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// --- Checks used by ops -----------------------------------------------------------
// Throws "<op>: <what> must be ... but is ..." naming the op and the values.
void CheckDefined(const Tensor& t, const char* op, const char* what);
void CheckSameDevice(const Tensor& a, const Tensor& b, const char* op);
void CheckSameDType(const Tensor& a, const Tensor& b, const char* op);
void CheckFloating(const Tensor& t, const char* op);
void CheckDim(const Tensor& t, int64_t dim, const char* op, const char* what);

// --- Template definitions ----------------------------------------------------------
template <typename T>
T* Tensor::data() const {
  TANDEM_CHECK(defined(), "data(): undefined tensor");
  TANDEM_CHECK(DTypeOf<std::remove_const_t<T>>::value == dtype(), "data<",
               DTypeName(DTypeOf<std::remove_const_t<T>>::value), ">() on a ", DTypeName(dtype()),
               " tensor");
  return static_cast<T*>(data_ptr());
}

template <typename T>
T* Tensor::host_data() const {
  TANDEM_CHECK(defined(), "host_data(): undefined tensor");
  TANDEM_CHECK(DTypeOf<std::remove_const_t<T>>::value == dtype(), "host_data<",
               DTypeName(DTypeOf<std::remove_const_t<T>>::value), ">() on a ", DTypeName(dtype()),
               " tensor");
  return static_cast<T*>(host_ptr());
}

}  // namespace tandem::nn

#endif  // TANDEM_NN_TENSOR_H_
