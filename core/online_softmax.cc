#include "core/online_softmax.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/bf16.h"
#include "core/simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_ps(),
// which -Wmaybe-uninitialized reports where they are inlined.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define ATTNSERVE_AVX512_ROW 1
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


}  // namespace

float FastExp(float x) { return Exp(x); }

namespace {

// The portable row step. Neither GCC nor clang vectorizes its loops (the max
// and the exp's range checks are control flow to them; `omp simd` did not
// help, and clang reports that as an error under -Werror).
float PortableSoftmaxRow(float* x, int64_t limit, int64_t width, float& m, float& l,
                         uint16_t* p_bf16) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float block_max = kMinusInf;
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
    for (int64_t j = 0; j < limit; ++j) {
      const float p = Exp(x[j] - m_new);
      p_bf16[j] = FloatToBf16(p);
      sum += p;
    }
    std::fill(p_bf16 + limit, p_bf16 + width, uint16_t{0});
  } else {
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

#ifdef ATTNSERVE_AVX512_ROW
#define ATTNSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

// Exp above on 16 lanes: the same polynomial and range, branch-free. NaN
// stays NaN (max(floor, NaN) is NaN: MAXPS returns its second operand when
// either is NaN).
ATTNSERVE_AVX512 inline __m512 Exp16(__m512 x) {
  const __m512 floor = _mm512_set1_ps(kExpFloor);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(floor, x), _mm512_set1_ps(kLog2e));
  const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, r);
  __m512 p = _mm512_set1_ps(kC7);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512 e = _mm512_scalef_ps(p, r);  // p * 2^r
  const __mmask16 below = _mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ);
  return _mm512_mask_mov_ps(e, below, _mm512_setzero_ps());
}

// Round to nearest even BF16 (as FloatToBf16; p is never NaN), 16 lanes to 16 halves.
ATTNSERVE_AVX512 inline __m256i ToBf16x16(__m512 p) {
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

ATTNSERVE_AVX512 float Avx512SoftmaxRow(float* x, int64_t limit, int64_t width, float& m,
                                        float& l, uint16_t* p_bf16) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  auto tail = [](int64_t left) -> __mmask16 {
    return left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1u);
  };
  __m512 max16 = _mm512_set1_ps(kMinusInf);
  for (int64_t j = 0; j < limit; j += 16) {
    const __mmask16 k = tail(limit - j);
    max16 = _mm512_mask_max_ps(max16, k, _mm512_maskz_loadu_ps(k, x + j), max16);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(max16));
  if (m_new == kMinusInf) {
    if (p_bf16 != nullptr) {
      std::memset(p_bf16, 0, static_cast<size_t>(width) * sizeof(uint16_t));
    } else {
      std::fill(x, x + width, 0.0f);
    }
    return 1.0f;
  }
  const __m512 shift = _mm512_set1_ps(m_new);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 k = tail(width - j);
    const __mmask16 visible = j < limit ? tail(limit - j) : __mmask16{0};
    // Lanes past limit are 0.
    const __m512 scores = _mm512_maskz_loadu_ps(visible, x + j);
    const __m512 p = _mm512_maskz_mov_ps(visible, Exp16(_mm512_sub_ps(scores, shift)));
    sum16 = _mm512_add_ps(sum16, p);
    if (p_bf16 != nullptr) {
      _mm256_mask_storeu_epi16(p_bf16 + j, k, ToBf16x16(p));
    } else {
      _mm512_mask_storeu_ps(x + j, k, p);
    }
  }
  const float alpha = Exp(m - m_new);  // m == -inf: 0
  l = l * alpha + _mm512_reduce_add_ps(sum16);
  m = m_new;
  return alpha;
}

bool HasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}

// p [width] (FP32 probabilities: 0 or normal numbers, never subnormal, which
// VCVTNEPS2BF16 would flush) to BF16 with the CPU's own rounding, which then
// equals FloatToBf16.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void NativeProbabilitiesToBf16(
    const float* p, int64_t width, uint16_t* p_bf16) {
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = width - j;
    const __mmask16 k = left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1u);
    const __m256bh halves = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, p + j));
    _mm256_mask_storeu_epi16(p_bf16 + j, k, reinterpret_cast<const __m256i&>(halves));
  }
}

bool HasAvx512Bf16() {
  static const bool has = HasAvx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif  // ATTNSERVE_AVX512_ROW

}  // namespace

float OnlineSoftmaxRow(float* x, int64_t limit, int64_t width, float& m, float& l,
                       uint16_t* p_bf16) {
#ifdef ATTNSERVE_AVX512_ROW
  if (p_bf16 != nullptr && HasAvx512Bf16()) {
    // The FP32 row in place, then the CPU's conversion: cheaper than rounding
    // in integer lanes inside the row loop (measured: the BF16 row step
    // 79 -> 65 thousand cycles per 256 x 256 block).
    const float alpha = Avx512SoftmaxRow(x, limit, width, m, l, nullptr);
    NativeProbabilitiesToBf16(x, width, p_bf16);
    return alpha;
  }
  if (HasAvx512()) return Avx512SoftmaxRow(x, limit, width, m, l, p_bf16);
#endif
  return PortableSoftmaxRow(x, limit, width, m, l, p_bf16);
}

ATTNSERVE_CLONES
void ScaleAndAdd(float* o, const float* add, int64_t n, float alpha, bool first) {
  if (first) {
    std::memcpy(o, add, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  ATTNSERVE_SIMD_LOOP
  for (int64_t i = 0; i < n; ++i) o[i] = o[i] * alpha + add[i];
}

ATTNSERVE_CLONES
void ScaleRow(float* o, int64_t n, float factor) {
  ATTNSERVE_SIMD_LOOP
  for (int64_t i = 0; i < n; ++i) o[i] *= factor;
}

ATTNSERVE_CLONES
void ScaleInto(const float* from, int64_t n, float factor, float* to) {
  ATTNSERVE_SIMD_LOOP
  for (int64_t i = 0; i < n; ++i) to[i] = from[i] * factor;
}

}  // namespace attnserve::core::internal
