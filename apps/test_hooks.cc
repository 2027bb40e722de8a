// The test-only flags (see test_hooks.h). SetUpHelp (apps/flag_check.cc) keeps
// this file's flags out of --help by its path.
#include "apps/test_hooks.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, test_slow_rank, "",
          "For tests only: R:MS makes rank R sleep MS milliseconds in every training step of "
          "train_mnist and train_cifar10 (a straggler, or a collective that waits past "
          "--timeout_s). Empty: off.");
ABSL_FLAG(std::string, test_fail_at, "",
          "For tests only: R:S makes rank R of train_mnist and train_cifar10 throw after global "
          "step S on the run's first attempt only (a failure that --max_restarts restarts). "
          "Empty: off.");
ABSL_FLAG(double, test_checkpoint_write_delay_ms, 0,
          "For tests only: the checkpoint writer thread sleeps this many milliseconds before "
          "each write (a stop while a write is in flight). 0: off.");
