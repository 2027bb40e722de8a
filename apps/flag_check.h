// FindBadFlag: checks a command line against the flags the program defines before
// absl::ParseCommandLine sees it, so that an unknown flag or a value its type cannot
// hold gets the programs' one-line error and exit status 2 (Abseil's parser prints
// its own report and exits 1).
#ifndef TANDEM_APPS_FLAG_CHECK_H_
#define TANDEM_APPS_FLAG_CHECK_H_

#include <optional>
#include <string>

namespace tandem::apps {

// The first problem on the command line, as one line ("unknown flag --epoch (see
// --help)", "--epochs=x: ..."), or nullopt. Abseil's built-in flags (--help,
// --flagfile, ...), names listed in --undefok, the contents of a --flagfile and
// everything after a bare "--" are left to Abseil (which exits 1 on their errors).
// Checking a value parses it into the flag, which absl::ParseCommandLine then
// sets again.
std::optional<std::string> FindBadFlag(int argc, char** argv);

}  // namespace tandem::apps

#endif  // TANDEM_APPS_FLAG_CHECK_H_
