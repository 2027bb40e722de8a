// Per-example transforms of host tensors, composable with Compose.
//
// Random transforms draw from the nn::Generator passed in (Philox, see
// nn/random.h), so a seed reproduces them; deterministic ones ignore it.
// Thread-safety: transforms are immutable after construction; operator() may be
// called from several threads with distinct generators.
#ifndef TANDEM_DATA_TRANSFORMS_H_
#define TANDEM_DATA_TRANSFORMS_H_

#include <array>
#include <memory>
#include <vector>

#include "nn/random.h"
#include "nn/tensor.h"

namespace tandem::data {

class Transform {
 public:
  virtual ~Transform() = default;
  // x: a host tensor, usually an image (C, H, W). Returns a new tensor (x unchanged).
  virtual nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const = 0;
};

// Applies its transforms in order.
class Compose : public Transform {
 public:
  explicit Compose(std::vector<std::shared_ptr<const Transform>> transforms)
      : transforms_(std::move(transforms)) {}
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override;

 private:
  std::vector<std::shared_ptr<const Transform>> transforms_;
};

// Any dtype -> float32, multiplied by `scale` (1/255 maps bytes to [0, 1]).
class ToFloat : public Transform {
 public:
  explicit ToFloat(double scale = 1.0) : scale_(scale) {}
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override;

 private:
  double scale_;
};

// (x[c] - mean[c]) / std[c] per channel. x: float (C, ...) with C == mean.size().
// Throws tandem::Error on a channel-count mismatch or a std <= 0.
class Normalize : public Transform {
 public:
  Normalize(std::vector<double> mean, std::vector<double> std);
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override;

 private:
  std::vector<double> mean_;
  std::vector<double> std_;
};

// ToFloat(scale) then Normalize(mean, std) in one pass, for a sample (C, H, W)
// or a batch (B, C, H, W) (channels are dimension dim() - 3; dim() must be 3 or
// 4): y = (x * scale - mean[c]) / std[c] as float32, computed in double and
// rounded once. x: any dtype (uint8 images with scale 1/255 are what
// torchvision's ToTensor + Normalize do). The only allocation is y, so a
// dataset kept in uint8 is converted per batch without float temporaries.
// Host tensors run one fused loop; a device tensor (a batch already on a GPU)
// goes through nn ops on its device. Throws tandem::Error on a channel-count
// mismatch, a std <= 0, or a dimension count other than 3 or 4.
class ToFloatNormalize : public Transform {
 public:
  ToFloatNormalize(double scale, std::vector<double> mean, std::vector<double> std);
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override;

 private:
  double scale_;
  std::vector<double> mean_;
  std::vector<double> std_;
};

// Pads x: (C, H, W) with `padding` zeros on each side, then crops (C, height,
// width) at a uniformly drawn offset. Any dtype. The arguments are Paddle's and
// torchvision's: RandomCrop(32, 4) crops 32x32 after a padding of 4;
// RandomCrop({24, 32}) crops 24 rows by 32 columns.
class RandomCrop : public Transform {
 public:
  explicit RandomCrop(int64_t size, int64_t padding = 0) : RandomCrop({size, size}, padding) {}
  // size: {height, width}.
  explicit RandomCrop(std::array<int64_t, 2> size, int64_t padding = 0);
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override;

 private:
  int64_t height_, width_, padding_;
};

// Mirrors x: (C, H, W) along W with probability p. Any dtype.
class RandomHorizontalFlip : public Transform {
 public:
  explicit RandomHorizontalFlip(double p = 0.5) : p_(p) {}
  nn::Tensor operator()(const nn::Tensor& x, nn::Generator& generator) const override;

 private:
  double p_;
};

}  // namespace tandem::data

#endif  // TANDEM_DATA_TRANSFORMS_H_
