// The test-only flags of the training programs (defined in apps/test_hooks.cc):
// hooks through which tests/apps/ make one rank slow or fail once, or a
// checkpoint write long. --help and --helpshort leave them out (SetUpHelp); --helpfull lists
// them. ParseFlagsOrExit copies them into RunFlags.
#ifndef TANDEM_APPS_TEST_HOOKS_H_
#define TANDEM_APPS_TEST_HOOKS_H_

#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, test_slow_rank);
ABSL_DECLARE_FLAG(std::string, test_fail_at);
ABSL_DECLARE_FLAG(double, test_checkpoint_write_delay_ms);

#endif  // TANDEM_APPS_TEST_HOOKS_H_
