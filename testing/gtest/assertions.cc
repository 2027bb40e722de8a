#include "testing/gtest/assertions.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::testing {

::testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected OK, got " << status.ToString();
}

::testing::AssertionResult StatusIs(const absl::Status& status, absl::StatusCode code,
                                    absl::string_view substring) {
  if (status.code() == code && status.message().find(substring) != absl::string_view::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "expected " << absl::StatusCodeToString(code)
         << (substring.empty() ? std::string() : absl::StrCat(" containing \"", substring, "\""))
         << ", got " << status.ToString();
}

::testing::AssertionResult EquivalentToOneRank(const TrainingFunction& fn,
                                               const EquivalenceOptions& options) {
  absl::Status status = CheckEquivalence(fn, options);
  if (status.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << status.message();
}

}  // namespace tandem::testing
