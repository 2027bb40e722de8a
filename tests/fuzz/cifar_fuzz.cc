// libFuzzer target: the CIFAR-10 binary batch parser must return a status for
// any input, never crash or read out of bounds.
#include <cstddef>
#include <cstdint>

#include "data/readers.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<tandem::data::TensorDataset> ds = tandem::data::ParseCifar10(bytes, "fuzz.bin");
  tandem::fuzz::AbortUnlessOneLinePrintable(ds);
  if (ds.ok() && ds->size() > 0) (void)ds->get(ds->size() - 1);
  return 0;
}
