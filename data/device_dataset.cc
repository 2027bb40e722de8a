#include "data/device_dataset.h"

#include "nn/error.h"
#include "nn/ops/index.h"

namespace tandem::data {
namespace {

// Throws naming the first index outside [0, n) of `what`.
void CheckIndices(const std::vector<int64_t>& indices, int64_t n, const char* op,
                  const nn::Tensor& source) {
  for (size_t k = 0; k < indices.size(); ++k) {
    TANDEM_CHECK(indices[k] >= 0 && indices[k] < n, op, ": index ", indices[k], " (position ", k,
                 ") out of range for ", source.ToString(), " (N = ", n, ")");
  }
}

// One host-to-device copy of the B indices (none on the CPU).
nn::Tensor Upload(const std::vector<int64_t>& indices, nn::Device device) {
  return nn::from_vector<int64_t>(indices, {static_cast<int64_t>(indices.size())},
                                  {.dtype = nn::kInt64, .device = device});
}

}  // namespace

nn::Tensor IndexSelectRows(const nn::Tensor& source, const std::vector<int64_t>& indices) {
  TANDEM_CHECK(source.defined() && source.dim() >= 1,
               "IndexSelectRows: source must have a first dimension");
  CheckIndices(indices, source.size(0), "IndexSelectRows", source);
  nn::NoGradGuard no_grad;
  return nn::index_select(source.detach(), Upload(indices, source.device()));
}

DeviceDataset::DeviceDataset(const TensorDataset& dataset, nn::Device device)
    : data_(dataset.data().to(device)), targets_(dataset.targets().to(device)) {}

Batch DeviceDataset::gather(const std::vector<int64_t>& indices) const {
  TANDEM_CHECK(!indices.empty(), "DeviceDataset::gather: no indices");
  CheckIndices(indices, size(), "DeviceDataset::gather", data_);
  const nn::Tensor on_device = Upload(indices, device());
  nn::NoGradGuard no_grad;
  return {nn::index_select(data_, on_device), nn::index_select(targets_, on_device), indices};
}

}  // namespace tandem::data
