#ifndef ATTNSERVE_CORE_BF16_H_
#define ATTNSERVE_CORE_BF16_H_

// bfloat16 <-> float32, the one place the project converts them.

#include <cstdint>
#include <cstring>

namespace attnserve::core {

// A bfloat16 value: the upper 16 bits of an IEEE float32.
using Bf16 = uint16_t;

// Round to nearest even; NaN stays NaN (a quiet NaN). Branch-free, so that
// loops over it vectorize (FloatsToBf16).
inline Bf16 FloatToBf16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<Bf16>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Exact.
inline float Bfloat16ToFloat(Bf16 bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value = 0.0f;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// to[i] = FloatToBf16(from[i]) for i < n, vectorized on the calling thread
// (AVX-512 or AVX2 where the CPU has them). The ranges must not overlap.
void FloatsToBf16(const float* from, int64_t n, Bf16* to);

// to[i] = FloatToBf16(from[i] * factor) for i < n, in one pass, as above.
void ScaledFloatsToBf16(const float* from, int64_t n, float factor, Bf16* to);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_BF16_H_
