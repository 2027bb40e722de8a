// What the hapi tests share besides their data (classification.h): CPU ranks
// with the tests' spawn options, an Adam factory, a status message check.
#ifndef TANDEM_TESTS_HAPI_HAPI_TEST_UTIL_H_
#define TANDEM_TESTS_HAPI_HAPI_TEST_UTIL_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "hapi/model.h"
#include "optim/adam.h"
#include "testing/run.h"

namespace tandem::hapi::test {

// `ranks` CPU ranks (gpus "cpu") under tandem::testing's spawn options.
inline LaunchOptions Cpu(int ranks) {
  return {.gpus = "cpu", .nprocs = ranks, .spawn = tandem::testing::DefaultTestSpawnOptions()};
}

// Adam with lr 1e-2.
inline OptimizerFactory AdamFactory() {
  return [](std::vector<nn::Tensor> params) {
    return std::make_unique<optim::Adam>(std::move(params), optim::AdamOptions{.lr = 1e-2});
  };
}

// Whether `s`'s message contains `part`.
inline bool Contains(const absl::Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

}  // namespace tandem::hapi::test

#endif  // TANDEM_TESTS_HAPI_HAPI_TEST_UTIL_H_
