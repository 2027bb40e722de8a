#include "data/transforms.h"

#include <cstring>
#include <type_traits>

#include "nn/error.h"
#include "nn/ops/elementwise.h"

namespace tandem::data {
namespace {

// One uniform [0, 1) draw from the generator.
double Uniform(nn::Generator& generator) {
  const uint64_t offset = generator.Advance(1);
  return nn::UniformFromBits(nn::PhiloxAt(generator.seed, generator.stream, offset, 0).out[0]);
}

// An element as double (bfloat16 and float16 through their float value).
template <typename T>
double Widen(T v) {
  if constexpr (std::is_same_v<T, nn::BFloat16> || std::is_same_v<T, nn::Float16>) {
    return static_cast<double>(static_cast<float>(v));
  } else {
    return static_cast<double>(v);
  }
}

void CheckImage(const nn::Tensor& x, const char* op) {
  TANDEM_CHECK(x.defined() && x.device().is_cpu() && x.dim() == 3, op,
               ": expects a host image (C, H, W) but got ", x.defined() ? x.ToString() : "undefined");
}

}  // namespace

nn::Tensor Compose::operator()(const nn::Tensor& x, nn::Generator& generator) const {
  nn::Tensor y = x;
  for (const auto& t : transforms_) y = (*t)(y, generator);
  return y;
}

nn::Tensor ToFloat::operator()(const nn::Tensor& x, nn::Generator&) const {
  nn::NoGradGuard no_grad;
  nn::Tensor y = x.dtype() == nn::kFloat32 ? x.clone() : x.to(nn::kFloat32);
  if (scale_ != 1.0) y.mul_(scale_);
  return y;
}

Normalize::Normalize(std::vector<double> mean, std::vector<double> std)
    : mean_(std::move(mean)), std_(std::move(std)) {
  TANDEM_CHECK(mean_.size() == std_.size() && !mean_.empty(), "Normalize: ", mean_.size(),
               " means but ", std_.size(), " standard deviations");
  for (double s : std_) TANDEM_CHECK(s > 0, "Normalize: standard deviation ", s, " must be > 0");
}

nn::Tensor Normalize::operator()(const nn::Tensor& x, nn::Generator&) const {
  TANDEM_CHECK(x.defined() && x.device().is_cpu() && x.dim() >= 1 &&
                   x.size(0) == static_cast<int64_t>(mean_.size()),
               "Normalize: expects a host tensor with ", mean_.size(), " channels (C, ...) but got ",
               x.defined() ? x.ToString() : "undefined");
  nn::Tensor y = nn::empty(x.shape(), {.dtype = x.dtype(), .device = nn::Device::CPU()});
  TANDEM_DISPATCH_FLOAT(x.dtype(), "Normalize", [&]<typename scalar_t>() {
    const scalar_t* in = x.host_data<scalar_t>();
    scalar_t* out = y.host_data<scalar_t>();
    const int64_t per_channel = x.numel() / x.size(0);
    for (int64_t c = 0; c < x.size(0); ++c) {
      const double mean = mean_[c], inv_std = 1.0 / std_[c];
      for (int64_t i = c * per_channel; i < (c + 1) * per_channel; ++i) {
        out[i] = static_cast<scalar_t>((in[i] - mean) * inv_std);
      }
    }
  });
  return y;
}

ToFloatNormalize::ToFloatNormalize(double scale, std::vector<double> mean,
                                   std::vector<double> std)
    : scale_(scale), mean_(std::move(mean)), std_(std::move(std)) {
  TANDEM_CHECK(mean_.size() == std_.size() && !mean_.empty(), "ToFloatNormalize: ", mean_.size(),
               " means but ", std_.size(), " standard deviations");
  for (double s : std_) {
    TANDEM_CHECK(s > 0, "ToFloatNormalize: standard deviation ", s, " must be > 0");
  }
}

nn::Tensor ToFloatNormalize::operator()(const nn::Tensor& x, nn::Generator&) const {
  const int64_t channels = static_cast<int64_t>(mean_.size());
  TANDEM_CHECK(x.defined() && (x.dim() == 3 || x.dim() == 4) &&
                   x.size(x.dim() - 3) == channels,
               "ToFloatNormalize: expects (C, H, W) or (B, C, H, W) with C = ", channels,
               " but got ", x.defined() ? x.ToString() : "undefined");
  nn::NoGradGuard no_grad;
  if (!x.device().is_cpu()) {
    // A batch already on its device: per-channel scale and shift as two
    // broadcast ops there, (x * a[c] + b[c]) with a = scale / std, b = -mean / std.
    std::vector<float> a(channels), b(channels);
    for (int64_t c = 0; c < channels; ++c) {
      a[c] = static_cast<float>(scale_ / std_[c]);
      b[c] = static_cast<float>(-mean_[c] / std_[c]);
    }
    nn::Shape per_channel(x.dim(), 1);
    per_channel[x.dim() - 3] = channels;
    const nn::TensorOptions on_x{.dtype = nn::kFloat32, .device = x.device()};
    return x.to(nn::kFloat32) * nn::from_vector<float>(a, per_channel, on_x) +
           nn::from_vector<float>(b, per_channel, on_x);
  }
  nn::Tensor y = nn::empty(x.shape(), {.dtype = nn::kFloat32, .device = nn::Device::CPU()});
  const int64_t plane = x.size(x.dim() - 2) * x.size(x.dim() - 1);
  const int64_t images = x.dim() == 4 ? x.size(0) : 1;
  float* out = y.host_data<float>();
  TANDEM_DISPATCH_ALL(x.dtype(), [&]<typename scalar_t>() {
    const scalar_t* src = x.host_data<scalar_t>();
    for (int64_t s = 0; s < images; ++s) {
      for (int64_t c = 0; c < channels; ++c) {
        const double a = scale_ / std_[c], b = -mean_[c] / std_[c];
        const int64_t base = (s * channels + c) * plane;
        for (int64_t i = base; i < base + plane; ++i) {
          out[i] = static_cast<float>(Widen(src[i]) * a + b);
        }
      }
    }
  });
  return y;
}

RandomCrop::RandomCrop(std::array<int64_t, 2> size, int64_t padding)
    : height_(size[0]), width_(size[1]), padding_(padding) {
  TANDEM_CHECK(height_ > 0 && width_ > 0 && padding >= 0, "RandomCrop: bad size ", height_, "x",
               width_, " or padding ", padding);
}

nn::Tensor RandomCrop::operator()(const nn::Tensor& x, nn::Generator& generator) const {
  CheckImage(x, "RandomCrop");
  const int64_t channels = x.size(0), h = x.size(1), w = x.size(2);
  const int64_t padded_h = h + 2 * padding_, padded_w = w + 2 * padding_;
  TANDEM_CHECK(height_ <= padded_h && width_ <= padded_w, "RandomCrop: crop ", height_, "x", width_,
               " larger than the padded image ", padded_h, "x", padded_w);
  const int64_t top = static_cast<int64_t>(Uniform(generator) * (padded_h - height_ + 1));
  const int64_t left = static_cast<int64_t>(Uniform(generator) * (padded_w - width_ + 1));
  nn::Tensor y = nn::zeros({channels, height_, width_}, {.dtype = x.dtype(), .device = nn::Device::CPU()});
  const int64_t elem = nn::ElementSize(x.dtype());
  const char* in = static_cast<const char*>(x.host_ptr());
  char* out = static_cast<char*>(y.host_ptr());
  // Output pixel (r, c) reads padded pixel (top + r, left + c) = input (top + r - p, left + c - p).
  for (int64_t ch = 0; ch < channels; ++ch) {
    for (int64_t r = 0; r < height_; ++r) {
      const int64_t src_r = top + r - padding_;
      if (src_r < 0 || src_r >= h) continue;
      const int64_t c_begin = std::max<int64_t>(0, padding_ - left);
      const int64_t c_end = std::min<int64_t>(width_, w + padding_ - left);
      if (c_begin >= c_end) continue;
      const int64_t src_c = left + c_begin - padding_;
      std::memcpy(out + ((ch * height_ + r) * width_ + c_begin) * elem,
                  in + ((ch * h + src_r) * w + src_c) * elem, (c_end - c_begin) * elem);
    }
  }
  return y;
}

nn::Tensor RandomHorizontalFlip::operator()(const nn::Tensor& x, nn::Generator& generator) const {
  CheckImage(x, "RandomHorizontalFlip");
  if (Uniform(generator) >= p_) return x.clone();
  const int64_t rows = x.size(0) * x.size(1), w = x.size(2), elem = nn::ElementSize(x.dtype());
  nn::Tensor y = nn::empty(x.shape(), {.dtype = x.dtype(), .device = nn::Device::CPU()});
  const char* in = static_cast<const char*>(x.host_ptr());
  char* out = static_cast<char*>(y.host_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < w; ++c) {
      std::memcpy(out + (r * w + c) * elem, in + (r * w + (w - 1 - c)) * elem, elem);
    }
  }
  return y;
}

}  // namespace tandem::data
