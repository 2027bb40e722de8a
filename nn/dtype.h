// Element types of tensors. float32 is the default; float64 is for gradient
// checks; bfloat16 is a storage type for mixed precision (nn/autocast.h): ops with
// bfloat16 kernels do their arithmetic in float32; int64 holds class labels and
// indices; uint8 holds raw image bytes. float16 (IEEE binary16) is a storage type
// only, for exchanging weights (nn/safetensors.h) and checkpoints: tensors of it
// can be made, filled, copied, converted (to(), copy_()) and saved, and every op
// with arithmetic rejects it naming the dtype (convert to float32 first).
#ifndef TANDEM_NN_DTYPE_H_
#define TANDEM_NN_DTYPE_H_

#include <cstdint>
#include <cstring>


namespace tandem::nn {

// The numeric values are the dtype codes of checkpoint files (nn/checkpoint.h):
// append new dtypes, never renumber.
enum class DType : uint8_t { kFloat32, kFloat64, kBFloat16, kInt64, kUInt8, kFloat16 };

inline constexpr DType kFloat32 = DType::kFloat32;
inline constexpr DType kFloat64 = DType::kFloat64;
inline constexpr DType kBFloat16 = DType::kBFloat16;
inline constexpr DType kInt64 = DType::kInt64;
inline constexpr DType kUInt8 = DType::kUInt8;
inline constexpr DType kFloat16 = DType::kFloat16;

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

// float16: IEEE 754 binary16 (1 sign, 5 exponent, 10 mantissa bits), with
// subnormals, infinities and NaN. From float32: round to nearest, ties to even;
// magnitudes from 65520 up become infinity; every NaN becomes the quiet NaN
// 0x7e00 (with its sign). To float32: exact.
struct Float16 {
  uint16_t bits = 0;
  Float16() = default;
  explicit Float16(float f) : bits(FromFloat(f)) {}
  explicit operator float() const { return ToFloat(bits); }
  static uint16_t FromFloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) {  // |f| >= 65536, infinity or NaN
      return static_cast<uint16_t>(sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u));
    }
    if (u < 0x38800000u) {  // below 2^-14: a float16 subnormal or zero
      // Adding 0.5 puts the value's float16 mantissa in the float's low bits,
      // rounded to nearest even by the float addition itself.
      float scaled;
      std::memcpy(&scaled, &u, sizeof scaled);
      scaled += 0.5f;
      uint32_t r;
      std::memcpy(&r, &scaled, sizeof r);
      return static_cast<uint16_t>(sign | (r - 0x3f000000u));
    }
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to
    // nearest even; a carry out of the mantissa moves to the exponent (up to
    // infinity for 65520 <= |f| < 65536).
    const uint32_t odd = (u >> 13) & 1u;
    u += 0xc8000fffu + odd;
    return static_cast<uint16_t>(sign | (u >> 13));
  }
  static float ToFloat(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    uint32_t u;
    if (exponent == 0x1fu) {
      u = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
      u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else {
      // Zero or subnormal: mantissa * 2^-24, exact in float32.
      float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      std::memcpy(&u, &f, sizeof u);
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
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
    case DType::kFloat16: return 2;
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
    case DType::kFloat16: return "float16";
  }
  return "?";
}

// The floating dtypes that ops compute in (float16 is storage only: see above).
constexpr bool IsFloating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kBFloat16;
}

// Every floating dtype, float16 included (what a conversion between floating
// dtypes may target).
constexpr bool IsFloatingPoint(DType t) { return IsFloating(t) || t == DType::kFloat16; }

// C++ type <-> DType.
template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::kBFloat16; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kInt64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::kUInt8; };
template <> struct DTypeOf<Float16> { static constexpr DType value = DType::kFloat16; };

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

// TANDEM_DISPATCH_ALL(dtype, [&]<typename scalar_t>() { ... }): every dtype
// (BFloat16 and Float16 are structs that convert to and from float explicitly).
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
      case ::tandem::nn::DType::kFloat16:                                                \
        return fn.template operator()<::tandem::nn::Float16>();                          \
    }                                                                                    \
    ::tandem::Fail("unknown dtype");                                                     \
  }()

#endif  // TANDEM_NN_DTYPE_H_
