// TensorBoard scalars: dist::SummaryWriter writes the event files TensorBoard
// reads (what torch.utils.tensorboard.SummaryWriter.add_scalar writes).
//
//   ASSIGN_OR_RETURN(auto tb, dist::SummaryWriter::Open("runs/mnist"));
//   tb->AddScalar("train/loss", loss, step);
//   ... tensorboard --logdir runs
//
// The file: DIR/events.out.tfevents.<seconds>.<host>.<pid>.<n>[.<suffix>] (n counts
// this process's writers; never an existing file), a
// sequence of TFRecords (uint64 length, masked CRC32C of the length, the bytes,
// masked CRC32C of the bytes; little-endian), each a serialised tensorflow.Event:
// first {wall_time, file_version: "brain.Event:2"}, then one per scalar
// {wall_time, step, summary {value {tag, simple_value}}}.
//
// Why an encoder of our own and not libprotobuf: three messages and five fields
// (varint, 64-bit, 32-bit and length-delimited wire types) are ~60 lines; Debian's
// libprotobuf would add a dependency, protoc code generation in the build and
// TensorFlow's .proto files to the tree for no gain. The test decodes the files
// with protobuf's own Python runtime and an independent CRC32C
// (tests/spawn/observe/read_tfevents.py), so the encoder is checked against the real format.
//
// Records are buffered and written by Flush() (also every 64 records and at
// Close/destruction); a flushed file is complete up to its last record.
// Thread-safety: every method may be called from any thread.
#ifndef TANDEM_SPAWN_OBSERVE_SUMMARY_WRITER_H_
#define TANDEM_SPAWN_OBSERVE_SUMMARY_WRITER_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::dist {

class SummaryWriter {
 public:
  // Creates `dir` (and its parents) and a new event file in it. Errors name the
  // directory or file and the reason.
  static absl::StatusOr<std::unique_ptr<SummaryWriter>> Open(const std::string& dir,
                                                             const std::string& suffix = "");
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  // One scalar (stored as a float, as TensorBoard's simple_value is) at `step`;
  // wall_time: seconds since the epoch, the current time when negative.
  void AddScalar(absl::string_view tag, double value, int64_t step, double wall_time = -1);
  // A SessionLog START event at `step`: TensorBoard then drops the events of
  // earlier files with steps >= step (a run resumed from a checkpoint at `step`
  // repeats them).
  void AddSessionStart(int64_t step, double wall_time = -1);
  // Writes the buffered records; the first error is kept and returned again.
  absl::Status Flush();
  // Flushes and closes; later calls do nothing.
  absl::Status Close();

  const std::string& path() const { return path_; }

 private:
  SummaryWriter(std::string path, std::FILE* file);
  // Appends one serialised Event (flushing every 64); nothing after a write error.
  void AddEvent(const std::string& event);
  void AppendRecordLocked(const std::string& event);
  absl::Status FlushLocked();

  std::mutex mutex_;
  std::string path_;
  std::FILE* file_;
  std::string pending_;  // framed records not written yet
  int pending_records_ = 0;
  absl::Status error_;
};

namespace internal {
// CRC32C (Castagnoli), and TFRecord's masked form of it. Exposed for the tests.
uint32_t Crc32c(absl::string_view data);
uint32_t MaskedCrc32c(absl::string_view data);
// The serialised tensorflow.Event of one scalar (the test's known answer), and of
// a SessionLog START.
std::string ScalarEvent(absl::string_view tag, float value, int64_t step, double wall_time);
std::string SessionStartEvent(int64_t step, double wall_time);
}  // namespace internal

}  // namespace tandem::dist

#endif  // TANDEM_SPAWN_OBSERVE_SUMMARY_WRITER_H_
