#ifndef ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_
#define ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_

// Private to core/: the row loops of the decode attention
// (core/decode/paged_attention.h) over one KV head's rows of one cache block.
// Plain C++ that GCC vectorizes, with AVX-512 and AVX2 clones chosen at load
// time (ATTNSERVE_CLONES, core/kernels/simd.h); FP32 accumulation, BF16 rows
// widened as they are read.

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

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_
