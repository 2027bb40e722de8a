// Element types of tensors. float32 is the default; float64 is for gradient
// checks; bfloat16 is a storage type for mixed precision (nn/autocast.h): ops with
// bfloat16 kernels do their arithmetic in float32; int64 holds class labels and
// indices; uint8 holds raw image bytes.
#ifndef TANDEM_NN_DTYPE_H_
#define TANDEM_NN_DTYPE_H_

#include <cstdint>
#include <cstring>


namespace tandem::nn {

enum class DType : uint8_t { kFloat32, kFloat64, kBFloat16, kInt64, kUInt8 };

inline constexpr DType kFloat32 = DType::kFloat32;
inline constexpr DType kFloat64 = DType::kFloat64;
inline constexpr DType kBFloat16 = DType::kBFloat16;
inline constexpr DType kInt64 = DType::kInt64;
inline constexpr DType kUInt8 = DType::kUInt8;

// bfloat16: the upper 16 bits of an IEEE float32; conversion rounds to nearest even.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float f) : bits(FromFloat(f)) {}
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static uint16_t FromFloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN stays NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return static_cast<uint16_t>(u >> 16);
  }
};

// Bytes per element.
constexpr int64_t ElementSize(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kBFloat16: return 2;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}

constexpr bool IsFloating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16;
}

// C++ type <-> DType.
template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::kBFloat16; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kInt64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::kUInt8; };

}  // namespace tandem::nn

// TANDEM_DISPATCH_FLOAT(dtype, opname, [&]<typename scalar_t>() { ... }):
// calls the lambda with scalar_t = float or double; other dtypes throw an error
// naming the op. Math ops support float32 and float64.
#define TANDEM_DISPATCH_FLOAT(dtype, opname, ...)                                 \
  [&]() {                                                                         \
    auto&& fn = __VA_ARGS__;                                                      \
    switch (dtype) {                                                              \
      case ::tandem::nn::DType::kFloat32: return fn.template operator()<float>(); \
      case ::tandem::nn::DType::kFloat64: return fn.template operator()<double>();\
      default:                                                                    \
        ::tandem::Fail(opname, ": unsupported dtype ",                            \
                       ::tandem::nn::DTypeName(dtype),                            \
                       " (float32 and float64 only)");                            \
    }                                                                             \
  }()

// TANDEM_DISPATCH_FLOATING(dtype, opname, [&]<typename scalar_t>() { ... }):
// calls the lambda with scalar_t = float, double or BFloat16; other dtypes throw
// an error naming the op. For ops with bfloat16 kernels (bf16 storage, float math).
#define TANDEM_DISPATCH_FLOATING(dtype, opname, ...)                              \
  [&]() {                                                                         \
    auto&& fn = __VA_ARGS__;                                                      \
    switch (dtype) {                                                              \
      case ::tandem::nn::DType::kFloat32: return fn.template operator()<float>(); \
      case ::tandem::nn::DType::kFloat64: return fn.template operator()<double>();\
      case ::tandem::nn::DType::kBFloat16:                                        \
        return fn.template operator()<::tandem::nn::BFloat16>();                  \
      default:                                                                    \
        ::tandem::Fail(opname, ": unsupported dtype ",                            \
                       ::tandem::nn::DTypeName(dtype),                            \
                       " (float32, float64 and bfloat16 only)");                  \
    }                                                                             \
  }()

// TANDEM_DISPATCH_ALL(dtype, [&]<typename scalar_t>() { ... }): every dtype.
#define TANDEM_DISPATCH_ALL(dtype, ...)                                                  \
  [&]() {                                                                                \
    auto&& fn = __VA_ARGS__;                                                             \
    switch (dtype) {                                                                     \
      case ::tandem::nn::DType::kFloat32: return fn.template operator()<float>();        \
      case ::tandem::nn::DType::kFloat64: return fn.template operator()<double>();       \
      case ::tandem::nn::DType::kBFloat16:                                               \
        return fn.template operator()<::tandem::nn::BFloat16>();                         \
      case ::tandem::nn::DType::kInt64: return fn.template operator()<int64_t>();        \
      case ::tandem::nn::DType::kUInt8: return fn.template operator()<uint8_t>();        \
    }                                                                                    \
    ::tandem::Fail("unknown dtype");                                                     \
  }()

#endif  // TANDEM_NN_DTYPE_H_
