#include "apps/flag_check.h"

#include <array>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
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

}  // namespace

std::optional<std::string> FindBadFlag(int argc, char** argv) {
  // --undefok=a,b: names Abseil lets pass undefined; they pass here too.
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
  auto allowed_undefined = [&](absl::string_view name) {
    for (const std::string& ok : undefok) {
      if (name == ok || (absl::StartsWith(name, "no") && name.substr(2) == ok)) return true;
    }
    return false;
  };
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional: the caller reports it
    absl::string_view body = arg.substr(arg[1] == '-' ? 2 : 1);
    const size_t eq = body.find('=');
    const absl::string_view name = body.substr(0, eq);
    const bool has_value = eq != absl::string_view::npos;
    if (IsAbseilBuiltin(name)) continue;
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        if (has_value) return absl::StrCat("--", name, " takes no value (got \"", arg, "\")");
        continue;
      }
    }
    if (flag == nullptr) {
      if (allowed_undefined(name)) continue;
      return absl::StrCat("unknown flag --", name, " (see --help)");
    }
    std::string value;
    if (has_value) {
      value = std::string(body.substr(eq + 1));
    } else if (flag->IsOfType<bool>()) {
      continue;  // --flag alone sets a bool
    } else if (i + 1 < argc) {
      value = argv[++i];  // "--flag value"
    } else {
      return absl::StrCat("--", name, " needs a value (--", name, "=...)");
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::StrCat("--", name, "=", value, ": ", error);
    }
  }
  return std::nullopt;
}

}  // namespace tandem::apps
