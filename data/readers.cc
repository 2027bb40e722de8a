#include "data/readers.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nn/status_macros.h"

namespace tandem::data {
namespace {

constexpr int64_t kNumClasses = 10;
constexpr int64_t kCifarImageBytes = 3 * 32 * 32;
constexpr int64_t kCifarRecordBytes = 1 + kCifarImageBytes;

bool IsGzip(absl::string_view bytes) {
  return bytes.size() >= 2 && static_cast<uint8_t>(bytes[0]) == 0x1f &&
         static_cast<uint8_t>(bytes[1]) == 0x8b;
}

// Inflates `compressed` (gzip or zlib, auto-detected) producing at most
// `max_bytes`. With stop_at_max, reaching max_bytes ends early without error
// (used to read just a header); otherwise more output is an error.
absl::StatusOr<std::string> Inflate(absl::string_view compressed, int64_t max_bytes, bool stop_at_max,
                                    const std::string& name) {
  z_stream z{};
  if (inflateInit2(&z, 15 + 32) != Z_OK) {
    return absl::InternalError(absl::StrCat(name, ": cannot initialise zlib"));
  }
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(compressed.data()));
  // zlib counts input in uInt; a file beyond 4 GiB is not a dataset we read.
  if (compressed.size() > std::numeric_limits<uInt>::max()) {
    inflateEnd(&z);
    return absl::InvalidArgumentError(absl::StrCat(name, ": compressed file too large"));
  }
  z.avail_in = static_cast<uInt>(compressed.size());
  std::string out;
  char chunk[1 << 16];
  int rc = Z_OK;
  while (true) {
    z.next_out = reinterpret_cast<Bytef*>(chunk);
    z.avail_out = sizeof chunk;
    rc = inflate(&z, Z_NO_FLUSH);
    const size_t produced = sizeof chunk - z.avail_out;
    if (rc != Z_OK && rc != Z_STREAM_END && !(rc == Z_BUF_ERROR && produced > 0)) break;
    const int64_t room = max_bytes - static_cast<int64_t>(out.size());
    if (static_cast<int64_t>(produced) > room) {
      if (stop_at_max) {
        out.append(chunk, static_cast<size_t>(room));
        inflateEnd(&z);
        return out;
      }
      inflateEnd(&z);
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": decompressed data exceeds the ", max_bytes, " bytes its header promises"));
    }
    out.append(chunk, produced);
    if (rc == Z_STREAM_END) break;
    if (produced == 0 && z.avail_in == 0) {
      rc = Z_BUF_ERROR;
      break;
    }
  }
  inflateEnd(&z);
  if (rc != Z_STREAM_END) {
    if (stop_at_max && rc == Z_BUF_ERROR) return out;  // short file: the header check reports it
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": corrupt or truncated gzip data (zlib: ", z.msg != nullptr ? z.msg : zError(rc), ")"));
  }
  return out;
}

uint32_t BigEndian32(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | uint32_t{u[3]};
}

struct IdxHeader {
  int64_t header_bytes = 0;
  nn::Shape dims;
  int64_t payload_bytes = 0;
};

// Validates the header of raw IDX bytes (which may be just a prefix of the file).
absl::StatusOr<IdxHeader> ParseIdxHeader(absl::string_view bytes, const std::string& name) {
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": file is empty"));
  if (bytes.size() < 4) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": truncated header (", bytes.size(), " bytes)"));
  }
  const auto* magic = reinterpret_cast<const uint8_t*>(bytes.data());
  if (magic[0] != 0 || magic[1] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": wrong magic (", int{magic[0]}, ", ",
                                                   int{magic[1]}, "); not an IDX file"));
  }
  if (magic[2] != 0x08) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": type code 0x", absl::Hex(magic[2]),
                                                   " is not unsigned byte (0x08)"));
  }
  const int ndim = magic[3];
  if (ndim < 1 || ndim > 3) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dimension count ", ndim, " outside 1..3"));
  }
  IdxHeader header;
  header.header_bytes = 4 + 4 * ndim;
  if (static_cast<int64_t>(bytes.size()) < header.header_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": truncated header (", bytes.size(), " bytes, ", ndim, " dims need ",
                     header.header_bytes, ")"));
  }
  // Each dim < 2^32; the product of three could overflow int64, so check.
  int64_t product = 1;
  for (int d = 0; d < ndim; ++d) {
    const int64_t dim = BigEndian32(bytes.data() + 4 + 4 * d);
    header.dims.push_back(dim);
    if (dim != 0 && product > (std::numeric_limits<int64_t>::max() - header.header_bytes) / dim) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": dims ", nn::ShapeToString(header.dims),
                                                     "... overflow the element count"));
    }
    product *= dim;
  }
  header.payload_bytes = product;
  return header;
}

absl::StatusOr<nn::Tensor> ParseRawIdx(absl::string_view bytes, const std::string& name) {
  ASSIGN_OR_RETURN(IdxHeader header, ParseIdxHeader(bytes, name));
  const int64_t actual = static_cast<int64_t>(bytes.size()) - header.header_bytes;
  if (actual != header.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": payload has ", actual, " bytes but dims ", nn::ShapeToString(header.dims), " need ",
        header.payload_bytes, actual < header.payload_bytes ? " (truncated)" : ""));
  }
  nn::Tensor t = nn::empty(header.dims, {.dtype = nn::kUInt8, .device = nn::Device::CPU()});
  if (actual > 0) std::memcpy(t.host_ptr(), bytes.data() + header.header_bytes, actual);
  return t;
}

absl::StatusOr<TensorDataset> MakeDataset(nn::Tensor images, nn::Tensor labels, bool as_float) {
  if (as_float) {
    nn::NoGradGuard no_grad;
    images = images.to(nn::kFloat32);
    images.mul_(1.0 / 255.0);
  }
  return TensorDataset(std::move(images), std::move(labels));
}

// uint8 labels -> int64, each checked against 0..9.
absl::StatusOr<nn::Tensor> Labels(const uint8_t* bytes, int64_t count, int64_t stride,
                                  const std::string& name) {
  nn::Tensor labels = nn::empty({count}, {.dtype = nn::kInt64, .device = nn::Device::CPU()});
  int64_t* out = labels.host_data<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t label = bytes[i * stride];
    if (label >= kNumClasses) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": label ", label, " of record ", i,
                                                     " outside 0..", kNumClasses - 1));
    }
    out[i] = label;
  }
  return labels;
}

}  // namespace

absl::StatusOr<std::string> Gunzip(absl::string_view compressed, int64_t max_bytes,
                                   const std::string& name) {
  return Inflate(compressed, max_bytes, /*stop_at_max=*/false, name);
}

absl::StatusOr<nn::Tensor> ParseIdx(absl::string_view bytes, const std::string& name) {
  if (!IsGzip(bytes)) return ParseRawIdx(bytes, name);
  // Read the header first, then inflate at most what it promises.
  ASSIGN_OR_RETURN(std::string prefix, Inflate(bytes, 16, /*stop_at_max=*/true, name));
  ASSIGN_OR_RETURN(IdxHeader header, ParseIdxHeader(prefix, name));
  ASSIGN_OR_RETURN(std::string raw, Gunzip(bytes, header.header_bytes + header.payload_bytes, name));
  return ParseRawIdx(raw, name);
}

absl::StatusOr<TensorDataset> ParseMnist(absl::string_view images, absl::string_view labels,
                                         const std::string& images_name,
                                         const std::string& labels_name, bool as_float) {
  ASSIGN_OR_RETURN(nn::Tensor image_tensor, ParseIdx(images, images_name));
  ASSIGN_OR_RETURN(nn::Tensor label_tensor, ParseIdx(labels, labels_name));
  if (image_tensor.dim() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(images_name, ": images need 3 dims (N, H, W) but have ",
                                                   nn::ShapeToString(image_tensor.shape())));
  }
  if (label_tensor.dim() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(labels_name, ": labels need 1 dim (N) but have ",
                                                   nn::ShapeToString(label_tensor.shape())));
  }
  const int64_t n = image_tensor.size(0);
  if (label_tensor.size(0) != n) {
    return absl::InvalidArgumentError(absl::StrCat(labels_name, ": ", label_tensor.size(0),
                                                   " labels but ", images_name, " holds ", n, " images"));
  }
  ASSIGN_OR_RETURN(nn::Tensor label_values, Labels(label_tensor.host_data<uint8_t>(), n, 1, labels_name));
  nn::Tensor images4 = image_tensor.reshape({n, 1, image_tensor.size(1), image_tensor.size(2)});
  return MakeDataset(images4, label_values, as_float);
}

absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return buffer.str();
}

absl::StatusOr<TensorDataset> LoadMnist(const std::string& dir, bool train, bool as_float) {
  const std::string prefix = absl::StrCat(dir, "/", train ? "train" : "t10k");
  auto read = [](const std::string& base) -> absl::StatusOr<std::pair<std::string, std::string>> {
    absl::StatusOr<std::string> gz = ReadFileBytes(base + ".gz");
    if (gz.ok()) return std::make_pair(base + ".gz", *std::move(gz));
    absl::StatusOr<std::string> raw = ReadFileBytes(base);
    if (raw.ok()) return std::make_pair(base, *std::move(raw));
    return absl::NotFoundError(absl::StrCat("neither ", base, ".gz nor ", base, " can be read"));
  };
  ASSIGN_OR_RETURN(auto images, read(prefix + "-images-idx3-ubyte"));
  ASSIGN_OR_RETURN(auto labels, read(prefix + "-labels-idx1-ubyte"));
  return ParseMnist(images.second, labels.second, images.first, labels.first, as_float);
}

absl::StatusOr<TensorDataset> ParseCifar10(absl::string_view bytes, const std::string& name,
                                           bool as_float) {
  if (bytes.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": file is empty"));
  const int64_t size = static_cast<int64_t>(bytes.size());
  if (size % kCifarRecordBytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": size ", size, " is not a multiple of the ",
                                                   kCifarRecordBytes, "-byte record (truncated?)"));
  }
  const int64_t n = size / kCifarRecordBytes;
  const auto* records = reinterpret_cast<const uint8_t*>(bytes.data());
  ASSIGN_OR_RETURN(nn::Tensor labels, Labels(records, n, kCifarRecordBytes, name));
  nn::Tensor images = nn::empty({n, 3, 32, 32}, {.dtype = nn::kUInt8, .device = nn::Device::CPU()});
  uint8_t* out = images.host_data<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out + i * kCifarImageBytes, records + i * kCifarRecordBytes + 1, kCifarImageBytes);
  }
  return MakeDataset(images, labels, as_float);
}

absl::StatusOr<TensorDataset> LoadCifar10(const std::string& dir, bool train, bool as_float) {
  std::vector<std::string> names;
  if (train) {
    for (int i = 1; i <= 5; ++i) names.push_back(absl::StrCat(dir, "/data_batch_", i, ".bin"));
  } else {
    names.push_back(dir + "/test_batch.bin");
  }
  std::vector<TensorDataset> parts;
  int64_t total = 0;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(name));
    ASSIGN_OR_RETURN(TensorDataset part, ParseCifar10(bytes, name, false));
    total += part.size();
    parts.push_back(std::move(part));
  }
  if (parts.size() == 1) return MakeDataset(parts[0].data(), parts[0].targets(), as_float);
  nn::Tensor images = nn::empty({total, 3, 32, 32}, {.dtype = nn::kUInt8, .device = nn::Device::CPU()});
  nn::Tensor labels = nn::empty({total}, {.dtype = nn::kInt64, .device = nn::Device::CPU()});
  int64_t row = 0;
  for (const TensorDataset& part : parts) {
    std::memcpy(images.host_data<uint8_t>() + row * kCifarImageBytes, part.data().host_ptr(), part.data().nbytes());
    std::memcpy(labels.host_data<int64_t>() + row, part.targets().host_ptr(), part.targets().nbytes());
    row += part.size();
  }
  return MakeDataset(images, labels, as_float);
}

}  // namespace tandem::data
