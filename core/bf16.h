#ifndef ATTNSERVE_CORE_BF16_H_
#define ATTNSERVE_CORE_BF16_H_

// bfloat16 <-> float32, the one place the project converts them.

#include <cstdint>
#include <cstring>

namespace attnserve::core {

// A bfloat16 value: the upper 16 bits of an IEEE float32.
using Bf16 = uint16_t;

// Round to nearest even; NaN stays NaN (a quiet NaN).
inline Bf16 FloatToBf16(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<Bf16>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<Bf16>(bits >> 16);
}

// Exact.
inline float Bfloat16ToFloat(Bf16 bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value = 0.0f;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_BF16_H_
