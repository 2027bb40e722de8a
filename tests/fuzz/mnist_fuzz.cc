// libFuzzer target: the IDX / MNIST buffer parsers (raw and gzip) must return a
// status for any input, never crash, read out of bounds or over-allocate.
#include <cstddef>
#include <cstdint>
#include <string>

#include "data/readers.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const char* bytes = reinterpret_cast<const char*>(data);
  const uint8_t mode = data[0];
  const absl::string_view rest(bytes + 3, size - 3);
  if (mode % 3 == 0) {
    tandem::fuzz::AbortUnlessOneLinePrintable(tandem::data::ParseIdx(rest, "fuzz.idx"));
  } else if (mode % 3 == 1) {
    // Split the rest into an images and a labels buffer.
    const size_t split = ((size_t{data[1]} << 8) | data[2]) % (rest.size() + 1);
    tandem::fuzz::AbortUnlessOneLinePrintable(
        tandem::data::ParseMnist(rest.substr(0, split), rest.substr(split), "images", "labels",
                                 /*as_float=*/(mode & 8) != 0));
  } else {
    tandem::fuzz::AbortUnlessOneLinePrintable(
        tandem::data::Gunzip(rest, int64_t{data[1]} * 256 + data[2], "fuzz.gz"));
  }
  return 0;
}
