#include "nn/autograd.h"

#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "nn/ops/elementwise.h"
#include "nn/ops/internal/fill_kernels.h"

namespace tandem::nn::autograd {
namespace {

std::atomic<uint64_t> g_sequence_nr{0};

// Whether a leaf's first gradient can take `grad`'s buffer instead of a copy
// (as PyTorch's AccumulateGrad does): no other Tensor holds it (the engine's
// reference is the only one), no other tensor views its storage, it spans the
// whole storage, and dtype and device match. Saves an allocation and a copy
// (on a GPU a device copy and two CUDA calls) per leaf in the first backward
// after zero_grad(set_to_none).
bool CanSteal(const Tensor& grad, const Tensor& leaf) {
  const auto& impl = grad.impl_ptr();
  return impl.use_count() == 1 && impl->storage != nullptr && impl->storage.use_count() == 1 &&
         impl->offset == 0 && impl->storage->bytes() == grad.nbytes() && !impl->requires_grad &&
         impl->grad_fn == nullptr && grad.dtype() == leaf.dtype() &&
         grad.device() == leaf.device();
}

// Accumulates into a leaf's grad(), then fires its grad-ready hooks. Holds the
// leaf weakly: the leaf owns this node (through grad_accumulator's users), not
// the other way round.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::weak_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> Apply(const Tensor& grad) override {
    std::shared_ptr<TensorImpl> impl = leaf_.lock();
    if (!impl) return {};
    Tensor leaf(impl);
    TANDEM_CHECK(grad.shape() == leaf.shape(), "backward: gradient ", grad.ToString(),
                 " does not match parameter '", leaf.name(), "' ", leaf.ToString());
    if (!impl->grad.defined()) {
      if (CanSteal(grad, leaf)) {
        impl->grad = grad.detach();
      } else {
        Tensor g = empty(leaf.shape(), {.dtype = leaf.dtype(), .device = leaf.device()});
        g.copy_(grad);
        impl->grad = g;
      }
    } else {
      // In place, so a gradient that is a view into a communication bucket stays there.
      impl->grad.add_(grad);
    }
    for (auto& [handle, hook] : impl->grad_ready_hooks) hook(leaf);
    return {};
  }

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

// A node whose backward is a function.
class FunctionNode final : public Node {
 public:
  FunctionNode(const char* name, BackwardFn fn) : name_(name), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  std::vector<Tensor> Apply(const Tensor& grad) override { return fn_(grad); }

 private:
  const char* name_;
  BackwardFn fn_;
};

std::shared_ptr<Node> GradAccumulator(const Tensor& leaf) {
  TensorImpl* impl = leaf.impl();
  if (auto node = impl->grad_accumulator.lock()) return node;
  auto node = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  impl->grad_accumulator = node;
  return node;
}

// Where the gradient of `t` goes: its producer, its accumulator, or nowhere.
std::shared_ptr<Node> EdgeOf(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return nullptr;
  if (t.grad_fn()) return t.grad_fn();
  return GradAccumulator(t);
}

struct BackwardState {
  std::vector<std::function<void()>> callbacks;
};
thread_local BackwardState* t_backward = nullptr;

}  // namespace

Node::Node() : sequence_nr_(g_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}

bool NeedsGrad(std::initializer_list<Tensor> inputs) {
  return NeedsGrad(std::span<const Tensor>(inputs.begin(), inputs.size()));
}

bool NeedsGrad(std::span<const Tensor> inputs) {
  if (!grad_mode_enabled()) return false;
  for (const Tensor& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

Tensor Record(const char* name, std::initializer_list<Tensor> inputs, Tensor output,
              BackwardFn backward) {
  return Record(name, std::span<const Tensor>(inputs.begin(), inputs.size()), std::move(output),
                std::move(backward));
}

Tensor Record(const char* name, std::span<const Tensor> inputs, Tensor output,
              BackwardFn backward) {
  if (!NeedsGrad(inputs)) return output;
  auto node = std::make_shared<FunctionNode>(name, std::move(backward));
  std::vector<std::shared_ptr<Node>> next;
  next.reserve(inputs.size());
  for (const Tensor& t : inputs) next.push_back(EdgeOf(t));
  node->set_next_edges(std::move(next));
  // The output is a fresh handle, so it never aliases an input's autograd state.
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = output.storage();
  impl->offset = output.storage_offset();
  impl->shape = output.shape();
  impl->dtype = output.dtype();
  impl->requires_grad = true;
  impl->grad_fn = std::move(node);
  return Tensor(impl);
}

void QueueCallback(std::function<void()> callback) {
  TANDEM_CHECK(t_backward != nullptr, "QueueCallback called outside a backward pass");
  t_backward->callbacks.push_back(std::move(callback));
}

bool InBackward() { return t_backward != nullptr; }

namespace {

// Backward's steps.

void CheckBackwardArguments(const Tensor& root, const Tensor& grad_root) {
  TANDEM_CHECK(root.defined(), "backward(): undefined tensor");
  TANDEM_CHECK(root.requires_grad(), "backward(): ", root.ToString(),
               " does not require grad (no parameter or input with requires_grad reached it)");
  TANDEM_CHECK(grad_root.defined() && grad_root.shape() == root.shape(),
               "backward(): gradient ", grad_root.ToString(), " does not match ", root.ToString());
  TANDEM_CHECK(grad_root.dtype() == root.dtype() && grad_root.device() == root.device(),
               "backward(): gradient ", grad_root.ToString(), " must have the dtype and device of ",
               root.ToString(), " (convert it with .to())");
  TANDEM_CHECK(t_backward == nullptr, "backward(): nested backward passes are not supported");
}

// For every node reachable from `start`, how many edges lead into it.
std::unordered_map<Node*, int> CountDependencies(Node* start) {
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack{start};
  std::unordered_set<Node*> seen{start};
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const auto& next : node->next_edges()) {
      if (!next) continue;
      dependencies[next.get()]++;
      if (seen.insert(next.get()).second) stack.push_back(next.get());
    }
  }
  return dependencies;
}

// The nodes of one backward pass: a node runs once every edge into it has
// delivered (its incoming gradients summed), latest-created first among the
// ready ones; a node that no gradient reached is skipped with everything only
// it feeds.
class BackwardQueue {
 public:
  BackwardQueue(const std::shared_ptr<Node>& start, const Tensor& grad_root)
      : dependencies_(CountDependencies(start.get())) {
    pending_[start.get()] = grad_root;
    ready_.push(start);
  }

  bool empty() const { return ready_.empty(); }

  // The next node to run and its summed incoming gradient.
  std::pair<std::shared_ptr<Node>, Tensor> Pop() {
    std::shared_ptr<Node> node = ready_.top();
    ready_.pop();
    Tensor grad = std::move(pending_[node.get()]);
    pending_.erase(node.get());
    return {std::move(node), std::move(grad)};
  }

  // `from` delivered `g` (maybe undefined: nothing) along its edge to `target`.
  void Deliver(const Node& from, const std::shared_ptr<Node>& target, const Tensor& g) {
    if (g.defined()) {
      Tensor& slot = pending_[target.get()];
      if (!slot.defined()) {
        slot = g;
      } else {
        TANDEM_CHECK(slot.shape() == g.shape(), "backward of ", from.name(), ": gradient ",
                     g.ToString(), " does not match ", slot.ToString());
        // Sum into a fresh tensor: `slot` may alias a tensor an op saved.
        slot = add(slot, g);
      }
    }
    EdgeDone(target);
  }

 private:
  bool HasGradient(Node* node) const {
    auto it = pending_.find(node);
    return it != pending_.end() && it->second.defined();
  }

  // One edge into `target` is done: queue it once all are, or skip it (and
  // release its own inputs) when no gradient reached it.
  void EdgeDone(const std::shared_ptr<Node>& target) {
    if (--dependencies_[target.get()] != 0) return;
    if (HasGradient(target.get())) {
      ready_.push(target);
      return;
    }
    pending_.erase(target.get());  // nothing to run below it
    std::vector<Node*> skip{target.get()};
    while (!skip.empty()) {
      Node* s = skip.back();
      skip.pop_back();
      for (const auto& n : s->next_edges()) {
        if (!n || --dependencies_[n.get()] != 0) continue;
        if (HasGradient(n.get())) {
          ready_.push(n);
        } else {
          pending_.erase(n.get());
          skip.push_back(n.get());
        }
      }
    }
  }

  struct LaterFirst {
    bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
      return a->sequence_nr() < b->sequence_nr();
    }
  };
  std::unordered_map<Node*, int> dependencies_;
  std::unordered_map<Node*, Tensor> pending_;  // summed incoming gradient per node
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, LaterFirst>
      ready_;
};

}  // namespace

void Backward(const Tensor& root, const Tensor& grad_root) {
  CheckBackwardArguments(root, grad_root);
  BackwardQueue queue(EdgeOf(root), grad_root);
  NoGradGuard no_grad;
  BackwardState state;
  t_backward = &state;
  struct Clear {
    ~Clear() { t_backward = nullptr; }
  } clear;
  while (!queue.empty()) {
    auto [node, grad] = queue.Pop();
    std::vector<Tensor> input_grads = node->Apply(grad);
    const auto& next = node->next_edges();
    TANDEM_CHECK(input_grads.size() == next.size() || next.empty(), "backward of ",
                 node->name(), " returned ", input_grads.size(), " gradients for ", next.size(),
                 " inputs");
    for (size_t i = 0; i < next.size(); ++i) {
      if (next[i] != nullptr) queue.Deliver(*node, next[i], input_grads[i]);
    }
  }
  // Index loop: a callback may queue another.
  for (size_t i = 0; i < state.callbacks.size(); ++i) state.callbacks[i]();
}

}  // namespace tandem::nn::autograd
