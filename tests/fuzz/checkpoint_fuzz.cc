// libFuzzer target: ParseCheckpoint must reject any malformed input with a status.
#include <cstddef>
#include <cstdint>
#include <string>

#include "nn/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)tandem::nn::ParseCheckpoint(std::string(reinterpret_cast<const char*>(data), size), "fuzz.ckpt");
  return 0;
}
