#include "bench/exchange.h"

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "nn/device.h"

namespace tandem::apps::bench {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the exchange files are little-endian raw values; this host is not");

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

}  // namespace

absl::Status WriteRawTensor(const std::string& path, const nn::Tensor& tensor) {
  if (!tensor.defined()) return absl::InvalidArgumentError(absl::StrCat(path, ": undefined tensor"));
  const nn::Tensor host = tensor.to(nn::Device::CPU());
  File f(std::fopen(path.c_str(), "wb"));
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("fopen ", path, ": ", std::strerror(errno)));
  }
  const size_t bytes = static_cast<size_t>(host.nbytes());
  if (bytes > 0 && std::fwrite(host.host_ptr(), 1, bytes, f.get()) != bytes) {
    return absl::InternalError(absl::StrCat("fwrite ", path, ": ", std::strerror(errno)));
  }
  if (std::fclose(f.release()) != 0) {
    return absl::InternalError(absl::StrCat("fclose ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<nn::Tensor> ReadRawTensor(const std::string& path, const nn::Shape& shape,
                                         nn::DType dtype) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": ", ec.message()));
  const int64_t want = nn::NumElements(shape) * nn::ElementSize(dtype);
  if (static_cast<int64_t>(size) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes, but ", nn::DTypeName(dtype), " ",
                     nn::ShapeToString(shape), " needs ", want));
  }
  nn::Tensor out = nn::empty(shape, {.dtype = dtype, .device = nn::Device::CPU()});
  File f(std::fopen(path.c_str(), "rb"));
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat("fopen ", path, ": ", std::strerror(errno)));
  }
  if (want > 0 && std::fread(out.host_ptr(), 1, static_cast<size_t>(want), f.get()) !=
                      static_cast<size_t>(want)) {
    return absl::InvalidArgumentError(absl::StrCat("fread ", path, ": short read"));
  }
  return out;
}

absl::StatusOr<nn::Tensor> ReadRawRows(const std::string& path, const nn::Shape& row_shape,
                                       nn::DType dtype) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": ", ec.message()));
  const int64_t row_bytes = nn::NumElements(row_shape) * nn::ElementSize(dtype);
  if (size == 0 || static_cast<int64_t>(size) % row_bytes != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes is not a positive multiple of one ",
                     nn::DTypeName(dtype), " row ", nn::ShapeToString(row_shape), " (",
                     row_bytes, " bytes)"));
  }
  nn::Shape shape{static_cast<int64_t>(size) / row_bytes};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return ReadRawTensor(path, shape, dtype);
}

absl::Status ReadModelState(const std::string& dir, const std::string& model_name,
                            nn::Module& model) {
  nn::StateDict state;
  for (const auto& [name, tensor] : model.state_dict()) {
    absl::StatusOr<nn::Tensor> t = ReadRawTensor(
        absl::StrCat(dir, "/", model_name, "/", name, ".bin"), tensor.shape(), tensor.dtype());
    if (!t.ok()) return t.status();
    state.emplace_back(name, *t);
  }
  return model.load_state_dict(state);
}

}  // namespace tandem::apps::bench
