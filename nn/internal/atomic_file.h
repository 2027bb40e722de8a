// WriteFileAtomically: the one way nn writes a file that must never be seen half
// written (checkpoints, safetensors). The bytes go to a temporary file beside the
// target (<path>.tmp.<pid>.<n>, created exclusively, O_EXCL: a name that exists,
// as one of another host's writers on a shared filesystem may, is passed over for
// the next n, so no two writers share one), which is fsynced, closed and renamed
// over `path`; then the directory is fsynced so the rename survives a power
// loss. A reader, or a process killed mid-write, sees the old file or the whole
// new one, never a mixture; a failed write removes the temporary file and
// leaves `path` as it was.
#ifndef TANDEM_NN_INTERNAL_ATOMIC_FILE_H_
#define TANDEM_NN_INTERNAL_ATOMIC_FILE_H_

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"

namespace tandem::nn::internal {

// Where a writer puts its bytes; Write retries short writes and EINTR.
class AtomicFileSink {
 public:
  AtomicFileSink(int fd, const std::string& what, const std::string& path, const std::string& temp)
      : fd_(fd), what_(what), path_(path), temp_(temp) {}
  absl::Status Write(const void* data, size_t size);

 private:
  int fd_;
  const std::string& what_;
  const std::string& path_;
  const std::string& temp_;
};

// Creates `path` atomically (see above) with the bytes `write` puts into its sink.
// what: the kind of file, first word of every error ("checkpoint", "safetensors"),
// which reads "<what> <path>: <step> <file> failed: <errno text>". An
// exception from `write` removes the temporary file and propagates.
absl::Status WriteFileAtomically(const std::string& path, const std::string& what,
                                 const std::function<absl::Status(AtomicFileSink&)>& write);

}  // namespace tandem::nn::internal

#endif  // TANDEM_NN_INTERNAL_ATOMIC_FILE_H_
