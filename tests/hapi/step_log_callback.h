// A hapi callback that reports each training step (its loss and the network's
// parameters) to a tandem::testing StepLog, where a planned fault fires; a
// StepLog error is thrown on the rank.
#ifndef TANDEM_TESTS_HAPI_STEP_LOG_CALLBACK_H_
#define TANDEM_TESTS_HAPI_STEP_LOG_CALLBACK_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "hapi/callbacks.h"
#include "nn/error.h"
#include "testing/run.h"

namespace tandem::testing {

struct StepLogCallback : hapi::Callback {
  explicit StepLogCallback(StepLog* log) : log(log) {}
  std::string name() const override { return "Report"; }
  void on_train_batch_end(hapi::RunState& s) override {
    absl::Status st = log->EndStep(s.batch_loss.item(), *s.network);
    if (!st.ok()) throw Error(std::string(st.message()));
  }
  StepLog* log;
};

// FitOptions::callbacks' entry for a StepLogCallback on `log`.
inline hapi::CallbackFactory StepLogReport(StepLog* log) {
  return [log] { return std::make_unique<StepLogCallback>(log); };
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_HAPI_STEP_LOG_CALLBACK_H_
