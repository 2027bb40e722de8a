// hapi::Model's save() and load(): the weights as safetensors and the
// optimizer state in OptimizerStatePath(path) (model.h says the contract).
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hapi/internal/host_state.h"
#include "hapi/internal/on_rank.h"
#include "hapi/model.h"
#include "nn/checkpoint.h"
#include "nn/random.h"
#include "nn/safetensors.h"
#include "nn/status_macros.h"
#include "spawn/comm/communicator.h"
#include "spawn/context.h"
#include "spawn/train/checkpoint.h"

namespace tandem::hapi {

using internal::HostCopy;
using internal::HostState;

std::string OptimizerStatePath(const std::string& path) { return path + ".optim"; }

namespace {

constexpr char kOptimizerTypeKey[] = "hapi.optimizer";
// The weights the optimizer file goes with (WeightsFingerprint): load() pairs
// the file only with them, not with other weights written over `path` since
// (ModelCheckpoint's final.safetensors, nn::SaveSafetensors, a copy).
constexpr char kWeightsKey[] = "hapi.weights_fnv1a64";
// save's collective inside a rank's function (dist::Communicator::Label).
constexpr char kInsideRanksLabel[] =
    "hapi::Model::save (inside a rank's function a collective: call it on every rank, not "
    "under `if (rank == 0)`; the process's first rank writes)";

void Fnv1a(uint64_t& hash, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ULL;
  }
}

// FNV-1a (64 bits) over the weights' names, dtypes, shapes and bytes, in hex.
std::string WeightsFingerprint(const nn::StateDict& weights) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (const auto& [name, t] : weights) {
    Fnv1a(hash, name.data(), name.size() + 1);  // with its '\0': names apart
    const int32_t dtype = static_cast<int32_t>(t.dtype());
    Fnv1a(hash, &dtype, sizeof(dtype));
    const int64_t dims = t.dim();
    Fnv1a(hash, &dims, sizeof(dims));
    Fnv1a(hash, t.shape().data(), t.shape().size() * sizeof(int64_t));
    Fnv1a(hash, t.host_ptr(), static_cast<size_t>(t.nbytes()));
  }
  return absl::StrCat(absl::Hex(hash, absl::kZeroPad16));
}

// The string entry `key` of an optimizer file, or InvalidArgument naming it.
absl::StatusOr<std::string> StringEntry(const nn::Checkpoint& file, const char* key,
                                        const std::string& path) {
  auto entry = file.metadata.find(key);
  if (entry == file.metadata.end() || !std::holds_alternative<std::string>(entry->second)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hapi::Model::load: ", path, ": no string entry \"", key,
                     "\" (not an optimizer file that Model::save wrote)"));
  }
  return std::get<std::string>(entry->second);
}

}  // namespace

absl::Status Model::save(const std::string& path, SaveOptions options) {
  FoldBatchRun();
  // Both files are renamed over the earlier ones, never removed: writers of
  // one path at once (the processes of a job on a shared filesystem) leave no
  // moment without an optimizer file. One left by an earlier save (this save
  // failing between the two) holds the fingerprint of other weights, which
  // load() refuses.
  auto write_files = [&]() -> absl::Status {
    const std::string optimizer_file = OptimizerStatePath(path);
    if (!options.training || !kept_.have_optimizer_state) {
      // An earlier save's optimizer file goes first: it belongs to other weights.
      std::error_code error;
      std::filesystem::remove(optimizer_file, error);
      if (error) {
        return absl::InternalError(absl::StrCat("hapi::Model::save: cannot remove the earlier ",
                                                optimizer_file, ": ", error.message()));
      }
      return nn::SaveSafetensors(path, kept_.weights);
    }
    RETURN_IF_ERROR(nn::SaveSafetensors(path, kept_.weights));
    nn::Checkpoint file;
    dist::PutOptimizerEntries(kept_.optimizer_state, file);
    file.metadata[kOptimizerTypeKey] = kept_.optimizer_type;
    file.metadata[kWeightsKey] = WeightsFingerprint(kept_.weights);
    return nn::SaveCheckpoint(optimizer_file, file);
  };
  // Weights of this rank's own: a load() or an earlier call, not a draw.
  const bool held = kept_.have_weights && !kept_.weights_of_this_rank;
  absl::Status materialized = Materialize();
  dist::Context* ctx = dist::current_or_null();
  if (ctx == nullptr) {
    RETURN_IF_ERROR(materialized);
    return write_files();
  }
  // Inside a rank's function every rank holds the same weights (DataParallel),
  // so the process's first rank writes for its process's ranks, as Paddle's
  // local rank 0 does; every rank returns once every process's files are
  // written, with an error when any writer failed.
  absl::Status written = materialized;
  double failures = 0;
  {
    // A rank that calls save alone (`if (rank == 0) save(path)`, as a
    // PyTorch script saves) fails here: the collective check or the watchdog
    // names this label.
    dist::Communicator::Label label(ctx->communicator(), kInsideRanksLabel);
    // Weights that Materialize() drew on each rank differ: the first rank
    // writes rank 0's and every rank keeps them, as a first fit takes them.
    // So do weights that rank 0 alone loaded (after an earlier call: the other
    // ranks hold their own). A load() on a rank other than 0 alone, while rank
    // 0 drew or did not load: refused on every rank, as evaluate, predict and
    // fit refuse it. What load() marks stays for the next fit's check of the
    // optimizer states.
    const bool drew = kept_.weights_of_this_rank;
    const bool zero = ctx->rank() == 0;
    const bool loaded = kept_.loaded_since_agreed;
    const std::vector<double> built = internal::SumOverRanks(
        *ctx, {materialized.ok() ? 0.0 : 1.0, drew ? 1.0 : 0.0, zero && drew ? 1.0 : 0.0,
               !zero && held ? 1.0 : 0.0, loaded ? 1.0 : 0.0, zero && loaded ? 1.0 : 0.0,
               !zero && loaded ? 1.0 : 0.0});
    if (built[2] > 0 && built[3] > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "hapi::Model::save: ", built[3], " rank(s) other than rank 0 hold weights of their own "
          "(a load() there alone, or an earlier call's), while rank 0's Model has none: every "
          "rank would take rank 0's fresh weights and drop theirs; call load() on rank 0 (its "
          "weights go to every rank) or on every rank"));
    }
    if (built[5] == 0 && built[6] > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "hapi::Model::save: ", built[6], " rank(s) other than rank 0 loaded weights (a load() "
          "there alone) that rank 0 did not load: every rank would keep rank 0's and drop "
          "theirs; call load() on rank 0 (its weights go to every rank) or on every rank"));
    }
    const bool loads_differ = built[4] > 0 && built[4] < ctx->world_size();
    if (built[0] == 0 && (built[1] > 0 || loads_differ)) TakeRankZerosWeights(*ctx);
    if (written.ok() && internal::LocalRank(*ctx) == 0) written = write_files();
    failures = internal::SumOverRanks(*ctx, {written.ok() ? 0.0 : 1.0})[0];
  }
  if (!written.ok()) return written;
  if (failures > 0) {
    return absl::InternalError(absl::StrCat(
        "hapi::Model::save: ", path, ": ", failures, " rank", failures == 1 ? "" : "s",
        " failed to save it (the first rank of each process writes; that rank's error "
        "names the cause)"));
  }
  return absl::OkStatus();
}

void Model::TakeRankZerosWeights(dist::Context& ctx) {
  nn::NoGradGuard no_grad;
  for (auto& [name, t] : kept_.weights) {
    // A new tensor: a state_dict() the caller holds keeps this rank's values.
    nn::Tensor on_device = ctx.device().is_cpu() ? HostCopy(t) : t.to(ctx.device());
    ctx.communicator().broadcast(on_device, 0);
    t = ctx.device().is_cpu() ? on_device : HostCopy(on_device);
  }
  kept_.weights_of_this_rank = false;
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
  FoldBatchRun();
  std::shared_ptr<nn::Module> net = network_();
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  absl::StatusOr<nn::SafetensorsLoadReport> report = nn::LoadSafetensors(path, *net);
  if (!report.ok()) return report.status();
  nn::StateDict weights = HostState(*net);
  const std::string optimizer_file = OptimizerStatePath(path);
  std::optional<optim::StateDict> optimizer_state;
  std::string type;
  std::error_code error;
  if (!options.reset_optimizer && std::filesystem::exists(optimizer_file, error)) {
    ASSIGN_OR_RETURN(nn::Checkpoint file, nn::LoadCheckpoint(optimizer_file));
    ASSIGN_OR_RETURN(type, StringEntry(file, kOptimizerTypeKey, optimizer_file));
    ASSIGN_OR_RETURN(const std::string saved_with, StringEntry(file, kWeightsKey, optimizer_file));
    ASSIGN_OR_RETURN(optimizer_state, dist::OptimizerEntriesOf(file, optimizer_file));
    if (optimizer_) {
      absl::Status fits = CheckOptimizerState(*optimizer_state, type, optimizer_file, *net);
      if (!fits.ok()) return absl::Status(fits.code(), absl::StrCat("hapi::Model::load: ", fits.message()));
    }
    const std::string fingerprint = WeightsFingerprint(weights);
    if (saved_with != fingerprint) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hapi::Model::load: ", optimizer_file, " was saved with other weights than ", path,
          " holds (weights fingerprint ", saved_with, ", ", path, "'s ", fingerprint,
          "; the weights were written over since): load with reset_optimizer to take the "
          "weights alone"));
    }
  } else if (error) {
    return absl::InternalError(absl::StrCat("hapi::Model::load: cannot look for ", optimizer_file,
                                            ": ", error.message()));
  }
  kept_.weights = std::move(weights);
  kept_.have_weights = true;
  kept_.weights_of_this_rank = false;
  kept_.loaded_since_agreed = dist::current_or_null() != nullptr;
  kept_.have_optimizer_state = optimizer_state.has_value();
  if (optimizer_state.has_value()) {
    kept_.optimizer_state = std::move(*optimizer_state);
    kept_.optimizer_type = std::move(type);
  }
  kept_.unchecked_optimizer_file = kept_.have_optimizer_state && !optimizer_ ? optimizer_file : "";
  return absl::OkStatus();
}

absl::Status Model::CheckPendingOptimizerState() {
  if (kept_.unchecked_optimizer_file.empty()) return absl::OkStatus();
  // The state load() read before prepare(), against the prepared optimizer.
  const nn::Generator generator = nn::thread_generator();
  std::shared_ptr<nn::Module> net = network_();
  nn::thread_generator() = generator;
  if (net == nullptr) return absl::InternalError("hapi::Model: the network factory returned null");
  absl::Status fits =
      CheckOptimizerState(kept_.optimizer_state, kept_.optimizer_type, kept_.unchecked_optimizer_file, *net);
  if (!fits.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "hapi::Model::fit: the optimizer state that load() read before prepare() does not "
        "fit the prepared optimizer (load with reset_optimizer to start it fresh): ",
        fits.message()));
  }
  kept_.unchecked_optimizer_file.clear();
  return absl::OkStatus();
}

}  // namespace tandem::hapi
