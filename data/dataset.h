// Datasets: random access to examples (one input tensor and one target each).
//
// Thread-safety: get() and get_in_epoch() are const and must be safe to call
// from several threads at once (the DataLoader's workers do); every dataset
// here is.
#ifndef TANDEM_DATA_DATASET_H_
#define TANDEM_DATA_DATASET_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "data/transforms.h"
#include "nn/tensor.h"

namespace tandem::data {

// One sample: `data` (e.g. an image (C, H, W)) and `target` (e.g. a 0-dim int64 label).
struct Example {
  nn::Tensor data;
  nn::Tensor target;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // Example `index` in [0, size()); throws tandem::Error naming the index otherwise.
  virtual Example get(int64_t index) const = 0;
  // The example as drawn in `epoch`: what a DataLoader calls, with its pass's
  // epoch (the sampler's), so a dataset with random draws (TransformDataset)
  // draws anew each epoch. The default ignores the epoch; a dataset wrapping
  // another passes it on.
  virtual Example get_in_epoch(int64_t index, int64_t epoch) const {
    (void)epoch;
    return get(index);
  }
};

// Rows of two host tensors: example i is (data[i], target[i]).
// data: (N, ...), targets: (N, ...) with the same N.
class TensorDataset : public Dataset {
 public:
  // Throws tandem::Error when the first dimensions differ or a tensor is not on the CPU.
  TensorDataset(nn::Tensor data, nn::Tensor targets);
  int64_t size() const override { return data_.size(0); }
  Example get(int64_t index) const override;  // views, no copy
  const nn::Tensor& data() const { return data_; }
  const nn::Tensor& targets() const { return targets_; }

 private:
  nn::Tensor data_;
  nn::Tensor targets_;
};

// Applies `transform` to each example's data. The random generator for example
// i in epoch e is Philox (seed, stream = i, offset = e << 32), so the same seed
// and epoch reproduce every crop and flip whatever the number of workers. e is
// the DataLoader's epoch (get_in_epoch; hapi::Model::fit's epochs too), or
// the one set_epoch() chose, which then holds for every loader.
class TransformDataset : public Dataset {
 public:
  TransformDataset(std::shared_ptr<const Dataset> base, std::shared_ptr<const Transform> transform,
                   uint64_t seed);
  int64_t size() const override { return base_->size(); }
  Example get(int64_t index) const override;  // epoch 0 unless set_epoch() chose one
  Example get_in_epoch(int64_t index, int64_t epoch) const override;
  // Selects the random draws of epoch `epoch` for every caller. Not
  // thread-safe against get(): call between epochs, when no loader is running
  // over this dataset.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }

 private:
  std::shared_ptr<const Dataset> base_;
  std::shared_ptr<const Transform> transform_;
  uint64_t seed_;
  std::optional<int64_t> epoch_;  // set_epoch()'s
};

// The examples of `base` at `indices` (paddle.io.Subset, torch's Subset):
// example i is base's indices[i] (repeats allowed), read in the same epoch
// (get_in_epoch passes it on, so a TransformDataset below draws per epoch).
// Throws tandem::Error on a null base or an index outside [0, base->size()),
// naming the index and its position.
class Subset : public Dataset {
 public:
  Subset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices);
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Example get(int64_t index) const override { return get_in_epoch(index, 0); }
  Example get_in_epoch(int64_t index, int64_t epoch) const override;
  const std::vector<int64_t>& indices() const { return indices_; }

 private:
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
};

// Splits `base` into disjoint Subsets of `lengths` (paddle.io.random_split,
// torch's random_split): the parts of one RandomPermutation(size, seed, 0)
// (data/sampler.h), in order, so the same seed gives the same split in every
// process. Throws tandem::Error naming the lengths when one is negative or
// more than base->size(), or when they do not add up to base->size().
std::vector<std::shared_ptr<Subset>> RandomSplit(std::shared_ptr<const Dataset> base,
                                                 const std::vector<int64_t>& lengths,
                                                 uint64_t seed);

// Fractions of a dataset for RandomSplit: Fractions{.values = {0.8, 0.2}}
// (a type of its own, so that RandomSplit(base, {6, 4}, seed) stays the
// lengths' overload).
struct Fractions {
  std::vector<double> values;
};
// Splits `base` into parts of the given fractions of its size, as torch
// 1.13's random_split does with fractions: part i gets
// floor(size * fraction_i) examples, and the examples left over go one each to
// the first parts, round-robin (10 examples at {0.33, 0.33, 0.34}: 4, 3, 3); a
// part may round to 0 examples, as torch allows (with a warning). Then as the
// lengths' overload (the same permutation, so the same split on every rank and
// process for the same seed). Throws tandem::Error naming the fractions when
// there are none, when one is not in [0, 1] (NaN included; naming its index),
// or when they do not sum to 1 within 1e-6 (naming the sum). torch also
// refuses a sum above 1 by more than 1e-9 (it reads {0.1, 0.7, 0.2}, whose
// float64 sum is 1 + 2.2e-16, as lengths); within 1e-6 tandem accepts it, and
// refuses it only when the floors alone exceed the size (a size of 1e6 or more).
std::vector<std::shared_ptr<Subset>> RandomSplit(std::shared_ptr<const Dataset> base,
                                                 const Fractions& fractions, uint64_t seed);

}  // namespace tandem::data

#endif  // TANDEM_DATA_DATASET_H_
