// The exchange directory through which tandem_bench hands its initial weights,
// its data and its first losses to the PyTorch side (bench/torch_bench.py),
// and from which it can read weights back (--import_dir).
//
// Layout (version 1):
//   manifest.json               what is in the directory (written by tandem_bench
//                               last, see bench.cc: format, byte order, seed, the
//                               optimizers' hyper-parameters, per model its
//                               parameters and data as {name, dtype, shape, file},
//                               and the first losses of every cell)
//   <model>/<param name>.bin    e.g. mlp/1.weight.bin: float32
//   <model>/images.bin          float32 (N, C, H, W)
//   <model>/labels.bin          int64 (N), values in [0, 10)
// Every .bin file is the tensor's elements in C (row-major) order as raw
// little-endian values, with no header: its size is numel x element size.
#ifndef TANDEM_BENCH_EXCHANGE_H_
#define TANDEM_BENCH_EXCHANGE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nn/module.h"
#include "nn/tensor.h"

namespace tandem::apps::bench {

// Writes `tensor`'s elements (copied to the host) to `path`, replacing it.
// Errors name the path and the failing call.
absl::Status WriteRawTensor(const std::string& path, const nn::Tensor& tensor);

// Reads a CPU tensor of `shape` and `dtype` from `path`. Errors (InvalidArgument,
// NotFound) name the path, and for a size mismatch both byte counts.
absl::StatusOr<nn::Tensor> ReadRawTensor(const std::string& path, const nn::Shape& shape,
                                         nn::DType dtype);

// Reads a CPU tensor whose rows have `row_shape`: (N, row_shape...), N taken from
// the file size, which must be a positive multiple of one row's bytes.
absl::StatusOr<nn::Tensor> ReadRawRows(const std::string& path, const nn::Shape& row_shape,
                                       nn::DType dtype);

// Loads every entry of `model`'s state (parameters and buffers) from
// dir/<model_name>/<entry name>.bin, in the entry's shape and dtype (the files
// tandem_bench --export_dir writes). Errors name the file.
absl::Status ReadModelState(const std::string& dir, const std::string& model_name,
                            nn::Module& model);

}  // namespace tandem::apps::bench

#endif  // TANDEM_BENCH_EXCHANGE_H_
