// What every fuzz target asks of a rejected input's status: its message is one
// line of printable ASCII, whatever bytes the input held (names and strings from
// the file reach messages only through nn::Printable). Aborts, which libFuzzer
// reports with the input, otherwise.
#ifndef TANDEM_TESTS_FUZZ_FUZZ_CHECK_H_
#define TANDEM_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::fuzz {

inline void AbortUnlessOneLinePrintable(const absl::Status& status) {
  for (const char c : status.message()) {
    if (c < 0x20 || c > 0x7e) std::abort();  // a line break, a control or a non-ASCII byte
  }
}

template <typename T>
void AbortUnlessOneLinePrintable(const absl::StatusOr<T>& result) {
  AbortUnlessOneLinePrintable(result.status());
}

}  // namespace tandem::fuzz

#endif  // TANDEM_TESTS_FUZZ_FUZZ_CHECK_H_
