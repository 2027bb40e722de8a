// FindBadFlag: checks a command line against the flags the program defines before
// absl::ParseCommandLine sees it, so that an unknown flag or a value its type cannot
// hold gets the programs' one-line error and exit status 2 (Abseil's parser prints
// its own report and exits 1).
// SetUpHelp: the --help text of the programs (their description, then their
// flags under headings without build paths).
// ParseCommandLineOrExit: how every program reads its command line (help, then
// the check above, then Abseil's parser).
// kTimeoutHelp / CheckTimeout: the --timeout_s flag of every program that runs
// dist::spawn.
#ifndef TANDEM_APPS_FLAG_CHECK_H_
#define TANDEM_APPS_FLAG_CHECK_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace tandem::apps {

// The help text of --timeout_s (SpawnOptions::timeout_s). Each program defines
// the flag itself (ABSL_FLAG(double, timeout_s, <default>, kTimeoutHelp)) and
// checks it with CheckTimeout.
inline constexpr char kTimeoutHelp[] =
    "Watchdog limit in seconds (positive). A collective (gradient all-reduce, broadcast, "
    "barrier, a checkpoint's exchange) not completed this long after a rank entered it ends "
    "the run (exit status 1, one line naming each rank's last collective), so a hung, killed "
    "or stopped rank or process ends the job instead of hanging it. Raise it when one rank "
    "can legitimately keep the others waiting that long (a long evaluation or checkpoint "
    "write on rank 0). After a stop (a failure, Ctrl-C, a stop signal) spawn waits for every "
    "rank to return; this long after the stop it names the ranks it still waits for (a "
    "second Ctrl-C exits at once). Every process of an mpirun/srun job must give the same "
    "value.";

// nullopt when `seconds` is a usable --timeout_s (positive and finite), else
// the one-line error naming the value: "--timeout_s 0: must be ...".
std::optional<std::string> CheckTimeout(double seconds);

// Sets what --help prints: `description` (what the program does in its own
// words, then a usage line), the text of `epilogue` when not empty (exit
// statuses), and the flags defined under apps/ and bench/, grouped under
// headings that name the program's own flags and the flags every training
// program shares instead of the source files' build paths. Call before
// absl::ParseCommandLine.
void SetUpHelp(absl::string_view program, absl::string_view description,
               absl::string_view epilogue = "");

// The first problem on the command line, as one line ("unknown flag --epoch (see
// --help)", "--epochs=x: ..."), or nullopt. Abseil's built-in flags (--help,
// --flagfile, ...), names listed in --undefok, the contents of a --flagfile and
// everything after a bare "--" are left to Abseil (which exits 1 on their errors).
// Checking a value parses it into the flag, which absl::ParseCommandLine then
// sets again.
std::optional<std::string> FindBadFlag(int argc, char** argv);

// The flag defined by the programs (apps/, bench/) nearest to `name` when exactly
// one is within edit distance 2 of it ("epoch" -> "epochs"), else nullopt.
std::optional<std::string> NearestFlag(absl::string_view name);

// Reads the command line the way every tandem program does, after SetUpHelp:
// --help (and --helpshort, --helpfull, --helpmatch=S, --helppackage, --version)
// prints to stdout and exits 0; the first bad flag (FindBadFlag) prints
// "<program>: error: <problem>" to stderr and exits 2; then Abseil sets the flags.
// Returns the positional arguments (argv[0] first) for the caller to check.
std::vector<char*> ParseCommandLineOrExit(absl::string_view program, int argc, char** argv);

}  // namespace tandem::apps

#endif  // TANDEM_APPS_FLAG_CHECK_H_
