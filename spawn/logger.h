// One Logger for all ranks of a spawn run.
//
// Each call writes one whole line, "[2026-01-02 03:04:05.678 rank 1 cuda:1] text",
// under one lock, so lines of different ranks never interleave. Rank 0's lines go
// to the console by default (LoggerOptions::all_ranks_to_console: every rank's);
// with a log_dir every rank's lines also go to log_dir/workerlog.<rank>. spawn's
// own lines (rank -1, prefixed "spawn") go to the console and every workerlog.
//
//   ctx.log().Info("step:{} loss:{}", step, loss.item());
//
// Formatting is fmt's (https://fmt.dev, Debian's libfmt-dev 9), the syntax of
// std::format: "{}", "{:.6f}", "{:>8}", "{0}". A literal format is checked when the
// call is compiled: a bad spec or a wrong argument count is a compile error. A format
// chosen at run time goes through fmt::runtime(text); if it is bad, the RankLogger
// writes an ERROR line naming the format and fmt's reason instead of the message
// (logging never throws into training code), and Format() throws fmt::format_error.
// Besides fmt's own types, anything with ToString() (nn::Device, nn::Tensor,
// absl::Status) and absl::string_view format as their text.
//
// Thread-safety: all methods may be called from any thread.
#ifndef TANDEM_SPAWN_LOGGER_H_
#define TANDEM_SPAWN_LOGGER_H_

#include <concepts>
#include <fstream>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "fmt/format.h"
#include "nn/device.h"

namespace tandem::dist::internal {

template <typename T>
concept HasToString = requires(const T& value) {
  { value.ToString() } -> std::convertible_to<std::string>;
};

}  // namespace tandem::dist::internal

// Anything with ToString() formats as that text ("{:>10}" pads it).
template <typename T, typename Char>
  requires tandem::dist::internal::HasToString<T>
struct fmt::formatter<T, Char> : fmt::formatter<fmt::basic_string_view<Char>, Char> {
  template <typename FormatContext>
  auto format(const T& value, FormatContext& ctx) const {
    const std::string text = value.ToString();
    return fmt::formatter<fmt::basic_string_view<Char>, Char>::format(
        fmt::basic_string_view<Char>(text.data(), text.size()), ctx);
  }
};

// absl::string_view is its own type in Debian's Abseil (not std::string_view).
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view value, FormatContext& ctx) const {
    return fmt::formatter<fmt::string_view>::format(
        fmt::string_view(value.data(), value.size()), ctx);
  }
};

namespace tandem::dist {

namespace internal {

// The line written in place of a message whose run-time format fmt rejected.
std::string BadFormatLine(fmt::string_view format, const fmt::format_error& error);

}  // namespace internal

// fmt::format with tandem's formatters in view. Throws fmt::format_error for a bad
// run-time format (fmt::runtime).
template <typename... Args>
std::string Format(fmt::format_string<Args...> format, Args&&... args) {
  return fmt::format(format, std::forward<Args>(args)...);
}

enum class LogLevel { kInfo, kWarning, kError };

struct LoggerOptions {
  // Where console lines go (std::cerr when null). Not owned; must outlive the Logger.
  std::ostream* console = nullptr;
  bool all_ranks_to_console = false;
  // When not empty, rank r's lines also go to log_dir/workerlog.<r> (the folder is
  // created if missing).
  std::string log_dir;
  // Several processes: the global rank of this process's first rank (ranks passed
  // to Write are global; this process's files are workerlog.<first_rank + i>).
  int first_rank = 0;
  // Several processes: spawn's own lines reach the console only on the first
  // process, except errors, which every process prints (so do its ranks' error
  // lines when process_tag is set).
  bool first_process = true;
  // Several processes: "host h pid p", added to every line's prefix.
  std::string process_tag;
};

class Logger;

// A rank's view of the shared Logger: the methods every rank calls.
class RankLogger {
 public:
  RankLogger(Logger* logger, int rank, nn::Device device)
      : logger_(logger), rank_(rank), device_(device) {}
  template <typename... Args>
  void Info(fmt::format_string<Args...> format, Args&&... args) const {
    Log(LogLevel::kInfo, format, fmt::make_format_args(args...));
  }
  template <typename... Args>
  void Warning(fmt::format_string<Args...> format, Args&&... args) const {
    Log(LogLevel::kWarning, format, fmt::make_format_args(args...));
  }
  template <typename... Args>
  void Error(fmt::format_string<Args...> format, Args&&... args) const {
    Log(LogLevel::kError, format, fmt::make_format_args(args...));
  }

 private:
  // Formats (fmt::vformat) and writes one line; a format fmt rejects at run time
  // becomes an ERROR line that names it.
  void Log(LogLevel level, fmt::string_view format, fmt::format_args args) const;

  Logger* logger_;
  int rank_;
  nn::Device device_;
};

class Logger {
 public:
  // Opens log_dir/workerlog.<first_rank> .. workerlog.<first_rank + world_size-1>
  // when log_dir is set (world_size: this process's ranks).
  static absl::StatusOr<std::unique_ptr<Logger>> Create(int world_size, LoggerOptions options);
  ~Logger();

  // rank -1: spawn's own lines, else a global rank of this process. device is
  // printed after the rank.
  void Write(LogLevel level, int rank, nn::Device device, absl::string_view text);
  // One of spawn's own lines to every workerlog only, not the console (detail
  // a file keeps for later; nothing without a log_dir).
  void WriteToFiles(LogLevel level, absl::string_view text);
  RankLogger ForRank(int rank, nn::Device device) { return RankLogger(this, rank, device); }

 private:
  Logger(int world_size, LoggerOptions options);
  // "[<time> <who>] <level tag><text>\n".
  std::string Line(LogLevel level, int rank, nn::Device device, absl::string_view text) const;

  const int world_size_;
  LoggerOptions options_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<std::ofstream>> files_;
};

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_LOGGER_H_
