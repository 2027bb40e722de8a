#include "nn/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nn/internal/atomic_file.h"
#include "nn/status_macros.h"

namespace tandem::nn {
namespace {

// The format stores little-endian bytes and tensors hold host-order ones.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

constexpr uint64_t kLengthBytes = 8;
// The format's own bound on the header (the reference implementation's), which
// also keeps a corrupt length from asking for a huge parse.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxDims = 16;
constexpr char kMetadataKey[] = "__metadata__";

struct DTypeCode {
  DType dtype;
  const char* name;
};
constexpr DTypeCode kDTypes[] = {{kFloat32, "F32"}, {kFloat64, "F64"}, {kBFloat16, "BF16"},
                                 {kFloat16, "F16"}, {kInt64, "I64"},   {kUInt8, "U8"}};

std::string ErrnoText() { return std::strerror(errno); }

// One tensor's entry in the header; its bytes are data[begin, end).
struct Entry {
  std::string name;
  DType dtype = kFloat32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;  // sorted by begin
  SafetensorsMetadata metadata;
  uint64_t data_start = 0;  // where the data part starts in the file
};

// --- Reading the header ---------------------------------------------------------------

// A JSON value of a header for a message: ASCII only (\uXXXX escapes), with bytes
// that are not UTF-8 replaced instead of throwing, so always one printable line.
std::string Dump(const nlohmann::json& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

class HeaderParser {
 public:
  explicit HeaderParser(const std::string& name) : name_(name) {}

  template <typename... Pieces>
  absl::Status Error(const Pieces&... pieces) const {
    return absl::DataLossError(absl::StrCat("safetensors ", name_, ": ", pieces...));
  }

  absl::StatusOr<Header> Parse(std::string_view bytes) {
    if (bytes.size() < kLengthBytes) {
      return Error("file of ", bytes.size(), " bytes is shorter than the 8-byte header length");
    }
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, bytes.data(), kLengthBytes);
    const uint64_t available = bytes.size() - kLengthBytes;
    if (header_bytes > available) {
      return Error("header length ", header_bytes, " exceeds the ", available,
                   " bytes after the length field");
    }
    if (header_bytes > kMaxHeaderBytes) {
      return Error("header length ", header_bytes, " exceeds the format's limit of ",
                   kMaxHeaderBytes, " bytes");
    }
    Header header;
    header.data_start = kLengthBytes + header_bytes;
    const std::string_view text = bytes.substr(kLengthBytes, header_bytes);
    const uint64_t data_bytes = bytes.size() - header.data_start;
    RETURN_IF_ERROR(ParseJson(text, header, data_bytes));
    RETURN_IF_ERROR(CheckCoverage(header.entries, data_bytes));
    return header;
  }

 private:
  absl::Status ParseJson(std::string_view text, Header& header, uint64_t data_bytes) {
    nlohmann::json root;
    std::string duplicate;
    // Duplicate top-level names: the parser would keep the last silently.
    std::set<std::string> top_keys;
    auto callback = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string() &&
          !top_keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
      return true;
    };
    try {
      root = nlohmann::json::parse(text.begin(), text.end(), callback);
    } catch (const nlohmann::json::exception& e) {
      return Error("header is not valid JSON: ", Printable(e.what()));
    }
    if (!root.is_object()) return Error("header is JSON ", root.type_name(), ", not an object");
    if (!duplicate.empty()) return Error("name '", Printable(duplicate), "' appears twice in the header");
    for (const auto& [key, value] : root.items()) {
      if (key == kMetadataKey) {
        RETURN_IF_ERROR(ParseMetadata(value, header.metadata));
        continue;
      }
      ASSIGN_OR_RETURN(Entry entry, ParseEntry(key, value, data_bytes));
      header.entries.push_back(std::move(entry));
    }
    return absl::OkStatus();
  }

  absl::Status ParseMetadata(const nlohmann::json& value, SafetensorsMetadata& metadata) const {
    if (!value.is_object()) {
      return Error("\"__metadata__\" is JSON ", value.type_name(), ", not an object of strings");
    }
    for (const auto& [key, v] : value.items()) {
      if (!v.is_string()) {
        return Error("\"__metadata__\" entry '", Printable(key), "' is JSON ", v.type_name(), ", not a string");
      }
      metadata[key] = v.get<std::string>();
    }
    return absl::OkStatus();
  }

  // A non-negative integer field (JSON numbers without sign or fraction).
  absl::StatusOr<uint64_t> Unsigned(const nlohmann::json& v, const std::string& what) const {
    if (!v.is_number_unsigned()) return Error(what, " is ", Dump(v), ", not a non-negative integer");
    return v.get<uint64_t>();
  }

  absl::StatusOr<Entry> ParseEntry(const std::string& key, const nlohmann::json& value,
                                   uint64_t data_bytes) const {
    const std::string what = absl::StrCat("tensor '", Printable(key), "'");
    if (!value.is_object()) return Error(what, " is JSON ", value.type_name(), ", not an object");
    for (const auto& [field, unused] : value.items()) {
      if (field != "dtype" && field != "shape" && field != "data_offsets") {
        return Error(what, " has an unknown field '", Printable(field), "'");
      }
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!value.contains(field)) return Error(what, " has no \"", field, "\"");
    }
    Entry entry{.name = key};
    const nlohmann::json& dtype = value["dtype"];
    if (!dtype.is_string()) return Error(what, " has dtype ", Dump(dtype), ", not a string");
    if (!SafetensorsDTypeFromName(dtype.get<std::string>(), entry.dtype)) {
      return Error(what, " has dtype ", Dump(dtype), ", which tandem does not support (",
                   "F32, F64, BF16, F16, I64, U8)");
    }
    const nlohmann::json& shape = value["shape"];
    if (!shape.is_array() || shape.size() > kMaxDims) {
      return Error(what, " has shape ", Dump(shape), ", not an array of at most ", kMaxDims,
                   " sizes");
    }
    const uint64_t element_bytes = static_cast<uint64_t>(ElementSize(entry.dtype));
    uint64_t elements = 1;
    for (const nlohmann::json& d : shape) {
      ASSIGN_OR_RETURN(const uint64_t dim, Unsigned(d, absl::StrCat("a size in the shape of ", what)));
      // Bounded so that elements * element bytes cannot overflow.
      if (dim != 0 && elements > (std::numeric_limits<uint64_t>::max() / 16) / dim) {
        return Error(what, " has shape ", Dump(shape), ", too many elements");
      }
      elements *= dim;
      entry.shape.push_back(static_cast<int64_t>(dim));
    }
    const nlohmann::json& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2) {
      return Error(what, " has data_offsets ", Dump(offsets), ", not [begin, end]");
    }
    ASSIGN_OR_RETURN(entry.begin, Unsigned(offsets[0], absl::StrCat("the begin offset of ", what)));
    ASSIGN_OR_RETURN(entry.end, Unsigned(offsets[1], absl::StrCat("the end offset of ", what)));
    if (entry.begin > entry.end || entry.end > data_bytes) {
      return Error(what, " has data_offsets [", entry.begin, ", ", entry.end,
                   "] outside the data part of ", data_bytes, " bytes");
    }
    if (entry.end - entry.begin != elements * element_bytes) {
      return Error(what, " of dtype ", Printable(dtype.get<std::string>()), " and shape ", Dump(shape),
                   " needs ", elements * element_bytes, " bytes but data_offsets [", entry.begin,
                   ", ", entry.end, "] hold ", entry.end - entry.begin);
    }
    return entry;
  }

  // The tensors tile the data part: sorted by offset, each starts where the
  // previous one ends, the last ends at the end of the file.
  absl::Status CheckCoverage(std::vector<Entry>& entries, uint64_t data_bytes) const {
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t position = 0;
    const Entry* previous = nullptr;
    for (const Entry& e : entries) {
      if (e.begin < position) {
        return Error("tensors '", Printable(previous->name), "' [", previous->begin, ", ",
                     previous->end, ") and '", Printable(e.name), "' [", e.begin, ", ", e.end, ") overlap");
      }
      if (e.begin > position) {
        return Error("data bytes [", position, ", ", e.begin, ") belong to no tensor");
      }
      position = e.end;
      previous = &e;
    }
    if (position != data_bytes) {
      return Error(data_bytes - position, " data bytes after the last tensor's end at ", position);
    }
    return absl::OkStatus();
  }

  const std::string& name_;
};

// A host tensor holding a copy of `entry`'s bytes.
Tensor TensorFrom(const Entry& entry, const char* data) {
  Tensor t = empty(entry.shape, {.dtype = entry.dtype, .device = Device::CPU()});
  if (entry.end > entry.begin) std::memcpy(t.host_ptr(), data + entry.begin, entry.end - entry.begin);
  return t;
}

// The file mapped read-only for the life of the object.
class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }

  absl::Status Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(absl::StrCat("safetensors ", path, ": cannot open: ", ErrnoText()));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const std::string why = ErrnoText();
      ::close(fd);
      return absl::InternalError(absl::StrCat("safetensors ", path, ": fstat failed: ", why));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("safetensors ", path, ": not a regular file"));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const std::string why = ErrnoText();
        ::close(fd);
        return absl::InternalError(absl::StrCat("safetensors ", path, ": mmap failed: ", why));
      }
      data_ = p;
    }
    ::close(fd);  // the mapping stays valid
    return absl::OkStatus();
  }

  std::string_view bytes() const { return {static_cast<const char*>(data_), size_}; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// --- Writing -----------------------------------------------------------------------------

// The header JSON, padded with spaces to a multiple of 8 bytes so that the data
// part starts aligned (as the reference writer does).
absl::StatusOr<std::string> HeaderJson(const std::string& path, const StateDict& state,
                                       const SafetensorsMetadata& metadata) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  if (!metadata.empty()) root[kMetadataKey] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, t] : state) {
    if (name == kMetadataKey || name.empty() || !names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors ", path, ": tensor name '", name, "' is ",
          name.empty() ? "empty" : name == kMetadataKey ? "reserved" : "given twice"));
    }
    if (!t.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors ", path, ": tensor '", name, "' is undefined"));
    }
    const uint64_t bytes = static_cast<uint64_t>(t.nbytes());
    root[name] = {{"dtype", SafetensorsDTypeName(t.dtype())},
                  {"shape", t.shape()},
                  {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = root.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or metadata that is not UTF-8
    return absl::InvalidArgumentError(absl::StrCat("safetensors ", path, ": ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// The file's bytes: the header's length, the header, every tensor's data.
absl::Status WriteContents(internal::AtomicFileSink& sink, const std::string& header,
                           const StateDict& state) {
  const uint64_t length = header.size();
  char length_bytes[kLengthBytes];
  std::memcpy(length_bytes, &length, kLengthBytes);
  RETURN_IF_ERROR(sink.Write(length_bytes, kLengthBytes));
  RETURN_IF_ERROR(sink.Write(header.data(), header.size()));
  for (const auto& [name, t] : state) {
    const Tensor host = t.detach().to(Device::CPU());
    if (host.nbytes() == 0) continue;
    RETURN_IF_ERROR(sink.Write(host.host_ptr(), static_cast<size_t>(host.nbytes())));
  }
  return absl::OkStatus();
}

// --- Loading into a module ------------------------------------------------------------

std::string Describe(DType dtype, const Shape& shape) {
  return absl::StrCat(DTypeName(dtype), ShapeToString(shape));
}

std::string ListOf(const char* what, const std::vector<std::string>& names) {
  // Names from the file among them: each quoted through Printable.
  return absl::StrCat(names.size(), " ", what, " (",
                      absl::StrJoin(names, ", ",
                                    [](std::string* out, const std::string& name) {
                                      out->append(Printable(name));
                                    }),
                      ")");
}

// Copies `entry`'s bytes into `dst` (converting dtype and device where needed).
void CopyInto(const Tensor& dst, const Entry& entry, const char* data) {
  NoGradGuard no_grad;
  if (dst.device().is_cpu() && dst.dtype() == entry.dtype) {
    if (entry.end > entry.begin) {
      std::memcpy(dst.host_ptr(), data + entry.begin, entry.end - entry.begin);
    }
    return;
  }
  Tensor(dst).copy_(TensorFrom(entry, data));
}

}  // namespace

const char* SafetensorsDTypeName(DType dtype) {
  for (const DTypeCode& c : kDTypes) {
    if (c.dtype == dtype) return c.name;
  }
  return "?";
}

bool SafetensorsDTypeFromName(std::string_view name, DType& dtype) {
  for (const DTypeCode& c : kDTypes) {
    if (name == c.name) {
      dtype = c.dtype;
      return true;
    }
  }
  return false;
}

absl::Status SaveSafetensors(const std::string& path, const StateDict& state,
                             const SafetensorsMetadata& metadata) {
  ASSIGN_OR_RETURN(const std::string header, HeaderJson(path, state, metadata));
  try {
    return internal::WriteFileAtomically(path, "safetensors",
                                         [&](internal::AtomicFileSink& sink) {
                                           return WriteContents(sink, header, state);
                                         });
  } catch (const Error& e) {  // a device copy that failed
    return absl::InternalError(absl::StrCat("safetensors ", path, ": ", e.what()));
  }
}

absl::Status SaveSafetensors(const std::string& path, const Module& module,
                             const SafetensorsMetadata& metadata) {
  return SaveSafetensors(path, module.state_dict(), metadata);
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes, const std::string& name) {
  HeaderParser parser(name);
  ASSIGN_OR_RETURN(const Header header, parser.Parse(bytes));
  SafetensorsFile file{.metadata = header.metadata};
  const char* data = bytes.data() + header.data_start;
  for (const Entry& e : header.entries) file.tensors.emplace_back(e.name, TensorFrom(e, data));
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  MappedFile file;
  RETURN_IF_ERROR(file.Open(path));
  return ParseSafetensors(file.bytes(), path);
}

absl::StatusOr<SafetensorsLoadReport> LoadSafetensors(const std::string& path, Module& module,
                                                      const SafetensorsLoadOptions& options) {
  MappedFile file;
  RETURN_IF_ERROR(file.Open(path));
  HeaderParser parser(path);
  ASSIGN_OR_RETURN(const Header header, parser.Parse(file.bytes()));
  std::unordered_map<std::string, const Entry*> in_file;
  for (const Entry& e : header.entries) in_file.emplace(e.name, &e);

  // Match everything first, so that a strict failure leaves the module as it was.
  SafetensorsLoadReport report{.metadata = header.metadata};
  std::vector<std::pair<Tensor, const Entry*>> copies;
  std::set<std::string> own_names;
  for (const auto& [name, dst] : module.state_dict()) {
    own_names.insert(name);
    auto it = in_file.find(name);
    if (it == in_file.end()) {
      report.missing.push_back(name);
      continue;
    }
    const Entry& e = *it->second;
    const bool dtype_ok = e.dtype == dst.dtype() || (options.convert_floating &&
                                                     IsFloatingPoint(e.dtype) &&
                                                     IsFloatingPoint(dst.dtype()));
    if (e.shape != dst.shape() || !dtype_ok) {
      report.mismatched.push_back(absl::StrCat(name, ": ", Describe(dst.dtype(), dst.shape()),
                                               " in the module, ", Describe(e.dtype, e.shape),
                                               " in the file"));
      continue;
    }
    report.loaded.push_back(name);
    copies.emplace_back(dst, &e);
  }
  for (const Entry& e : header.entries) {
    if (!own_names.contains(e.name)) report.unexpected.push_back(e.name);
  }
  if (options.strict &&
      (!report.missing.empty() || !report.unexpected.empty() || !report.mismatched.empty())) {
    std::vector<std::string> parts;
    if (!report.missing.empty()) parts.push_back(ListOf("missing from the file", report.missing));
    if (!report.unexpected.empty()) {
      parts.push_back(ListOf("unexpected in the file", report.unexpected));
    }
    if (!report.mismatched.empty()) parts.push_back(ListOf("mismatched", report.mismatched));
    return absl::InvalidArgumentError(absl::StrCat("safetensors ", path, " does not match ",
                                                   module.type_name(), ": ",
                                                   absl::StrJoin(parts, "; ")));
  }
  const char* data = file.bytes().data() + header.data_start;
  try {
    for (const auto& [dst, entry] : copies) CopyInto(dst, *entry, data);
  } catch (const Error& e) {
    return absl::InternalError(absl::StrCat("safetensors ", path, ": ", e.what()));
  }
  return report;
}

}  // namespace tandem::nn
