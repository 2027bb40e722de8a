// GoogleTest assertions over tandem::testing (target tandem::testing_gtest,
// which needs GoogleTest; tandem::testing does not):
//
//   EXPECT_TRUE(tandem::testing::IsOk(status));
//   EXPECT_TRUE(tandem::testing::StatusIs(status, absl::StatusCode::kDeadlineExceeded,
//                                         "rank 1 (cpu)"));
//   EXPECT_TRUE(tandem::testing::EquivalentToOneRank(Train, {.ranks = 2}));
//
// Each returns ::testing::AssertionResult: on failure its message says what was
// expected and what came (the status; the first difference between the runs).
#ifndef TANDEM_TESTING_GTEST_ASSERTIONS_H_
#define TANDEM_TESTING_GTEST_ASSERTIONS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "testing/equivalence.h"
#include "testing/run.h"

namespace tandem::testing {

// Success when `status` is OK.
::testing::AssertionResult IsOk(const absl::Status& status);
// Success when `status` has `code` and its message contains `substring`.
::testing::AssertionResult StatusIs(const absl::Status& status, absl::StatusCode code,
                                    absl::string_view substring = "");
// CheckEquivalence(fn, options) as an assertion.
::testing::AssertionResult EquivalentToOneRank(const TrainingFunction& fn,
                                               const EquivalenceOptions& options = {});

}  // namespace tandem::testing

#endif  // TANDEM_TESTING_GTEST_ASSERTIONS_H_
