// libFuzzer target: ParseCheckpoint must reject any malformed input with a status
// whose message is one printable line.
#include <cstddef>
#include <cstdint>
#include <string>

#include "nn/checkpoint.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::fuzz::AbortUnlessOneLinePrintable(tandem::nn::ParseCheckpoint(
      std::string(reinterpret_cast<const char*>(data), size), "fuzz.ckpt"));
  return 0;
}
