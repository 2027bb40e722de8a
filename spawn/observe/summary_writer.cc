#include "spawn/observe/summary_writer.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace tandem::dist {
namespace internal {
namespace {

// Protocol buffers wire format: just what the Event and Summary messages need.
void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void PutTag(std::string* out, int field, int wire_type) {
  PutVarint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}
template <typename T>
void PutLittleEndian(std::string* out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // the hosts tandem builds on are little-endian
  out->append(bytes, sizeof(T));
}
void PutDouble(std::string* out, int field, double v) {
  PutTag(out, field, 1);  // 64-bit
  PutLittleEndian(out, v);
}
void PutFloat(std::string* out, int field, float v) {
  PutTag(out, field, 5);  // 32-bit
  PutLittleEndian(out, v);
}
void PutInt64(std::string* out, int field, int64_t v) {
  PutTag(out, field, 0);  // varint (two's complement for negatives, as protobuf's int64)
  PutVarint(out, static_cast<uint64_t>(v));
}
void PutBytes(std::string* out, int field, absl::string_view bytes) {
  PutTag(out, field, 2);  // length-delimited
  PutVarint(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

// tensorflow.Event fields: wall_time 1 (double), step 2 (int64), file_version 3
// (string), summary 5 (Summary). Summary: value 1 (repeated Value). Value: tag 1
// (string), simple_value 2 (float).
constexpr int kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5,
              kEventSessionLog = 7;
constexpr int kSessionLogStatus = 1, kSessionLogStart = 1;  // SessionLog.status, START
constexpr int kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;

std::string VersionEvent(double wall_time) {
  std::string event;
  PutDouble(&event, kEventWallTime, wall_time);
  PutBytes(&event, kEventFileVersion, "brain.Event:2");
  return event;
}

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  static const std::array<uint32_t, 256> table = MakeCrcTable();
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : data) crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc32c(absl::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

namespace {
// An Event at `step` whose oneof `what` is message field `field` = `message`.
std::string StepEvent(double wall_time, int64_t step, int field, absl::string_view message) {
  std::string event;
  PutDouble(&event, kEventWallTime, wall_time);
  PutInt64(&event, kEventStep, step);
  PutBytes(&event, field, message);
  return event;
}
}  // namespace

std::string ScalarEvent(absl::string_view tag, float value, int64_t step, double wall_time) {
  std::string item;
  PutBytes(&item, kValueTag, tag);
  PutFloat(&item, kValueSimpleValue, value);
  std::string summary;
  PutBytes(&summary, kSummaryValue, item);
  return StepEvent(wall_time, step, kEventSummary, summary);
}

std::string SessionStartEvent(int64_t step, double wall_time) {
  std::string log;
  PutInt64(&log, kSessionLogStatus, kSessionLogStart);
  return StepEvent(wall_time, step, kEventSessionLog, log);
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<SummaryWriter>> SummaryWriter::Open(const std::string& dir,
                                                                   const std::string& suffix) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("TensorBoard directory \"", dir, "\": cannot create it: ", ec.message()));
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  const double now = internal::Now();
  // A counter keeps two writers of one process and second apart; "x" never
  // truncates an existing file.
  static std::atomic<int> opened{0};
  std::string path = absl::StrCat(dir, "/events.out.tfevents.", static_cast<int64_t>(now), ".",
                                  host, ".", ::getpid(), ".", opened.fetch_add(1),
                                  suffix.empty() ? "" : ".", suffix);
  std::FILE* file = std::fopen(path.c_str(), "wbx");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TensorBoard event file \"", path, "\": cannot create it: ", std::strerror(errno)));
  }
  std::unique_ptr<SummaryWriter> writer(new SummaryWriter(std::move(path), file));
  {
    std::lock_guard<std::mutex> lock(writer->mutex_);
    writer->AppendRecordLocked(internal::VersionEvent(now));
    absl::Status flushed = writer->FlushLocked();
    if (!flushed.ok()) return flushed;
  }
  return writer;
}

SummaryWriter::SummaryWriter(std::string path, std::FILE* file)
    : path_(std::move(path)), file_(file) {}

SummaryWriter::~SummaryWriter() { (void)Close(); }

void SummaryWriter::AppendRecordLocked(const std::string& event) {
  std::string length;
  internal::PutLittleEndian(&length, static_cast<uint64_t>(event.size()));
  pending_ += length;
  internal::PutLittleEndian(&pending_, internal::MaskedCrc32c(length));
  pending_ += event;
  internal::PutLittleEndian(&pending_, internal::MaskedCrc32c(event));
  ++pending_records_;
}

void SummaryWriter::AddScalar(absl::string_view tag, double value, int64_t step, double wall_time) {
  AddEvent(internal::ScalarEvent(tag, static_cast<float>(value), step,
                                 wall_time < 0 ? internal::Now() : wall_time));
}

void SummaryWriter::AddSessionStart(int64_t step, double wall_time) {
  AddEvent(internal::SessionStartEvent(step, wall_time < 0 ? internal::Now() : wall_time));
}

void SummaryWriter::AddEvent(const std::string& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (file_ == nullptr || !error_.ok()) return;  // after a write error: Flush reports it
  AppendRecordLocked(event);
  if (pending_records_ >= 64) (void)FlushLocked();
}

absl::Status SummaryWriter::FlushLocked() {
  if (!error_.ok() || file_ == nullptr) return error_;
  if (!pending_.empty()) {
    errno = 0;
    if (std::fwrite(pending_.data(), 1, pending_.size(), file_) != pending_.size() ||
        std::fflush(file_) != 0) {
      error_ = absl::InternalError(absl::StrCat("TensorBoard event file \"", path_,
                                                "\": write failed: ",
                                                errno ? std::strerror(errno) : "short write"));
    }
    pending_.clear();
    pending_records_ = 0;
  }
  return error_;
}

absl::Status SummaryWriter::Flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  return FlushLocked();
}

absl::Status SummaryWriter::Close() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (file_ == nullptr) return error_;
  absl::Status status = FlushLocked();
  if (std::fclose(file_) != 0 && status.ok()) {
    status = error_ = absl::InternalError(
        absl::StrCat("TensorBoard event file \"", path_, "\": close failed: ", std::strerror(errno)));
  }
  file_ = nullptr;
  return status;
}

}  // namespace tandem::dist
