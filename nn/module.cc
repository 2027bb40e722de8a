#include "nn/module.h"

#include <cxxabi.h>

#include <cstdlib>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "nn/dtype.h"

namespace tandem::nn {
namespace {

std::string Demangle(const char* mangled) {
  int status = 0;
  char* readable = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  if (status != 0 || readable == nullptr) return mangled;
  std::string out = readable;
  std::free(readable);
  // Drop the namespaces: "tandem::nn::LinearImpl" -> "LinearImpl".
  const size_t colon = out.rfind("::");
  return colon == std::string::npos ? out : out.substr(colon + 2);
}

// Points `t`'s TensorImpl at a copy of its data on `device`, so every handle to
// `t` sees the moved data.
void MoveInPlace(const Tensor& t, Device device) {
  if (t.device() == device) return;
  NoGradGuard no_grad;
  Tensor moved = t.detach().to(device);
  Tensor grad = t.grad();
  t.impl()->storage = moved.storage();
  t.impl()->offset = moved.storage_offset();
  if (grad.defined()) t.set_grad(grad.detach().to(device));
}

// Points `t`'s TensorImpl at a copy of its data converted to `dtype`.
void ConvertInPlace(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype || !IsFloatingPoint(t.dtype())) return;
  NoGradGuard no_grad;
  Tensor converted = t.detach().to(dtype);
  Tensor grad = t.grad();
  if (grad.defined()) t.set_grad(Tensor());  // set_grad checks the dtype against t's
  t.impl()->storage = converted.storage();
  t.impl()->offset = converted.storage_offset();
  t.impl()->dtype = dtype;
  if (grad.defined()) t.set_grad(grad.detach().to(dtype));
}

}  // namespace

Tensor Module::forward(const Tensor&) {
  Fail(type_name(), ": forward(const Tensor&) is not implemented by this module");
}

std::string Module::type_name() const { return Demangle(typeid(*this).name()); }

void Module::CheckNewName(const std::string& name, const char* what) const {
  TANDEM_CHECK(!name.empty() && name.find('.') == std::string::npos, type_name(), ": ", what,
               " name '", name, "' must be non-empty and contain no '.'");
  auto taken = [&name](const auto& list) {
    for (const auto& [n, unused] : list) {
      if (n == name) return true;
    }
    return false;
  };
  TANDEM_CHECK(!taken(parameters_) && !taken(buffers_) && !taken(children_), type_name(),
               ": cannot register ", what, " '", name, "': the name is already registered");
}

Tensor Module::register_parameter(std::string name, Tensor tensor) {
  CheckNewName(name, "parameter");
  TANDEM_CHECK(tensor.defined(), type_name(), ": parameter '", name, "' is an undefined tensor");
  TANDEM_CHECK(IsFloating(tensor.dtype()), type_name(), ": parameter '", name, "' is ",
               tensor.ToString(), "; parameters must be floating point");
  TANDEM_CHECK(tensor.is_leaf(), type_name(), ": parameter '", name,
               "' is the output of an op; register a leaf (detach() it first)");
  tensor.set_requires_grad(true);
  tensor.set_name(name);
  parameters_.emplace_back(std::move(name), tensor);
  return tensor;
}

Tensor Module::register_buffer(std::string name, Tensor tensor) {
  CheckNewName(name, "buffer");
  TANDEM_CHECK(tensor.defined(), type_name(), ": buffer '", name, "' is an undefined tensor");
  tensor.set_name(name);
  buffers_.emplace_back(std::move(name), tensor);
  return tensor;
}

void Module::RegisterChild(std::string name, std::shared_ptr<Module> child) {
  CheckNewName(name, "module");
  TANDEM_CHECK(child != nullptr, type_name(), ": module '", name, "' is empty");
  TANDEM_CHECK(child.get() != this, type_name(), ": cannot register a module as its own child");
  // Rename the child's tensors with their path from this module; a later
  // registration of this module into a parent renames them again.
  for (const auto& [n, t] : child->named_parameters()) t.set_name(absl::StrCat(name, ".", n));
  for (const auto& [n, t] : child->named_buffers()) t.set_name(absl::StrCat(name, ".", n));
  children_.emplace_back(std::move(name), std::move(child));
}

void Module::CollectNamed(const std::string& prefix, bool want_buffers, NamedTensors& out) const {
  for (const auto& [name, t] : want_buffers ? buffers_ : parameters_) {
    out.emplace_back(prefix + name, t);
  }
  for (const auto& [name, child] : children_) {
    child->CollectNamed(absl::StrCat(prefix, name, "."), want_buffers, out);
  }
}

namespace {
// Keeps the first occurrence of each TensorImpl.
NamedTensors Dedup(NamedTensors all) {
  std::unordered_set<const TensorImpl*> seen;
  NamedTensors out;
  for (auto& entry : all) {
    if (seen.insert(entry.second.impl()).second) out.push_back(std::move(entry));
  }
  return out;
}
std::vector<Tensor> Values(const NamedTensors& named) {
  std::vector<Tensor> out;
  out.reserve(named.size());
  for (const auto& [unused, t] : named) out.push_back(t);
  return out;
}
}  // namespace

NamedTensors Module::named_parameters() const {
  NamedTensors all;
  CollectNamed("", /*want_buffers=*/false, all);
  return Dedup(std::move(all));
}
std::vector<Tensor> Module::parameters() const { return Values(named_parameters()); }

NamedTensors Module::named_buffers() const {
  NamedTensors all;
  CollectNamed("", /*want_buffers=*/true, all);
  return Dedup(std::move(all));
}
std::vector<Tensor> Module::buffers() const { return Values(named_buffers()); }

std::vector<std::shared_ptr<Module>> Module::children() const {
  std::vector<std::shared_ptr<Module>> out;
  for (const auto& [unused, child] : children_) out.push_back(child);
  return out;
}
std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  return children_;
}

void Module::train(bool on) {
  training_ = on;
  for (const auto& [unused, child] : children_) child->train(on);
}

void Module::to(Device device) {
  for (const Tensor& p : parameters()) MoveInPlace(p, device);
  for (const Tensor& b : buffers()) MoveInPlace(b, device);
}

void Module::to(DType dtype) {
  TANDEM_CHECK(IsFloatingPoint(dtype), type_name(), ".to(", DTypeName(dtype),
               "): a module converts to a floating-point dtype only");
  for (const Tensor& p : parameters()) ConvertInPlace(p, dtype);
  for (const Tensor& b : buffers()) ConvertInPlace(b, dtype);
}

void Module::zero_grad() {
  for (const Tensor& p : parameters()) p.set_grad(Tensor());
}

StateDict Module::state_dict() const {
  StateDict out;
  std::unordered_set<const TensorImpl*> seen;
  // Per module: parameters, then buffers, then the children (PyTorch's order).
  struct Walker {
    static void Walk(const Module& m, const std::string& prefix, StateDict& out,
                     std::unordered_set<const TensorImpl*>& seen) {
      for (const NamedTensors* list : {&m.parameters_, &m.buffers_}) {
        for (const auto& [name, t] : *list) {
          if (seen.insert(t.impl()).second) out.emplace_back(prefix + name, t.detach());
        }
      }
      for (const auto& [name, child] : m.children_) {
        Walk(*child, absl::StrCat(prefix, name, "."), out, seen);
      }
    }
  };
  Walker::Walk(*this, "", out, seen);
  return out;
}

absl::Status Module::load_state_dict(const StateDict& state, bool strict) {
  const StateDict own = state_dict();
  std::unordered_map<std::string, const Tensor*> given;
  for (const auto& [name, t] : state) {
    if (!given.emplace(name, &t).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("load_state_dict: key '", Printable(name), "' appears twice in the state dict"));
    }
  }
  // Check everything before copying anything, so an error leaves the module as it was.
  std::vector<std::pair<Tensor, const Tensor*>> copies;
  std::unordered_set<std::string> own_names;
  for (const auto& [name, dst] : own) {
    own_names.insert(name);
    auto it = given.find(name);
    if (it == given.end()) {
      if (strict) {
        return absl::InvalidArgumentError(absl::StrCat(
            "load_state_dict: missing key '", Printable(name), "' (", dst.ToString(), " in ", type_name(),
            ") in the state dict"));
      }
      continue;
    }
    const Tensor& src = *it->second;
    if (!src.defined() || src.shape() != dst.shape() || src.dtype() != dst.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "load_state_dict: key '", Printable(name), "' is ", DTypeName(dst.dtype()),
          ShapeToString(dst.shape()), " in ", type_name(), " but ", src.defined() ? DTypeName(src.dtype()) : "",
          src.defined() ? ShapeToString(src.shape()) : "undefined", " in the state dict"));
    }
    copies.emplace_back(dst, &src);
  }
  if (strict) {
    for (const auto& [name, t] : state) {
      if (own_names.count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("load_state_dict: unexpected key '",
                                                       Printable(name), "' (", t.ToString(), ") not in ",
                                                       type_name()));
      }
    }
  }
  NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.copy_(*src);
  return absl::OkStatus();
}

}  // namespace tandem::nn
