#include "spawn/logger.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <iostream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::dist {
namespace internal {

std::string BadFormatLine(fmt::string_view format, const fmt::format_error& error) {
  return absl::StrCat("bad log format \"", absl::CHexEscape(absl::string_view(format.data(), format.size())),
                      "\": ", error.what());
}

}  // namespace internal

namespace {

std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const int millis = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() %
      1000);
  std::tm tm{};
  localtime_r(&seconds, &tm);
  return absl::StrFormat("%04d-%02d-%02d %02d:%02d:%02d.%03d", tm.tm_year + 1900, tm.tm_mon + 1,
                         tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, millis);
}

const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo: return "";
    case LogLevel::kWarning: return "WARNING: ";
    case LogLevel::kError: return "ERROR: ";
  }
  return "";
}

}  // namespace

Logger::Logger(int world_size, LoggerOptions options)
    : world_size_(world_size), options_(std::move(options)) {}

Logger::~Logger() = default;

absl::StatusOr<std::unique_ptr<Logger>> Logger::Create(int world_size, LoggerOptions options) {
  std::unique_ptr<Logger> logger(new Logger(world_size, std::move(options)));
  const std::string& dir = logger->options_.log_dir;
  if (!dir.empty()) {
    if (::mkdir(dir.c_str(), 0777) != 0 && errno != EEXIST) {
      return absl::InvalidArgumentError(
          absl::StrCat("log_dir \"", dir, "\" cannot be created: ", std::strerror(errno)));
    }
    for (int r = 0; r < world_size; ++r) {
      const std::string path =
          absl::StrCat(dir, "/workerlog.", logger->options_.first_rank + r);
      auto file = std::make_unique<std::ofstream>(path, std::ios::out | std::ios::trunc);
      if (!*file) {
        return absl::InvalidArgumentError(
            absl::StrCat("log_dir \"", dir, "\": cannot open \"", path, "\" for writing"));
      }
      logger->files_.push_back(std::move(file));
    }
  }
  return logger;
}

std::string Logger::Line(LogLevel level, int rank, nn::Device device,
                         absl::string_view text) const {
  std::string who =
      rank < 0 ? std::string("spawn") : absl::StrCat("rank ", rank, " ", device.ToString());
  if (!options_.process_tag.empty()) absl::StrAppend(&who, " ", options_.process_tag);
  return absl::StrCat("[", Timestamp(), " ", who, "] ", LevelTag(level), text, "\n");
}

void Logger::WriteToFiles(LogLevel level, absl::string_view text) {
  if (files_.empty()) return;
  const std::string line = Line(level, -1, nn::Device(), text);
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& file : files_) {
    *file << line;
    file->flush();
  }
}

void Logger::Write(LogLevel level, int rank, nn::Device device, absl::string_view text) {
  const std::string line = Line(level, rank, device, text);
  std::lock_guard<std::mutex> lock(mutex_);
  // Several processes (process_tag set): every error of every process reaches
  // its console, prefixed with rank, host and pid.
  const bool to_console =
      rank == 0 || options_.all_ranks_to_console ||
      (rank < 0 && (options_.first_process || level == LogLevel::kError)) ||
      (level == LogLevel::kError && !options_.process_tag.empty());
  if (to_console) {
    std::ostream& console = options_.console != nullptr ? *options_.console : std::cerr;
    console << line;
    console.flush();
  }
  const int index = rank - options_.first_rank;
  if (rank >= 0 && index >= 0 && index < static_cast<int>(files_.size())) {
    *files_[index] << line;
    files_[index]->flush();
  } else if (rank < 0) {
    for (auto& file : files_) {
      *file << line;
      file->flush();
    }
  }
}

void RankLogger::Log(LogLevel level, fmt::string_view format, fmt::format_args args) const {
  std::string text;
  try {
    text = fmt::vformat(format, args);
  } catch (const fmt::format_error& e) {
    logger_->Write(LogLevel::kError, rank_, device_, internal::BadFormatLine(format, e));
    return;
  }
  logger_->Write(level, rank_, device_, text);
}

}  // namespace tandem::dist
