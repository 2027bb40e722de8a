// tandem::testing_gtest: each assertion passes on the expected outcome and, on
// another, fails with a message that shows what came.
#include "testing/gtest/assertions.h"

#include "gtest/gtest.h"
#include "tests/testing/train_fixture.h"

namespace tandem::testing {
namespace {

TEST(AssertionsTest, IsOk) {
  EXPECT_TRUE(IsOk(absl::OkStatus()));
  ::testing::AssertionResult r = IsOk(absl::NotFoundError("no file x.bin"));
  EXPECT_FALSE(r);
  EXPECT_STREQ(r.message(), "expected OK, got NOT_FOUND: no file x.bin");
}

TEST(AssertionsTest, StatusIs) {
  const absl::Status s = absl::DeadlineExceededError("watchdog: rank 1 (cpu): last completed");
  EXPECT_TRUE(StatusIs(s, absl::StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(StatusIs(s, absl::StatusCode::kDeadlineExceeded, "rank 1 (cpu)"));
  ::testing::AssertionResult wrong_code = StatusIs(s, absl::StatusCode::kInternal);
  EXPECT_FALSE(wrong_code);
  EXPECT_NE(std::string(wrong_code.message()).find("expected INTERNAL, got DEADLINE_EXCEEDED"),
            std::string::npos)
      << wrong_code.message();
  ::testing::AssertionResult wrong_text =
      StatusIs(s, absl::StatusCode::kDeadlineExceeded, "rank 0");
  EXPECT_FALSE(wrong_text);
  EXPECT_NE(std::string(wrong_text.message()).find("containing \"rank 0\""), std::string::npos)
      << wrong_text.message();
}

TEST(AssertionsTest, EquivalentToOneRank) {
  EXPECT_TRUE(EquivalentToOneRank(TrainWith({}), {.ranks = 2}));
  ::testing::AssertionResult r = EquivalentToOneRank(
      TrainWith({.perturb_step = 1, .perturb_name = "l2.weight", .perturb_element = 3,
                 .perturb_by = 1e-2}),
      {.ranks = 2});
  EXPECT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("at step 1: parameter l2.weight[3] on rank 0"),
            std::string::npos)
      << r.message();
}

}  // namespace
}  // namespace tandem::testing
