// DeviceDataset: a whole (small) dataset copied once to a device, batches
// gathered there, so a step moves no data from the host (MNIST and CIFAR-10 fit
// in GPU memory many times over).
//
// Thread-safety: immutable after construction; gather() may be called from
// several threads (each enqueues on its own stream). The upload runs on the
// constructing thread's stream, which owns the device copies (nn::Storage): a
// gather from another thread first makes that thread's stream wait for the
// upload (once per stream, no host wait), and the copies are freed on the
// owner after every stream that gathered from them, whichever thread drops
// the dataset last.
#ifndef TANDEM_DATA_DEVICE_DATASET_H_
#define TANDEM_DATA_DEVICE_DATASET_H_

#include <cstdint>
#include <vector>

#include "data/dataloader.h"
#include "data/dataset.h"
#include "nn/device.h"
#include "nn/tensor.h"

namespace tandem::data {

class DeviceDataset {
 public:
  // Copies dataset.data() (N, ...) and dataset.targets() (N, ...) to `device`
  // (on the calling thread's stream; returns without waiting for the copy).
  DeviceDataset(const TensorDataset& dataset, nn::Device device);
  int64_t size() const { return data_.size(0); }
  nn::Device device() const { return data_.device(); }
  const nn::Tensor& data() const { return data_; }
  const nn::Tensor& targets() const { return targets_; }

  // Rows `indices` of data and targets, on the device: batch.data (B, ...),
  // batch.target (B, ...), without autograd history. The indices are checked
  // on the host (tandem::Error naming the first one outside [0, size()) and its
  // position), copied to the device once (B int64, one host-to-device copy on
  // the calling thread's stream, through pinned staging), and data and targets
  // are gathered by nn::index_select: one kernel each, no host sync.
  Batch gather(const std::vector<int64_t>& indices) const;

 private:
  nn::Tensor data_;
  nn::Tensor targets_;
};

// Rows `indices` of `source` (N, ...) stacked into (B, ...) on source's device,
// without autograd history. The host-side indices are range-checked here (a
// tandem::Error names the bad index), uploaded once and gathered with
// nn::index_select (nn/ops/index.h; use that directly for device-side indices
// or a differentiable gather).
nn::Tensor IndexSelectRows(const nn::Tensor& source, const std::vector<int64_t>& indices);

}  // namespace tandem::data

#endif  // TANDEM_DATA_DEVICE_DATASET_H_
