// Optimizer: the base of tandem's optimizers (SGD, Adagrad, Adam, AdamW).
//
// An optimizer updates parameter groups; every group has its own lr,
// weight_decay and other hyper-parameters (held as named doubles, so that a
// schedule or a checkpoint can read and write them without knowing the type).
// State (momentum buffers, moment estimates, step counts) is kept per parameter
// and created at the parameter's first step, on its device and in its dtype.
//
// step() enqueues the updates on the calling thread's stream (CUDA: one fused
// kernel launch per group, no host synchronisation). A group whose parameters
// live on several devices (or have two dtypes) gets one launch per device and
// dtype, as PyTorch's foreach and fused paths group by device: each CUDA launch
// runs with its device made current for it, on the thread's stream of that
// device. A parameter whose grad() is undefined is skipped, as in PyTorch.
//
// CUDA graphs (nn/graph.h): step(), zero_grad() and clip_grad_norm_ may run
// inside CudaGraph::Capture after one eager step (which creates the state and
// uploads the kernels' pointer tables; a captured step that would have to do
// either throws "run one eager step before capturing"). Under capture step()
// does not advance the step counts: it registers a pre-replay hook that, before
// every Replay(), advances them and uploads the scalars (lr, bias corrections)
// computed from the groups' current hyper-parameters, so set_lr / LR schedules
// between replays take effect and state_dict() counts every replay. A replay
// after load_state_dict() (new state tensors) or after a gradient was replaced
// by a new tensor throws: capture again. The optimizer must outlive the
// graph's replays (a replay after its destruction throws).
//
// Thread-safety: an optimizer is used by one thread (its rank's); parameters
// must not be modified by another thread during step().
#ifndef TANDEM_OPTIM_OPTIMIZER_H_
#define TANDEM_OPTIM_OPTIMIZER_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "nn/tensor.h"

namespace tandem::optim {

namespace internal {
class DeviceTables;
enum class Algorithm;
struct UpdateScalars;
struct UpdateTensors;
}  // namespace internal

// Parameters with the options of one group: {params, {.lr = 1e-2}}.
template <typename Options>
struct ParamGroup {
  std::vector<nn::Tensor> params;
  Options options;
};

// What an optimizer saves: a representation a checkpoint writer serialises.
//   tensors: ("state.<group>.<index>.<buffer>", tensor), e.g. "state.0.3.exp_avg";
//            copies of the state, on the parameters' devices.
//   scalars: "num_groups", "group.<g>.num_params", "group.<g>.<hyper>" (lr, ...),
//            "state.<g>.<i>.step" for every parameter that has state.
struct StateDict {
  std::vector<std::pair<std::string, nn::Tensor>> tensors;
  std::map<std::string, double> scalars;
};

class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient.
  virtual void step() = 0;

  // Zeroes every defined gradient IN PLACE: the gradient tensors are kept, since
  // DataParallel's gradients are views into its communication buckets.
  void zero_grad();
  // Paddle's name for zero_grad().
  void clear_grad() { zero_grad(); }

  // The type's name ("SGD", "Adam", "AdamW", "Adagrad"), as errors give it.
  const char* name() const { return name_; }
  int64_t num_groups() const { return static_cast<int64_t>(groups_.size()); }
  const std::vector<nn::Tensor>& params(int64_t group) const;
  // Learning rate of a group; set_lr(lr) sets every group's.
  double lr(int64_t group = 0) const { return hyper(group, "lr"); }
  void set_lr(double lr);
  void set_lr(int64_t group, double lr) { set_hyper(group, "lr", lr); }
  // Any hyper-parameter of a group by name ("lr", "weight_decay", "momentum",
  // "beta1", ...). Throws tandem::Error naming the key when it does not exist.
  double hyper(int64_t group, const std::string& key) const;
  void set_hyper(int64_t group, const std::string& key, double value);
  // Step count of parameter `index` of `group` (0 before its first update).
  int64_t step_count(int64_t group, int64_t index) const;

  // Copies of the state and the hyper-parameters (see StateDict).
  StateDict state_dict() const;
  // Replaces state and hyper-parameters with `dict`'s. The groups must have the
  // same number of parameters and the tensors the parameters' shapes; tensors
  // are copied to the parameters' device and dtype. On error (naming the key and
  // the shapes) the optimizer is unchanged.
  absl::Status load_state_dict(const StateDict& dict);

 protected:
  struct ParamState {
    int64_t step = 0;
    std::vector<nn::Tensor> buffers;  // by StateNames(); undefined until created
  };
  struct Group {
    std::vector<nn::Tensor> params;
    std::map<std::string, double> hyper;
    std::vector<ParamState> state;  // one per parameter
    std::shared_ptr<internal::DeviceTables> device_tables;  // CUDA pointer tables
  };

  // `state_names`: the names of the per-parameter buffers, in the order the
  // update kernel takes them (see internal/fused_kernels.h).
  Optimizer(const char* name, std::vector<std::string> state_names);
  void AddGroup(std::vector<nn::Tensor> params, std::map<std::string, double> hyper);
  // Whether a group uses buffer `buffer` (e.g. no momentum buffer when momentum is 0).
  virtual bool UsesBuffer(const Group& group, int buffer) const = 0;
  // Initial value of a new buffer (Adagrad: initial_accumulator_value).
  virtual double InitialBufferValue(const Group& group, int buffer) const;

  // The kernel scalars of group `group` at step count `step` (>= 1), from the
  // group's current hyper-parameters.
  virtual internal::UpdateScalars ScalarsFor(int64_t group, int64_t step) const = 0;

  // Runs `algo` over group `g`'s parameters that have gradients: creates missing
  // state, increments step counts and calls ScalarsFor(g, step) once per
  // distinct step count among them (once in the usual case) for one launch each.
  // Under CUDA graph capture: see the file comment.
  void UpdateGroup(int64_t g, internal::Algorithm algo);

  const char* name_;
  std::vector<std::string> state_names_;
  std::vector<Group> groups_;

 private:
  // Under capture: the launch of `tensors` (parameters `indices` of group g)
  // reads its scalars from device memory that a pre-replay hook rewrites.
  void CaptureLaunch(int64_t g, internal::Algorithm algo,
                     const std::vector<internal::UpdateTensors>& tensors,
                     const std::vector<size_t>& indices);

  // load_state_dict's steps: group g's hyper-parameters and state, parameter
  // i's step count and buffers (into `out` / `st`, not the optimizer), and the
  // check that no key of the dict went unread.
  struct DictReader;
  absl::Status LoadGroup(int64_t g, DictReader& reader, Group& out) const;
  absl::Status LoadParamState(int64_t g, size_t i, DictReader& reader, ParamState& st) const;
  absl::Status CheckEverythingRead(const DictReader& reader) const;

  // Expires with the optimizer: pre-replay hooks of captured graphs check it.
  std::shared_ptr<char> alive_ = std::make_shared<char>(0);
};

}  // namespace tandem::optim

#endif  // TANDEM_OPTIM_OPTIMIZER_H_
