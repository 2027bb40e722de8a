// Training-state checkpoints: the entries of spawn/train/checkpoint.h's file comment,
// gathered on every rank, written by rank 0, loaded by every rank.
#include "spawn/train/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "nn/error.h"
#include "nn/layers.h"  // AddMissingBatchCounts
#include "nn/random.h"
#include "spawn/train/data_parallel.h"
#include "spawn/train/sync_batch_norm.h"
#include "nn/status_macros.h"

namespace tandem::dist {
namespace {

constexpr int64_t kFormatVersion = 1;
constexpr char kVersionKey[] = "training_state.version";
constexpr const char* kLibraryPrefixes[] = {"model.", "optim.",          "sched.",
                                            "sampler.", "rng.", "training_state."};

bool IsLibraryKey(const std::string& key) {
  for (const char* prefix : kLibraryPrefixes) {
    if (absl::StartsWith(key, prefix)) return true;
  }
  return key == "step" || key == "world_size";
}

std::string RngKey(int64_t rank, const char* field) { return absl::StrCat("rng.", rank, ".", field); }

std::string Describe(const nn::CheckpointValue& value) {
  if (const auto* s = std::get_if<std::string>(&value)) return absl::StrCat("\"", *s, "\"");
  if (const auto* i = std::get_if<int64_t>(&value)) return absl::StrCat(*i, " (int64)");
  return absl::StrCat(absl::StrFormat("%.17g", std::get<double>(value)), " (double)");
}

// The (seed, stream, offset) of the calling thread's generator, as int64 bits.
std::vector<int64_t> GeneratorWords() {
  const nn::Generator& g = nn::thread_generator();
  return {static_cast<int64_t>(g.seed), static_cast<int64_t>(g.stream),
          static_cast<int64_t>(g.offset)};
}

absl::Status CheckPointers(const TrainingState& state) {
  if (state.loader != nullptr && state.sampler != nullptr) {
    return absl::InvalidArgumentError(
        "TrainingState: set loader or sampler, not both (they would both hold the position)");
  }
  return absl::OkStatus();
}

constexpr char kBuffersKey[] = "training_state.buffers";
constexpr char kBufferPrefix[] = "training_state.buffer.";

// Rank 0's statement of `model`'s buffers (BufferSync, checkpoint.h).
std::vector<SavedBuffer> StateBuffers(const nn::Module& model, int world_size) {
  // Buffers of BatchNorm2d layers synchronised by a SyncBatchNormReducer.
  std::set<const nn::TensorImpl*> synced;
  std::function<void(const nn::Module&)> walk = [&](const nn::Module& m) {
    if (const auto* bn = dynamic_cast<const nn::BatchNorm2dImpl*>(&m);
        bn != nullptr && dynamic_cast<const SyncBatchNormReducer*>(bn->reducer.get()) != nullptr) {
      for (const auto& [name, tensor] : m.named_buffers()) synced.insert(tensor.impl());
    }
    for (const std::shared_ptr<nn::Module>& child : m.children()) walk(*child);
  };
  walk(model);
  const std::optional<bool> broadcast = internal::BroadcastBuffersOf(&model);
  std::vector<SavedBuffer> out;
  for (const auto& [name, tensor] : model.named_buffers()) {
    BufferSync sync = BufferSync::kUnknown;
    if (world_size == 1) {
      sync = BufferSync::kOneRank;
    } else if (synced.contains(tensor.impl())) {
      sync = BufferSync::kSyncBatchNorm;
    } else if (broadcast.has_value()) {
      sync = *broadcast ? BufferSync::kBroadcastFromRank0 : BufferSync::kRank0Only;
    }
    out.push_back({.name = name, .sync = sync});
  }
  return out;
}

constexpr BufferSync kAllSyncs[] = {BufferSync::kOneRank, BufferSync::kSyncBatchNorm,
                                    BufferSync::kBroadcastFromRank0, BufferSync::kRank0Only,
                                    BufferSync::kUnknown};

const char* BufferSyncWords(BufferSync sync) {
  switch (sync) {
    case BufferSync::kOneRank: return "of a run of one rank";
    case BufferSync::kSyncBatchNorm:
      return "identical on every rank (SyncBatchNorm: statistics of every rank's batch)";
    case BufferSync::kBroadcastFromRank0:
      return "rank 0's, broadcast to every rank at each synchronised step (broadcast_buffers "
             "on), after rank 0's own last forward";
    case BufferSync::kRank0Only:
      return "rank 0's own, the other ranks' differ (broadcast_buffers off)";
    case BufferSync::kUnknown:
      return "rank 0's, the other ranks' unknown (no DataParallel over the model on rank 0)";
  }
  return "?";
}

// Rank 0's part of a save: the checkpoint built from `state`.
// `generators`: world_size rows of (seed, stream, offset).
absl::StatusOr<nn::Checkpoint> Build(const std::string& path, const TrainingState& state,
                                     int world_size, const std::vector<int64_t>& generators) {
  RETURN_IF_ERROR(CheckPointers(state));
  nn::Checkpoint ck;
  for (const auto& [key, value] : state.extra) {
    if (IsLibraryKey(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", path, ": extra entry \"", key,
          "\" uses a name the training state itself writes (see spawn/train/checkpoint.h)"));
    }
    ck.metadata[key] = value;
  }
  try {
    if (state.model != nullptr) {
      for (const auto& [name, tensor] : state.model->state_dict()) ck.tensors["model." + name] = tensor;
      const std::vector<SavedBuffer> buffers = StateBuffers(*state.model, world_size);
      ck.metadata[kBuffersKey] = static_cast<int64_t>(buffers.size());
      for (const SavedBuffer& b : buffers) {
        ck.metadata[kBufferPrefix + b.name] = std::string(BufferSyncCode(b.sync));
      }
    }
    if (state.optimizer != nullptr) PutOptimizerEntries(state.optimizer->state_dict(), ck);
    if (state.scheduler != nullptr) {
      for (const auto& [key, value] : state.scheduler->state_dict()) ck.metadata["sched." + key] = value;
    }
    if (state.loader != nullptr || state.sampler != nullptr) {
      const data::SamplerState s =
          state.loader != nullptr ? state.loader->get_state() : state.sampler->get_state();
      ck.metadata["sampler.epoch"] = s.epoch;
      ck.metadata["sampler.position"] = s.position;
    }
    if (state.step != nullptr) ck.metadata["step"] = *state.step;
    ck.metadata["world_size"] = int64_t{world_size};
    for (int r = 0; r < world_size; ++r) {
      ck.metadata[RngKey(r, "seed")] = generators[3 * r];
      ck.metadata[RngKey(r, "stream")] = generators[3 * r + 1];
      ck.metadata[RngKey(r, "offset")] = generators[3 * r + 2];
    }
    ck.metadata[kVersionKey] = kFormatVersion;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("checkpoint ", path, ": collecting the state: ", e.what()));
  }
  return ck;
}

absl::Status Write(const std::string& path, const TrainingState& state, int world_size,
                   const std::vector<int64_t>& generators) {
  ASSIGN_OR_RETURN(const nn::Checkpoint ck, Build(path, state, world_size, generators));
  return nn::SaveCheckpoint(path, ck);
}

}  // namespace

const char* BufferSyncCode(BufferSync sync) {
  switch (sync) {
    case BufferSync::kOneRank: return "one_rank";
    case BufferSync::kSyncBatchNorm: return "sync_batch_norm";
    case BufferSync::kBroadcastFromRank0: return "broadcast_from_rank0";
    case BufferSync::kRank0Only: return "rank0_only";
    case BufferSync::kUnknown: return "unknown";
  }
  return "unknown";
}

absl::StatusOr<SavedBuffers> SavedBuffersOf(const nn::Checkpoint& checkpoint,
                                            const std::string& path) {
  SavedBuffers out;
  if (!checkpoint.metadata.contains(kBuffersKey)) return out;  // not stated
  ASSIGN_OR_RETURN(const int64_t count, ExtraValue<int64_t>(checkpoint.metadata, kBuffersKey, path));
  out.stated = true;
  for (const auto& [key, value] : checkpoint.metadata) {
    if (!absl::StartsWith(key, kBufferPrefix)) continue;
    ASSIGN_OR_RETURN(const std::string code, ExtraValue<std::string>(checkpoint.metadata, key, path));
    SavedBuffer b{.name = key.substr(std::strlen(kBufferPrefix))};
    bool known = false;
    for (BufferSync sync : kAllSyncs) {
      if (code == BufferSyncCode(sync)) {
        b.sync = sync;
        known = true;
      }
    }
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": entry \"", key,
                                                     "\" is \"", code, "\", not a buffer statement"));
    }
    out.buffers.push_back(std::move(b));
  }
  if (static_cast<int64_t>(out.buffers.size()) != count) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": entry \"", kBuffersKey,
                                                   "\" is ", count, " but the file states ",
                                                   out.buffers.size(), " buffer(s)"));
  }
  return out;
}

SavedBuffers SavedBuffersFor(const TrainingState& state, int world_size) {
  SavedBuffers out{.stated = true};
  if (state.model != nullptr) out.buffers = StateBuffers(*state.model, world_size);
  return out;
}

absl::StatusOr<SavedBuffers> ReadSavedBuffers(const std::string& path) {
  ASSIGN_OR_RETURN(const nn::Checkpoint ck, nn::LoadCheckpoint(path));
  return SavedBuffersOf(ck, path);
}

std::string DescribeSavedBuffers(const SavedBuffers& buffers) {
  if (!buffers.stated) return "not stated (written before checkpoints stated their buffers)";
  if (buffers.buffers.empty()) return "no buffers";
  std::string text;
  for (BufferSync sync : kAllSyncs) {
    std::vector<std::string> names;
    for (const SavedBuffer& b : buffers.buffers) {
      if (b.sync == sync) names.push_back(b.name);
    }
    if (names.empty()) continue;
    absl::StrAppend(&text, text.empty() ? "" : "; ", names.size(),
                    names.size() == 1 ? " buffer " : " buffers ", BufferSyncWords(sync), ": ",
                    absl::StrJoin(names, ", "));
  }
  return text;
}

namespace {

template <typename T>
absl::StatusOr<T> Entry(const nn::Checkpoint& ck, const std::string& key, const std::string& path) {
  return ExtraValue<T>(ck.metadata, key, path);
}

// "checkpoint <path>: <what>: <status message>" with the status's code.
absl::Status Wrap(const absl::Status& status, const std::string& path, const char* what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("checkpoint ", path, ": ", what, ": ", status.message()));
}

absl::Status CheckFormatVersion(const nn::Checkpoint& ck, const std::string& path) {
  if (!ck.metadata.contains(kVersionKey)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": missing entry \"", kVersionKey,
                                            "\": not a training-state checkpoint"));
  }
  ASSIGN_OR_RETURN(const int64_t version, Entry<int64_t>(ck, kVersionKey, path));
  if (version != kFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": entry \"", kVersionKey,
                                                   "\" is ", version, ", this build reads ",
                                                   kFormatVersion));
  }
  return absl::OkStatus();
}

// The caller's own entries (TrainingState::extra), checked against options.expect.
absl::StatusOr<std::map<std::string, nn::CheckpointValue>> ExtraEntries(
    const nn::Checkpoint& ck, const LoadOptions& options, const std::string& path) {
  std::map<std::string, nn::CheckpointValue> extra;
  for (const auto& [key, value] : ck.metadata) {
    if (!IsLibraryKey(key)) extra[key] = value;
  }
  for (const auto& [key, expected] : options.expect) {
    auto it = extra.find(key);
    if (it == extra.end()) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": missing entry \"", key,
                                              "\" (expected ", Describe(expected), ")"));
    }
    if (it->second != expected) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path, ": entry \"", key,
                                                        "\" is ", Describe(it->second),
                                                        ", expected ", Describe(expected)));
    }
  }
  return extra;
}

// The world the file was written by, and this rank's generator when it is ours.
struct SavedGenerator {
  int64_t saved_world = 0;
  bool same_world = false;
  nn::Generator generator;  // set when same_world
};

absl::StatusOr<SavedGenerator> ReadGenerator(Context& ctx, const nn::Checkpoint& ck,
                                             const LoadOptions& options, const std::string& path) {
  SavedGenerator saved;
  ASSIGN_OR_RETURN(saved.saved_world, Entry<int64_t>(ck, "world_size", path));
  if (saved.saved_world < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint ", path, ": entry \"world_size\" is ", saved.saved_world));
  }
  saved.same_world = saved.saved_world == ctx.world_size();
  if (!saved.same_world && options.require_same_world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path, ": written by ", saved.saved_world, " rank(s), this run has ",
        ctx.world_size(), " (generator states cannot be restored)"));
  }
  if (saved.same_world) {
    ASSIGN_OR_RETURN(const int64_t seed, Entry<int64_t>(ck, RngKey(ctx.rank(), "seed"), path));
    ASSIGN_OR_RETURN(const int64_t stream, Entry<int64_t>(ck, RngKey(ctx.rank(), "stream"), path));
    ASSIGN_OR_RETURN(const int64_t offset, Entry<int64_t>(ck, RngKey(ctx.rank(), "offset"), path));
    saved.generator = {static_cast<uint64_t>(seed), static_cast<uint64_t>(stream),
                       static_cast<uint64_t>(offset)};
  }
  return saved;
}

// Every object's state as the file holds it, read and checked before any is loaded.
struct SavedObjects {
  nn::StateDict model;
  optim::StateDict optimizer;
  std::map<std::string, double> scheduler;
  data::SamplerState sampler;
  int64_t step = 0;
};

absl::Status ReadModelAndOptimizer(const nn::Checkpoint& ck, const TrainingState& state,
                                   const std::string& path, SavedObjects& saved) {
  if (state.model != nullptr) {
    for (const auto& [name, tensor] : ck.tensors) {
      if (absl::StartsWith(name, "model.")) saved.model.emplace_back(name.substr(6), tensor);
    }
    if (saved.model.empty()) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", path,
                                              ": no \"model.*\" entries (saved without a model)"));
    }
    nn::AddMissingBatchCounts(*state.model, saved.model);
  }
  if (state.optimizer != nullptr) {
    ASSIGN_OR_RETURN(saved.optimizer, OptimizerEntriesOf(ck, path));
  }
  return absl::OkStatus();
}

absl::Status ReadScheduleSamplerAndStep(const nn::Checkpoint& ck, const TrainingState& state,
                                        const std::string& path, SavedObjects& saved) {
  if (state.scheduler != nullptr) {
    if (!ck.metadata.contains("sched.last_epoch")) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", path,
                                              ": missing entry \"sched.last_epoch\" (saved "
                                              "without a scheduler)"));
    }
    for (const auto& [key, value] : ck.metadata) {
      if (!absl::StartsWith(key, "sched.")) continue;
      ASSIGN_OR_RETURN(saved.scheduler[key.substr(6)], Entry<double>(ck, key, path));
    }
  }
  if (state.loader != nullptr || state.sampler != nullptr) {
    data::SamplerState& sampler = saved.sampler;
    ASSIGN_OR_RETURN(sampler.epoch, Entry<int64_t>(ck, "sampler.epoch", path));
    ASSIGN_OR_RETURN(sampler.position, Entry<int64_t>(ck, "sampler.position", path));
    const int64_t batches =
        state.loader != nullptr ? state.loader->num_batches() : state.sampler->num_batches();
    if (sampler.epoch < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", path, ": entry \"sampler.epoch\" is ", sampler.epoch));
    }
    if (sampler.position < 0 || sampler.position > batches) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", path, ": entry \"sampler.position\" is ", sampler.position,
          ", outside 0..", batches, " (the batches per epoch of this run's sampler)"));
    }
  }
  if (state.step != nullptr) {
    ASSIGN_OR_RETURN(saved.step, Entry<int64_t>(ck, "step", path));
  }
  return absl::OkStatus();
}

// Loads what was read into the objects, in order (model, optimizer, schedule,
// sampler, step, generator).
absl::Status Apply(Context& ctx, const std::string& path, TrainingState& state,
                   SavedObjects& saved, const SavedGenerator& generator) {
  try {
    if (state.model != nullptr) RETURN_IF_ERROR(Wrap(state.model->load_state_dict(saved.model), path, "model"));
    if (state.optimizer != nullptr) {
      RETURN_IF_ERROR(Wrap(state.optimizer->load_state_dict(saved.optimizer), path, "optimizer"));
    }
    if (state.scheduler != nullptr) {
      RETURN_IF_ERROR(Wrap(state.scheduler->load_state_dict(saved.scheduler), path, "scheduler"));
    }
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", e.what()));
  }
  if (state.loader != nullptr) state.loader->set_state(saved.sampler);
  if (state.sampler != nullptr) state.sampler->set_state(saved.sampler);
  if (state.step != nullptr) *state.step = saved.step;
  if (generator.same_world) {
    nn::thread_generator() = generator.generator;
  } else if (ctx.rank() == 0) {
    ctx.log().Warning("checkpoint {} was written by {} rank(s), this run has {}: generator "
                      "states are not restored (the run continues, not bit for bit)",
                      path, generator.saved_world, ctx.world_size());
  }
  return absl::OkStatus();
}

// One rank's load: every metadata entry is read and checked first, then the
// objects are loaded in order (model, optimizer, schedule, sampler, step,
// generator).
absl::Status LoadLocal(Context& ctx, const std::string& path, TrainingState& state,
                       const LoadOptions& options, const absl::StatusOr<nn::Checkpoint>& file) {
  RETURN_IF_ERROR(CheckPointers(state));
  RETURN_IF_ERROR(file.status());
  const nn::Checkpoint& ck = *file;
  RETURN_IF_ERROR(CheckFormatVersion(ck, path));
  ASSIGN_OR_RETURN(auto extra, ExtraEntries(ck, options, path));
  ASSIGN_OR_RETURN(const SavedGenerator generator, ReadGenerator(ctx, ck, options, path));
  SavedObjects saved;
  RETURN_IF_ERROR(ReadModelAndOptimizer(ck, state, path, saved));
  RETURN_IF_ERROR(ReadScheduleSamplerAndStep(ck, state, path, saved));
  RETURN_IF_ERROR(Apply(ctx, path, state, saved, generator));
  state.extra = std::move(extra);
  return absl::OkStatus();
}

// Test-only fault injection into the load of a job of several processes, read
// here and nowhere else: TANDEM_TEST_CHECKPOINT_LOAD_FAULT=<point>:<rank> makes
// global rank <rank> throw std::bad_alloc at <point>: read (rank 0 reading the
// file) or buffer (building the buffers that receive rank 0's bytes).
void InjectLoadFault(const char* point, int rank) {
  const char* fault = std::getenv("TANDEM_TEST_CHECKPOINT_LOAD_FAULT");
  if (fault != nullptr && absl::StrCat(point, ":", rank) == fault) throw std::bad_alloc();
}

// Runs `step` (this rank's local work between two collectives); an exception
// becomes the step's status, so the rank still reaches the next collective.
template <typename F>
absl::Status Guarded(const std::string& path, F&& step) {
  try {
    return step();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("checkpoint ", path, ": ", e.what()));
  }
}

// Every rank's outcome of one part of the load to every rank, in one
// all_gather (the same collective on every rank, whatever its outcome): per
// rank its status code, whether it is a peer's failure, and its message's first
// bytes. Returns this rank's own failure; else the first rank's own failure,
// as a peer failure that names the rank and quotes its cause; else this rank's
// status (OK, or a peer failure when no rank has its own).
constexpr int kOutcomeWords = 2 + 64;  // code, is-peer, 512 bytes of message

absl::Status AgreeOnOutcome(Context& ctx, const absl::Status& mine) {
  std::vector<int64_t> words(kOutcomeWords, 0);
  words[0] = static_cast<int64_t>(mine.code());
  words[1] = IsPeerFailure(mine) ? 1 : 0;
  const size_t text_bytes = (kOutcomeWords - 2) * sizeof(int64_t) - 1;  // NUL-terminated
  std::memcpy(&words[2], mine.message().data(), std::min(mine.message().size(), text_bytes));
  const nn::Tensor tensor = nn::from_vector<int64_t>(
      words, {kOutcomeWords}, {.dtype = nn::kInt64, .device = ctx.device()});
  const std::vector<int64_t> all = ctx.communicator().all_gather(tensor).to_vector<int64_t>();
  if (!mine.ok() && !IsPeerFailure(mine)) return mine;
  for (size_t r = 0; r * kOutcomeWords < all.size(); ++r) {
    const int64_t* theirs = &all[r * kOutcomeWords];
    if (theirs[0] == 0 || theirs[1] != 0) continue;
    return MarkPeerFailure(absl::Status(
        static_cast<absl::StatusCode>(theirs[0]),
        absl::StrCat("rank ", r, " could not load the checkpoint: ",
                     reinterpret_cast<const char*>(theirs + 2))));
  }
  return mine;
}

// Rank 0 reads the whole file into *bytes.
absl::Status ReadFileOnRankZero(Context& ctx, const std::string& path, std::string* bytes) {
  InjectLoadFault("read", ctx.rank());
  std::ifstream in(path, std::ios::binary);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (!in) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": cannot read it on host ",
                                            ctx.host(), ": ", std::strerror(errno)));
  }
  *bytes = buffer.str();
  return absl::OkStatus();
}

// The n bytes' tensor on the rank's device, rank 0's filled with `bytes`. The
// communicator works on the rank's device (a GPU's memory for NCCL), so the
// bytes are staged through a host tensor: the host never touches device memory.
nn::Tensor StageBytes(Context& ctx, const std::string& bytes, int64_t n) {
  InjectLoadFault("buffer", ctx.rank());
  nn::Tensor host = nn::empty({n}, {.dtype = nn::kUInt8, .device = nn::Device::CPU()});
  if (ctx.rank() == 0) std::memcpy(host.host_ptr(), bytes.data(), static_cast<size_t>(n));
  return host.to(ctx.device());
}

std::string UnstageBytes(const nn::Tensor& data, int64_t n) {
  const nn::Tensor received = data.to(nn::Device::CPU());
  return std::string(static_cast<const char*>(received.host_ptr()), static_cast<size_t>(n));
}

// Rank 0's `bytes` (n of them; every rank knows n) to every rank.
std::string BroadcastBytes(Context& ctx, const std::string& bytes, int64_t n) {
  if (n == 0) return std::string();
  nn::Tensor data = StageBytes(ctx, bytes, n);
  ctx.communicator().broadcast(data, 0);
  return UnstageBytes(data, n);
}

// Several processes: rank 0 reads the file, every rank parses rank 0's bytes.
// One process: every rank reads the file itself. Every rank takes the same
// collectives whatever fails where: rank 0's read outcome and the size
// (broadcast), every rank's buffers' outcome (AgreeOnOutcome), then the bytes.
// What fails after the last collective (the copy back, the parse) is this
// rank's error, which LoadTrainingCheckpoint's agreement shares.
absl::StatusOr<nn::Checkpoint> ReadCheckpoint(Context& ctx, const std::string& path) {
  if (ctx.process_count() == 1) return nn::LoadCheckpoint(path);
  std::string bytes;
  absl::Status status;
  if (ctx.rank() == 0) status = Guarded(path, [&] { return ReadFileOnRankZero(ctx, path, &bytes); });
  nn::Tensor header = nn::from_vector<int64_t>(
      {static_cast<int64_t>(status.code()), static_cast<int64_t>(bytes.size())}, {2},
      {.dtype = nn::kInt64, .device = ctx.device()});
  ctx.communicator().broadcast(header, 0);
  const std::vector<int64_t> h = header.to_vector<int64_t>();
  if (h[0] != 0) {
    if (ctx.rank() == 0) return status;
    return MarkPeerFailure(absl::Status(static_cast<absl::StatusCode>(h[0]),
                                        absl::StrCat("checkpoint ", path,
                                                     ": rank 0 could not read it")));
  }
  const int64_t n = h[1];
  if (n == 0) return nn::ParseCheckpoint(std::string(), path);
  nn::Tensor data;
  RETURN_IF_ERROR(AgreeOnOutcome(ctx, Guarded(path, [&] {
                                   data = StageBytes(ctx, bytes, n);
                                   return absl::OkStatus();
                                 })));
  bytes.clear();
  ctx.communicator().broadcast(data, 0);
  return nn::ParseCheckpoint(UnstageBytes(data, n), path);
}

}  // namespace

void PutOptimizerEntries(const optim::StateDict& state, nn::Checkpoint& checkpoint) {
  for (const auto& [name, tensor] : state.tensors) checkpoint.tensors["optim." + name] = tensor;
  for (const auto& [key, value] : state.scalars) checkpoint.metadata["optim." + key] = value;
}

absl::StatusOr<optim::StateDict> OptimizerEntriesOf(const nn::Checkpoint& checkpoint,
                                                    const std::string& path) {
  if (!checkpoint.metadata.contains("optim.num_groups")) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path,
                                            ": missing entry \"optim.num_groups\" (saved "
                                            "without an optimizer)"));
  }
  optim::StateDict state;
  for (const auto& [name, tensor] : checkpoint.tensors) {
    if (absl::StartsWith(name, "optim.")) state.tensors.emplace_back(name.substr(6), tensor);
  }
  for (const auto& [key, value] : checkpoint.metadata) {
    if (!absl::StartsWith(key, "optim.")) continue;
    ASSIGN_OR_RETURN(state.scalars[key.substr(6)], Entry<double>(checkpoint, key, path));
  }
  return state;
}

std::string BroadcastString(Context& ctx, const std::string& value) {
  Communicator& comm = ctx.communicator();
  nn::Tensor size = nn::from_vector<int64_t>({static_cast<int64_t>(value.size())}, {1},
                                             {.dtype = nn::kInt64, .device = ctx.device()});
  comm.broadcast(size, 0);
  return BroadcastBytes(ctx, value, size.to_vector<int64_t>()[0]);
}

absl::Status SaveTrainingCheckpoint(Context& ctx, const std::string& path,
                                    const TrainingState& state) {
  Communicator& comm = ctx.communicator();
  const nn::Tensor mine = nn::from_vector<int64_t>(GeneratorWords(), {3},
                                                   {.dtype = nn::kInt64, .device = ctx.device()});
  const std::vector<int64_t> generators = comm.all_gather(mine).to_vector<int64_t>();
  absl::Status status;
  if (ctx.rank() == 0) {
    try {
      status = Write(path, state, ctx.world_size(), generators);
    } catch (const std::exception& e) {  // never leave the other ranks in the broadcast
      status = absl::InternalError(absl::StrCat("checkpoint ", path, ": ", e.what()));
    }
  }
  // Rank 0's outcome to every rank; no rank passes this before the file is
  // complete (rank 0 enters the broadcast after its write).
  nn::Tensor code = nn::from_vector<int64_t>({static_cast<int64_t>(status.code())}, {1},
                                             {.dtype = nn::kInt64, .device = ctx.device()});
  comm.broadcast(code, 0);
  const auto root_code = static_cast<absl::StatusCode>(code.to_vector<int64_t>()[0]);
  if (ctx.rank() == 0 || root_code == absl::StatusCode::kOk) return status;
  return MarkPeerFailure(absl::Status(root_code,
                                      absl::StrCat("checkpoint ", path,
                                                   ": rank 0 could not write it (rank 0's error "
                                                   "names the cause)")));
}

absl::StatusOr<std::string> SnapshotTrainingCheckpoint(Context& ctx, const std::string& path,
                                                       const TrainingState& state) {
  const nn::Tensor mine = nn::from_vector<int64_t>(GeneratorWords(), {3},
                                                   {.dtype = nn::kInt64, .device = ctx.device()});
  const std::vector<int64_t> generators = ctx.communicator().all_gather(mine).to_vector<int64_t>();
  if (ctx.rank() != 0) return std::string();
  try {
    ASSIGN_OR_RETURN(const nn::Checkpoint ck, Build(path, state, ctx.world_size(), generators));
    return nn::SerializeCheckpoint(ck);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("checkpoint ", path, ": ", e.what()));
  }
}

absl::Status LoadTrainingCheckpoint(Context& ctx, const std::string& path, TrainingState& state,
                                    const LoadOptions& options) {
  absl::Status status;
  try {
    status = LoadLocal(ctx, path, state, options, ReadCheckpoint(ctx, path));
  } catch (const std::exception& e) {
    status = absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", e.what()));
  }
  // Every rank learns every rank's outcome, so all go on or all stop, and every
  // rank's error quotes the cause (a rank 0 that could not read the file included).
  return AgreeOnOutcome(ctx, status);
}

// --- In-memory snapshots for restarts ------------------------------------------
namespace {

std::string SnapshotName(const Context& ctx, int64_t step) {
  return absl::StrCat("snapshot of step ", step, " (rank ", ctx.rank(), ")");
}

// The bytes a snapshot of `state` takes, about (its tensors).
int64_t TensorBytes(const TrainingState& state) {
  int64_t bytes = 0;
  if (state.model != nullptr) {
    for (const auto& [name, tensor] : state.model->state_dict()) bytes += tensor.nbytes();
  }
  if (state.optimizer != nullptr) {
    for (const auto& [name, tensor] : state.optimizer->state_dict().tensors) bytes += tensor.nbytes();
  }
  return bytes;
}

}  // namespace

absl::Status SaveSnapshot(Context& ctx, const TrainingState& state) {
  SnapshotStore* store = ctx.attempt_info().snapshots;
  if (store == nullptr) return absl::OkStatus();  // the run cannot restart: nothing to keep
  if (state.step == nullptr) {
    return absl::InvalidArgumentError(
        "SaveSnapshot: TrainingState::step is null (a snapshot is the state at a step)");
  }
  const std::string name = SnapshotName(ctx, *state.step);
  // This rank's generator only, in its row of the file's table.
  std::vector<int64_t> generators(3 * static_cast<size_t>(ctx.world_size()), 0);
  const std::vector<int64_t> mine = GeneratorWords();
  std::copy(mine.begin(), mine.end(), generators.begin() + 3 * ctx.rank());
  std::string bytes;
  try {
    ASSIGN_OR_RETURN(const nn::Checkpoint ck, Build(name, state, ctx.world_size(), generators));
    bytes = nn::SerializeCheckpoint(ck);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name, ": about ", TensorBytes(state), " bytes could not be allocated in host memory"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(name, ": ", e.what()));
  }
  return store->Put(ctx.local_rank(), *state.step, std::move(bytes));
}

absl::StatusOr<bool> RestoreSnapshot(Context& ctx, TrainingState& state) {
  const AttemptInfo& info = ctx.attempt_info();
  if (info.snapshots == nullptr || !info.resume_step.has_value()) return false;
  const std::string name = SnapshotName(ctx, *info.resume_step);
  const std::shared_ptr<const std::string> bytes =
      info.snapshots->Get(ctx.local_rank(), *info.resume_step);
  if (bytes == nullptr) {
    return absl::InternalError(absl::StrCat(name, ": not in the run's snapshots"));
  }
  absl::Status status;
  try {
    // After a world shrink the snapshot is another world's: no generator.
    status = LoadLocal(ctx, name, state, {.require_same_world_size = !info.world_shrunk},
                       nn::ParseCheckpoint(*bytes, name));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(name, ": ", e.what()));
  }
  RETURN_IF_ERROR(status);
  return true;
}

}  // namespace tandem::dist
