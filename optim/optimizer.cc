// Optimizer base: parameter groups, state, state_dict and the step driver.
#include "optim/optimizer.h"

#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "nn/device.h"
#include "nn/graph.h"
#include "nn/status_macros.h"
#include "optim/internal/device_scope.h"
#include "optim/internal/fused_kernels.h"

namespace tandem::optim {

Optimizer::Optimizer(const char* name, std::vector<std::string> state_names)
    : name_(name), state_names_(std::move(state_names)) {}

Optimizer::~Optimizer() = default;

void Optimizer::AddGroup(std::vector<nn::Tensor> params, std::map<std::string, double> hyper) {
  const int64_t g = num_groups();
  TANDEM_CHECK(!params.empty(), name_, ": parameter group ", g, " is empty");
  for (size_t i = 0; i < params.size(); ++i) {
    TANDEM_CHECK(params[i].defined(), name_, ": parameter ", i, " of group ", g, " is undefined");
    TANDEM_CHECK(params[i].dtype() == nn::kFloat32 || params[i].dtype() == nn::kFloat64, name_,
                 ": parameter ", i, " of group ", g, " is ", params[i].ToString(),
                 " (float32 and float64 only)");
  }
  TANDEM_CHECK(hyper.at("lr") >= 0, name_, ": lr of group ", g, " must be >= 0 but is ",
               hyper.at("lr"));
  Group group;
  group.state.resize(params.size());
  group.params = std::move(params);
  group.hyper = std::move(hyper);
  groups_.push_back(std::move(group));
}

double Optimizer::InitialBufferValue(const Group&, int) const { return 0.0; }

void Optimizer::zero_grad() {
  nn::NoGradGuard no_grad;
  for (Group& group : groups_) {
    for (nn::Tensor& p : group.params) {
      nn::Tensor g = p.grad();
      if (g.defined()) g.zero_();
    }
  }
}

const std::vector<nn::Tensor>& Optimizer::params(int64_t group) const {
  TANDEM_CHECK(group >= 0 && group < num_groups(), name_, ": group ", group, " out of range [0, ",
               num_groups(), ")");
  return groups_[group].params;
}

void Optimizer::set_lr(double lr) {
  for (int64_t g = 0; g < num_groups(); ++g) set_lr(g, lr);
}

double Optimizer::hyper(int64_t group, const std::string& key) const {
  params(group);  // checks the index
  auto it = groups_[group].hyper.find(key);
  TANDEM_CHECK(it != groups_[group].hyper.end(), name_, " has no hyper-parameter '", key, "'");
  return it->second;
}

void Optimizer::set_hyper(int64_t group, const std::string& key, double value) {
  hyper(group, key);  // checks group and key
  groups_[group].hyper[key] = value;
}

int64_t Optimizer::step_count(int64_t group, int64_t index) const {
  const auto& ps = params(group);
  TANDEM_CHECK(index >= 0 && index < static_cast<int64_t>(ps.size()), name_, ": parameter ", index,
               " out of range for group ", group, " of ", ps.size());
  return groups_[group].state[index].step;
}

void Optimizer::UpdateGroup(int64_t g, internal::Algorithm algo) {
  Group& group = groups_[g];
  const bool capturing = nn::CudaGraph::IsCapturing();
  nn::NoGradGuard no_grad;
  // Launch sets: parameters sharing a step count, device and dtype (one set
  // unless some parameter missed a step or the group mixes devices).
  using Key = std::tuple<int64_t, int, int, int>;
  std::map<Key, std::vector<internal::UpdateTensors>> launches;
  std::map<Key, std::vector<size_t>> indices;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const nn::Tensor& p = group.params[i];
    const nn::Tensor grad = p.grad();
    if (!grad.defined()) continue;
    TANDEM_CHECK(grad.shape() == p.shape() && grad.dtype() == p.dtype() &&
                     grad.device() == p.device(),
                 name_, ": gradient ", grad.ToString(), " does not match parameter ", p.ToString());
    TANDEM_CHECK(!capturing || p.is_cuda(), name_, ": parameter ", i, " of group ", g, " is ",
                 p.ToString(), "; a step captured in a CUDA graph can update CUDA parameters only");
    ParamState& st = group.state[i];
    st.buffers.resize(state_names_.size());
    internal::UpdateTensors t{.param = p, .grad = grad};
    for (size_t b = 0; b < state_names_.size(); ++b) {
      if (!UsesBuffer(group, static_cast<int>(b))) continue;
      if (!st.buffers[b].defined()) {
        // A buffer created under capture would be re-initialised by every replay.
        TANDEM_CHECK(!capturing, name_, ": parameter ", i, " of group ", g, " has no '",
                     state_names_[b], "' state yet; run one eager step before capturing");
        st.buffers[b] = nn::zeros_like(p);
        const double init = InitialBufferValue(group, static_cast<int>(b));
        if (init != 0) {
          // fill_'s kernel runs on the thread's stream of p's device, which must
          // be current for the launch (a group may span devices).
          const internal::DeviceScope on_device(p.device());
          st.buffers[b].fill_(init);
        }
      }
      t.state[b] = st.buffers[b];
    }
    // Under capture the step count advances at each replay (CaptureLaunch).
    const int64_t step = capturing ? st.step + 1 : ++st.step;
    const Key key{step, static_cast<int>(p.device().type), p.device().index,
                  static_cast<int>(p.dtype())};
    launches[key].push_back(std::move(t));
    indices[key].push_back(i);
  }
  for (const auto& [key, tensors] : launches) {
#if TANDEM_WITH_CUDA
    if (tensors.front().param.is_cuda()) {
      // A group may mix devices (one launch set each, as PyTorch's foreach and
      // fused paths group by device): each launch runs with its device current.
      const internal::DeviceScope on_device(tensors.front().param.device());
      if (!group.device_tables) group.device_tables = internal::MakeDeviceTables();
      if (capturing) {
        CaptureLaunch(g, algo, tensors, indices[key]);
      } else {
        internal::FusedUpdateCuda(algo, tensors, ScalarsFor(g, std::get<0>(key)), nullptr,
                                  *group.device_tables);
      }
      continue;
    }
#endif
    internal::FusedUpdateCpu(algo, tensors, ScalarsFor(g, std::get<0>(key)));
  }
}

void Optimizer::CaptureLaunch(int64_t g, internal::Algorithm algo,
                              const std::vector<internal::UpdateTensors>& tensors,
                              const std::vector<size_t>& indices) {
#if TANDEM_WITH_CUDA
  const nn::Device device = tensors.front().param.device();
  // From the graph's arena: lives as long as the graph (the hook holds it).
  constexpr int64_t kWords =
      (sizeof(internal::UpdateScalars) + sizeof(int64_t) - 1) / sizeof(int64_t);
  nn::Tensor scalars = nn::empty({kWords}, {.dtype = nn::kInt64, .device = device});
  auto* device_scalars = static_cast<internal::UpdateScalars*>(scalars.data_ptr());
  internal::FusedUpdateCuda(algo, tensors, internal::UpdateScalars{}, device_scalars,
                            *groups_[g].device_tables);
  // What the graph reads: each parameter's, gradient's and state's address.
  std::vector<const void*> captured;
  for (const internal::UpdateTensors& t : tensors) {
    captured.push_back(t.param.data_ptr());
    captured.push_back(t.grad.data_ptr());
    for (const nn::Tensor& s : t.state) captured.push_back(s.defined() ? s.data_ptr() : nullptr);
  }
  std::weak_ptr<char> alive = alive_;
  const bool added = nn::CudaGraph::AddPreReplayHook(
      [this, alive, g, indices, captured = std::move(captured), scalars, device_scalars, device] {
        TANDEM_CHECK(!alive.expired(), "CudaGraph::Replay: an optimizer used by the captured step "
                     "has been destroyed");
        Group& group = groups_[g];
        int64_t step = -1;
        size_t k = 0;
        for (size_t i : indices) {
          const nn::Tensor& p = group.params[i];
          const nn::Tensor grad = p.grad();
          const ParamState& st = group.state[i];
          bool same = p.data_ptr() == captured[k] && grad.defined() &&
                      grad.data_ptr() == captured[k + 1];
          for (size_t b = 0; b < 3; ++b) {
            const void* now = b < st.buffers.size() && st.buffers[b].defined()
                                  ? st.buffers[b].data_ptr()
                                  : nullptr;
            if (captured[k + 2 + b] != nullptr) same = same && now == captured[k + 2 + b];
          }
          TANDEM_CHECK(same, name_, ": parameter ", i, " of group ", g, ", its gradient or its "
                       "state is no longer the tensor the CUDA graph captured (load_state_dict, "
                       "or a gradient replaced by a new tensor); capture the step again");
          TANDEM_CHECK(step < 0 || st.step == step, name_, ": the parameters of group ", g,
                       " captured in one launch have diverging step counts (", step, " and ",
                       st.step, "); capture the step again");
          step = st.step;
          k += 5;
        }
        (void)scalars;  // held: the arena memory the graph reads
        for (size_t i : indices) ++group.state[i].step;
        const internal::DeviceScope on_device(device);
        internal::WriteUpdateScalarsCuda(ScalarsFor(g, step + 1), device_scalars, device);
      });
  TANDEM_CHECK(added, name_, ": internal error: no capture to attach the step's hook to");
#else
  (void)g, (void)algo, (void)tensors, (void)indices;
  Fail(name_, ": CUDA graph capture needs a CUDA build");
#endif
}

namespace {

std::string GroupKey(int64_t g, const std::string& name) { return absl::StrCat("group.", g, ".", name); }
std::string StateKey(int64_t g, size_t i, const std::string& name) {
  return absl::StrCat("state.", g, ".", i, ".", name);
}

}  // namespace

StateDict Optimizer::state_dict() const {
  nn::NoGradGuard no_grad;
  StateDict dict;
  dict.scalars["num_groups"] = static_cast<double>(num_groups());
  for (int64_t g = 0; g < num_groups(); ++g) {
    const Group& group = groups_[g];
    dict.scalars[GroupKey(g, "num_params")] = static_cast<double>(group.params.size());
    for (const auto& [key, value] : group.hyper) dict.scalars[GroupKey(g, key)] = value;
    for (size_t i = 0; i < group.state.size(); ++i) {
      const ParamState& st = group.state[i];
      if (st.step == 0) continue;
      dict.scalars[StateKey(g, i, "step")] = static_cast<double>(st.step);
      for (size_t b = 0; b < st.buffers.size(); ++b) {
        if (st.buffers[b].defined()) {
          dict.tensors.emplace_back(StateKey(g, i, state_names_[b]), st.buffers[b].clone());
        }
      }
    }
  }
  return dict;
}

// What load_state_dict has read of a StateDict: every scalar and tensor must be
// read exactly once, so that a key the optimizer does not know is an error.
struct Optimizer::DictReader {
  explicit DictReader(const StateDict& d) : dict(d) {
    for (const auto& [key, t] : dict.tensors) tensors[key] = &t;
  }
  // The scalar named `key` (marked as read), or nullptr.
  const double* Scalar(const std::string& key) {
    auto it = dict.scalars.find(key);
    if (it == dict.scalars.end()) return nullptr;
    used_scalars.insert(key);
    return &it->second;
  }
  // The tensor named `key` (counted as read), or nullptr.
  const nn::Tensor* Tensor(const std::string& key) {
    auto it = tensors.find(key);
    if (it == tensors.end()) return nullptr;
    ++used_tensors;
    return it->second;
  }

  const StateDict& dict;
  std::map<std::string, const nn::Tensor*> tensors;
  std::set<std::string> used_scalars;
  size_t used_tensors = 0;
};

absl::Status Optimizer::load_state_dict(const StateDict& dict) {
  DictReader reader(dict);
  const double* n = reader.Scalar("num_groups");
  if (n == nullptr || *n != static_cast<double>(num_groups())) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, " load_state_dict: 'num_groups' is ", n ? absl::StrCat(*n) : "missing",
        " but the optimizer has ", num_groups(), " groups"));
  }
  // Built aside and swapped in at the end: on error the optimizer is unchanged.
  std::vector<Group> loaded(groups_.size());
  for (int64_t g = 0; g < num_groups(); ++g) RETURN_IF_ERROR(LoadGroup(g, reader, loaded[g]));
  RETURN_IF_ERROR(CheckEverythingRead(reader));
  groups_ = std::move(loaded);
  return absl::OkStatus();
}

absl::Status Optimizer::LoadGroup(int64_t g, DictReader& reader, Group& out) const {
  const Group& group = groups_[g];
  const std::string np_key = GroupKey(g, "num_params");
  const double* np = reader.Scalar(np_key);
  if (np == nullptr || *np != static_cast<double>(group.params.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        name_, " load_state_dict: '", np_key, "' is ", np ? absl::StrCat(*np) : "missing",
        " but group ", g, " has ", group.params.size(), " parameters"));
  }
  for (const auto& [name, value] : group.hyper) {
    const std::string key = GroupKey(g, name);
    const double* v = reader.Scalar(key);
    if (v == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, " load_state_dict: missing hyper-parameter '", key, "'"));
    }
    out.hyper[name] = *v;
  }
  out.params = group.params;
  out.device_tables = group.device_tables;
  out.state.resize(group.params.size());
  for (size_t i = 0; i < group.params.size(); ++i) {
    RETURN_IF_ERROR(LoadParamState(g, i, reader, out.state[i]));
  }
  return absl::OkStatus();
}

absl::Status Optimizer::LoadParamState(int64_t g, size_t i, DictReader& reader,
                                       ParamState& st) const {
  const nn::Tensor& p = groups_[g].params[i];
  const std::string step_key = StateKey(g, i, "step");
  const double* step = reader.Scalar(step_key);
  st.buffers.resize(state_names_.size());
  if (step != nullptr) {
    if (*step < 1 || *step != static_cast<double>(static_cast<int64_t>(*step))) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, " load_state_dict: '", step_key, "' must be a whole number >= 1 but is ", *step));
    }
    st.step = static_cast<int64_t>(*step);
  }
  for (size_t b = 0; b < state_names_.size(); ++b) {
    const std::string key = StateKey(g, i, state_names_[b]);
    const nn::Tensor* src = reader.Tensor(key);
    if (src == nullptr) continue;
    if (step == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, " load_state_dict: '", key, "' is given but '", step_key, "' is not"));
    }
    if (!src->defined() || src->shape() != p.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, " load_state_dict: '", key, "' has shape ",
          src->defined() ? nn::ShapeToString(src->shape()) : "undefined",
          " but the parameter has shape ", nn::ShapeToString(p.shape())));
    }
    nn::NoGradGuard no_grad;
    st.buffers[b] = nn::empty_like(p);
    st.buffers[b].copy_(*src);
  }
  return absl::OkStatus();
}

absl::Status Optimizer::CheckEverythingRead(const DictReader& reader) const {
  for (const auto& [key, value] : reader.dict.scalars) {
    if (!reader.used_scalars.count(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, " load_state_dict: unexpected scalar '", key, "'"));
    }
  }
  if (reader.used_tensors == reader.dict.tensors.size()) return absl::OkStatus();
  for (const auto& [key, t] : reader.dict.tensors) {
    bool known = false;
    for (int64_t g = 0; g < num_groups() && !known; ++g) {
      for (size_t i = 0; i < groups_[g].params.size() && !known; ++i) {
        for (const std::string& name : state_names_) known |= key == StateKey(g, i, name);
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, " load_state_dict: unexpected tensor '", key, "'"));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(name_, " load_state_dict: a state tensor name appears twice"));
}

}  // namespace tandem::optim
