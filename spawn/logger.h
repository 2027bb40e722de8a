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
// Formatting: each "{}" is replaced by the next argument (absl::StrCat rules for
// numbers and strings; anything with ToString(), such as nn::Device or nn::Tensor,
// through it); surplus "{}" stay, surplus arguments are appended with spaces.
//
// Thread-safety: all methods may be called from any thread.
#ifndef TANDEM_SPAWN_LOGGER_H_
#define TANDEM_SPAWN_LOGGER_H_

#include <fstream>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nn/device.h"

namespace tandem::dist {

namespace internal {

template <typename T>
std::string FormatArg(const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else if constexpr (std::is_convertible_v<const T&, std::string_view> &&
                       !std::is_convertible_v<const T&, absl::string_view>) {
    return std::string(std::string_view(value));
  } else if constexpr (std::is_constructible_v<absl::AlphaNum, const T&>) {
    return absl::StrCat(value);
  } else if constexpr (std::is_same_v<T, absl::Status>) {
    return value.ToString();
  } else {
    return value.ToString();
  }
}

// Replaces each "{}" of `format` by the next of `args`.
std::string FormatPieces(absl::string_view format, const std::vector<std::string>& args);

}  // namespace internal

template <typename... Args>
std::string Format(absl::string_view format, const Args&... args) {
  return internal::FormatPieces(format, {internal::FormatArg(args)...});
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
  void Info(absl::string_view format, const Args&... args) const;
  template <typename... Args>
  void Warning(absl::string_view format, const Args&... args) const;
  template <typename... Args>
  void Error(absl::string_view format, const Args&... args) const;

 private:
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
  RankLogger ForRank(int rank, nn::Device device) { return RankLogger(this, rank, device); }

 private:
  Logger(int world_size, LoggerOptions options);

  const int world_size_;
  LoggerOptions options_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<std::ofstream>> files_;
};

template <typename... Args>
void RankLogger::Info(absl::string_view format, const Args&... args) const {
  logger_->Write(LogLevel::kInfo, rank_, device_, Format(format, args...));
}
template <typename... Args>
void RankLogger::Warning(absl::string_view format, const Args&... args) const {
  logger_->Write(LogLevel::kWarning, rank_, device_, Format(format, args...));
}
template <typename... Args>
void RankLogger::Error(absl::string_view format, const Args&... args) const {
  logger_->Write(LogLevel::kError, rank_, device_, Format(format, args...));
}

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_LOGGER_H_
