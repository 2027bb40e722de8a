// Counts the atomic writes into a folder from a TemporaryFiles' construction
// on, by the file they write: each creates one temporary file,
// "<file>.tmp.<pid>.<n>" (nn/internal/atomic_file.h). Creations, not renames,
// are counted: inotify merges two identical events in a row, and two renames
// onto one name are identical, while every temporary file has a name of its
// own. Linux only (inotify); one thread at a time.
#ifndef TANDEM_TESTS_HAPI_TEMPORARY_FILES_H_
#define TANDEM_TESTS_HAPI_TEMPORARY_FILES_H_

#include <sys/inotify.h>
#include <unistd.h>

#include <map>
#include <ostream>
#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::testing {

// How many temporary files were made for one file: by every process, and by
// this one (its pid in their names).
struct Writes {
  int all = 0;
  int this_process = 0;
  bool operator==(const Writes&) const = default;
};

inline std::ostream& operator<<(std::ostream& os, const Writes& w) {
  return os << "{all " << w.all << ", this process " << w.this_process << "}";
}

class TemporaryFiles {
 public:
  explicit TemporaryFiles(const std::string& dir)
      : fd_(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC)),
        watch_(fd_ < 0 ? -1 : ::inotify_add_watch(fd_, dir.c_str(), IN_CREATE)) {}
  ~TemporaryFiles() {
    if (fd_ >= 0) ::close(fd_);
  }
  TemporaryFiles(const TemporaryFiles&) = delete;
  TemporaryFiles& operator=(const TemporaryFiles&) = delete;
  // False when inotify could not watch the folder (errno says why).
  bool ok() const { return fd_ >= 0 && watch_ >= 0; }
  // The writes since construction or the last Take, by the file written.
  std::map<std::string, Writes> Take() {
    alignas(inotify_event) char buffer[64 * 1024];
    std::map<std::string, Writes> writes;
    const std::string mine = absl::StrCat(".tmp.", ::getpid(), ".");
    for (;;) {
      const ssize_t n = ::read(fd_, buffer, sizeof(buffer));
      if (n <= 0) break;  // EAGAIN: every event read
      for (ssize_t at = 0; at < n;) {
        const auto* event = reinterpret_cast<const inotify_event*>(buffer + at);
        const std::string name = event->len > 0 ? event->name : "";
        const size_t temp = name.find(".tmp.");
        if (temp != std::string::npos) {
          Writes& w = writes[name.substr(0, temp)];
          ++w.all;
          if (name.compare(temp, mine.size(), mine) == 0) ++w.this_process;
        }
        at += static_cast<ssize_t>(sizeof(inotify_event) + event->len);
      }
    }
    return writes;
  }

 private:
  int fd_;
  int watch_;
};

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_HAPI_TEMPORARY_FILES_H_
