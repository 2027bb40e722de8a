// Runs a program of apps/ as a shell command for the programs' tests: its exit
// status and its output (stdout and stderr together).
#ifndef TANDEM_TESTS_APPS_RUN_PROGRAM_H_
#define TANDEM_TESTS_APPS_RUN_PROGRAM_H_

#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::testing {

struct RunResult {
  int status = -1;     // exit status, or -1 when killed by a signal
  std::string output;  // stdout and stderr together
  std::vector<std::string> lines() const {
    return absl::StrSplit(output, '\n', absl::SkipEmpty());
  }
};

// `program args 2>&1` through popen.
inline RunResult RunProgram(const std::string& program, const std::string& args) {
  const std::string command = absl::StrCat(program, " ", args, " 2>&1");
  RunResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int raw = ::pclose(pipe);
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return result;
}

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_APPS_RUN_PROGRAM_H_
