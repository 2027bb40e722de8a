// Checkpoints: a file of named tensors plus named string/int64/double metadata
// (model and optimizer state, step counters, sampler state).
//
// File layout (little-endian):
//   "TANDEMCK" | version u32 | payload_bytes u64 | crc32(payload) u32 | payload
//   payload: tensor_count u32, then per tensor
//              name_len u32, name, dtype u8, ndim u32, dims i64[ndim], nbytes u64, bytes
//              (dtype: nn::DType's value: 0 float32, 1 float64, 2 bfloat16, 3 int64,
//              4 uint8, 5 float16)
//            metadata_count u32, then per entry
//              key_len u32, key, kind u8 (0 string, 1 int64, 2 double), value
//              (string: len u32 + bytes; int64 / double: 8 bytes)
//
// Crash safety: SaveCheckpoint writes a temporary file in the target's directory,
// fsyncs it, renames it over the target and fsyncs the directory, so a reader
// (or a process restarted after a crash or SIGKILL at any instant) finds either
// the previous complete checkpoint or the new one, never a mix.
//
// Thread-safety: free functions; concurrent saves to the same path from one
// process are safe (distinct temporary files) and the last rename wins.
#ifndef TANDEM_NN_CHECKPOINT_H_
#define TANDEM_NN_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nn/tensor.h"

namespace tandem::nn {

inline constexpr char kCheckpointMagic[] = "TANDEMCK";  // 8 bytes in the file, no NUL
inline constexpr uint32_t kCheckpointVersion = 1;

using CheckpointValue = std::variant<std::string, int64_t, double>;

struct Checkpoint {
  // Saved from any device (copied to the host); loaded onto the CPU.
  std::map<std::string, Tensor> tensors;
  std::map<std::string, CheckpointValue> metadata;
};

// Serialises `checkpoint` (file layout above) into bytes. Throws tandem::Error
// on an undefined tensor.
std::string SerializeCheckpoint(const Checkpoint& checkpoint);

// Parses bytes produced by SerializeCheckpoint. `name` (usually the path) is
// used in error messages. Errors (InvalidArgument / DataLoss): wrong magic,
// unsupported version, truncated header or payload, checksum mismatch, bad
// dtype, shape that does not match the byte count, trailing bytes.
absl::StatusOr<Checkpoint> ParseCheckpoint(const std::string& bytes, const std::string& name);

// Writes `checkpoint` to `path` atomically (temporary file, fsync, rename, fsync
// of the directory). Errors name the path and the failing system call.
absl::Status SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint);

// The write half of SaveCheckpoint: `bytes` (from SerializeCheckpoint) to
// `path` with the same atomic protocol. Lets a caller serialise on one thread
// (a consistent snapshot) and write on another (dist::CheckpointManager).
absl::Status WriteCheckpointBytes(const std::string& path, const std::string& bytes);

// Reads and verifies a checkpoint; errors name the path and the problem.
absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path);

}  // namespace tandem::nn

#endif  // TANDEM_NN_CHECKPOINT_H_
