#include "core/kernels/block_kernels.h"

#include <cstdint>
#include <cstring>

#include "core/kernels/simd.h"

// The register tiles. Scores: kStripRows rows x up to 3 key tiles (24 FP32
// accumulators of the 32 vector registers; per step of the reduction 3 vector
// loads and 8 broadcasts feed 24 multiply-adds). P V: kStripRows rows x up to
// 2 tiles of 16 output dimensions (16 accumulators; 2 loads and 8 broadcasts
// per 16 multiply-adds). Each tile's shape is a template parameter so that the
// accumulators are registers.

namespace attnserve::core::internal {
namespace {

constexpr int kScoreTiles = 3;
constexpr int kValueTiles = 2;
static_assert(kStripRows == 8, "the dispatch tables below have kStripRows entries");

int64_t RoundUp(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// The 4-byte unit at `from` (a BF16 pair or an FP32), unaligned.
inline uint32_t Unit(const void* from) {
  uint32_t unit;
  std::memcpy(&unit, from, sizeof(unit));
  return unit;
}

#ifdef ATTNSERVE_X86_INTRINSICS

// ---- Packing. ----

// Transposes 16 x 16 4-byte units in place: r[i] lane c -> r[c] lane i.
// Unpacking pairs of units, then pairs of pairs, leaves 4 x 4 blocks
// transposed within each 128-bit lane; two rounds of lane shuffles put the
// blocks in place.
ATTNSERVE_TARGET_AVX512 inline void Transpose16x16(__m512i r[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4 q + k]: rows 4q..4q+3, column k + 4 L in 128-bit lane L
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);  // lanes 0, 1 of each
    const __m512i x1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xee);  // lanes 2, 3
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xee);
    r[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);       // lane 0 of the four
    r[k + 4] = _mm512_shuffle_i32x4(x0, y0, 0xdd);   // lane 1
    r[k + 8] = _mm512_shuffle_i32x4(x1, y1, 0x88);   // lane 2
    r[k + 12] = _mm512_shuffle_i32x4(x1, y1, 0xdd);  // lane 3
  }
}

// Both key layouts are the transpose of 4-byte units (a BF16 pair or an FP32)
// within each tile of 16 keys: 16 x 16 units at a time.
ATTNSERVE_TARGET_AVX512 void PackKeyBlockAvx512(const void* k, int64_t row_stride, int64_t keys,
                                             int64_t valid, int64_t head_dim, bool bf16,
                                             void* packed) {
  const int64_t element_bytes = bf16 ? 2 : 4;
  const int64_t units = head_dim * element_bytes / 4;
  const int64_t rows = valid < keys ? valid : keys;
  const char* const from = static_cast<const char*>(k);
  int32_t* const to = static_cast<int32_t*>(packed);
  const int64_t tiles = (keys + kKeyTile - 1) / kKeyTile;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    int32_t* const tile_to = to + tile * units * kKeyTile;
    for (int64_t u0 = 0; u0 < units; u0 += 16) {
      const __mmask16 columns = FirstLanes(units - u0);
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const int64_t j = tile * kKeyTile + i;
        r[i] = j < rows ? _mm512_maskz_loadu_epi32(columns,
                                                   from + (j * row_stride) * element_bytes + 4 * u0)
                        : _mm512_setzero_si512();
      }
      Transpose16x16(r);
      const int64_t n = units - u0 < 16 ? units - u0 : 16;
      for (int64_t c = 0; c < n; ++c) _mm512_storeu_si512(tile_to + (u0 + c) * kKeyTile, r[c]);
    }
  }
}

// Pairs of key rows interleaved: packed row j / 2 = v[j][0], v[j+1][0],
// v[j][1], ... 32 dimensions at a time.
ATTNSERVE_TARGET_AVX512 void PackValueBlockAvx512(const Bf16* v, int64_t row_stride, int64_t keys,
                                               int64_t valid, int64_t head_dim, Bf16* packed) {
  alignas(64) static constexpr int16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                    53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                    27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_load_si512(kHigh);
  const int64_t rows = valid < keys ? valid : keys;
  const int64_t padded = (keys + kKeyTile - 1) / kKeyTile * kKeyTile;
  for (int64_t j = 0; j < padded; j += 2) {
    Bf16* const to = packed + j * head_dim;  // (j / 2) * 2 * head_dim
    for (int64_t d = 0; d < head_dim; d += 32) {
      const __mmask32 lanes =
          head_dim - d >= 32 ? ~__mmask32{0} : (__mmask32{1} << (head_dim - d)) - 1;
      const __m512i a = j < rows ? _mm512_maskz_loadu_epi16(lanes, v + j * row_stride + d)
                                 : _mm512_setzero_si512();
      const __m512i b = j + 1 < rows ? _mm512_maskz_loadu_epi16(lanes, v + (j + 1) * row_stride + d)
                                     : _mm512_setzero_si512();
      _mm512_storeu_si512(to + 2 * d, _mm512_permutex2var_epi16(a, low, b));
      if (head_dim - d > 16)
        _mm512_storeu_si512(to + 2 * d + 32, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// ---- The accumulator tiles (inlined into the FP32 and BF16 kernels). ----

template <int R, int C>
[[gnu::always_inline]] ATTNSERVE_TARGET_AVX512 inline void ZeroTile(__m512 (&acc)[R][C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
}

// acc = 0 (first) or o * alpha[r].
template <int R, int C>
[[gnu::always_inline]] ATTNSERVE_TARGET_AVX512 inline void LoadScaledTile(
    __m512 (&acc)[R][C], const float* o, int64_t o_stride, const float* alpha, bool first) {
  if (first) return ZeroTile(acc);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * o_stride + c * 16), a);
    }
  }
}

template <int R, int C>
[[gnu::always_inline]] ATTNSERVE_TARGET_AVX512 inline void StoreTile(const __m512 (&acc)[R][C],
                                                                  float* o, int64_t o_stride) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * o_stride + c * 16, acc[r][c]);
  }
}

// ---- Scores: s[r][16 c + l] = sum_d q[r][d] k[16 c + l][d]. ----

// R rows x C key tiles. BF16: the reduction runs over pairs of dimensions
// (q's pair broadcast, the tiles' pairs loaded), FP32 over dimensions.
template <int R, int C>
ATTNSERVE_TARGET_AVX512_BF16 void ScoresTileBf16(const Bf16* q, int64_t q_stride, const Bf16* k,
                                          int64_t tile_elements, int64_t pairs, float* s,
                                          int64_t s_stride) {
  __m512 acc[R][C];
  ZeroTile(acc);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i keys[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) keys[c] = _mm512_loadu_si512(k + c * tile_elements + p * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i pair = _mm512_set1_epi32(static_cast<int>(Unit(q + r * q_stride + 2 * p)));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)pair, (__m512bh)keys[c]);
      }
    }
  }
  StoreTile(acc, s, s_stride);
}

template <int R, int C>
ATTNSERVE_TARGET_AVX512 void ScoresTileF32(const float* q, int64_t q_stride, const float* k,
                                        int64_t tile_elements, int64_t dims, float* s,
                                        int64_t s_stride) {
  __m512 acc[R][C];
  ZeroTile(acc);
  for (int64_t d = 0; d < dims; ++d) {
    __m512 keys[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) keys[c] = _mm512_loadu_ps(k + c * tile_elements + d * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * q_stride + d]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(x, keys[c], acc[r][c]);
    }
  }
  StoreTile(acc, s, s_stride);
}

// R rows against `tiles` key tiles, kScoreTiles at a time.
template <int R>
ATTNSERVE_TARGET_AVX512_BF16 void ScoresRowsBf16(const void* q, int64_t q_stride, const void* k,
                                          int64_t tiles, int64_t head_dim, float* s,
                                          int64_t s_stride) {
  const Bf16* const qb = static_cast<const Bf16*>(q);
  const Bf16* const kb = static_cast<const Bf16*>(k);
  const int64_t tile_elements = head_dim * kKeyTile;
  const int64_t pairs = head_dim / 2;
  int64_t t = 0;
  for (; t + kScoreTiles <= tiles; t += kScoreTiles) {
    ScoresTileBf16<R, kScoreTiles>(qb, q_stride, kb + t * tile_elements, tile_elements, pairs,
                                   s + t * 16, s_stride);
  }
  if (tiles - t == 2) {
    ScoresTileBf16<R, 2>(qb, q_stride, kb + t * tile_elements, tile_elements, pairs, s + t * 16,
                         s_stride);
  } else if (tiles - t == 1) {
    ScoresTileBf16<R, 1>(qb, q_stride, kb + t * tile_elements, tile_elements, pairs, s + t * 16,
                         s_stride);
  }
}

template <int R>
ATTNSERVE_TARGET_AVX512 void ScoresRowsF32(const void* q, int64_t q_stride, const void* k,
                                        int64_t tiles, int64_t head_dim, float* s,
                                        int64_t s_stride) {
  const float* const qf = static_cast<const float*>(q);
  const float* const kf = static_cast<const float*>(k);
  const int64_t tile_elements = head_dim * kKeyTile;
  int64_t t = 0;
  for (; t + kScoreTiles <= tiles; t += kScoreTiles) {
    ScoresTileF32<R, kScoreTiles>(qf, q_stride, kf + t * tile_elements, tile_elements, head_dim,
                                  s + t * 16, s_stride);
  }
  if (tiles - t == 2) {
    ScoresTileF32<R, 2>(qf, q_stride, kf + t * tile_elements, tile_elements, head_dim, s + t * 16,
                        s_stride);
  } else if (tiles - t == 1) {
    ScoresTileF32<R, 1>(qf, q_stride, kf + t * tile_elements, tile_elements, head_dim, s + t * 16,
                        s_stride);
  }
}

using ScoresRowsFn = void (*)(const void*, int64_t, const void*, int64_t, int64_t, float*, int64_t);
// [rows - 1]
constexpr ScoresRowsFn kScoresRowsBf16[kStripRows] = {
    &ScoresRowsBf16<1>, &ScoresRowsBf16<2>, &ScoresRowsBf16<3>, &ScoresRowsBf16<4>,
    &ScoresRowsBf16<5>, &ScoresRowsBf16<6>, &ScoresRowsBf16<7>, &ScoresRowsBf16<8>};
constexpr ScoresRowsFn kScoresRowsF32[kStripRows] = {
    &ScoresRowsF32<1>, &ScoresRowsF32<2>, &ScoresRowsF32<3>, &ScoresRowsF32<4>,
    &ScoresRowsF32<5>, &ScoresRowsF32<6>, &ScoresRowsF32<7>, &ScoresRowsF32<8>};

// ---- P V: o[r][16 t + l] = o * alpha[r] + sum_j p[r][j] v[j][16 t + l]. ----

// R rows x D tiles of 16 output dimensions; v points at the first tile.
template <int R, int D>
ATTNSERVE_TARGET_AVX512_BF16 void ValuesTileBf16(const Bf16* p, int64_t p_stride, int64_t pairs,
                                          const Bf16* v, int64_t pair_stride, const float* alpha,
                                          bool first, float* o, int64_t o_stride) {
  __m512 acc[R][D];
  LoadScaledTile(acc, o, o_stride, alpha, first);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i values[D];
#pragma GCC unroll 4
    for (int d = 0; d < D; ++d) values[d] = _mm512_loadu_si512(v + j * pair_stride + d * 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i pair = _mm512_set1_epi32(static_cast<int>(Unit(p + r * p_stride + 2 * j)));
#pragma GCC unroll 4
      for (int d = 0; d < D; ++d) {
        acc[r][d] = _mm512_dpbf16_ps(acc[r][d], (__m512bh)pair, (__m512bh)values[d]);
      }
    }
  }
  StoreTile(acc, o, o_stride);
}

template <int R, int D>
ATTNSERVE_TARGET_AVX512 void ValuesTileF32(const float* p, int64_t p_stride, int64_t keys,
                                        const float* v, int64_t v_stride, const float* alpha,
                                        bool first, float* o, int64_t o_stride) {
  __m512 acc[R][D];
  LoadScaledTile(acc, o, o_stride, alpha, first);
  for (int64_t j = 0; j < keys; ++j) {
    __m512 values[D];
#pragma GCC unroll 4
    for (int d = 0; d < D; ++d) values[d] = _mm512_loadu_ps(v + j * v_stride + d * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(p[r * p_stride + j]);
#pragma GCC unroll 4
      for (int d = 0; d < D; ++d) acc[r][d] = _mm512_fmadd_ps(x, values[d], acc[r][d]);
    }
  }
  StoreTile(acc, o, o_stride);
}

// R rows over every output dimension, kValueTiles at a time. head_dim is a
// multiple of 16.
template <int R>
ATTNSERVE_TARGET_AVX512_BF16 void ValuesRowsBf16(const Bf16* p, int64_t p_stride, int64_t keys,
                                          const Bf16* v, int64_t head_dim, const float* alpha,
                                          bool first, float* o, int64_t o_stride) {
  const int64_t tiles = head_dim / 16;
  const int64_t pairs = keys / 2;
  const int64_t pair_stride = 2 * head_dim;
  int64_t t = 0;
  for (; t + kValueTiles <= tiles; t += kValueTiles) {
    ValuesTileBf16<R, kValueTiles>(p, p_stride, pairs, v + t * 32, pair_stride, alpha, first,
                                   o + t * 16, o_stride);
  }
  if (t < tiles) {
    ValuesTileBf16<R, 1>(p, p_stride, pairs, v + t * 32, pair_stride, alpha, first, o + t * 16,
                         o_stride);
  }
}

template <int R>
ATTNSERVE_TARGET_AVX512 void ValuesRowsF32(const float* p, int64_t p_stride, int64_t keys,
                                        const float* v, int64_t v_stride, int64_t head_dim,
                                        const float* alpha, bool first, float* o,
                                        int64_t o_stride) {
  const int64_t tiles = head_dim / 16;
  int64_t t = 0;
  for (; t + kValueTiles <= tiles; t += kValueTiles) {
    ValuesTileF32<R, kValueTiles>(p, p_stride, keys, v + t * 16, v_stride, alpha, first, o + t * 16,
                                  o_stride);
  }
  if (t < tiles) {
    ValuesTileF32<R, 1>(p, p_stride, keys, v + t * 16, v_stride, alpha, first, o + t * 16,
                        o_stride);
  }
}

using ValuesRowsBf16Fn = void (*)(const Bf16*, int64_t, int64_t, const Bf16*, int64_t, const float*,
                                  bool, float*, int64_t);
constexpr ValuesRowsBf16Fn kValuesRowsBf16[kStripRows] = {
    &ValuesRowsBf16<1>, &ValuesRowsBf16<2>, &ValuesRowsBf16<3>, &ValuesRowsBf16<4>,
    &ValuesRowsBf16<5>, &ValuesRowsBf16<6>, &ValuesRowsBf16<7>, &ValuesRowsBf16<8>};
using ValuesRowsF32Fn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t,
                                 const float*, bool, float*, int64_t);
constexpr ValuesRowsF32Fn kValuesRowsF32[kStripRows] = {
    &ValuesRowsF32<1>, &ValuesRowsF32<2>, &ValuesRowsF32<3>, &ValuesRowsF32<4>,
    &ValuesRowsF32<5>, &ValuesRowsF32<6>, &ValuesRowsF32<7>, &ValuesRowsF32<8>};
#endif  // ATTNSERVE_X86_INTRINSICS

}  // namespace

bool OwnBlockKernelsAvailable(bool bf16, int64_t head_dim) {
#ifdef ATTNSERVE_X86_INTRINSICS
  if (head_dim <= 0 || head_dim % 16 != 0) return false;
  return bf16 ? CpuHasAvx512Bf16() : CpuHasAvx512();
#else
  (void)bf16;
  (void)head_dim;
  return false;
#endif
}

int64_t PackedBlockElements(int64_t keys, int64_t head_dim) {
  return RoundUp(keys, kKeyTile) * head_dim;
}

void PackKeyBlock(const void* k, int64_t row_stride, int64_t keys, int64_t valid, int64_t head_dim,
                  bool bf16, void* packed) {
#ifdef ATTNSERVE_X86_INTRINSICS
  PackKeyBlockAvx512(k, row_stride, keys, valid, head_dim, bf16, packed);
#else
  (void)k, (void)row_stride, (void)keys, (void)valid, (void)head_dim, (void)bf16, (void)packed;
#endif
}

void PackValueBlockBf16(const Bf16* v, int64_t row_stride, int64_t keys, int64_t valid,
                        int64_t head_dim, Bf16* packed) {
#ifdef ATTNSERVE_X86_INTRINSICS
  PackValueBlockAvx512(v, row_stride, keys, valid, head_dim, packed);
#else
  (void)v, (void)row_stride, (void)keys, (void)valid, (void)head_dim, (void)packed;
#endif
}

void BlockScores(bool bf16, const void* q, int64_t q_stride, int64_t rows, const void* k_packed,
                 int64_t tiles, int64_t head_dim, float* scores, int64_t scores_stride) {
#ifdef ATTNSERVE_X86_INTRINSICS
  if (rows < 1 || rows > kStripRows || tiles < 1) return;
  const ScoresRowsFn run = bf16 ? kScoresRowsBf16[rows - 1] : kScoresRowsF32[rows - 1];
  run(q, q_stride, k_packed, tiles, head_dim, scores, scores_stride);
#else
  (void)bf16, (void)q, (void)q_stride, (void)rows, (void)k_packed, (void)tiles, (void)head_dim,
      (void)scores, (void)scores_stride;
#endif
}

void BlockValuesBf16(const Bf16* p, int64_t p_stride, int64_t rows, int64_t keys,
                     const Bf16* v_packed, int64_t head_dim, const float* alpha, bool first,
                     float* acc, int64_t acc_stride) {
#ifdef ATTNSERVE_X86_INTRINSICS
  if (rows < 1 || rows > kStripRows) return;
  kValuesRowsBf16[rows - 1](p, p_stride, keys, v_packed, head_dim, alpha, first, acc, acc_stride);
#else
  (void)p, (void)p_stride, (void)rows, (void)keys, (void)v_packed, (void)head_dim, (void)alpha,
      (void)first, (void)acc, (void)acc_stride;
#endif
}

void BlockValuesFp32(const float* p, int64_t p_stride, int64_t rows, int64_t keys, const float* v,
                     int64_t v_stride, int64_t head_dim, const float* alpha, bool first, float* acc,
                     int64_t acc_stride) {
#ifdef ATTNSERVE_X86_INTRINSICS
  if (rows < 1 || rows > kStripRows) return;
  kValuesRowsF32[rows - 1](p, p_stride, keys, v, v_stride, head_dim, alpha, first, acc, acc_stride);
#else
  (void)p, (void)p_stride, (void)rows, (void)keys, (void)v, (void)v_stride, (void)head_dim,
      (void)alpha, (void)first, (void)acc, (void)acc_stride;
#endif
}

}  // namespace attnserve::core::internal
