#include "nn/internal/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tandem::nn::internal {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::Status Failed(const std::string& what, const std::string& path, const std::string& step) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", step, " failed: ", ErrnoText()));
}

// Fsyncs the directory holding `path`, so that a rename into it is durable.
absl::Status SyncDirectory(const std::string& path, const std::string& what) {
  const std::string dir = DirectoryOf(path);
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return Failed(what, path, absl::StrCat("opening directory ", dir));
  const int rc = ::fsync(dir_fd);
  const int saved = errno;
  ::close(dir_fd);
  if (rc != 0) {
    errno = saved;
    return Failed(what, path, absl::StrCat("fsync of directory ", dir));
  }
  return absl::OkStatus();
}

// Creates a temporary file beside `path` that no other writer uses:
// <path>.tmp.<pid>.<n>, with n this process's count of temporary files.
// O_EXCL: a name that exists all the same (a pid that two machines sharing a
// filesystem both run, or a crashed writer's left-over) is passed over for
// the next n, never opened and truncated under its writer.
int CreateTemporary(const std::string& path, std::string& temp) {
  static std::atomic<uint64_t> counter{0};
  constexpr int kAttempts = 64;
  int fd = -1;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    temp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) break;
  }
  return fd;
}

}  // namespace

absl::Status AtomicFileSink::Write(const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd_, bytes + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Failed(what_, path_, absl::StrCat("write to ", temp_));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& what,
                                 const std::function<absl::Status(AtomicFileSink&)>& write) {
  std::string temp;
  const int fd = CreateTemporary(path, temp);
  if (fd < 0) return Failed(what, path, absl::StrCat("creating ", temp));
  absl::Status status;
  try {
    AtomicFileSink sink(fd, what, path, temp);
    status = write(sink);
  } catch (...) {
    ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  if (status.ok() && ::fsync(fd) != 0) status = Failed(what, path, absl::StrCat("fsync of ", temp));
  if (::close(fd) != 0 && status.ok()) status = Failed(what, path, absl::StrCat("close of ", temp));
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = Failed(what, path, absl::StrCat("rename from ", temp));
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  return SyncDirectory(path, what);
}

}  // namespace tandem::nn::internal
