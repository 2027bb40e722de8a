// safetensors files: the weight format PyTorch, Hugging Face and most inference
// servers exchange, so that a tandem model's weights load elsewhere and weights
// trained elsewhere start a tandem run.
//
// File layout (little-endian):
//   header_bytes u64 | header: header_bytes of UTF-8 JSON | data
//   header: {"__metadata__": {"key": "value", ...},           (optional, strings)
//            "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//            ...}
//   data: each tensor's elements, row-major, at [begin, end) of the data part;
//         the tensors cover the data part exactly, without gaps or overlaps.
// dtypes: "F32", "F64", "BF16", "F16", "I64", "U8" (kFloat32, kFloat64,
// kBFloat16, kFloat16, kInt64, kUInt8); a file with another dtype ("I32",
// "BOOL", "F8_E4M3", ...) is refused naming it. Names are the state-dict names
// (Module::state_dict(): parameters and buffers, "features.0.1.running_mean"),
// which for the models of apps/models.h are torchvision's, so that
// `model.load_state_dict(...)` in PyTorch takes a file SaveSafetensors wrote.
//
// Writing is atomic, as SaveCheckpoint's (nn/checkpoint.h): a temporary file in
// the target's directory, fsync, rename over the target, fsync of the directory;
// tensors are streamed to it one at a time. Reading maps the file (mmap) and
// copies each tensor from the mapping into its destination, so a large file is
// not held twice in memory.
//
// Errors are absl::Status naming the file and the problem (a tensor, its dtype,
// shape or offsets; the JSON parser's message and byte position), never a crash,
// for any file (tests/fuzz/safetensors_fuzz.cc).
//
// Thread-safety: free functions; a module is loaded on the thread that owns it.
#ifndef TANDEM_NN_SAFETENSORS_H_
#define TANDEM_NN_SAFETENSORS_H_

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nn/module.h"
#include "nn/tensor.h"

namespace tandem::nn {

// The "__metadata__" entry: free-form string pairs.
using SafetensorsMetadata = std::map<std::string, std::string>;

// Writes `state` (names unique, none "__metadata__"; every tensor defined, on
// any device: copied to the host one at a time) and `metadata` to `path`.
// Errors name the path and the tensor or system call.
absl::Status SaveSafetensors(const std::string& path, const StateDict& state,
                             const SafetensorsMetadata& metadata = {});
// The module's state_dict(): its parameters and buffers under PyTorch's names.
absl::Status SaveSafetensors(const std::string& path, const Module& module,
                             const SafetensorsMetadata& metadata = {});

// A whole file, read into host tensors (in the order of their data offsets).
struct SafetensorsFile {
  StateDict tensors;
  SafetensorsMetadata metadata;
};
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);
// The same for bytes in memory; `name` (usually the path) is used in errors.
absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes, const std::string& name);

struct SafetensorsLoadOptions {
  // true: every parameter and buffer of the module must be in the file with
  // its shape and dtype, and the file must hold nothing else; otherwise nothing
  // is loaded and the error lists every mismatch at once. false: what matches
  // is loaded and the rest is listed in the report.
  bool strict = true;
  // Converts between floating dtypes (a float16 or bfloat16 file into float32
  // parameters, say) instead of calling a dtype difference a mismatch.
  bool convert_floating = false;
};

// What LoadSafetensors did: names in the module's state-dict order, then the
// file's order for `unexpected`.
struct SafetensorsLoadReport {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     // in the module, not in the file
  std::vector<std::string> unexpected;  // in the file, not in the module
  // In both with another shape or dtype: "name: float32(10, 84) in the module,
  // float32(10, 80) in the file".
  std::vector<std::string> mismatched;
  SafetensorsMetadata metadata;
};

// Copies the file's tensors into the module's parameters and buffers (on their
// devices, in place: optimizers holding them see the new values). With strict,
// any mismatch is InvalidArgument naming the file and listing every missing,
// unexpected and mismatched name, and the module is unchanged. A malformed
// file is DataLoss; an unreadable one NotFound / Internal.
absl::StatusOr<SafetensorsLoadReport> LoadSafetensors(const std::string& path, Module& module,
                                                      const SafetensorsLoadOptions& options = {});

// The file format's dtype name ("F32") of `dtype`, and back (false for a name
// tandem has no dtype for).
const char* SafetensorsDTypeName(DType dtype);
bool SafetensorsDTypeFromName(std::string_view name, DType& dtype);

}  // namespace tandem::nn

#endif  // TANDEM_NN_SAFETENSORS_H_
