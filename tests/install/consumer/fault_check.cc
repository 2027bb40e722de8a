// fault_check: a program of an outside project that uses tandem::testing
// without GoogleTest (tests/install/CMakeLists.txt builds consumer/ with
// GoogleTest's find disabled, so the core package must not need it). Rank 1
// of two throws at step 1 of a small training loop; the run must fail naming
// rank 1 and the message, and a clean run must pass. Exits 0 when both hold.
#include <cstdio>
#include <string>

#include "nn/nn.h"
#include "nn/status_macros.h"
#include "spawn/spawn.h"
#include "testing/testing.h"

namespace {

namespace nn = ::tandem::nn;
namespace dist = ::tandem::dist;
namespace tt = ::tandem::testing;

absl::Status Train(dist::Context& ctx, tt::StepLog& log) {
  nn::Linear net(3, 1);
  dist::DataParallel dp(*net, ctx);
  for (int step = 0; step < 3; ++step) {
    nn::Tensor loss = nn::mse_loss(dp(nn::ones({2, 3})), nn::zeros({2, 1}));
    loss.backward();
    RETURN_IF_ERROR(log.EndStep(loss, *net));
  }
  return absl::OkStatus();
}

}  // namespace

int main() {
  absl::Status clean = tt::RunRanks(Train, {.ranks = 2});
  tt::RunOptions faulty{.ranks = 2,
                        .faults = {{.action = tt::FaultAction::kThrow,
                                    .rank = 1,
                                    .step = 1,
                                    .error = absl::InternalError("injected: disk full")}}};
  absl::Status failed = tt::RunRanks(Train, faulty);
  const bool ok = clean.ok() && failed.code() == absl::StatusCode::kInternal &&
                  std::string(failed.message()).find("rank 1 (cpu) threw: injected: disk full") !=
                      std::string::npos;
  std::printf("fault_check: clean run: %s; faulty run: %s\n", clean.ToString().c_str(),
              failed.ToString().c_str());
  std::printf("fault_check: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
