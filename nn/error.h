// Error policy of tandem (see docs/architecture.md, "Errors"):
//  - Graph code (tensors, ops, modules, optimizers) throws tandem::Error for
//    programming errors such as a shape or dtype mismatch. The message names the
//    op and the values involved.
//  - API edges that deal with the outside world (gpus strings, files,
//    checkpoints, spawn) return absl::Status / absl::StatusOr.
//  - spawn converts an exception escaping a rank's function into a Status that
//    names the rank.
//  - A name or string read from a file (a tensor name, a metadata key) is quoted
//    in a message through Printable(), so that a damaged file cannot put a line
//    break or terminal control bytes into the one-line error.
#ifndef TANDEM_NN_ERROR_H_
#define TANDEM_NN_ERROR_H_

#include <stdexcept>
#include <string>
#include <string_view>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace tandem {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// `text` as one line of printable ASCII for a message: C escapes for quotes,
// backslash, \n, \r, \t, and \xNN for every other byte outside printable ASCII
// (absl::CHexEscape). For names and strings taken from files.
inline std::string Printable(std::string_view text) {
  return absl::CHexEscape(absl::string_view(text.data(), text.size()));
}

// Throws tandem::Error with the pieces concatenated (absl::StrCat).
template <typename... Args>
[[noreturn]] void Fail(const Args&... args) {
  throw Error(absl::StrCat(args...));
}

}  // namespace tandem

// TANDEM_CHECK(cond, pieces...): throws tandem::Error("<pieces>") when cond is false.
#define TANDEM_CHECK(cond, ...)                 \
  do {                                          \
    if (!(cond)) ::tandem::Fail(__VA_ARGS__);   \
  } while (0)

#endif  // TANDEM_NN_ERROR_H_
