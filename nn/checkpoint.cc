#include "nn/checkpoint.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "nn/internal/atomic_file.h"
#include "nn/status_macros.h"

namespace tandem::nn {
namespace {

constexpr size_t kMagicBytes = 8;
constexpr size_t kHeaderBytes = kMagicBytes + 4 + 8 + 4;

// --- Little-endian encoding ------------------------------------------------------------
void PutU8(std::string& out, uint8_t v) { out.push_back(static_cast<char>(v)); }
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutString(std::string& out, const std::string& s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}

// Reads from a byte range; every read checks the remaining length first.
class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), size_(size) {}
  size_t remaining() const { return size_ - pos_; }
  bool U8(uint8_t& v) {
    if (remaining() < 1) return false;
    v = static_cast<uint8_t>(data_[pos_++]);
    return true;
  }
  bool U32(uint32_t& v) {
    if (remaining() < 4) return false;
    v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    pos_ += 4;
    return true;
  }
  bool U64(uint64_t& v) {
    if (remaining() < 8) return false;
    v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    pos_ += 8;
    return true;
  }
  bool Bytes(size_t n, const char*& out) {
    if (remaining() < n) return false;
    out = data_ + pos_;
    pos_ += n;
    return true;
  }
  bool String(std::string& s) {
    uint32_t n;
    const char* p;
    if (!U32(n) || !Bytes(n, p)) return false;
    s.assign(p, n);
    return true;
  }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

uint32_t Crc32(const char* data, size_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  // zlib's length argument is a uInt: feed large payloads in pieces.
  while (size > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(size, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(data), chunk);
    data += chunk;
    size -= chunk;
  }
  return static_cast<uint32_t>(crc);
}

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

std::string SerializeCheckpoint(const Checkpoint& checkpoint) {
  std::string payload;
  PutU32(payload, static_cast<uint32_t>(checkpoint.tensors.size()));
  for (const auto& [name, tensor] : checkpoint.tensors) {
    TANDEM_CHECK(tensor.defined(), "SerializeCheckpoint: tensor '", name, "' is undefined");
    const Tensor host = tensor.detach().to(Device::CPU());
    PutString(payload, name);
    PutU8(payload, static_cast<uint8_t>(host.dtype()));
    PutU32(payload, static_cast<uint32_t>(host.dim()));
    for (int64_t d : host.shape()) PutU64(payload, static_cast<uint64_t>(d));
    PutU64(payload, static_cast<uint64_t>(host.nbytes()));
    payload.append(static_cast<const char*>(host.host_ptr()), static_cast<size_t>(host.nbytes()));
  }
  PutU32(payload, static_cast<uint32_t>(checkpoint.metadata.size()));
  for (const auto& [key, value] : checkpoint.metadata) {
    PutString(payload, key);
    PutU8(payload, static_cast<uint8_t>(value.index()));
    if (const auto* s = std::get_if<std::string>(&value)) {
      PutString(payload, *s);
    } else if (const auto* i = std::get_if<int64_t>(&value)) {
      PutU64(payload, static_cast<uint64_t>(*i));
    } else {
      uint64_t bits;
      const double d = std::get<double>(value);
      std::memcpy(&bits, &d, sizeof bits);
      PutU64(payload, bits);
    }
  }
  std::string out(kCheckpointMagic, kMagicBytes);
  PutU32(out, kCheckpointVersion);
  PutU64(out, payload.size());
  PutU32(out, Crc32(payload.data(), payload.size()));
  out.append(payload);
  return out;
}

namespace {

// The error of a bad checkpoint file: DataLoss, "checkpoint <name>: <pieces>".
struct ParseError {
  const std::string& name;
  template <typename... Pieces>
  absl::Status operator()(const Pieces&... pieces) const {
    return absl::DataLossError(absl::StrCat("checkpoint ", name, ": ", pieces...));
  }
};

// ParseCheckpoint's steps, in order.

// Checks magic, version, length and checksum; sets `payload` to the checked bytes.
absl::Status CheckHeader(const std::string& bytes, const ParseError& error,
                         std::string_view& payload) {
  if (bytes.empty()) return error("file is empty");
  if (bytes.size() < kMagicBytes || bytes.compare(0, kMagicBytes, kCheckpointMagic) != 0) {
    return error("wrong magic (not a tandem checkpoint)");
  }
  Reader header(bytes.data() + kMagicBytes, bytes.size() - kMagicBytes);
  uint32_t version, crc;
  uint64_t payload_bytes;
  if (!header.U32(version) || !header.U64(payload_bytes) || !header.U32(crc)) {
    return error("truncated header (", bytes.size(), " bytes)");
  }
  if (version != kCheckpointVersion) {
    return error("unsupported version ", version, " (this build reads version ", kCheckpointVersion, ")");
  }
  const uint64_t available = bytes.size() - kHeaderBytes;
  if (payload_bytes > available) {
    return error("truncated: header promises ", payload_bytes, " payload bytes but the file holds ", available);
  }
  if (payload_bytes < available) {
    return error(available - payload_bytes, " trailing bytes after the payload");
  }
  payload = std::string_view(bytes.data() + kHeaderBytes, payload_bytes);
  const uint32_t actual_crc = Crc32(payload.data(), payload.size());
  if (actual_crc != crc) {
    return error("checksum mismatch (stored crc32 ", crc, ", computed ", actual_crc, ")");
  }
  return absl::OkStatus();
}

// One tensor record (the checksum matched, so what follows is what a writer
// produced; the checks still guard against a file crafted with a valid checksum).
absl::Status ReadTensor(Reader& r, uint32_t index, const ParseError& error,
                        Checkpoint& checkpoint) {
  std::string tensor_name;
  uint8_t dtype_code;
  uint32_t ndim;
  if (!r.String(tensor_name) || !r.U8(dtype_code) || !r.U32(ndim)) {
    return error("truncated record of tensor #", index);
  }
  if (dtype_code > static_cast<uint8_t>(DType::kFloat16)) {
    return error("tensor '", Printable(tensor_name), "' has unknown dtype code ", dtype_code);
  }
  if (ndim > 16 || r.remaining() < ndim * 8ull) {
    return error("tensor '", Printable(tensor_name), "' has a bad dimension count ", ndim);
  }
  Shape shape(ndim);
  uint64_t elements = 1;
  for (uint32_t d = 0; d < ndim; ++d) {
    uint64_t dim;
    r.U64(dim);
    if (dim > (1ull << 40) || (dim != 0 && elements > (1ull << 40) / dim)) {
      return error("tensor '", Printable(tensor_name), "' has an implausible dimension ", dim);
    }
    elements *= dim;
    shape[d] = static_cast<int64_t>(dim);
  }
  const DType dtype = static_cast<DType>(dtype_code);
  uint64_t nbytes;
  const char* data;
  if (!r.U64(nbytes)) return error("truncated byte count of tensor '", Printable(tensor_name), "'");
  if (nbytes != elements * static_cast<uint64_t>(ElementSize(dtype))) {
    return error("tensor '", Printable(tensor_name), "' of shape ", ShapeToString(shape), " and dtype ",
                 DTypeName(dtype), " stores ", nbytes, " bytes");
  }
  if (!r.Bytes(nbytes, data)) return error("truncated data of tensor '", Printable(tensor_name), "'");
  Tensor tensor = empty(shape, {.dtype = dtype, .device = Device::CPU()});
  if (nbytes > 0) std::memcpy(tensor.host_ptr(), data, nbytes);
  if (!checkpoint.tensors.emplace(tensor_name, tensor).second) {
    return error("duplicate tensor name '", Printable(tensor_name), "'");
  }
  return absl::OkStatus();
}

// One metadata entry: a string (kind 0), an int64 (1) or a double (2).
absl::Status ReadMetadataEntry(Reader& r, uint32_t index, const ParseError& error,
                               Checkpoint& checkpoint) {
  std::string key;
  uint8_t kind;
  if (!r.String(key) || !r.U8(kind)) return error("truncated metadata entry #", index);
  CheckpointValue value;
  if (kind == 0) {
    std::string s;
    if (!r.String(s)) return error("truncated metadata '", Printable(key), "'");
    value = std::move(s);
  } else if (kind == 1 || kind == 2) {
    uint64_t bits;
    if (!r.U64(bits)) return error("truncated metadata '", Printable(key), "'");
    if (kind == 1) {
      value = static_cast<int64_t>(bits);
    } else {
      double d;
      std::memcpy(&d, &bits, sizeof d);
      value = d;
    }
  } else {
    return error("metadata '", Printable(key), "' has unknown kind ", kind);
  }
  if (!checkpoint.metadata.emplace(key, std::move(value)).second) {
    return error("duplicate metadata key '", Printable(key), "'");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Checkpoint> ParseCheckpoint(const std::string& bytes, const std::string& name) {
  const ParseError error{name};
  std::string_view payload;
  RETURN_IF_ERROR(CheckHeader(bytes, error, payload));
  Reader r(payload.data(), payload.size());
  Checkpoint checkpoint;
  uint32_t tensor_count;
  if (!r.U32(tensor_count)) return error("truncated tensor count");
  for (uint32_t t = 0; t < tensor_count; ++t) {
    RETURN_IF_ERROR(ReadTensor(r, t, error, checkpoint));
  }
  uint32_t meta_count;
  if (!r.U32(meta_count)) return error("truncated metadata count");
  for (uint32_t m = 0; m < meta_count; ++m) {
    RETURN_IF_ERROR(ReadMetadataEntry(r, m, error, checkpoint));
  }
  if (r.remaining() != 0) return error(r.remaining(), " unparsed bytes at the end of the payload");
  return checkpoint;
}

absl::Status SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint) {
  std::string bytes;
  try {
    bytes = SerializeCheckpoint(checkpoint);
  } catch (const Error& e) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, ": ", e.what()));
  }
  return WriteCheckpointBytes(path, bytes);
}

absl::Status WriteCheckpointBytes(const std::string& path, const std::string& bytes) {
  return internal::WriteFileAtomically(path, "checkpoint", [&bytes](internal::AtomicFileSink& sink) {
    return sink.Write(bytes.data(), bytes.size());
  });
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path) {
  // An ifstream opens a directory and reads nothing: it would be "file is empty".
  std::error_code dir_error;
  if (std::filesystem::is_directory(path, dir_error)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": is a directory, not a file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": cannot open: ", ErrnoText()));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("checkpoint ", path, ": read failed"));
  return ParseCheckpoint(buffer.str(), path);
}

}  // namespace tandem::nn
