#pragma once

// Scalar conversions between float and the two 16-bit float formats, rounding to nearest
// even like PyTorch's c10::Half and c10::BFloat16. Header-only and `static inline` on
// purpose: each ISA's kernel file includes it and must get its own copy (see reduce_impl.h).

#include <cstdint>
#include <cstring>

namespace loom::kernels {

static inline uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

static inline float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// bfloat16 -> float is exact: the bf16 bits are the float's upper half.
static inline float bf16ToFloat(uint16_t h) {
  return bitsFloat(uint32_t{h} << 16);
}

/// float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
static inline uint16_t floatToBf16(float f) {
  uint32_t u = floatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// IEEE binary16 -> float, exact (subnormals, infinities and NaN included).
static inline float fp16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bitsFloat(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bitsFloat(sign | ((exp + 112) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, exact in float.
  const float mag = static_cast<float>(man) * bitsFloat(0x33800000u);  // 2^-24
  return sign ? -mag : mag;
}

/// float -> IEEE binary16, round to nearest even, overflow to infinity, NaN stays NaN.
static inline uint16_t floatToFp16(float f) {
  const uint32_t u = floatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x1ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs >= 0x38800000u) {                       // normal half
    const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
  }
  // Subnormal half (or zero): scale so that the half's last place is the float's units,
  // then let the float adder round to nearest even.
  const float scaled = bitsFloat(abs) + 0.5f;  // 0.5 = 2^-1 aligns 2^-24 to bit 0 of 2^-1
  return sign | static_cast<uint16_t>(floatBits(scaled) - 0x3f000000u);
}

}  // namespace loom::kernels
