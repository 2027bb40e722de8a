// Module: a node of a model's tree that owns named parameters, buffers and child
// modules (libtorch's Module / ModuleHolder design, PyTorch's snake_case API).
//
//   struct LinearNet : nn::Module {
//     LinearNet() : l1(register_module("l1", nn::Linear(10, 10))),
//                   l2(register_module("l2", nn::Linear(10, 1))) {}
//     nn::Tensor forward(const nn::Tensor& x) override { return l2(l1(x)); }
//     nn::Linear l1, l2;
//   };
//
// Layers are used through holders (nn::Linear holds a std::shared_ptr<LinearImpl>):
// copying a holder shares the module, operator() calls forward, -> reaches the
// module (l1->weight). A parent keeps each child it registers alive.
//
// Parameters and buffers are created on nn::current_device() (thread-local; spawn
// sets it per rank). A parameter's Tensor::name() is its dotted path from the
// outermost module it was registered into ("l1.weight").
//
// Thread-safety: a Module is not synchronised; build, move and train it on one
// thread (each rank owns its own copy of the model).
//
// Recording calls: while a ForwardRecorder is installed on a thread
// (ForwardRecordScope), every module call through Module::operator() or a holder's
// operator() on that thread reports Enter before forward and Exit with the output
// after it (a call that throws reports no Exit); a direct call of forward() is not
// seen. hapi::Summary uses it for each layer's output shape. Without one a call
// costs one thread-local read more.
#ifndef TANDEM_NN_MODULE_H_
#define TANDEM_NN_MODULE_H_

#include <concepts>
#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "nn/device.h"
#include "nn/tensor.h"

namespace tandem::nn {

// (dotted name, tensor) pairs in registration order.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
// Parameters then buffers of each module, the module itself before its children.
using StateDict = NamedTensors;

class ModuleHolderBase;
class Module;

// Observes module calls on one thread (see the file comment). Not owned by the scope.
class ForwardRecorder {
 public:
  virtual ~ForwardRecorder() = default;
  virtual void Enter(const Module& module) = 0;
  virtual void Exit(const Module& module, const Tensor& output) = 0;
};

namespace internal {
// The calling thread's recorder; null (the usual case) records nothing.
inline thread_local ForwardRecorder* forward_recorder = nullptr;

// forward() (a callable returning the output of `module`), reported to the
// thread's recorder when one is installed: Module's and holders' operator().
template <typename Forward>
Tensor RecordedCall(const Module& module, Forward&& forward) {
  ForwardRecorder* recorder = forward_recorder;
  if (recorder == nullptr) [[likely]] return forward();
  recorder->Enter(module);
  Tensor y = forward();
  recorder->Exit(module, y);
  return y;
}
}  // namespace internal

// Installs `recorder` on the calling thread for the scope's life, then puts back
// the one before (scopes nest).
class ForwardRecordScope {
 public:
  explicit ForwardRecordScope(ForwardRecorder* recorder)
      : previous_(internal::forward_recorder) {
    internal::forward_recorder = recorder;
  }
  ~ForwardRecordScope() { internal::forward_recorder = previous_; }
  ForwardRecordScope(const ForwardRecordScope&) = delete;
  ForwardRecordScope& operator=(const ForwardRecordScope&) = delete;

 private:
  ForwardRecorder* previous_;
};

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  // Modules are shared through holders and shared_ptr, never copied.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Computes the module's output. The default throws tandem::Error naming the
  // module's type: a module that is only a container need not define it.
  virtual Tensor forward(const Tensor& x);
  // forward(x), reported to the thread's ForwardRecorder when one is installed.
  Tensor operator()(const Tensor& x) {
    return internal::RecordedCall(*this, [&] { return forward(x); });
  }

  // The module's C++ type name ("LinearImpl", "LinearNet"), for messages.
  std::string type_name() const;

  // --- Registration (called from constructors) ----------------------------------
  // Registers `tensor` as parameter `name` (no dots, unique among this module's
  // parameters, buffers and children), marks it requires_grad and names it.
  // Returns the same handle. Throws tandem::Error on a bad or duplicate name or a
  // non-floating tensor.
  Tensor register_parameter(std::string name, Tensor tensor);
  // Registers state that is saved and moved with the module but not trained
  // (BatchNorm's running statistics). Returns the same handle.
  Tensor register_buffer(std::string name, Tensor tensor);
  // Registers a child held by a holder (nn::Linear, ...); returns the holder.
  template <typename Holder>
    requires std::derived_from<Holder, ModuleHolderBase>
  Holder register_module(std::string name, Holder holder) {
    RegisterChild(std::move(name), holder.module_ptr());
    return holder;
  }
  // Registers a user module held by shared_ptr; returns it.
  template <typename M>
    requires std::derived_from<M, Module>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> module) {
    RegisterChild(std::move(name), module);
    return module;
  }

  // --- Traversal ---------------------------------------------------------------
  // This module's parameters, then each child's, depth-first in registration
  // order. A tensor registered twice (shared weights) appears once, at its first
  // place.
  std::vector<Tensor> parameters() const;
  NamedTensors named_parameters() const;  // "l1.weight", ...
  std::vector<Tensor> buffers() const;
  NamedTensors named_buffers() const;
  // Direct children in registration order.
  std::vector<std::shared_ptr<Module>> children() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;

  // --- Modes --------------------------------------------------------------------
  // Sets training mode (Dropout drops, BatchNorm uses batch statistics) on this
  // module and every descendant. eval() is train(false).
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves every parameter, buffer and existing gradient to `device` IN PLACE: the
  // same Tensor handles (held by optimizers, say) point at the moved data
  // afterwards. Enqueued on the thread's stream for CUDA. A parameter that shared
  // storage with a tensor outside the module no longer does after a move.
  void to(Device device);
  // Converts every floating-point parameter and buffer (and existing gradient) to
  // the floating-point `dtype` IN PLACE, as to(Device) does (PyTorch's
  // module.double() / .to(dtype)); integer buffers such as BatchNorm2d's
  // num_batches_tracked stay as they are. For a float64 copy of a model to check
  // a float32 run against. Convert before making an optimizer over the parameters.
  void to(DType dtype);
  // Drops every parameter's gradient (grad() becomes undefined).
  void zero_grad();

  // --- Saving and loading ---------------------------------------------------------
  // Parameters and buffers as detached handles sharing the module's storage
  // (copy them to keep a snapshot).
  StateDict state_dict() const;
  // Copies values from `state` into the parameters and buffers (converting the
  // device, not the dtype). Errors (InvalidArgument), leaving the module
  // unchanged: a key of the module missing from `state` or a key of `state` the
  // module lacks (both only when strict), or a shape or dtype mismatch; the
  // message names the key and both shapes/dtypes.
  absl::Status load_state_dict(const StateDict& state, bool strict = true);

 private:
  void RegisterChild(std::string name, std::shared_ptr<Module> child);
  void CheckNewName(const std::string& name, const char* what) const;
  // Appends (prefix + name, tensor) of this subtree's parameters or buffers.
  void CollectNamed(const std::string& prefix, bool want_buffers, NamedTensors& out) const;

  NamedTensors parameters_;
  NamedTensors buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

// Untemplated base of all holders, so Module::register_module can recognise them.
class ModuleHolderBase {
 public:
  virtual ~ModuleHolderBase() = default;
  virtual std::shared_ptr<Module> module_ptr() const = 0;
};

// A shared handle to a module of type Impl (libtorch's ModuleHolder). Copies share
// one module. Constructing with arguments builds a new Impl from them.
template <typename Impl>
class ModuleHolder : public ModuleHolderBase {
 public:
  using ImplType = Impl;

  // A new Impl built with its default constructor (when it has one).
  ModuleHolder()
    requires std::is_default_constructible_v<Impl>
      : impl_(std::make_shared<Impl>()) {}
  // An empty holder (is_empty()); assign a real one before use.
  ModuleHolder(std::nullptr_t) {}
  // Shares an existing module.
  ModuleHolder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // A new Impl built from `args`.
  template <typename First, typename... Rest>
    requires(!std::is_same_v<std::remove_cvref_t<First>, std::nullptr_t> &&
             !std::is_same_v<std::remove_cvref_t<First>, std::shared_ptr<Impl>> &&
             !std::is_base_of_v<ModuleHolderBase, std::remove_cvref_t<First>> &&
             std::is_constructible_v<Impl, First, Rest...>)
  explicit ModuleHolder(First&& first, Rest&&... rest)
      : impl_(std::make_shared<Impl>(std::forward<First>(first), std::forward<Rest>(rest)...)) {}

  Impl* operator->() const { return get(); }
  Impl& operator*() const { return *get(); }
  Impl* get() const {
    TANDEM_CHECK(impl_ != nullptr, "use of an empty module holder");
    return impl_.get();
  }
  const std::shared_ptr<Impl>& ptr() const { return impl_; }
  std::shared_ptr<Module> module_ptr() const override { return impl_; }
  bool is_empty() const { return impl_ == nullptr; }

  // Calls the module's forward with `args` (one tensor for layers; prediction and
  // target for losses), reported to the thread's ForwardRecorder when one is installed.
  template <typename... Args>
  Tensor operator()(Args&&... args) const {
    Impl* module = get();
    return internal::RecordedCall(
        *module, [&] { return module->forward(std::forward<Args>(args)...); });
  }

 private:
  std::shared_ptr<Impl> impl_;
};

// Declares holder class Name for NameImpl, inheriting its constructors.
#define TANDEM_MODULE(Name)                                  \
  class Name : public ::tandem::nn::ModuleHolder<Name##Impl> { \
   public:                                                   \
    using ::tandem::nn::ModuleHolder<Name##Impl>::ModuleHolder; \
  }

// A type-erased shared module, for containers (Sequential): converts from any
// holder or std::shared_ptr to a Module subclass.
class AnyModule {
 public:
  template <typename Holder>
    requires std::derived_from<Holder, ModuleHolderBase>
  AnyModule(const Holder& holder) : module_(holder.module_ptr()) {}
  template <typename M>
    requires std::derived_from<M, Module>
  AnyModule(std::shared_ptr<M> module) : module_(std::move(module)) {}

  const std::shared_ptr<Module>& ptr() const { return module_; }

 private:
  std::shared_ptr<Module> module_;
};

}  // namespace tandem::nn

#endif  // TANDEM_NN_MODULE_H_
