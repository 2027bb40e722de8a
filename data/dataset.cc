#include "data/dataset.h"

#include <cmath>
#include <numeric>
#include <string>

#include "absl/strings/str_join.h"
#include "data/sampler.h"
#include "nn/error.h"

namespace tandem::data {

TensorDataset::TensorDataset(nn::Tensor data, nn::Tensor targets)
    : data_(std::move(data)), targets_(std::move(targets)) {
  TANDEM_CHECK(data_.defined() && targets_.defined() && data_.dim() >= 1 && targets_.dim() >= 1,
               "TensorDataset: data and targets must be tensors with a first dimension");
  TANDEM_CHECK(data_.size(0) == targets_.size(0), "TensorDataset: ", data_.size(0), " inputs ",
               data_.ToString(), " but ", targets_.size(0), " targets ", targets_.ToString());
  TANDEM_CHECK(data_.device().is_cpu() && targets_.device().is_cpu(),
               "TensorDataset: tensors must be on the CPU (use DeviceDataset for device data)");
}

Example TensorDataset::get(int64_t index) const {
  TANDEM_CHECK(index >= 0 && index < size(), "TensorDataset: index ", index,
               " out of range for a dataset of size ", size());
  return {data_[index], targets_[index]};
}

TransformDataset::TransformDataset(std::shared_ptr<const Dataset> base,
                                   std::shared_ptr<const Transform> transform, uint64_t seed)
    : base_(std::move(base)), transform_(std::move(transform)), seed_(seed) {
  TANDEM_CHECK(base_ != nullptr && transform_ != nullptr, "TransformDataset: null dataset or transform");
}

Example TransformDataset::get(int64_t index) const { return get_in_epoch(index, 0); }

Example TransformDataset::get_in_epoch(int64_t index, int64_t epoch) const {
  Example example = base_->get_in_epoch(index, epoch);
  const int64_t draws_of = epoch_.value_or(epoch);
  nn::Generator generator{.seed = seed_, .stream = static_cast<uint64_t>(index),
                          .offset = static_cast<uint64_t>(draws_of) << 32};
  example.data = (*transform_)(example.data, generator);
  return example;
}

Subset::Subset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices)
    : base_(std::move(base)), indices_(std::move(indices)) {
  TANDEM_CHECK(base_ != nullptr, "Subset: null dataset");
  const int64_t n = base_->size();
  for (size_t i = 0; i < indices_.size(); ++i) {
    TANDEM_CHECK(indices_[i] >= 0 && indices_[i] < n, "Subset: index ", indices_[i], " (position ",
                 i, ") is outside [0, ", n, "), the base dataset's size");
  }
}

Example Subset::get_in_epoch(int64_t index, int64_t epoch) const {
  TANDEM_CHECK(index >= 0 && index < size(), "Subset: index ", index,
               " out of range for a subset of size ", size());
  return base_->get_in_epoch(indices_[static_cast<size_t>(index)], epoch);
}

std::vector<std::shared_ptr<Subset>> RandomSplit(std::shared_ptr<const Dataset> base,
                                                 const std::vector<int64_t>& lengths,
                                                 uint64_t seed) {
  TANDEM_CHECK(base != nullptr, "RandomSplit: null dataset");
  const std::string listed = absl::StrJoin(lengths, ", ");
  for (int64_t length : lengths) {
    TANDEM_CHECK(length >= 0, "RandomSplit: length ", length, " of (", listed, ") is negative");
    // Each at most the size, so that their sum cannot overflow into it.
    TANDEM_CHECK(length <= base->size(), "RandomSplit: length ", length, " of (", listed,
                 ") is more than the dataset's ", base->size(), " examples");
  }
  const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  TANDEM_CHECK(total == base->size(), "RandomSplit: the lengths (", listed, ") add up to ", total,
               ", not the dataset's ", base->size(), " examples");
  const std::vector<int64_t> order = RandomPermutation(base->size(), seed, 0);
  std::vector<std::shared_ptr<Subset>> parts;
  auto begin = order.begin();
  for (int64_t length : lengths) {
    parts.push_back(std::make_shared<Subset>(base, std::vector<int64_t>(begin, begin + length)));
    begin += length;
  }
  return parts;
}

std::vector<std::shared_ptr<Subset>> RandomSplit(std::shared_ptr<const Dataset> base,
                                                 const Fractions& fractions, uint64_t seed) {
  TANDEM_CHECK(base != nullptr, "RandomSplit: null dataset");
  const std::vector<double>& values = fractions.values;
  const std::string listed = absl::StrJoin(values, ", ");
  TANDEM_CHECK(!values.empty(), "RandomSplit: no fractions (an empty list)");
  for (size_t i = 0; i < values.size(); ++i) {
    TANDEM_CHECK(values[i] >= 0 && values[i] <= 1, "RandomSplit: fraction ", values[i],
                 " at index ", i, " of (", listed, ") is not in [0, 1]");
  }
  const double sum = std::accumulate(values.begin(), values.end(), 0.0);
  TANDEM_CHECK(std::abs(sum - 1.0) <= 1e-6, "RandomSplit: the fractions (", listed,
               ") sum to ", sum, ", not 1 (within 1e-6)");
  // torch's rule: floor(size * fraction) each, the remainder one by one to the
  // first parts.
  const int64_t size = base->size();
  std::vector<int64_t> lengths;
  for (double f : values)
    lengths.push_back(static_cast<int64_t>(std::floor(static_cast<double>(size) * f)));
  const int64_t floors = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  TANDEM_CHECK(floors <= size, "RandomSplit: the fractions (", listed, ") sum to ", sum,
               ", above 1: their parts of the dataset's ", size, " examples add up to ", floors);
  for (int64_t i = 0; i < size - floors; ++i)
    ++lengths[static_cast<size_t>(i) % lengths.size()];
  return RandomSplit(std::move(base), lengths, seed);
}

}  // namespace tandem::data
