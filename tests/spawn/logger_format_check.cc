// Compiled, not run, by the ctests spawn_logger_format_compiles and
// spawn_logger_bad_format_does_not_compile: a literal format that fmt rejects
// ("{:q}" has no meaning for an int) must stop the build, and the same file
// without it must compile, so that the first test fails for that reason alone.
// The bad call must stay on line 13: the test looks for the compiler's report of it.
#include "spawn/logger.h"

namespace tandem::dist {

void LogStep(const RankLogger& log, int step, double loss) {
  log.Info("step:{} loss:{:.6f}", step, loss);
#ifdef TANDEM_BAD_FORMAT
  log.Info("step:{:q}", step);
#endif
}

}  // namespace tandem::dist
