#include "hapi/summary.h"

#include <algorithm>
#include <cctype>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nn/device.h"
#include "nn/random.h"

namespace tandem::hapi {
namespace {

struct Place {
  std::string path;
  int depth = 0;
};

// Every module of the tree, the root first, each before its children.
void Walk(nn::Module& module, const std::string& path, int depth,
          std::unordered_map<const nn::Module*, Place>& places,
          std::vector<std::pair<nn::Module*, bool>>& training) {
  training.emplace_back(&module, module.is_training());
  places.try_emplace(&module, Place{path, depth});  // a shared module: its first place
  for (const auto& [name, child] : module.named_children()) {
    Walk(*child, path.empty() ? name : absl::StrCat(path, ".", name), depth + 1, places, training);
  }
}

// Puts back every module's training flag: train() sets a subtree, so setting each
// module's own flag root first leaves every module with its own.
class TrainingRestorer {
 public:
  explicit TrainingRestorer(std::vector<std::pair<nn::Module*, bool>> flags)
      : flags_(std::move(flags)) {}
  ~TrainingRestorer() {
    for (const auto& [module, on] : flags_) module->train(on);
  }
  TrainingRestorer(const TrainingRestorer&) = delete;
  TrainingRestorer& operator=(const TrainingRestorer&) = delete;

 private:
  std::vector<std::pair<nn::Module*, bool>> flags_;
};

// Module::type_name() without "Impl" and without the namespaces it leaves inside
// template arguments: "Conv2dImpl" -> "Conv2d".
std::string ShortType(std::string name) {
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at; (at = name.find(anonymous)) != std::string::npos;) {
    name.erase(at, anonymous.size());
  }
  for (size_t at; (at = name.find("::")) != std::string::npos;) {
    size_t begin = at;
    while (begin > 0 && (std::isalnum(static_cast<unsigned char>(name[begin - 1])) != 0 ||
                         name[begin - 1] == '_')) {
      --begin;
    }
    name.erase(begin, at + 2 - begin);
  }
  const size_t end = name.find('<') == std::string::npos ? name.size() : name.find('<');
  if (end >= 4 && name.compare(end - 4, 4, "Impl") == 0) name.erase(end - 4, 4);
  return name;
}

// Records each call's module and output shape, in the order the calls began.
class ShapeRecorder : public nn::ForwardRecorder {
 public:
  ShapeRecorder(const nn::Module& root, const std::unordered_map<const nn::Module*, Place>& places)
      : root_(root), places_(places) {}

  void Enter(const nn::Module& module) override {
    if (&module == &root_) {
      open_.push_back({kRoot, &module});
      return;
    }
    SummaryLayer layer;
    auto place = places_.find(&module);
    layer.name = place == places_.end() ? "(unregistered)" : place->second.path;
    // An unregistered module sits one below the layer that called it.
    layer.depth = place == places_.end() ? CallerDepth() + 1 : place->second.depth;
    layer.type = ShortType(module.type_name());
    layer.has_children = !module.named_children().empty();
    layer.params = CountElements(module.parameters());
    open_.push_back({rows_.size(), &module});
    rows_.push_back({.layer = std::move(layer)});
  }

  // The innermost open call of `module`: the calls still open inside it threw
  // (a throw reports no Exit) and their callers caught it; they are dropped.
  void Exit(const nn::Module& module, const nn::Tensor& output) override {
    auto it = std::find_if(open_.rbegin(), open_.rend(),
                           [&](const OpenCall& call) { return call.module == &module; });
    if (it == open_.rend()) return;
    const size_t row = it->row;
    open_.erase(std::prev(it.base()), open_.end());
    if (row == kRoot) return;
    rows_[row].layer.output_shape = output.shape();
    rows_[row].ended = true;
  }

  // The rows whose call ended (those that threw and were caught are left out).
  std::vector<SummaryLayer> TakeLayers() {
    std::vector<SummaryLayer> ended;
    for (Row& row : rows_) {
      if (row.ended) ended.push_back(std::move(row.layer));
    }
    rows_.clear();
    return ended;
  }

  // After a forward threw: " in layer <path> (<type>)" for the innermost call
  // still open, "" when only the root's was.
  std::string OpenLayer() const {
    for (auto it = open_.rbegin(); it != open_.rend(); ++it) {
      if (it->row == kRoot) continue;
      const SummaryLayer& layer = rows_[it->row].layer;
      return absl::StrCat(" in layer ", layer.name, " (", layer.type, ")");
    }
    return "";
  }

  static int64_t CountElements(const std::vector<nn::Tensor>& tensors) {
    int64_t n = 0;
    for (const nn::Tensor& t : tensors) n += t.numel();
    return n;
  }

 private:
  static constexpr size_t kRoot = static_cast<size_t>(-1);

  int CallerDepth() const {
    for (auto it = open_.rbegin(); it != open_.rend(); ++it) {
      if (it->row != kRoot) return rows_[it->row].layer.depth;
    }
    return 0;
  }

  const nn::Module& root_;
  const std::unordered_map<const nn::Module*, Place>& places_;
  struct OpenCall {
    size_t row;  // kRoot for the root's call
    const nn::Module* module;
  };

  struct Row {
    SummaryLayer layer;
    bool ended = false;  // its call reported Exit
  };

  std::vector<Row> rows_;       // one per call, in the order the calls began
  std::vector<OpenCall> open_;  // calls whose forward has begun and not ended
};

std::string Grouped(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

std::string Bytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  if (bytes < 1024 * 1024) return absl::StrFormat("%.2f KiB", static_cast<double>(bytes) / 1024.0);
  return absl::StrFormat("%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

std::string Table(const ModelSummary& s) {
  std::vector<std::string> names, shapes, counts;
  size_t name_width = std::string("Layer (type)").size();
  size_t shape_width = std::string("Output shape").size();
  for (const SummaryLayer& layer : s.layers) {
    names.push_back(absl::StrCat(std::string(2 * static_cast<size_t>(layer.depth - 1), ' '),
                                 layer.name, " (", layer.type, ")"));
    shapes.push_back(nn::ShapeToString(layer.output_shape));
    counts.push_back(layer.has_children ? "--" : Grouped(layer.params));
    name_width = std::max(name_width, names.back().size());
    shape_width = std::max(shape_width, shapes.back().size());
  }
  const size_t count_width = std::max<size_t>(10, Grouped(s.total_params).size());
  const std::string rule(name_width + shape_width + count_width + 4, '=');
  std::string out = absl::StrFormat("%-*s  %-*s  %*s\n", name_width, "Layer (type)", shape_width,
                                    "Output shape", count_width, "Param #");
  absl::StrAppend(&out, rule, "\n");
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, absl::StrFormat("%-*s  %-*s  %*s\n", name_width, names[i], shape_width,
                                          shapes[i], count_width, counts[i]));
  }
  absl::StrAppend(&out, rule, "\n");
  absl::StrAppend(&out, "Input shape: ", nn::ShapeToString(s.input_shape),
                  "; output shape: ", nn::ShapeToString(s.output_shape), "\n");
  absl::StrAppend(&out, "Total params: ", Grouped(s.total_params), " (",
                  Bytes(s.total_param_bytes), ")\n");
  absl::StrAppend(&out, "Trainable params: ", Grouped(s.trainable_params), " (",
                  Bytes(s.trainable_param_bytes), ")\n");
  absl::StrAppend(&out, "Non-trainable params: ", Grouped(s.non_trainable_params), " (",
                  Bytes(s.non_trainable_param_bytes), ")\n");
  absl::StrAppend(&out, "Buffers: ", Grouped(s.buffer_elements), " (", Bytes(s.buffer_bytes),
                  ")\n");
  return out;
}

void CountParameters(const nn::Module& network, ModelSummary& s) {
  for (const nn::Tensor& p : network.parameters()) {
    s.total_params += p.numel();
    s.total_param_bytes += p.nbytes();
    if (p.requires_grad()) {
      s.trainable_params += p.numel();
      s.trainable_param_bytes += p.nbytes();
    } else {
      s.non_trainable_params += p.numel();
      s.non_trainable_param_bytes += p.nbytes();
    }
  }
  for (const nn::Tensor& b : network.buffers()) {
    s.buffer_elements += b.numel();
    s.buffer_bytes += b.nbytes();
  }
}

absl::Status CheckShape(const nn::Shape& shape) {
  if (shape.empty()) {
    return absl::InvalidArgumentError(
        "hapi::Summary: the input shape () has no dimensions; give the batch first, (N, ...)");
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("hapi::Summary: the input shape ",
                                                     nn::ShapeToString(shape), " has dimension ", i,
                                                     " = ", shape[i], "; each must be positive"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelSummary> Summary(nn::Module& network, const nn::Shape& input_shape) {
  if (absl::Status bad = CheckShape(input_shape); !bad.ok()) return bad;
  const std::vector<nn::Tensor> params = network.parameters();
  const std::vector<nn::Tensor> buffers = network.buffers();
  nn::Device device = nn::current_device();
  if (!params.empty()) {
    device = params.front().device();
  } else if (!buffers.empty()) {
    device = buffers.front().device();
  }
  const nn::DType dtype = params.empty() ? nn::kFloat32 : params.front().dtype();

  std::unordered_map<const nn::Module*, Place> places;
  std::vector<std::pair<nn::Module*, bool>> training;
  Walk(network, "", 0, places, training);

  ModelSummary s;
  s.input_shape = input_shape;
  ShapeRecorder recorder(network, places);
  {
    const nn::Generator generator = nn::thread_generator();
    TrainingRestorer restore_training(std::move(training));
    nn::DeviceGuard on_device(device);
    nn::NoGradGuard no_grad;
    network.eval();
    nn::ForwardRecordScope record(&recorder);
    try {
      const nn::Tensor x = nn::zeros(input_shape, {.dtype = dtype, .device = device});
      s.output_shape = network(x).shape();
    } catch (const std::exception& e) {
      nn::thread_generator() = generator;
      return absl::InvalidArgumentError(
          absl::StrCat("hapi::Summary: the forward of ", ShortType(network.type_name()),
                       " on an input of shape ", nn::ShapeToString(input_shape), " failed",
                       recorder.OpenLayer(), ": ", e.what()));
    }
    nn::thread_generator() = generator;
  }
  s.layers = recorder.TakeLayers();
  CountParameters(network, s);
  s.table = Table(s);
  return s;
}

}  // namespace tandem::hapi
