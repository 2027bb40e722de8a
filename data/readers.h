// Readers of the standard image-classification files.
//
// Every reader returns absl::Status errors naming the file and the problem for
// bad input (empty, truncated, wrong magic, unsupported type or dimension count,
// sizes that do not match, labels out of range); none crashes, reads past a
// buffer or allocates more than the header promises (gzip output is capped at
// the size the IDX header announces). The Parse* functions work on byte buffers
// and are what the fuzzers (tests/fuzz/) call.
//
// Thread-safety: free functions without shared state.
#ifndef TANDEM_DATA_READERS_H_
#define TANDEM_DATA_READERS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "data/dataset.h"
#include "nn/tensor.h"

namespace tandem::data {

// Decompresses a gzip (or zlib) buffer, failing when the output would exceed
// `max_bytes`. `name` is used in errors.
absl::StatusOr<std::string> Gunzip(absl::string_view compressed, int64_t max_bytes,
                                   const std::string& name);

// Parses an IDX file (MNIST format; raw, or gzip-compressed when it starts with
// the gzip magic 1f 8b). Only unsigned-byte data (type code 0x08) with 1 to 3
// dimensions is accepted. Returns a uint8 tensor of the file's dims.
absl::StatusOr<nn::Tensor> ParseIdx(absl::string_view bytes, const std::string& name);

// Images (N, 28, 28) and labels (N) of IDX buffers -> images uint8 (N, 1, H, W)
// (or float32 scaled to [0, 1] with as_float) and labels int64 (N) in 0..9.
absl::StatusOr<TensorDataset> ParseMnist(absl::string_view images, absl::string_view labels,
                                         const std::string& images_name,
                                         const std::string& labels_name, bool as_float = false);

// Reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (the .gz name is
// tried first). Works for MNIST and Fashion-MNIST.
absl::StatusOr<TensorDataset> LoadMnist(const std::string& dir, bool train, bool as_float = false);

// One CIFAR-10 binary batch: records of 1 label byte (0..9) + 3072 image bytes
// (3 x 32 x 32, channel-major). Returns images uint8 (N, 3, 32, 32), labels int64 (N).
absl::StatusOr<TensorDataset> ParseCifar10(absl::string_view bytes, const std::string& name,
                                           bool as_float = false);

// Reads <dir>/data_batch_1.bin .. data_batch_5.bin (train) or test_batch.bin.
absl::StatusOr<TensorDataset> LoadCifar10(const std::string& dir, bool train, bool as_float = false);

// Reads a whole file; NotFound / DataLoss errors name the path.
absl::StatusOr<std::string> ReadFileBytes(const std::string& path);

}  // namespace tandem::data

#endif  // TANDEM_DATA_READERS_H_
