#ifndef ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_
#define ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_

// Private to core/: the row loops of the decode attention
// (core/decode/paged_attention.h) over one KV head's rows of one cache block,
// FP32 accumulation, BF16 rows widened as they are read (but the group scores'
// on CPUs with AVX512_BF16: VDPBF16PS against the query rows split into BF16
// hi + lo). The first implementation that runs on this CPU is chosen once by
// its features: AVX-512 intrinsics (scores sixteen keys at a time, each key's
// products reduced together; P V with two accumulator rows in registers, for
// head_dim up to 128, longer rows as AVX2), AVX2+FMA intrinsics (scores eight
// keys at a time with independent accumulators; P V with the accumulator row
// held in registers over the keys), and plain C++ that GCC vectorizes
// (ATTNSERVE_CLONES).

#include <cstdint>

#include "core/bf16.h"

namespace attnserve::core::internal {

// s [keys] = k [keys, head_dim] (row-major) x q [head_dim], unscaled.
void DecodeScores(const float* q, const float* k, int64_t keys, int64_t head_dim, float* s);
void DecodeScores(const float* q, const Bf16* k, int64_t keys, int64_t head_dim, float* s);

// acc [head_dim] = acc * alpha + p [keys] x v [keys, head_dim] (row-major).
void DecodeValues(const float* p, const float* v, int64_t keys, int64_t head_dim, float alpha,
                  float* acc);
void DecodeValues(const float* p, const Bf16* v, int64_t keys, int64_t head_dim, float alpha,
                  float* acc);

// The rows of one KV head over a span of keys that crosses cache blocks: key
// j's row is at blocks[j / block_rows] + (j % block_rows) * head_dim.
// Optionally the rows the caller reads next (the next span's, laid out the
// same way): row j of them is prefetched as row j is read, a span's worth of
// work ahead of its use (a hint: it changes no result).
template <typename T>
struct BlockRows {
  const T* const* blocks = nullptr;
  int64_t block_rows = 0;
  const T* const* next_blocks = nullptr;
  int64_t next_keys = 0;
};

// The block of rows.next_blocks that the keys from j0 (a block's first key)
// pair with, or nullptr when the next span has no keys there. The kernels
// look it up once a block: a division per row measured in the profiles.
template <typename T>
inline const T* NextBlock(const BlockRows<T>& rows, int64_t j0) {
  return j0 < rows.next_keys ? rows.next_blocks[j0 / rows.block_rows] : nullptr;
}

// Prefetches row j of `next` (NextBlock(rows, j0)), key j0 + j of the next
// span, if it has that key, as non-temporal (PREFETCHNTA: the row is read
// once, a span later). On the Zen 5 measured, BF16 decode from memory took
// 0.77-1.04x the time it took with PREFETCHT1 (about 0.95x; less in 16 of 18
// alternated pairs; docs/measurements.md, "Prefetch hints").
template <typename T>
inline void PrefetchRow(const BlockRows<T>& rows, const T* next, int64_t j0, int64_t j,
                        int64_t head_dim) {
  if (j0 + j >= rows.next_keys) return;
  const char* row = reinterpret_cast<const char*>(next + j * head_dim);
  const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 0);
}

// Prefetches row j of rows.next_blocks (if j < rows.next_keys): PrefetchRow.
template <typename T>
inline void PrefetchNextRow(const BlockRows<T>& rows, int64_t j, int64_t head_dim) {
  const int64_t j0 = j - j % rows.block_rows;
  if (const T* next = NextBlock(rows, j0)) PrefetchRow(rows, next, j0, j - j0, head_dim);
}

// The G (`group`) query heads that share one KV head, over `keys` keys of it:
// s [r, keys] (row r at s + r * s_stride) = K x q [r] (q rows [group,
// head_dim] contiguous), unscaled. Each K row is read, and a BF16 one widened
// (or, with AVX512_BF16, multiplied as stored by VDPBF16PS), once for several
// heads (as many as the registers hold), and the call spans blocks (no
// per-block dispatch). Thread-safe (writes only s).
void DecodeGroupScores(const float* q, int64_t group, BlockRows<float> k, int64_t keys,
                       int64_t head_dim, float* s, int64_t s_stride);
void DecodeGroupScores(const float* q, int64_t group, BlockRows<Bf16> k, int64_t keys,
                       int64_t head_dim, float* s, int64_t s_stride);

// acc [r] = acc [r] * alpha [r] + p [r] x V for the `group` rows r (acc rows
// [group, head_dim] contiguous, p row r at p + r * p_stride), V rows read (and
// BF16 ones widened) once for several heads. Thread-safe (writes only acc).
void DecodeGroupValues(const float* p, int64_t p_stride, int64_t group, BlockRows<float> v,
                       int64_t keys, int64_t head_dim, const float* alpha, float* acc);
void DecodeGroupValues(const float* p, int64_t p_stride, int64_t group, BlockRows<Bf16> v,
                       int64_t keys, int64_t head_dim, const float* alpha, float* acc);

// The implementations, for tests: DecodeScores and DecodeValues run the first
// of kAvx512Bf16, kAvx512, kAvx2, kPortable that runs here (by the CPU's
// features: AVX-512 F/BW/DQ/VL and AVX512_BF16; AVX-512 F/BW/DQ/VL; AVX2 and
// FMA). kAvx512Bf16 is kAvx512 but for the group scores of BF16 rows (head_dim
// a multiple of 32), which take VDPBF16PS instead of widening the rows.
enum class DecodeKernel { kPortable, kAvx2, kAvx512, kAvx512Bf16 };
bool DecodeKernelRuns(DecodeKernel kernel);
void DecodeScoresOn(DecodeKernel kernel, const float* q, const float* k, int64_t keys,
                    int64_t head_dim, float* s);
void DecodeScoresOn(DecodeKernel kernel, const float* q, const Bf16* k, int64_t keys,
                    int64_t head_dim, float* s);
void DecodeValuesOn(DecodeKernel kernel, const float* p, const float* v, int64_t keys,
                    int64_t head_dim, float alpha, float* acc);
void DecodeValuesOn(DecodeKernel kernel, const float* p, const Bf16* v, int64_t keys,
                    int64_t head_dim, float alpha, float* acc);

void DecodeGroupScoresOn(DecodeKernel kernel, const float* q, int64_t group, BlockRows<float> k,
                         int64_t keys, int64_t head_dim, float* s, int64_t s_stride);
void DecodeGroupScoresOn(DecodeKernel kernel, const float* q, int64_t group, BlockRows<Bf16> k,
                         int64_t keys, int64_t head_dim, float* s, int64_t s_stride);
void DecodeGroupValuesOn(DecodeKernel kernel, const float* p, int64_t p_stride, int64_t group,
                         BlockRows<float> v, int64_t keys, int64_t head_dim, const float* alpha,
                         float* acc);
void DecodeGroupValuesOn(DecodeKernel kernel, const float* p, int64_t p_stride, int64_t group,
                         BlockRows<Bf16> v, int64_t keys, int64_t head_dim, const float* alpha,
                         float* acc);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_
