#include "core/kernels/online_softmax.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/bf16.h"
#include "core/kernels/simd.h"

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

// A row with nothing visible so far: p = 0, the state stays, alpha 1.
float NothingVisible(float* x, int64_t width, uint16_t* p_bf16) {
  if (p_bf16 != nullptr) {
    std::memset(p_bf16, 0, static_cast<size_t>(width) * sizeof(uint16_t));
  } else {
    std::fill(x, x + width, 0.0f);
  }
  return 1.0f;
}

// The portable row step. Neither GCC nor clang vectorizes its loops (the max
// and the exp's range checks are control flow to them; `omp simd` did not
// help, and clang reports that as an error under -Werror).
float PortableSoftmaxRow(float* x, int64_t limit, int64_t width, float scale, float& m, float& l,
                         uint16_t* p_bf16) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float block_max = kMinusInf;
  for (int64_t j = 0; j < limit; ++j) block_max = std::max(block_max, x[j]);
  const float m_new = std::max(m, block_max);
  if (m_new == kMinusInf) return NothingVisible(x, width, p_bf16);
  float sum = 0.0f;
  if (p_bf16 != nullptr) {
    for (int64_t j = 0; j < limit; ++j) {
      const float p = Exp((x[j] - m_new) * scale);
      p_bf16[j] = FloatToBf16(p);
      sum += p;
    }
    std::fill(p_bf16 + limit, p_bf16 + width, uint16_t{0});
  } else {
    for (int64_t j = 0; j < limit; ++j) {
      const float p = Exp((x[j] - m_new) * scale);
      x[j] = p;
      sum += p;
    }
    std::fill(x + limit, x + width, 0.0f);
  }
  const float alpha = Exp((m - m_new) * scale);  // m == -inf: 0
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

#ifdef ATTNSERVE_X86_INTRINSICS

// 2^t on 16 lanes for t = y log2(e), y <= 0: Exp(y) branch-free, with the
// polynomial of degree kDegree (7: Exp's; 4: for probabilities kept in BF16,
// relative error 4.2e-5 = (ln 2 / 2)^5 / 5!, a hundredth of BF16's rounding).
// Lanes outside `keep` are 0. t is clamped at -160, where p 2^t is 0; between
// that and Exp's floor (exp(y) < 2^-125) the result is subnormal or 0 (Exp
// gives 0 there). NaN stays NaN (max(floor, NaN) is NaN: MAXPS returns its
// second operand when either is NaN).
template <int kDegree>
ATTNSERVE_TARGET_AVX512 inline __m512 Exp2x16(__m512 t, __mmask16 keep) {
  static_assert(kDegree >= 1 && kDegree <= 7);
  constexpr float kCoefficients[8] = {1.0f, kC1, kC2, kC3, kC4, kC5, kC6, kC7};
  t = _mm512_max_ps(_mm512_set1_ps(-160.0f), t);
  const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, r);
  __m512 p = _mm512_set1_ps(kCoefficients[kDegree]);
#pragma GCC unroll 7
  for (int k = kDegree - 1; k >= 0; --k) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kCoefficients[k]));
  }
  return _mm512_maskz_scalef_ps(keep, p, r);  // p * 2^r
}

// The exponent t = (x - m) c of p = 2^t, c = scale log2(e), two ways:
// - subtracting first, (x - m) c: x - m is exact when x and m are within a
//   factor of 2 of each other (and p is 0 when they are not), then one
//   rounding, relative to t. Right for every finite m, however large.
// - fused, one FMA x c - m_c with m_c = m c rounded to FP32: that rounding,
//   up to |m c| 2^-24, shifts every exponent of the row by the same amount,
//   which is harmless only while it is small. At |m c| = 2^8 it is 2^-16,
//   a relative error of 1.1e-5 in p (the degree-4 exponential's is 4.2e-5);
//   at m = -1e10 (a mask's "minus infinity") it is up to 512: 2^t under- or
//   overflows and the row's weights are lost.
// BF16 probabilities take the fused form in rows with |m c| <=
// kFusedShiftLimit (the usual case: scores and masks of ordinary size; it
// saves one operation per score), subtracting first in the others; FP32
// probabilities always subtract first.
constexpr float kFusedShiftLimit = 256.0f;

ATTNSERVE_TARGET_AVX512 inline __m512 ExponentSubtractingFirst(__m512 x, __m512 m, __m512 c) {
  return _mm512_mul_ps(_mm512_sub_ps(x, m), c);
}
ATTNSERVE_TARGET_AVX512 inline __m512 ExponentFused(__m512 x, __m512 m_times_c, __m512 c) {
  return _mm512_fmsub_ps(x, c, m_times_c);
}

// Round to nearest even BF16 (as FloatToBf16; p is never NaN), 16 lanes to 16 halves.
ATTNSERVE_TARGET_AVX512 inline __m256i ToBf16x16(__m512 p) {
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// The parts of the AVX-512 row step around its exp loop: m_new (the new
// running max; -inf when nothing is visible yet, and then p = 0 is written
// and the state stays), and the state update from the row's sum of p.
ATTNSERVE_TARGET_AVX512 inline float NewMax(const float* x, int64_t limit, float m) {
  __m512 max16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < limit; j += 16) {
    const __mmask16 k = FirstLanes(limit - j);
    max16 = _mm512_mask_max_ps(max16, k, _mm512_maskz_loadu_ps(k, x + j), max16);
  }
  return std::max(m, _mm512_reduce_max_ps(max16));
}

ATTNSERVE_TARGET_AVX512 inline float UpdateState(float m_new, __m512 sum16, float scale, float& m,
                                          float& l) {
  const float alpha = Exp((m - m_new) * scale);  // m == -inf: 0
  l = l * alpha + _mm512_reduce_add_ps(sum16);
  m = m_new;
  return alpha;
}

// FP32 probabilities in place, or BF16 rounded in integer lanes (CPUs
// without AVX512-BF16).
ATTNSERVE_TARGET_AVX512 float Avx512SoftmaxRow(float* x, int64_t limit, int64_t width, float scale,
                                        float& m, float& l, uint16_t* p_bf16) {
  const float m_new = NewMax(x, limit, m);
  if (m_new == -std::numeric_limits<float>::infinity()) return NothingVisible(x, width, p_bf16);
  const __m512 shift = _mm512_set1_ps(m_new);
  const __m512 to_log2 = _mm512_set1_ps(scale * kLog2e);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 k = FirstLanes(width - j);
    const __mmask16 visible = j < limit ? FirstLanes(limit - j) : __mmask16{0};
    // Lanes past limit are 0.
    const __m512 scores = _mm512_maskz_loadu_ps(visible, x + j);
    const __m512 p = Exp2x16<7>(ExponentSubtractingFirst(scores, shift, to_log2), visible);
    sum16 = _mm512_add_ps(sum16, p);
    if (p_bf16 != nullptr) {
      _mm256_mask_storeu_epi16(p_bf16 + j, k, ToBf16x16(p));
    } else {
      _mm512_mask_storeu_ps(x + j, k, p);
    }
  }
  return UpdateState(m_new, sum16, scale, m, l);
}

// The exponent's form in a strip's probability pass (see kFusedShiftLimit).
enum class Exponent { kSubtractingFirst, kFused };

// The probability pass of a strip of R rows: p = 2^t with t = (x - m) c, for
// keys [0, limit[r]) of row r (0 past them), FP32 in place (degree-7
// exponential) or BF16 through VCVTNEPS2BF16 (degree 4); sum16[r] += p.
// shift[r] is m (kSubtractingFirst) or m c (kFused).
template <int R, Exponent kExponent, bool kBf16>
[[gnu::always_inline]] ATTNSERVE_TARGET_AVX512_BF16 inline void StripProbabilities(
    float* x, int64_t stride, const int64_t (&limit)[R], int64_t width, const __m512 (&shift)[R],
    __m512 to_log2, __m512 (&sum16)[R], uint16_t* p_bf16) {
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 k = FirstLanes(width - j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __mmask16 visible = j < limit[r] ? FirstLanes(limit[r] - j) : __mmask16{0};
      const __m512 scores = _mm512_maskz_loadu_ps(visible, x + r * stride + j);
      const __m512 t = kExponent == Exponent::kFused
                           ? ExponentFused(scores, shift[r], to_log2)
                           : ExponentSubtractingFirst(scores, shift[r], to_log2);
      if constexpr (kBf16) {
        const __m512 p = Exp2x16<4>(t, visible);
        sum16[r] = _mm512_add_ps(sum16[r], p);
        const __m256bh halves = _mm512_cvtneps_pbh(p);
        _mm256_mask_storeu_epi16(p_bf16 + r * stride + j, k,
                                 reinterpret_cast<const __m256i&>(halves));
      } else {
        const __m512 p = Exp2x16<7>(t, visible);
        sum16[r] = _mm512_add_ps(sum16[r], p);
        _mm512_mask_storeu_ps(x + r * stride + j, k, p);
      }
    }
  }
}

// StripProbabilities for one row of BF16 probabilities (shift: m or m c, as
// kExponent wants); returns the row's sum16.
template <Exponent kExponent>
ATTNSERVE_TARGET_AVX512_BF16 __m512 RowProbabilitiesBf16(float* x, int64_t limit, int64_t width,
                                                         float shift, __m512 to_log2,
                                                         uint16_t* p_bf16) {
  const int64_t limits[1] = {limit};
  const __m512 shifts[1] = {_mm512_set1_ps(shift)};
  __m512 sum16[1] = {_mm512_setzero_ps()};
  StripProbabilities<1, kExponent, true>(x, 0, limits, width, shifts, to_log2, sum16, p_bf16);
  return sum16[0];
}

// OnlineSoftmaxStrip for R rows on CPUs with AVX512-BF16: the rows' passes
// interleaved (R independent dependency chains in the max and the sum), FP32
// probabilities in place or BF16 ones (degree-4 exponential) through
// VCVTNEPS2BF16, as the row functions above compute them.
template <int R>
ATTNSERVE_TARGET_AVX512_BF16 void Avx512SoftmaxStrip(float* x, int64_t stride,
                                                     const int64_t* limits, int64_t width,
                                                     float scale, float* m, float* l, float* alpha,
                                                     uint16_t* p_bf16) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  int64_t limit[R];
  int64_t longest = 0;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    limit[r] = limits[r];
    longest = std::max(longest, limit[r]);
  }
  __m512 max16[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) max16[r] = _mm512_set1_ps(kMinusInf);
  for (int64_t j = 0; j < longest; j += 16) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __mmask16 k = j < limit[r] ? FirstLanes(limit[r] - j) : __mmask16{0};
      max16[r] =
          _mm512_mask_max_ps(max16[r], k, _mm512_maskz_loadu_ps(k, x + r * stride + j), max16[r]);
    }
  }
  const float c = scale * kLog2e;
  float m_new[R];
  // Which exponent BF16 probabilities take, row by row (see kFusedShiftLimit):
  // fused where |m c| is small, subtracting first where it is large (or not
  // finite: NaN compares false). Rows with nothing visible take either.
  bool fusable[R];
  int fusable_rows = 0;
  int large_rows = 0;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    m_new[r] = std::max(m[r], _mm512_reduce_max_ps(max16[r]));
    fusable[r] = std::fabs(m_new[r] * c) <= kFusedShiftLimit;
    if (m_new[r] == kMinusInf) {
      limit[r] = 0;  // nothing visible yet: p = 0 (every lane masked), the state stays
    } else if (fusable[r]) {
      ++fusable_rows;
    } else {
      ++large_rows;
    }
  }
  __m512 sum16[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum16[r] = _mm512_setzero_ps();
  const __m512 to_log2 = _mm512_set1_ps(c);
  const bool fused = p_bf16 != nullptr && large_rows == 0;
  if (p_bf16 == nullptr || fused || fusable_rows == 0) {
    __m512 shift[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) shift[r] = _mm512_set1_ps(fused ? m_new[r] * c : m_new[r]);
    if (p_bf16 == nullptr) {
      StripProbabilities<R, Exponent::kSubtractingFirst, false>(x, stride, limit, width, shift,
                                                                to_log2, sum16, p_bf16);
    } else if (fused) {
      StripProbabilities<R, Exponent::kFused, true>(x, stride, limit, width, shift, to_log2, sum16,
                                                    p_bf16);
    } else {
      StripProbabilities<R, Exponent::kSubtractingFirst, true>(x, stride, limit, width, shift,
                                                               to_log2, sum16, p_bf16);
    }
  } else {
    // BF16 rows of both kinds (a rare strip): each row by itself in its own
    // form, so that it gets exactly what it gets alone.
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sum16[r] =
          fusable[r]
              ? RowProbabilitiesBf16<Exponent::kFused>(x + r * stride, limit[r], width,
                                                       m_new[r] * c, to_log2, p_bf16 + r * stride)
              : RowProbabilitiesBf16<Exponent::kSubtractingFirst>(
                    x + r * stride, limit[r], width, m_new[r], to_log2, p_bf16 + r * stride);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    if (m_new[r] == kMinusInf) {
      alpha[r] = 1.0f;
      continue;
    }
    alpha[r] = Exp((m[r] - m_new[r]) * scale);  // m == -inf: 0
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum16[r]);
    m[r] = m_new[r];
  }
}

using SoftmaxStripFn = void (*)(float*, int64_t, const int64_t*, int64_t, float, float*, float*,
                                float*, uint16_t*);
constexpr SoftmaxStripFn kSoftmaxStrips[8] = {
    &Avx512SoftmaxStrip<1>, &Avx512SoftmaxStrip<2>, &Avx512SoftmaxStrip<3>,
    &Avx512SoftmaxStrip<4>, &Avx512SoftmaxStrip<5>, &Avx512SoftmaxStrip<6>,
    &Avx512SoftmaxStrip<7>, &Avx512SoftmaxStrip<8>};

// Exp on 8 lanes, as the scalar one: y = max(y, kExpFloor) (NaN stays: MAXPS
// returns its second operand when either is NaN), 2^round * p(frac) with the
// degree-7 polynomial, 0 where y < kExpFloor.
ATTNSERVE_TARGET_AVX2_FMA inline __m256 Exp8(__m256 y) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(_mm256_set1_ps(kExpFloor), y),
                                 _mm256_set1_ps(kLog2e));
  const __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, r);
  __m256 p = _mm256_set1_ps(kC7);
  for (const float c : {kC6, kC5, kC4, kC3, kC2, kC1, 1.0f}) {
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  }
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
  const __m256 below = _mm256_cmp_ps(y, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// FP32 probabilities in place, 8 keys a vector, the tail past the last whole
// vector by the scalar Exp; BF16 probabilities as the portable row.
ATTNSERVE_TARGET_AVX2_FMA float Avx2SoftmaxRow(float* x, int64_t limit, int64_t width, float scale,
                                               float& m, float& l, uint16_t* p_bf16) {
  if (p_bf16 != nullptr) return PortableSoftmaxRow(x, limit, width, scale, m, l, p_bf16);
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const int64_t body = limit & ~int64_t{7};
  __m256 max8 = _mm256_set1_ps(kMinusInf);
  for (int64_t j = 0; j < body; j += 8) max8 = _mm256_max_ps(_mm256_loadu_ps(x + j), max8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, max8);
  float m_new = m;
  for (const float lane : lanes) m_new = std::max(m_new, lane);
  for (int64_t j = body; j < limit; ++j) m_new = std::max(m_new, x[j]);
  if (m_new == kMinusInf) return NothingVisible(x, width, nullptr);
  const __m256 shift = _mm256_set1_ps(m_new);
  const __m256 scale8 = _mm256_set1_ps(scale);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 8) {
    const __m256 p = Exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift), scale8));
    _mm256_storeu_ps(x + j, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  _mm256_store_ps(lanes, sum8);
  float sum = 0.0f;
  for (const float lane : lanes) sum += lane;
  for (int64_t j = body; j < limit; ++j) {
    x[j] = Exp((x[j] - m_new) * scale);
    sum += x[j];
  }
  std::fill(x + limit, x + width, 0.0f);
  const float alpha = Exp((m - m_new) * scale);  // m == -inf: 0
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

#endif  // ATTNSERVE_X86_INTRINSICS

}  // namespace

bool SoftmaxKernelRuns(SoftmaxKernel kernel) {
  switch (kernel) {
    case SoftmaxKernel::kPortable:
      return true;
#ifdef ATTNSERVE_X86_INTRINSICS
    case SoftmaxKernel::kAvx512:
      return CpuHasAvx512();
    case SoftmaxKernel::kAvx512Bf16:
      return CpuHasAvx512Bf16();
    case SoftmaxKernel::kAvx2:
      return CpuHasAvx2Fma();
#else
    case SoftmaxKernel::kAvx512:
    case SoftmaxKernel::kAvx512Bf16:
    case SoftmaxKernel::kAvx2:
      return false;
#endif
  }
  return false;
}

float OnlineSoftmaxRowOn(SoftmaxKernel kernel, float* x, int64_t limit, int64_t width, float scale,
                         float& m, float& l, uint16_t* p_bf16) {
#ifdef ATTNSERVE_X86_INTRINSICS
  if (kernel == SoftmaxKernel::kAvx512Bf16) {  // a strip of one row
    float alpha = 1.0f;
    kSoftmaxStrips[0](x, width, &limit, width, scale, &m, &l, &alpha, p_bf16);
    return alpha;
  }
  if (kernel == SoftmaxKernel::kAvx512) {
    return Avx512SoftmaxRow(x, limit, width, scale, m, l, p_bf16);
  }
  if (kernel == SoftmaxKernel::kAvx2) return Avx2SoftmaxRow(x, limit, width, scale, m, l, p_bf16);
#endif
  return PortableSoftmaxRow(x, limit, width, scale, m, l, p_bf16);
}

float OnlineSoftmaxRow(float* x, int64_t limit, int64_t width, float scale, float& m, float& l,
                       uint16_t* p_bf16) {
  static const SoftmaxKernel best = SoftmaxKernelRuns(SoftmaxKernel::kAvx512Bf16)
                                        ? SoftmaxKernel::kAvx512Bf16
                                    : SoftmaxKernelRuns(SoftmaxKernel::kAvx512)
                                        ? SoftmaxKernel::kAvx512
                                    : SoftmaxKernelRuns(SoftmaxKernel::kAvx2)
                                        ? SoftmaxKernel::kAvx2
                                        : SoftmaxKernel::kPortable;
  return OnlineSoftmaxRowOn(best, x, limit, width, scale, m, l, p_bf16);
}

void OnlineSoftmaxStrip(float* x, int64_t stride, int64_t rows, const int64_t* limits,
                        int64_t width, float scale, float* m, float* l, float* alpha,
                        uint16_t* p_bf16) {
#ifdef ATTNSERVE_X86_INTRINSICS
  // FP32 strips wider than 512 keys go row by row: the interleaved passes
  // over 8 such rows (in place, 16+ KiB each way) left L1 and were slower
  // (BM_OnlineSoftmaxStrip: 3.05 against 3.26 G scores/s at 1024).
  if (rows >= 1 && rows <= 8 && CpuHasAvx512Bf16() && (p_bf16 != nullptr || width <= 512)) {
    kSoftmaxStrips[rows - 1](x, stride, limits, width, scale, m, l, alpha, p_bf16);
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) {
    alpha[r] = OnlineSoftmaxRow(x + r * stride, limits[r], width, scale, m[r], l[r],
                                p_bf16 != nullptr ? p_bf16 + r * stride : nullptr);
  }
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
void ScaleInto(const float* from, int64_t n, float factor, float* to) {
  ATTNSERVE_SIMD_LOOP
  for (int64_t i = 0; i < n; ++i) to[i] = from[i] * factor;
}

}  // namespace attnserve::core::internal
