#include "apps/flag_check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace tandem::apps {
namespace {

// Flags Abseil itself handles (usage and flag files).
bool IsAbseilBuiltin(absl::string_view name) {
  constexpr std::array<absl::string_view, 10> kBuiltins = {
      "help", "helpfull", "helpshort", "helppackage", "helpmatch",
      "version", "only_check_args", "flagfile", "fromenv", "tryfromenv"};
  for (absl::string_view b : kBuiltins) {
    if (name == b) return true;
  }
  return name == "undefok";
}

// The names that --undefok=a,b lets pass undefined (Abseil lets them pass too).
std::vector<std::string> UndefOkNames(int argc, char** argv) {
  std::vector<std::string> undefok;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    for (absl::string_view prefix : {"--undefok=", "-undefok="}) {
      if (absl::StartsWith(arg, prefix)) {
        for (absl::string_view name : absl::StrSplit(arg.substr(prefix.size()), ',')) {
          undefok.emplace_back(name);
        }
      }
    }
  }
  return undefok;
}

// Whether `name`, or `name` less a "no" prefix, is one of `undefok`.
bool AllowedUndefined(const std::vector<std::string>& undefok, absl::string_view name) {
  for (const std::string& ok : undefok) {
    if (name == ok || (absl::StartsWith(name, "no") && name.substr(2) == ok)) return true;
  }
  return false;
}

// The problem with `arg`, whose flag `name` is not defined: nullopt for --noX
// of a bool flag X without a value and for a name --undefok lists.
std::optional<std::string> CheckUndefined(absl::string_view arg, absl::string_view name,
                                          bool has_value,
                                          const std::vector<std::string>& undefok) {
  if (absl::StartsWith(name, "no")) {
    absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
    if (negated != nullptr && negated->IsOfType<bool>()) {
      if (has_value) return absl::StrCat("--", name, " takes no value (got \"", arg, "\")");
      return std::nullopt;
    }
  }
  if (AllowedUndefined(undefok, name)) return std::nullopt;
  if (std::optional<std::string> near = NearestFlag(name)) {
    return absl::StrCat("unknown flag --", name, "; did you mean --", *near, "? (see --help)");
  }
  return absl::StrCat("unknown flag --", name, " (see --help)");
}

// The problem with the value of the defined `flag` (`value` from "--name=value",
// nullopt without "="), or nullopt. "--name value" takes argv[i + 1] and
// advances i past it.
std::optional<std::string> CheckValue(absl::CommandLineFlag& flag, absl::string_view name,
                                      std::optional<absl::string_view> value, int& i, int argc,
                                      char** argv) {
  std::string text;
  if (value.has_value()) {
    text = std::string(*value);
  } else if (flag.IsOfType<bool>()) {
    return std::nullopt;  // --flag alone sets a bool
  } else if (i + 1 < argc) {
    text = argv[++i];  // "--flag value"
  } else {
    return absl::StrCat("--", name, " needs a value (--", name, "=...)");
  }
  std::string error;
  if (!flag.ParseFrom(text, &error)) return absl::StrCat("--", name, "=", text, ": ", error);
  return std::nullopt;
}

}  // namespace

std::optional<std::string> FindBadFlag(int argc, char** argv) {
  const std::vector<std::string> undefok = UndefOkNames(argc, argv);
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional: the caller reports it
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    const size_t eq = body.find('=');
    const absl::string_view name = body.substr(0, eq);
    if (IsAbseilBuiltin(name)) continue;
    std::optional<absl::string_view> value;
    if (eq != absl::string_view::npos) value = body.substr(eq + 1);
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    std::optional<std::string> problem =
        flag == nullptr ? CheckUndefined(arg, name, value.has_value(), undefok)
                        : CheckValue(*flag, name, value, i, argc, argv);
    if (problem.has_value()) return problem;
  }
  return std::nullopt;
}

std::optional<std::string> CheckTimeout(double seconds) {
  if (seconds > 0 && std::isfinite(seconds)) return std::nullopt;
  return absl::StrCat("--timeout_s ", seconds, ": must be a positive, finite number of seconds");
}

namespace {

// The part of a flag's source path from its "apps/" or "bench/" folder on
// ("apps/common.cc", "bench/comm_bench.cc"), or "" for a file outside both
// (Abseil's own flags).
absl::string_view AppsPath(absl::string_view file) {
  for (absl::string_view folder : {"apps/", "bench/"}) {
    if (absl::StartsWith(file, folder)) return file;
    const size_t at = file.rfind(absl::StrCat("/", folder));
    if (at != absl::string_view::npos) return file.substr(at + 1);
  }
  return absl::string_view();
}

// The test-only flags' file (apps/test_hooks.cc) and the heading --helpfull
// lists them under; --help and --helpshort leave them out.
constexpr absl::string_view kTestHooksFile = "apps/test_hooks.cc";
constexpr absl::string_view kTestHooksHeading = "tests only (not in --help)";

}  // namespace

void SetUpHelp(absl::string_view program, absl::string_view description,
               absl::string_view epilogue) {
  absl::FlagsUsageConfig config;
  // Abseil prints "Flags from <name>:" above each source file's flags, the name
  // being the file's build path: meaningless to a reader, and different on every
  // machine. The program's own flags are headed by its name, the shared ones
  // (apps/common.cc) say so; "train_mnist" sorts before "train_mnist, ..."
  // (Abseil orders the headings by name).
  config.normalize_filename = [program = std::string(program)](absl::string_view file) {
    const absl::string_view apps = AppsPath(file);
    if (apps == kTestHooksFile) return std::string(kTestHooksHeading);
    if (apps.empty() || absl::StartsWith(file, program)) return std::string(file);
    if (apps == "apps/common.cc") {
      return absl::StrCat(program, ", common to every tandem training program");
    }
    return program;
  };
  // --help and --helpshort list the flags of apps/ and bench/ (the program's and
  // the shared ones), not Abseil's own nor the test-only ones (--helpfull lists every
  // flag). The filter may be handed the normalised name.
  config.contains_help_flags = [program = std::string(program)](absl::string_view file) {
    if (file == kTestHooksHeading || AppsPath(file) == kTestHooksFile) return false;
    return !AppsPath(file).empty() || absl::StartsWith(file, program);
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(
      epilogue.empty() ? std::string(description) : absl::StrCat(description, "\n\n", epilogue));
}

namespace {

// Levenshtein distance of a and b (flag names: short).
int EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<int> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int diagonal = row[0];
    row[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

}  // namespace

std::optional<std::string> NearestFlag(absl::string_view name) {
  constexpr int kMaxDistance = 2;
  int best = kMaxDistance + 1;
  std::vector<std::string> nearest;
  for (const auto& [flag_name, flag] : absl::GetAllFlags()) {
    // Filename() is what SetUpHelp's normalize_filename made of the path (a
    // heading such as "train_mnist"), or the path itself without SetUpHelp.
    const std::string file = flag->Filename();
    const absl::string_view path = AppsPath(file);
    if (file == kTestHooksHeading || path == kTestHooksFile) continue;  // test-only
    if (path.empty() && absl::StrContains(file, '/')) continue;  // Abseil's own
    const int distance = EditDistance(name, flag_name);
    if (distance < best) {
      best = distance;
      nearest.assign(1, std::string(flag_name));
    } else if (distance == best) {
      nearest.emplace_back(flag_name);
    }
  }
  if (nearest.size() != 1) return std::nullopt;  // none near, or no single nearest
  return nearest.front();
}

std::vector<char*> ParseCommandLineOrExit(absl::string_view program, int argc, char** argv) {
  // Abseil's parser exits 1 after --help; a help asked for is no failure.
  absl::flags_internal::SetProgramInvocationName(argv[0]);  // --help's first word
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    const size_t eq = body.find('=');
    const absl::string_view value = eq == absl::string_view::npos ? "" : body.substr(eq + 1);
    const absl::string_view name = body.substr(0, eq);
    if (name == "only_check_args") continue;  // not a help: left to Abseil
    help |= absl::flags_internal::DeduceUsageFlags(name, value);
  }
  if (help) {
    absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage());
    std::cout.flush();
    std::exit(0);
  }
  if (std::optional<std::string> bad = FindBadFlag(argc, argv)) {
    std::cerr << program << ": error: " << *bad << "\n";
    std::exit(2);
  }
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace tandem::apps
