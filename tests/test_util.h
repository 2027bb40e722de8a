// Small helpers shared by the test files.
#ifndef TANDEM_TESTS_TEST_UTIL_H_
#define TANDEM_TESTS_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::testing {

// The message of the exception `f` throws, or "" when it throws none.
inline std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Bitwise equality of two float vectors (NaN-safe, -0 != +0); `what` names them.
inline void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                           const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << what << " element " << i << ": " << a[i] << " vs " << b[i];
  }
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TEST_UTIL_H_
