// libFuzzer target: ParseSafetensors must reject any malformed input (header
// lengths, JSON, dtypes, shapes, offsets out of range, overlapping or missing
// bytes) with one DataLoss status naming the file, never crash or read out of
// bounds; and what it accepts must describe exactly the bytes it was given.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "absl/strings/string_view.h"

#include "nn/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<tandem::nn::SafetensorsFile> file =
      tandem::nn::ParseSafetensors(bytes, "fuzz.safetensors");
  if (!file.ok()) {
    // The contract of the errors: DataLoss, one printable line, naming the file first.
    tandem::fuzz::AbortUnlessOneLinePrintable(file.status());
    const absl::string_view message = file.status().message();
    if (file.status().code() != absl::StatusCode::kDataLoss ||
        message.substr(0, 29) != "safetensors fuzz.safetensors:" ||
        message.find('\n') != absl::string_view::npos) {
      std::abort();
    }
    return 0;
  }
  // Accepted: the tensors tile the data part exactly.
  uint64_t total = 0;
  for (const auto& [name, t] : file->tensors) total += static_cast<uint64_t>(t.nbytes());
  uint64_t header = 0;
  for (int i = 0; i < 8; ++i) header |= static_cast<uint64_t>(data[i]) << (8 * i);
  if (8 + header + total != size) std::abort();
  return 0;
}
