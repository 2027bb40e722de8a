// hapi::Model's save() and load(): the weights as safetensors and the
// optimizer state in OptimizerStatePath(path) (model.h says the contract).
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "hapi/internal/host_state.h"
#include "hapi/model.h"
#include "nn/checkpoint.h"
#include "nn/random.h"
#include "nn/safetensors.h"
#include "nn/status_macros.h"
#include "spawn/train/checkpoint.h"

namespace tandem::hapi {

using internal::HostState;

std::string OptimizerStatePath(const std::string& path) { return path + ".optim"; }

namespace {

constexpr char kOptimizerTypeKey[] = "hapi.optimizer";

}  // namespace

absl::Status Model::save(const std::string& path, SaveOptions options) {
  RETURN_IF_ERROR(Materialize());
  const std::string optimizer_file = OptimizerStatePath(path);
  // An earlier save's optimizer file goes first: it belongs to other weights.
  std::error_code error;
  std::filesystem::remove(optimizer_file, error);
  if (error) {
    return absl::InternalError(absl::StrCat("hapi::Model::save: cannot remove the earlier ",
                                            optimizer_file, ": ", error.message()));
  }
  RETURN_IF_ERROR(nn::SaveSafetensors(path, weights_));
  if (!options.training || !have_optimizer_state_) return absl::OkStatus();
  nn::Checkpoint file;
  dist::PutOptimizerEntries(optimizer_state_, file);
  file.metadata[kOptimizerTypeKey] = optimizer_type_;
  return nn::SaveCheckpoint(optimizer_file, file);
}

absl::Status Model::CheckOptimizerState(const optim::StateDict& state, const std::string& type,
                                        const std::string& file, nn::Module& network) const {
  const nn::Generator generator = nn::thread_generator();
  std::unique_ptr<optim::Optimizer> optimizer;
  try {
    optimizer = optimizer_(network.parameters());
  } catch (const std::exception& e) {
    nn::thread_generator() = generator;
    return absl::InvalidArgumentError(
        absl::StrCat("hapi::Model: the optimizer factory threw: ", e.what()));
  }
  nn::thread_generator() = generator;
  if (optimizer == nullptr)
    return absl::InternalError("hapi::Model: the optimizer factory returned null");
  if (type != optimizer->name()) {
    return absl::InvalidArgumentError(absl::StrCat(file, " holds the state of an optimizer of type ",
                                                   type, "; the prepared optimizer is a ",
                                                   optimizer->name()));
  }
  absl::Status loaded = optimizer->load_state_dict(state);
  if (!loaded.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, " does not fit the prepared optimizer: ", loaded.message()));
  }
  return absl::OkStatus();
}

absl::Status Model::load(const std::string& path, LoadOptions options) {
  std::shared_ptr<nn::Module> net = network_();
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  absl::StatusOr<nn::SafetensorsLoadReport> report = nn::LoadSafetensors(path, *net);
  if (!report.ok()) return report.status();
  const std::string optimizer_file = OptimizerStatePath(path);
  std::optional<optim::StateDict> optimizer_state;
  std::string type;
  std::error_code error;
  if (!options.reset_optimizer && std::filesystem::exists(optimizer_file, error)) {
    ASSIGN_OR_RETURN(nn::Checkpoint file, nn::LoadCheckpoint(optimizer_file));
    auto entry = file.metadata.find(kOptimizerTypeKey);
    if (entry == file.metadata.end() || !std::holds_alternative<std::string>(entry->second)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hapi::Model::load: ", optimizer_file, ": no string entry \"", kOptimizerTypeKey,
          "\" (not an optimizer file that Model::save wrote)"));
    }
    type = std::get<std::string>(entry->second);
    ASSIGN_OR_RETURN(optimizer_state, dist::OptimizerEntriesOf(file, optimizer_file));
    if (optimizer_) {
      absl::Status fits = CheckOptimizerState(*optimizer_state, type, optimizer_file, *net);
      if (!fits.ok()) return absl::Status(fits.code(), absl::StrCat("hapi::Model::load: ", fits.message()));
    }
  } else if (error) {
    return absl::InternalError(absl::StrCat("hapi::Model::load: cannot look for ", optimizer_file,
                                            ": ", error.message()));
  }
  weights_ = HostState(*net);
  have_weights_ = true;
  have_optimizer_state_ = optimizer_state.has_value();
  if (optimizer_state.has_value()) {
    optimizer_state_ = std::move(*optimizer_state);
    optimizer_type_ = std::move(type);
  }
  unchecked_optimizer_file_ = have_optimizer_state_ && !optimizer_ ? optimizer_file : "";
  return absl::OkStatus();
}

absl::Status Model::CheckPendingOptimizerState() {
  if (unchecked_optimizer_file_.empty()) return absl::OkStatus();
  // The state load() read before prepare(), against the prepared optimizer.
  const nn::Generator generator = nn::thread_generator();
  std::shared_ptr<nn::Module> net = network_();
  nn::thread_generator() = generator;
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  absl::Status fits =
      CheckOptimizerState(optimizer_state_, optimizer_type_, unchecked_optimizer_file_, *net);
  if (!fits.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "hapi::Model::fit: the optimizer state that load() read before prepare() does not "
        "fit the prepared optimizer (load with reset_optimizer to start it fresh): ",
        fits.message()));
  }
  unchecked_optimizer_file_.clear();
  return absl::OkStatus();
}

}  // namespace tandem::hapi
