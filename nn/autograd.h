// Define-by-run autograd: each recorded op adds a Node that knows how to turn the
// gradient of its output into gradients of its inputs. Tensor::backward() walks
// the nodes reachable from the loss in reverse creation order (later nodes first),
// summing the gradients that reach a node before running it, so each node runs
// once per pass and each leaf's gradient is final when its accumulator runs.
//
// Thread-safety: a backward pass runs entirely on the calling thread; separate
// threads may run separate passes over separate graphs at once (one per rank).
#ifndef TANDEM_NN_AUTOGRAD_H_
#define TANDEM_NN_AUTOGRAD_H_

#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "nn/tensor.h"

namespace tandem::nn::autograd {

class Node {
 public:
  Node();
  virtual ~Node() = default;
  // grad_output: gradient of this node's output (same shape). Returns one gradient
  // per input (next_edges()[i]); an undefined Tensor means "no gradient".
  virtual std::vector<Tensor> Apply(const Tensor& grad_output) = 0;
  virtual std::string name() const = 0;

  // One per input; nullptr where that input needs no gradient.
  const std::vector<std::shared_ptr<Node>>& next_edges() const { return next_; }
  void set_next_edges(std::vector<std::shared_ptr<Node>> next) { next_ = std::move(next); }
  // Creation order on this thread; later nodes run first in backward.
  uint64_t sequence_nr() const { return sequence_nr_; }

 private:
  std::vector<std::shared_ptr<Node>> next_;
  uint64_t sequence_nr_;
};

using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;

// Records `output` as produced by op `name` from `inputs`, with `backward`
// computing the input gradients (one per input, in order). Does nothing and
// returns output unchanged when grad mode is off or no input requires grad.
// The backward function must not capture `output` itself (a cycle): capture
// output.detach() and inputs' .detach() for the data it needs.
Tensor Record(const char* name, std::initializer_list<Tensor> inputs, Tensor output,
              BackwardFn backward);
// The same for a number of inputs known only at run time (nn::cat).
Tensor Record(const char* name, std::span<const Tensor> inputs, Tensor output,
              BackwardFn backward);
// Whether Record would record an op over these inputs.
bool NeedsGrad(std::initializer_list<Tensor> inputs);
bool NeedsGrad(std::span<const Tensor> inputs);

// Runs a backward pass (Tensor::backward calls this).
void Backward(const Tensor& root, const Tensor& grad_root);

// Queues `callback` to run on this thread when the backward pass now running has
// finished every node (DataParallel waits for its last bucket there). Must be
// called from inside a backward pass (a node or a grad-ready hook).
void QueueCallback(std::function<void()> callback);
// True while this thread is inside a backward pass.
bool InBackward();

}  // namespace tandem::nn::autograd

#endif  // TANDEM_NN_AUTOGRAD_H_
