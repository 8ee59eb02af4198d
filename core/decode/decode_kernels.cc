#include "core/decode/decode_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/bf16.h"
#include "core/kernels/simd.h"

namespace attnserve::core::internal {
namespace {

// ATTNSERVE_SIMD_LOOP with a sum over the loop in `sum` (the dot products).
#if defined(__clang__)
#define ATTNSERVE_SIMD_SUM_LOOP
#else
#define ATTNSERVE_SIMD_SUM_LOOP _Pragma("omp simd simdlen(16) reduction(+ : sum)")
#endif

[[gnu::always_inline]] inline float Widen(float x) { return x; }
[[gnu::always_inline]] inline float Widen(Bf16 x) { return Bfloat16ToFloat(x); }

template <typename T>
[[gnu::always_inline]] inline void Scores(const float* __restrict q, const T* __restrict k,
                                          int64_t keys, int64_t head_dim, float* __restrict s) {
  for (int64_t j = 0; j < keys; ++j) {
    const T* row = k + j * head_dim;
    float sum = 0.0f;
    ATTNSERVE_SIMD_SUM_LOOP
    for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * Widen(row[d]);
    s[j] = sum;
  }
}

// Four keys per pass over acc: a quarter of the accumulator's loads and
// stores.
template <typename T>
[[gnu::always_inline]] inline void Values(const float* __restrict p, const T* __restrict v,
                                          int64_t keys, int64_t head_dim, float alpha,
                                          float* __restrict acc) {
  if (alpha != 1.0f) {
    ATTNSERVE_SIMD_LOOP
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= alpha;
  }
  int64_t j = 0;
  for (; j + 4 <= keys; j += 4) {
    const T* r0 = v + j * head_dim;
    const T* r1 = r0 + head_dim;
    const T* r2 = r1 + head_dim;
    const T* r3 = r2 + head_dim;
    const float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
    ATTNSERVE_SIMD_LOOP
    for (int64_t d = 0; d < head_dim; ++d) {
      acc[d] += p0 * Widen(r0[d]) + p1 * Widen(r1[d]) + p2 * Widen(r2[d]) + p3 * Widen(r3[d]);
    }
  }
  for (; j < keys; ++j) {
    const T* row = v + j * head_dim;
    const float pj = p[j];
    ATTNSERVE_SIMD_LOOP
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * Widen(row[d]);
  }
}

#if defined(ATTNSERVE_X86_INTRINSICS)
// AVX2 and FMA; AVX-512 below. Checked at run time by features, never by CPU
// model. The decode reads each K/V byte once, but with G query heads per KV
// head (and BF16 rows widened) a key costs G dot products and G row updates:
// at 8 lanes the arithmetic, not memory, set the pace on BF16 and GQA caches.

ATTNSERVE_TARGET_AVX2_FMA inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
ATTNSERVE_TARGET_AVX2_FMA inline __m256 Load8(const Bf16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// [sum of a[0]'s lanes, ..., sum of a[7]'s lanes].
ATTNSERVE_TARGET_AVX2_FMA inline __m256 LaneSums(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // u0 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], u1 likewise for a4..a7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

ATTNSERVE_TARGET_AVX2_FMA inline float LaneSum(__m256 a) {
  const __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

// q . k for dimensions [from, head_dim) (the tail past whole vectors).
template <typename T>
inline float TailDot(const float* q, const T* k, int64_t from, int64_t head_dim) {
  float sum = 0.0f;
  for (int64_t d = from; d < head_dim; ++d) sum += q[d] * Widen(k[d]);
  return sum;
}

// Eight keys at a time, one accumulator each (independent FMA chains), their
// lanes summed together at the end.
template <typename T>
ATTNSERVE_TARGET_AVX2_FMA void ScoresAvx2(const float* q, const T* k, int64_t keys, int64_t head_dim,
                                      float* s) {
  const int64_t body = head_dim & ~int64_t{7};
  int64_t j = 0;
  for (; j + 8 <= keys; j += 8) {
    const T* rows = k + j * head_dim;
    __m256 acc[8];
    for (__m256& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < body; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        acc[t] = _mm256_fmadd_ps(qv, Load8(rows + t * head_dim + d), acc[t]);
      }
    }
    __m256 sums = LaneSums(acc);
    if (body < head_dim) {
      alignas(32) float tail[8];
      for (int t = 0; t < 8; ++t) tail[t] = TailDot(q, rows + t * head_dim, body, head_dim);
      sums = _mm256_add_ps(sums, _mm256_load_ps(tail));
    }
    _mm256_storeu_ps(s + j, sums);
  }
  for (; j < keys; ++j) {
    const T* row = k + j * head_dim;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < body; d += 8) {
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(row + d), acc);
    }
    s[j] = LaneSum(acc) + TailDot(q, row, body, head_dim);
  }
}

// acc [d0, d0 + 8 kVectors) = acc * alpha + sum_j p_j v_j, held in registers
// over the keys.
template <int kVectors, typename T>
ATTNSERVE_TARGET_AVX2_FMA void ValuesChunkAvx2(const float* p, const T* v, int64_t keys,
                                           int64_t head_dim, int64_t d0, __m256 alpha,
                                           float* acc) {
  __m256 a[kVectors];
#pragma GCC unroll 8
  for (int i = 0; i < kVectors; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), alpha);
  for (int64_t j = 0; j < keys; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* row = v + j * head_dim + d0;
#pragma GCC unroll 8
    for (int i = 0; i < kVectors; ++i) a[i] = _mm256_fmadd_ps(pj, Load8(row + 8 * i), a[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < kVectors; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, a[i]);
}

template <typename T>
ATTNSERVE_TARGET_AVX2_FMA void ValuesAvx2(const float* p, const T* v, int64_t keys, int64_t head_dim,
                                      float alpha, float* acc) {
  const __m256 alpha_v = _mm256_set1_ps(alpha);
  int64_t d = 0;
  for (; d + 64 <= head_dim; d += 64) ValuesChunkAvx2<8>(p, v, keys, head_dim, d, alpha_v, acc);
  for (; d + 32 <= head_dim; d += 32) ValuesChunkAvx2<4>(p, v, keys, head_dim, d, alpha_v, acc);
  for (; d + 8 <= head_dim; d += 8) ValuesChunkAvx2<1>(p, v, keys, head_dim, d, alpha_v, acc);
  for (; d < head_dim; ++d) {
    float sum = acc[d] * alpha;
    for (int64_t j = 0; j < keys; ++j) sum += p[j] * Widen(v[j * head_dim + d]);
    acc[d] = sum;
  }
}
// AVX-512 (F, BW, VL): 16 lanes, head_dim up to kMaxAvx512HeadDim (the
// query row or the accumulator row held in registers), any head_dim through
// masked loads of its last 16 dimensions; longer rows take the AVX2 kernels.
constexpr int64_t kMaxAvx512HeadDim = 128;

// 16 BF16 values (their bits) widened to floats: each shifted into the high
// half of its 32-bit lane.
ATTNSERVE_TARGET_AVX512 inline __m512 Widen16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

ATTNSERVE_TARGET_AVX512 inline __m512 Load16(__mmask16 mask, const float* p) {
  return _mm512_maskz_loadu_ps(mask, p);
}
ATTNSERVE_TARGET_AVX512 inline __m512 Load16(__mmask16 mask, const Bf16* p) {
  return Widen16(_mm256_maskz_loadu_epi16(mask, p));
}

// Lane i of the result = the sum of t[i]'s 16 lanes: a tree of unpacks and
// 128-bit shuffles, 45 operations for 16 sums.
ATTNSERVE_TARGET_AVX512 inline __m512 LaneSums16(const __m512* t) {
  __m512 u[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3].
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]),
                         _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  }
  __m512 w[4];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    // Per 128-bit lane: the partial sums of t[4i] ... t[4i + 3], in order.
    const __m512d x = _mm512_castps_pd(u[2 * i]), y = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(v01, v23, _MM_SHUFFLE(3, 1, 3, 1)));
}

ATTNSERVE_TARGET_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
ATTNSERVE_TARGET_AVX512 inline __m512 Load16(const Bf16* p) {
  return Widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Row chunk c of kChunks (16 dimensions each), the last one `last` masked
// unless kFull (head_dim a multiple of 16: plain loads, which measured
// faster than masked ones).
template <int kChunks, bool kFull, typename T>
ATTNSERVE_TARGET_AVX512 inline __m512 Chunk(const T* row, int c, __mmask16 last) {
  if (kFull || c < kChunks - 1) return Load16(row + 16 * c);
  return Load16(last, row + 16 * c);
}

// s[j] for the `keys` rows of k (row j at k + j * head_dim), sixteen at a
// time: `dot(row)` gives a row's products summed into one vector, and the 16
// vectors are reduced together (LaneSums16).
// Always inlined: GCC 12 otherwise keeps it out of line, one copy per kernel,
// reaching the query vectors `dot` captures through a reference.
template <typename T, typename Dot>
ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) inline void ScoreRows16(
    const T* k, int64_t keys, int64_t head_dim, const Dot& dot, float* s) {
  int64_t j = 0;
  for (; j + 16 <= keys; j += 16) {
    __m512 t[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) t[r] = dot(k + (j + r) * head_dim);
    _mm512_storeu_ps(s + j, LaneSums16(t));
  }
  if (j < keys) {
    const int64_t count = keys - j;
    __m512 t[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) t[r] = r < count ? dot(k + (j + r) * head_dim) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(s + j, FirstLanes(count), LaneSums16(t));
  }
}

// Scores with the query row in registers, kChunks vectors of 16 dimensions
// (ScoreRows16).
template <int kChunks, bool kFull, typename T>
ATTNSERVE_TARGET_AVX512 void ScoresAvx512(const float* q, const T* k, int64_t keys,
                                          int64_t head_dim, __mmask16 last, float* s) {
  __m512 qv[kChunks];
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) qv[c] = Chunk<kChunks, kFull>(q, c, last);
  auto dot = [&](const T* row) ATTNSERVE_TARGET_AVX512 {
    __m512 t = _mm512_mul_ps(qv[0], Chunk<kChunks, kFull>(row, 0, last));
#pragma GCC unroll 8
    for (int c = 1; c < kChunks; ++c) t = _mm512_fmadd_ps(qv[c], Chunk<kChunks, kFull>(row, c, last), t);
    return t;
  };
  ScoreRows16(k, keys, head_dim, dot, s);
}

// acc = acc * alpha + sum_j p_j v_j with two accumulator rows in registers
// (even and odd keys: two independent FMA chains per chunk).
template <int kChunks, bool kFull, typename T>
ATTNSERVE_TARGET_AVX512 void ValuesAvx512(const float* p, const T* v, int64_t keys,
                                          int64_t head_dim, __mmask16 last, float alpha,
                                          float* acc) {
  const __m512 alpha_v = _mm512_set1_ps(alpha);
  __m512 a[kChunks], b[kChunks];
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) {
    a[c] = _mm512_mul_ps(Chunk<kChunks, kFull>(acc, c, last), alpha_v);
    b[c] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 2 <= keys; j += 2) {
    const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
    const T* r0 = v + j * head_dim;
    const T* r1 = r0 + head_dim;
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
      a[c] = _mm512_fmadd_ps(p0, Chunk<kChunks, kFull>(r0, c, last), a[c]);
      b[c] = _mm512_fmadd_ps(p1, Chunk<kChunks, kFull>(r1, c, last), b[c]);
    }
  }
  if (j < keys) {
    const __m512 p0 = _mm512_set1_ps(p[j]);
    const T* r0 = v + j * head_dim;
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) a[c] = _mm512_fmadd_ps(p0, Chunk<kChunks, kFull>(r0, c, last), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < kChunks; ++c) {
    _mm512_mask_storeu_ps(acc + 16 * c, !kFull && c == kChunks - 1 ? last : __mmask16{0xffff},
                          _mm512_add_ps(a[c], b[c]));
  }
}

// The kernel instance for head_dim (<= kMaxAvx512HeadDim): its chunk count
// fixed at compile time, so that the row loops unroll and stay in registers.
template <typename T>
ATTNSERVE_TARGET_AVX512 void ScoresAvx512(const float* q, const T* k, int64_t keys,
                                          int64_t head_dim, float* s) {
  const __mmask16 last = FirstLanes(head_dim - 16 * ((head_dim - 1) / 16));
  if (head_dim == 64) return ScoresAvx512<4, true>(q, k, keys, head_dim, last, s);
  if (head_dim == 128) return ScoresAvx512<8, true>(q, k, keys, head_dim, last, s);
  switch ((head_dim + 15) / 16) {
    case 1: return ScoresAvx512<1, false>(q, k, keys, head_dim, last, s);
    case 2: return ScoresAvx512<2, false>(q, k, keys, head_dim, last, s);
    case 3: return ScoresAvx512<3, false>(q, k, keys, head_dim, last, s);
    case 4: return ScoresAvx512<4, false>(q, k, keys, head_dim, last, s);
    case 5: return ScoresAvx512<5, false>(q, k, keys, head_dim, last, s);
    case 6: return ScoresAvx512<6, false>(q, k, keys, head_dim, last, s);
    case 7: return ScoresAvx512<7, false>(q, k, keys, head_dim, last, s);
    default: return ScoresAvx512<8, false>(q, k, keys, head_dim, last, s);
  }
}

template <typename T>
ATTNSERVE_TARGET_AVX512 void ValuesAvx512(const float* p, const T* v, int64_t keys,
                                          int64_t head_dim, float alpha, float* acc) {
  const __mmask16 last = FirstLanes(head_dim - 16 * ((head_dim - 1) / 16));
  if (head_dim == 64) return ValuesAvx512<4, true>(p, v, keys, head_dim, last, alpha, acc);
  if (head_dim == 128) return ValuesAvx512<8, true>(p, v, keys, head_dim, last, alpha, acc);
  switch ((head_dim + 15) / 16) {
    case 1: return ValuesAvx512<1, false>(p, v, keys, head_dim, last, alpha, acc);
    case 2: return ValuesAvx512<2, false>(p, v, keys, head_dim, last, alpha, acc);
    case 3: return ValuesAvx512<3, false>(p, v, keys, head_dim, last, alpha, acc);
    case 4: return ValuesAvx512<4, false>(p, v, keys, head_dim, last, alpha, acc);
    case 5: return ValuesAvx512<5, false>(p, v, keys, head_dim, last, alpha, acc);
    case 6: return ValuesAvx512<6, false>(p, v, keys, head_dim, last, alpha, acc);
    case 7: return ValuesAvx512<7, false>(p, v, keys, head_dim, last, alpha, acc);
    default: return ValuesAvx512<8, false>(p, v, keys, head_dim, last, alpha, acc);
  }
}
// Scores of BF16 rows of head_dim a multiple of 32 (up to
// kMaxAvx512HeadDim), widened without a shuffle: 32 BF16 values are 16
// 32-bit words, and word i shifted left by 16 is value 2i, masked to its
// high half value 2i + 1 -- so the dot products take even and odd dimensions
// apart, against the query row split once. (P V the same way, with the
// accumulator row split and joined, measured slower than widening: it is the
// AVX-512 ValuesAvx512 for BF16 too.)
constexpr int kMaxPairs = kMaxAvx512HeadDim / 32;

ATTNSERVE_TARGET_AVX512 inline __m512i Words(const Bf16* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
ATTNSERVE_TARGET_AVX512 inline __m512 EvenOf(__m512i words) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}
ATTNSERVE_TARGET_AVX512 inline __m512 OddOf(__m512i words) {
  return _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(-65536)));
}
// Dimensions 2i (even) or 2i + 1 (odd) of x [32], lane i.
ATTNSERVE_TARGET_AVX512 inline __m512 EvenDims(const float* x) {
  const __m512i index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_permutex2var_ps(_mm512_loadu_ps(x), index, _mm512_loadu_ps(x + 16));
}
ATTNSERVE_TARGET_AVX512 inline __m512 OddDims(const float* x) {
  const __m512i index = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_permutex2var_ps(_mm512_loadu_ps(x), index, _mm512_loadu_ps(x + 16));
}

template <int kPairs>
ATTNSERVE_TARGET_AVX512 void ScoresBf16Avx512(const float* q, const Bf16* k, int64_t keys,
                                              int64_t head_dim, float* s) {
  __m512 even[kPairs], odd[kPairs];
#pragma GCC unroll 4
  for (int c = 0; c < kPairs; ++c) {
    even[c] = EvenDims(q + 32 * c);
    odd[c] = OddDims(q + 32 * c);
  }
  auto dot = [&](const Bf16* row) ATTNSERVE_TARGET_AVX512 {
    __m512i w = Words(row);
    __m512 t = _mm512_fmadd_ps(odd[0], OddOf(w), _mm512_mul_ps(even[0], EvenOf(w)));
#pragma GCC unroll 4
    for (int c = 1; c < kPairs; ++c) {
      w = Words(row + 32 * c);
      t = _mm512_fmadd_ps(even[c], EvenOf(w), t);
      t = _mm512_fmadd_ps(odd[c], OddOf(w), t);
    }
    return t;
  };
  ScoreRows16(k, keys, head_dim, dot, s);
}

// True (and done) when the even/odd BF16 kernel takes this head_dim.
ATTNSERVE_TARGET_AVX512 bool ScoresBf16Pairs(const float* q, const Bf16* k, int64_t keys,
                                             int64_t head_dim, float* s) {
  switch (head_dim) {
    case 32: ScoresBf16Avx512<1>(q, k, keys, head_dim, s); return true;
    case 64: ScoresBf16Avx512<2>(q, k, keys, head_dim, s); return true;
    case 96: ScoresBf16Avx512<3>(q, k, keys, head_dim, s); return true;
    case 128: ScoresBf16Avx512<4>(q, k, keys, head_dim, s); return true;
    default: return false;
  }
}
static_assert(kMaxPairs == 4, "the switch above covers head_dim 32 ... 128");

// The group kernels (DecodeGroupScores, DecodeGroupValues): a row policy
// gives a row's kVectors vectors, widened once and used for several heads:
// PlainRows (16 dimensions a vector, the last one masked unless kFull) or,
// for BF16 rows of head_dim a multiple of 32, PairedBf16Rows (even and odd
// dimensions apart, as ScoresBf16Avx512; the query or accumulator rows split
// the same way, and joined back when stored).
template <int kChunks, bool kFull, typename T>
struct PlainRows {
  static constexpr int kVectors = kChunks;
  __mmask16 last;
  ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) void Floats(const float* x,
                                                                    __m512* out) const {
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) out[c] = Chunk<kChunks, kFull>(x, c, last);
  }
  ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) void Row(const T* row,
                                                                 __m512* out) const {
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) out[c] = Chunk<kChunks, kFull>(row, c, last);
  }
  ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) void Store(const __m512* in,
                                                                   float* x) const {
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
      _mm512_mask_storeu_ps(x + 16 * c, !kFull && c == kChunks - 1 ? last : __mmask16{0xffff},
                            in[c]);
    }
  }
};

template <int kPairs>
struct PairedBf16Rows {
  static constexpr int kVectors = 2 * kPairs;
  ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) void Floats(const float* x,
                                                                    __m512* out) const {
#pragma GCC unroll 4
    for (int c = 0; c < kPairs; ++c) {
      out[2 * c] = EvenDims(x + 32 * c);
      out[2 * c + 1] = OddDims(x + 32 * c);
    }
  }
  ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) void Row(const Bf16* row,
                                                                 __m512* out) const {
#pragma GCC unroll 4
    for (int c = 0; c < kPairs; ++c) {
      const __m512i w = Words(row + 32 * c);
      out[2 * c] = EvenOf(w);
      out[2 * c + 1] = OddOf(w);
    }
  }
  // Interleaves even and odd dimensions back into x [32 kPairs].
  ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) void Store(const __m512* in,
                                                                   float* x) const {
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i high =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#pragma GCC unroll 4
    for (int c = 0; c < kPairs; ++c) {
      _mm512_storeu_ps(x + 32 * c, _mm512_permutex2var_ps(in[2 * c], low, in[2 * c + 1]));
      _mm512_storeu_ps(x + 32 * c + 16, _mm512_permutex2var_ps(in[2 * c], high, in[2 * c + 1]));
    }
  }
};

// [sum of t0's lanes, ..., sum of t3's lanes].
ATTNSERVE_TARGET_AVX512 inline __m128 LaneSums4(__m512 t0, __m512 t1, __m512 t2, __m512 t3) {
  // Per 128-bit lane: [t0 (0+2), t1 (0+2), t0 (1+3), t1 (1+3)], likewise t2, t3.
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(t0, t1), _mm512_unpackhi_ps(t0, t1));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(t2, t3), _mm512_unpackhi_ps(t2, t3));
  // Per 128-bit lane: the partial sums of t0, t1, t2, t3.
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  const __m512 c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// The loop over the keys of the group scores passes: `dot(row, t)` puts a K
// row's products with the pass's kHeads query rows in t[0 .. kHeads), each a
// vector to be summed; four keys' vectors are reduced together per head into
// s. With `prefetch`, the next span's rows are prefetched as these are read.
template <int kHeads, typename T, typename Dot>
ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) inline void ScoreKeysByFour(
    BlockRows<T> k, int64_t keys, int64_t head_dim, float* s, int64_t s_stride, bool prefetch,
    const Dot& dot) {
  for (int64_t j0 = 0; j0 < keys; j0 += k.block_rows) {
    const T* block = k.blocks[j0 / k.block_rows];
    const T* next = prefetch ? NextBlock(k, j0) : nullptr;
    const int64_t n = std::min(k.block_rows, keys - j0);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      if (next) {
        for (int r = 0; r < 4; ++r) PrefetchRow(k, next, j0, j + r, head_dim);
      }
      __m512 t[4][kHeads];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) dot(block + (j + r) * head_dim, t[r]);
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        _mm_storeu_ps(s + h * s_stride + j0 + j, LaneSums4(t[0][h], t[1][h], t[2][h], t[3][h]));
      }
    }
    if (j < n) {
      const int64_t count = n - j;
      if (next) {
        for (int64_t r = 0; r < count; ++r) PrefetchRow(k, next, j0, j + r, head_dim);
      }
      __m512 t[4][kHeads];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        if (r < count) {
          dot(block + (j + r) * head_dim, t[r]);
        } else {
          for (int h = 0; h < kHeads; ++h) t[r][h] = _mm512_setzero_ps();
        }
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        _mm_mask_storeu_ps(s + h * s_stride + j0 + j, static_cast<__mmask8>(FirstLanes(count)),
                           LaneSums4(t[0][h], t[1][h], t[2][h], t[3][h]));
      }
    }
  }
}

// Scores of kHeads query rows (q rows of head_dim floats) over the keys,
// four keys at a time: each K row loaded and widened once, its products with
// every head's query row, and the four keys' sums reduced together per head.
template <int kHeads, typename Rows, typename T>
ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) inline void GroupScoresPass(
    const Rows& rows, const float* q, BlockRows<T> k, int64_t keys, int64_t head_dim, float* s,
    int64_t s_stride, bool prefetch) {
  constexpr int kV = Rows::kVectors;
  __m512 qv[kHeads][kV];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) rows.Floats(q + h * head_dim, qv[h]);
  auto dot = [&](const T* row, __m512* t) ATTNSERVE_TARGET_AVX512 {
    __m512 w[kV];
    rows.Row(row, w);
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      __m512 x = _mm512_mul_ps(qv[h][0], w[0]);
#pragma GCC unroll 8
      for (int c = 1; c < kV; ++c) x = _mm512_fmadd_ps(qv[h][c], w[c], x);
      t[h] = x;
    }
  };
  ScoreKeysByFour<kHeads>(k, keys, head_dim, s, s_stride, prefetch, dot);
}

// acc [h] = acc [h] * alpha [h] + p [h] x V for kHeads rows, the accumulator
// rows in registers over the keys, each V row loaded and widened once for all
// of them; kParity 2: even and odd keys into separate accumulators (more
// independent FMA chains when kHeads kVectors is small).
template <int kHeads, int kParity, typename Rows, typename T>
ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) inline void GroupValuesPass(
    const Rows& rows, const float* p, int64_t p_stride, BlockRows<T> v, int64_t keys,
    int64_t head_dim, const float* alpha, float* acc, bool prefetch) {
  constexpr int kV = Rows::kVectors;
  __m512 a[kParity][kHeads][kV];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    rows.Floats(acc + h * head_dim, a[0][h]);
    const __m512 alpha_h = _mm512_set1_ps(alpha[h]);
#pragma GCC unroll 8
    for (int c = 0; c < kV; ++c) {
      a[0][h][c] = _mm512_mul_ps(a[0][h][c], alpha_h);
      if constexpr (kParity == 2) a[1][h][c] = _mm512_setzero_ps();
    }
  }
  auto add = [&](const T* row, int64_t j, __m512(*to)[kV]) ATTNSERVE_TARGET_AVX512 {
    __m512 w[kV];
    rows.Row(row, w);
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * p_stride + j]);
#pragma GCC unroll 8
      for (int c = 0; c < kV; ++c) to[h][c] = _mm512_fmadd_ps(ph, w[c], to[h][c]);
    }
  };
  for (int64_t j0 = 0; j0 < keys; j0 += v.block_rows) {
    const T* block = v.blocks[j0 / v.block_rows];
    const T* next = prefetch ? NextBlock(v, j0) : nullptr;
    const int64_t n = std::min(v.block_rows, keys - j0);
    int64_t j = 0;
    if constexpr (kParity == 2) {
      for (; j + 2 <= n; j += 2) {
        if (next) {
          PrefetchRow(v, next, j0, j, head_dim);
          PrefetchRow(v, next, j0, j + 1, head_dim);
        }
        add(block + j * head_dim, j0 + j, a[0]);
        add(block + (j + 1) * head_dim, j0 + j + 1, a[kParity - 1]);
      }
    }
    for (; j < n; ++j) {
      if (next) PrefetchRow(v, next, j0, j, head_dim);
      add(block + j * head_dim, j0 + j, a[0]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    if constexpr (kParity == 2) {
#pragma GCC unroll 8
      for (int c = 0; c < kV; ++c) a[0][h][c] = _mm512_add_ps(a[0][h][c], a[kParity - 1][h][c]);
    }
    rows.Store(a[0][h], acc + h * head_dim);
  }
}

// The passes over the group's rows: kHeads rows at a time while they last,
// then fewer (kHeads is 1, 2 or 4).
template <int kHeads, typename Rows, typename T>
ATTNSERVE_TARGET_AVX512 void GroupScoresAvx512(const Rows& rows, const float* q, int64_t group,
                                               BlockRows<T> k, int64_t keys, int64_t head_dim,
                                               float* s, int64_t s_stride) {
  // The first pass prefetches the next rows (BlockRows::next_blocks).
  int64_t h = 0;
  for (; h + kHeads <= group; h += kHeads) {
    GroupScoresPass<kHeads>(rows, q + h * head_dim, k, keys, head_dim, s + h * s_stride, s_stride,
                            h == 0);
  }
  if constexpr (kHeads > 2) {
    for (; h + 2 <= group; h += 2) {
      GroupScoresPass<2>(rows, q + h * head_dim, k, keys, head_dim, s + h * s_stride, s_stride,
                         h == 0);
    }
  }
  if constexpr (kHeads > 1) {
    for (; h < group; ++h) {
      GroupScoresPass<1>(rows, q + h * head_dim, k, keys, head_dim, s + h * s_stride, s_stride,
                         h == 0);
    }
  }
}

template <int kHeads, typename Rows, typename T>
ATTNSERVE_TARGET_AVX512 void GroupValuesAvx512(const Rows& rows, const float* p, int64_t p_stride,
                                               int64_t group, BlockRows<T> v, int64_t keys,
                                               int64_t head_dim, const float* alpha, float* acc) {
  constexpr int kV = Rows::kVectors;
  int64_t h = 0;
  for (; h + kHeads <= group; h += kHeads) {
    GroupValuesPass<kHeads, kHeads * kV < 8 ? 2 : 1>(rows, p + h * p_stride, p_stride, v, keys,
                                                     head_dim, alpha + h, acc + h * head_dim,
                                                     h == 0);
  }
  if constexpr (kHeads > 2) {
    for (; h + 2 <= group; h += 2) {
      GroupValuesPass<2, 2 * kV < 8 ? 2 : 1>(rows, p + h * p_stride, p_stride, v, keys, head_dim,
                                             alpha + h, acc + h * head_dim, h == 0);
    }
  }
  if constexpr (kHeads > 1) {
    for (; h < group; ++h) {
      GroupValuesPass<1, kV < 8 ? 2 : 1>(rows, p + h * p_stride, p_stride, v, keys, head_dim,
                                         alpha + h, acc + h * head_dim, h == 0);
    }
  }
}

// Heads per pass by the row's vectors, so that the query (or accumulator)
// rows, the widened K (V) row and the sums stay in the 32 registers.
template <typename Rows, typename T>
ATTNSERVE_TARGET_AVX512 void GroupScoresBy(const Rows& rows, const float* q, int64_t group,
                                           BlockRows<T> k, int64_t keys, int64_t head_dim,
                                           float* s, int64_t s_stride) {
  constexpr int kV = Rows::kVectors;
  GroupScoresAvx512<(kV <= 2 ? 4 : kV <= 4 ? 2 : 1)>(rows, q, group, k, keys, head_dim, s,
                                                     s_stride);
}
template <typename Rows, typename T>
ATTNSERVE_TARGET_AVX512 void GroupValuesBy(const Rows& rows, const float* p, int64_t p_stride,
                                           int64_t group, BlockRows<T> v, int64_t keys,
                                           int64_t head_dim, const float* alpha, float* acc) {
  constexpr int kV = Rows::kVectors;
  GroupValuesAvx512<(kV <= 4 ? 4 : 2)>(rows, p, p_stride, group, v, keys, head_dim, alpha, acc);
}

// Runs `run` with the row policy for head_dim (<= kMaxAvx512HeadDim): its
// vector count fixed at compile time, so that the row loops unroll and stay
// in registers (one switch for the scores and the values kernels).
template <typename T, typename Run>
ATTNSERVE_TARGET_AVX512 __attribute__((always_inline)) inline void WithRows(int64_t head_dim,
                                                                           const Run& run) {
  if constexpr (std::is_same_v<T, Bf16>) {
    switch (head_dim) {
      case 32: return run(PairedBf16Rows<1>{});
      case 64: return run(PairedBf16Rows<2>{});
      case 96: return run(PairedBf16Rows<3>{});
      case 128: return run(PairedBf16Rows<4>{});
      default: break;
    }
  }
  const __mmask16 last = FirstLanes(head_dim - 16 * ((head_dim - 1) / 16));
  if (head_dim == 64) return run(PlainRows<4, true, T>{last});
  if (head_dim == 128) return run(PlainRows<8, true, T>{last});
  switch ((head_dim + 15) / 16) {
    case 1: return run(PlainRows<1, false, T>{last});
    case 2: return run(PlainRows<2, false, T>{last});
    case 3: return run(PlainRows<3, false, T>{last});
    case 4: return run(PlainRows<4, false, T>{last});
    case 5: return run(PlainRows<5, false, T>{last});
    case 6: return run(PlainRows<6, false, T>{last});
    case 7: return run(PlainRows<7, false, T>{last});
    default: return run(PlainRows<8, false, T>{last});
  }
}

template <typename T>
ATTNSERVE_TARGET_AVX512 void GroupScoresAvx512(const float* q, int64_t group, BlockRows<T> k,
                                               int64_t keys, int64_t head_dim, float* s,
                                               int64_t s_stride) {
  WithRows<T>(head_dim, [&](const auto& rows) ATTNSERVE_TARGET_AVX512 {
    GroupScoresBy(rows, q, group, k, keys, head_dim, s, s_stride);
  });
}

template <typename T>
ATTNSERVE_TARGET_AVX512 void GroupValuesAvx512(const float* p, int64_t p_stride, int64_t group,
                                               BlockRows<T> v, int64_t keys, int64_t head_dim,
                                               const float* alpha, float* acc) {
  WithRows<T>(head_dim, [&](const auto& rows) ATTNSERVE_TARGET_AVX512 {
    GroupValuesBy(rows, p, p_stride, group, v, keys, head_dim, alpha, acc);
  });
}

// Group scores of BF16 K rows by VDPBF16PS, which multiplies BF16 pairs
// exactly and sums them in FP32: each query row is split once into BF16
// pairs hi (the row rounded) and lo (the rest, rounded), and q . k = hi . k +
// lo . k holds q to 16 significant bits (hi + lo within 2^-17 of q_d,
// relative: 1/512 of the rounding the BF16 K rows already carry; the decode
// kernels' test holds the scores to 1e-5 of the sum of |q_d k_d| against
// double precision, as the FP32 kernels). The BF16 instructions flush
// subnormals (a q_d under 2^-126 counts as 0, its lo part under about
// 2^-118), and a q_d at or past BF16's largest finite value (3.39e38) would
// score NaN: neither reaches a query row of a finite layer here. The K rows
// are used as stored, never widened. At head_dim 64 a key and head take four
// VDPBF16PS where the widening kernels take a multiply and three FMAs and,
// per key, four shifts or masks. The key loop and the prefetch are
// ScoreKeysByFour's.
template <int kPairs>
struct SplitBf16Query {
  __m512bh hi[kPairs], lo[kPairs];
};

// Splits q (kPairs x 32 floats) into out: hi = q rounded to BF16, lo = the
// rest (q - hi) rounded to BF16.
template <int kPairs>
ATTNSERVE_TARGET_AVX512_BF16 __attribute__((always_inline)) inline void SplitQueryRow(
    const float* q, SplitBf16Query<kPairs>& out) {
#pragma GCC unroll 4
  for (int c = 0; c < kPairs; ++c) {
    __m256bh hi[2], lo[2];
    for (int half = 0; half < 2; ++half) {
      const __m512 x = _mm512_loadu_ps(q + 32 * c + 16 * half);
      hi[half] = _mm512_cvtneps_pbh(x);
      const __m512 rounded = Widen16(reinterpret_cast<__m256i>(hi[half]));
      lo[half] = _mm512_cvtneps_pbh(_mm512_sub_ps(x, rounded));
    }
    // Dimensions 32c ... 32c + 31 in order, as a K row's 32 BF16 values.
    out.hi[c] = reinterpret_cast<__m512bh>(_mm512_inserti64x4(
        _mm512_castsi256_si512(reinterpret_cast<__m256i>(hi[0])), reinterpret_cast<__m256i>(hi[1]),
        1));
    out.lo[c] = reinterpret_cast<__m512bh>(_mm512_inserti64x4(
        _mm512_castsi256_si512(reinterpret_cast<__m256i>(lo[0])), reinterpret_cast<__m256i>(lo[1]),
        1));
  }
}

template <int kHeads, int kPairs>
ATTNSERVE_TARGET_AVX512_BF16 __attribute__((always_inline)) inline void GroupScoresDpPass(
    const float* q, BlockRows<Bf16> k, int64_t keys, int64_t head_dim, float* s, int64_t s_stride,
    bool prefetch) {
  SplitBf16Query<kPairs> qs[kHeads];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) SplitQueryRow(q + h * head_dim, qs[h]);
  auto dot = [&](const Bf16* row, __m512* t) ATTNSERVE_TARGET_AVX512_BF16 {
    __m512bh w[kPairs];
#pragma GCC unroll 4
    for (int c = 0; c < kPairs; ++c) {
      w[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + 32 * c));
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qs[h].hi[0], w[0]);
      x = _mm512_dpbf16_ps(x, qs[h].lo[0], w[0]);
#pragma GCC unroll 4
      for (int c = 1; c < kPairs; ++c) {
        x = _mm512_dpbf16_ps(x, qs[h].hi[c], w[c]);
        x = _mm512_dpbf16_ps(x, qs[h].lo[c], w[c]);
      }
      t[h] = x;
    }
  };
  ScoreKeysByFour<kHeads>(k, keys, head_dim, s, s_stride, prefetch, dot);
}

// Two heads a pass (the split query rows, eight sums and the K row in the 32
// registers up to head_dim 128), the first pass prefetching. Flattened: the
// passes' `dot` lambdas carry the BF16 target, which ScoreKeysByFour (AVX-512
// only) cannot inline by itself; everything is inlined here instead.
template <int kPairs>
ATTNSERVE_TARGET_AVX512_BF16 __attribute__((flatten)) void GroupScoresDp(
    const float* q, int64_t group, BlockRows<Bf16> k, int64_t keys, int64_t head_dim, float* s,
    int64_t s_stride) {
  int64_t h = 0;
  for (; h + 2 <= group; h += 2) {
    GroupScoresDpPass<2, kPairs>(q + h * head_dim, k, keys, head_dim, s + h * s_stride, s_stride,
                                 h == 0);
  }
  if (h < group) {
    GroupScoresDpPass<1, kPairs>(q + h * head_dim, k, keys, head_dim, s + h * s_stride, s_stride,
                                 h == 0);
  }
}

// True (and done) when the VDPBF16PS kernel takes this head_dim.
ATTNSERVE_TARGET_AVX512_BF16 bool GroupScoresBf16Dp(const float* q, int64_t group,
                                                    BlockRows<Bf16> k, int64_t keys,
                                                    int64_t head_dim, float* s,
                                                    int64_t s_stride) {
  switch (head_dim) {
    case 32: GroupScoresDp<1>(q, group, k, keys, head_dim, s, s_stride); return true;
    case 64: GroupScoresDp<2>(q, group, k, keys, head_dim, s, s_stride); return true;
    case 96: GroupScoresDp<3>(q, group, k, keys, head_dim, s, s_stride); return true;
    case 128: GroupScoresDp<4>(q, group, k, keys, head_dim, s, s_stride); return true;
    default: return false;
  }
}
#endif  // ATTNSERVE_X86_INTRINSICS

// The portable versions, vectorized by the compiler.
ATTNSERVE_CLONES
void PortableScores(const float* q, const float* k, int64_t keys, int64_t head_dim, float* s) {
  Scores(q, k, keys, head_dim, s);
}

ATTNSERVE_CLONES
void PortableScores(const float* q, const Bf16* k, int64_t keys, int64_t head_dim, float* s) {
  Scores(q, k, keys, head_dim, s);
}

ATTNSERVE_CLONES
void PortableValues(const float* p, const float* v, int64_t keys, int64_t head_dim, float alpha,
                    float* acc) {
  Values(p, v, keys, head_dim, alpha, acc);
}

ATTNSERVE_CLONES
void PortableValues(const float* p, const Bf16* v, int64_t keys, int64_t head_dim, float alpha,
                    float* acc) {
  Values(p, v, keys, head_dim, alpha, acc);
}

// kAvx512 and kAvx512Bf16 share the AVX-512 kernels (kAvx512Bf16 differs in
// GroupScoresOn only).
bool IsAvx512(DecodeKernel kernel) {
  return kernel == DecodeKernel::kAvx512 || kernel == DecodeKernel::kAvx512Bf16;
}

template <typename T>
void ScoresOn(DecodeKernel kernel, const float* q, const T* k, int64_t keys, int64_t head_dim,
              float* s) {
#if defined(ATTNSERVE_X86_INTRINSICS)
  if (IsAvx512(kernel) && head_dim <= kMaxAvx512HeadDim) {
    if constexpr (std::is_same_v<T, Bf16>) {
      if (ScoresBf16Pairs(q, k, keys, head_dim, s)) return;
    }
    return ScoresAvx512(q, k, keys, head_dim, s);
  }
  if (kernel != DecodeKernel::kPortable) return ScoresAvx2(q, k, keys, head_dim, s);
#endif
  (void)kernel;
  PortableScores(q, k, keys, head_dim, s);
}

template <typename T>
void ValuesOn(DecodeKernel kernel, const float* p, const T* v, int64_t keys, int64_t head_dim,
              float alpha, float* acc) {
#if defined(ATTNSERVE_X86_INTRINSICS)
  if (IsAvx512(kernel) && head_dim <= kMaxAvx512HeadDim) {
    return ValuesAvx512(p, v, keys, head_dim, alpha, acc);
  }
  if (kernel != DecodeKernel::kPortable) return ValuesAvx2(p, v, keys, head_dim, alpha, acc);
#endif
  (void)kernel;
  PortableValues(p, v, keys, head_dim, alpha, acc);
}

// Group kernels: fused on AVX-512 (head_dim up to kMaxAvx512HeadDim), else
// each head and block through ScoresOn / ValuesOn.
template <typename T>
void GroupScoresOn(DecodeKernel kernel, const float* q, int64_t group, BlockRows<T> k,
                   int64_t keys, int64_t head_dim, float* s, int64_t s_stride) {
#if defined(ATTNSERVE_X86_INTRINSICS)
  if (kernel == DecodeKernel::kAvx512Bf16 && head_dim <= kMaxAvx512HeadDim) {
    if constexpr (std::is_same_v<T, Bf16>) {
      if (GroupScoresBf16Dp(q, group, k, keys, head_dim, s, s_stride)) return;
    }
  }
  if (IsAvx512(kernel) && head_dim <= kMaxAvx512HeadDim) {
    return GroupScoresAvx512(q, group, k, keys, head_dim, s, s_stride);
  }
#endif
  for (int64_t j = 0; j < k.next_keys; ++j) PrefetchNextRow(k, j, head_dim);
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t j0 = 0; j0 < keys; j0 += k.block_rows) {
      ScoresOn(kernel, q + h * head_dim, k.blocks[j0 / k.block_rows],
               std::min(k.block_rows, keys - j0), head_dim, s + h * s_stride + j0);
    }
  }
}

template <typename T>
void GroupValuesOn(DecodeKernel kernel, const float* p, int64_t p_stride, int64_t group,
                   BlockRows<T> v, int64_t keys, int64_t head_dim, const float* alpha,
                   float* acc) {
#if defined(ATTNSERVE_X86_INTRINSICS)
  if (IsAvx512(kernel) && head_dim <= kMaxAvx512HeadDim) {
    return GroupValuesAvx512(p, p_stride, group, v, keys, head_dim, alpha, acc);
  }
#endif
  for (int64_t j = 0; j < v.next_keys; ++j) PrefetchNextRow(v, j, head_dim);
  for (int64_t h = 0; h < group; ++h) {
    float a = alpha[h];
    if (keys == 0) {
      ValuesOn(kernel, p, static_cast<const T*>(nullptr), 0, head_dim, a, acc + h * head_dim);
    }
    for (int64_t j0 = 0; j0 < keys; j0 += v.block_rows) {
      ValuesOn(kernel, p + h * p_stride + j0, v.blocks[j0 / v.block_rows],
               std::min(v.block_rows, keys - j0), head_dim, a, acc + h * head_dim);
      a = 1.0f;
    }
  }
}

DecodeKernel BestKernel() {
#if defined(ATTNSERVE_X86_INTRINSICS)
  if (CpuHasAvx512Bf16()) return DecodeKernel::kAvx512Bf16;
  if (CpuHasAvx512()) return DecodeKernel::kAvx512;
  if (CpuHasAvx2Fma()) return DecodeKernel::kAvx2;
#endif
  return DecodeKernel::kPortable;
}

}  // namespace

bool DecodeKernelRuns(DecodeKernel kernel) {
  switch (kernel) {
    case DecodeKernel::kPortable:
      return true;
#if defined(ATTNSERVE_X86_INTRINSICS)
    case DecodeKernel::kAvx2:
      return CpuHasAvx2Fma();
    case DecodeKernel::kAvx512:
      // Its rows past kMaxAvx512HeadDim run the AVX2 kernels.
      return CpuHasAvx512() && CpuHasAvx2Fma();
    case DecodeKernel::kAvx512Bf16:
      return CpuHasAvx512Bf16() && CpuHasAvx2Fma();
#endif
    default:
      return false;
  }
}

void DecodeScoresOn(DecodeKernel kernel, const float* q, const float* k, int64_t keys,
                    int64_t head_dim, float* s) {
  ScoresOn(kernel, q, k, keys, head_dim, s);
}
void DecodeScoresOn(DecodeKernel kernel, const float* q, const Bf16* k, int64_t keys,
                    int64_t head_dim, float* s) {
  ScoresOn(kernel, q, k, keys, head_dim, s);
}
void DecodeValuesOn(DecodeKernel kernel, const float* p, const float* v, int64_t keys,
                    int64_t head_dim, float alpha, float* acc) {
  ValuesOn(kernel, p, v, keys, head_dim, alpha, acc);
}
void DecodeValuesOn(DecodeKernel kernel, const float* p, const Bf16* v, int64_t keys,
                    int64_t head_dim, float alpha, float* acc) {
  ValuesOn(kernel, p, v, keys, head_dim, alpha, acc);
}

void DecodeGroupScoresOn(DecodeKernel kernel, const float* q, int64_t group, BlockRows<float> k,
                         int64_t keys, int64_t head_dim, float* s, int64_t s_stride) {
  GroupScoresOn(kernel, q, group, k, keys, head_dim, s, s_stride);
}
void DecodeGroupScoresOn(DecodeKernel kernel, const float* q, int64_t group, BlockRows<Bf16> k,
                         int64_t keys, int64_t head_dim, float* s, int64_t s_stride) {
  GroupScoresOn(kernel, q, group, k, keys, head_dim, s, s_stride);
}
void DecodeGroupValuesOn(DecodeKernel kernel, const float* p, int64_t p_stride, int64_t group,
                         BlockRows<float> v, int64_t keys, int64_t head_dim, const float* alpha,
                         float* acc) {
  GroupValuesOn(kernel, p, p_stride, group, v, keys, head_dim, alpha, acc);
}
void DecodeGroupValuesOn(DecodeKernel kernel, const float* p, int64_t p_stride, int64_t group,
                         BlockRows<Bf16> v, int64_t keys, int64_t head_dim, const float* alpha,
                         float* acc) {
  GroupValuesOn(kernel, p, p_stride, group, v, keys, head_dim, alpha, acc);
}

void DecodeScores(const float* q, const float* k, int64_t keys, int64_t head_dim, float* s) {
  static const DecodeKernel kernel = BestKernel();
  ScoresOn(kernel, q, k, keys, head_dim, s);
}
void DecodeScores(const float* q, const Bf16* k, int64_t keys, int64_t head_dim, float* s) {
  static const DecodeKernel kernel = BestKernel();
  ScoresOn(kernel, q, k, keys, head_dim, s);
}
void DecodeValues(const float* p, const float* v, int64_t keys, int64_t head_dim, float alpha,
                  float* acc) {
  static const DecodeKernel kernel = BestKernel();
  ValuesOn(kernel, p, v, keys, head_dim, alpha, acc);
}
void DecodeValues(const float* p, const Bf16* v, int64_t keys, int64_t head_dim, float alpha,
                  float* acc) {
  static const DecodeKernel kernel = BestKernel();
  ValuesOn(kernel, p, v, keys, head_dim, alpha, acc);
}

void DecodeGroupScores(const float* q, int64_t group, BlockRows<float> k, int64_t keys,
                       int64_t head_dim, float* s, int64_t s_stride) {
  static const DecodeKernel kernel = BestKernel();
  GroupScoresOn(kernel, q, group, k, keys, head_dim, s, s_stride);
}
void DecodeGroupScores(const float* q, int64_t group, BlockRows<Bf16> k, int64_t keys,
                       int64_t head_dim, float* s, int64_t s_stride) {
  static const DecodeKernel kernel = BestKernel();
  GroupScoresOn(kernel, q, group, k, keys, head_dim, s, s_stride);
}
void DecodeGroupValues(const float* p, int64_t p_stride, int64_t group, BlockRows<float> v,
                       int64_t keys, int64_t head_dim, const float* alpha, float* acc) {
  static const DecodeKernel kernel = BestKernel();
  GroupValuesOn(kernel, p, p_stride, group, v, keys, head_dim, alpha, acc);
}
void DecodeGroupValues(const float* p, int64_t p_stride, int64_t group, BlockRows<Bf16> v,
                       int64_t keys, int64_t head_dim, const float* alpha, float* acc) {
  static const DecodeKernel kernel = BestKernel();
  GroupValuesOn(kernel, p, p_stride, group, v, keys, head_dim, alpha, acc);
}

}  // namespace attnserve::core::internal
