#include "data/device_dataset.h"

#include "nn/error.h"

namespace tandem::data {

nn::Tensor IndexSelectRows(const nn::Tensor& source, const std::vector<int64_t>& indices) {
  TANDEM_CHECK(source.defined() && source.dim() >= 1, "IndexSelectRows: source must have a first dimension");
  const int64_t n = source.size(0);
  for (int64_t index : indices) {
    TANDEM_CHECK(index >= 0 && index < n, "IndexSelectRows: index ", index, " out of range for ",
                 source.ToString());
  }
  nn::Shape shape = source.shape();
  shape[0] = static_cast<int64_t>(indices.size());
  nn::Tensor out = nn::empty(shape, {.dtype = source.dtype(), .device = source.device()});
  nn::NoGradGuard no_grad;
  const nn::Tensor detached = source.detach();
  // Copy each maximal run of consecutive indices as one block.
  const int64_t count = static_cast<int64_t>(indices.size());
  for (int64_t k = 0; k < count;) {
    int64_t run = 1;
    while (k + run < count && indices[k + run] == indices[k] + run) ++run;
    out.slice(k, k + run).copy_(detached.slice(indices[k], indices[k] + run));
    k += run;
  }
  return out;
}

DeviceDataset::DeviceDataset(const TensorDataset& dataset, nn::Device device)
    : data_(dataset.data().to(device)), targets_(dataset.targets().to(device)) {}

Batch DeviceDataset::gather(const std::vector<int64_t>& indices) const {
  TANDEM_CHECK(!indices.empty(), "DeviceDataset::gather: no indices");
  return {IndexSelectRows(data_, indices), IndexSelectRows(targets_, indices), indices};
}

}  // namespace tandem::data
