#include "core/bf16.h"

#include "core/kernels/simd.h"

namespace attnserve::core {

ATTNSERVE_CLONES
void FloatsToBf16(const float* from, int64_t n, Bf16* to) {
  ATTNSERVE_SIMD_LOOP
  for (int64_t i = 0; i < n; ++i) to[i] = FloatToBf16(from[i]);
}

ATTNSERVE_CLONES
void ScaledFloatsToBf16(const float* from, int64_t n, float factor, Bf16* to) {
  ATTNSERVE_SIMD_LOOP
  for (int64_t i = 0; i < n; ++i) to[i] = FloatToBf16(from[i] * factor);
}

}  // namespace attnserve::core
