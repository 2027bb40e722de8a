#include "spawn/comm/mpi/process_transport.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tandem::dist::internal {
namespace {

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string();
}

// "name=value" evidence for the first (size, rank) variable pair present.
LauncherEnv FromPair(const char* size_var, const char* rank_var) {
  LauncherEnv env;
  const std::string size = Env(size_var);
  int parsed = 0;
  if (size.empty() || !absl::SimpleAtoi(size, &parsed) || parsed < 1) return env;
  env.size = parsed;
  int rank = 0;
  if (absl::SimpleAtoi(Env(rank_var), &rank) && rank >= 0) env.rank = rank;
  env.evidence = absl::StrCat(size_var, "=", size, " ", rank_var, "=", Env(rank_var));
  return env;
}

}  // namespace

LauncherEnv DetectLauncher() {
  for (const auto& [size_var, rank_var] :
       {std::pair{"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
        std::pair{"PMIX_SIZE", "PMIX_RANK"}, std::pair{"PMI_SIZE", "PMI_RANK"},
        std::pair{"SLURM_STEP_NUM_TASKS", "SLURM_PROCID"}}) {
    LauncherEnv env = FromPair(size_var, rank_var);
    if (!env.evidence.empty()) return env;
  }
  return {};
}

}  // namespace tandem::dist::internal
