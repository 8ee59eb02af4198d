#include "core/online_softmax.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

// Each exported function has an AVX-512 clone, an AVX2 clone and the
// baseline, chosen once by the dynamic loader (GCC's target_clones on ifunc).
// The inner loops are `omp simd` so that they vectorize at -O2 whatever the
// cost model says; simdlen(16) asks for full 512-bit vectors in the AVX-512
// clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__)
#define ATTNSERVE_CLONES \
  __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define ATTNSERVE_CLONES
#endif

namespace attnserve::core::internal {
namespace {

constexpr float kLog2e = 1.44269504088896341f;
// Below this exp(x) is under 2^-125: it counts as 0.
constexpr float kExpFloor = -87.0f;
// ln(2)^k / k!: 2^f = sum_k c_k f^k.
constexpr float kC1 = 0.693147180559945f;
constexpr float kC2 = 0.240226506959101f;
constexpr float kC3 = 0.0555041086648216f;
constexpr float kC4 = 0.00961812910762848f;
constexpr float kC5 = 0.00133335581464284f;
constexpr float kC6 = 0.000154035303933816f;
constexpr float kC7 = 0.0000152527338040598f;
// 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
constexpr float kRound = 12582912.0f;

[[gnu::always_inline]] inline float Exp(float x) {
  const float t = std::max(x, kExpFloor) * kLog2e;  // NaN stays NaN
  const float r = (t + kRound) - kRound;
  const float f = t - r;
  float p = kC7;
  p = p * f + kC6;
  p = p * f + kC5;
  p = p * f + kC4;
  p = p * f + kC3;
  p = p * f + kC2;
  p = p * f + kC1;
  p = p * f + 1.0f;
  const int32_t e = static_cast<int32_t>(r);
  const float scale = std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23);
  return x < kExpFloor ? 0.0f : p * scale;
}

[[gnu::always_inline]] inline uint16_t ToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

float FastExp(float x) { return Exp(x); }

ATTNSERVE_CLONES
float OnlineSoftmaxRow(float* x, int64_t limit, int64_t width, float& m, float& l,
                       uint16_t* p_bf16) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float block_max = kMinusInf;
#pragma omp simd simdlen(16) reduction(max : block_max)
  for (int64_t j = 0; j < limit; ++j) block_max = std::max(block_max, x[j]);
  const float m_new = std::max(m, block_max);
  if (m_new == kMinusInf) {  // nothing visible so far: p = 0, state unchanged
    if (p_bf16 != nullptr) {
      std::memset(p_bf16, 0, static_cast<size_t>(width) * sizeof(uint16_t));
    } else {
      std::fill(x, x + width, 0.0f);
    }
    return 1.0f;
  }
  float sum = 0.0f;
  if (p_bf16 != nullptr) {
#pragma omp simd simdlen(16) reduction(+ : sum)
    for (int64_t j = 0; j < limit; ++j) {
      const float p = Exp(x[j] - m_new);
      p_bf16[j] = ToBf16(p);
      sum += p;
    }
    std::fill(p_bf16 + limit, p_bf16 + width, uint16_t{0});
  } else {
#pragma omp simd simdlen(16) reduction(+ : sum)
    for (int64_t j = 0; j < limit; ++j) {
      const float p = Exp(x[j] - m_new);
      x[j] = p;
      sum += p;
    }
    std::fill(x + limit, x + width, 0.0f);
  }
  const float alpha = Exp(m - m_new);  // m == -inf: 0
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

ATTNSERVE_CLONES
void ScaleAndAdd(float* o, const float* add, int64_t n, float alpha, bool first) {
  if (first) {
    std::memcpy(o, add, static_cast<size_t>(n) * sizeof(float));
    return;
  }
#pragma omp simd simdlen(16)
  for (int64_t i = 0; i < n; ++i) o[i] = o[i] * alpha + add[i];
}

ATTNSERVE_CLONES
void ScaleRow(float* o, int64_t n, float factor) {
#pragma omp simd simdlen(16)
  for (int64_t i = 0; i < n; ++i) o[i] *= factor;
}

}  // namespace attnserve::core::internal
