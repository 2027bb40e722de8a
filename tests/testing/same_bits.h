// Exact comparison of two runs' records (testing/run.h): the restart tests'
// check that a run with a fault and restarts is the run without it.
#ifndef TANDEM_TESTS_TESTING_SAME_BITS_H_
#define TANDEM_TESTS_TESTING_SAME_BITS_H_

#include <cstddef>

#include "gtest/gtest.h"
#include "testing/run.h"

namespace tandem::testing {

// Every rank's losses and parameters at every step, exactly.
inline void ExpectSameLossesAndParameters(const RunReport& expected, const RunReport& actual) {
  ASSERT_EQ(expected.ranks.size(), actual.ranks.size());
  for (size_t r = 0; r < expected.ranks.size(); ++r) {
    const RankRecord& e = expected.ranks[r];
    const RankRecord& a = actual.ranks[r];
    ASSERT_EQ(a.losses.size(), e.losses.size()) << "rank " << r;
    for (size_t s = 0; s < e.losses.size(); ++s) {
      EXPECT_EQ(e.losses[s], a.losses[s]) << "rank " << r << " step " << s;
      ASSERT_EQ(e.parameters[s].size(), a.parameters[s].size());
      for (size_t p = 0; p < e.parameters[s].size(); ++p) {
        EXPECT_EQ(e.parameters[s][p].values, a.parameters[s][p].values)
            << "rank " << r << " step " << s << " " << e.parameters[s][p].name;
      }
    }
  }
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_SAME_BITS_H_
