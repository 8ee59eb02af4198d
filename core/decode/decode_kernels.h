#ifndef ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_
#define ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_

// Private to core/: the row loops of the decode attention
// (core/decode/paged_attention.h) over one KV head's rows of one cache block,
// FP32 accumulation, BF16 rows widened as they are read. Two
// implementations, the first that runs on this CPU chosen once by its
// features: AVX-512 intrinsics (scores sixteen keys at a time, each key's
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

// The implementations, for tests: DecodeScores and DecodeValues run the first
// of kAvx512, kAvx2, kPortable that runs here (by the CPU's features: AVX-512
// F/BW/DQ/VL; AVX2 and FMA).
enum class DecodeKernel { kPortable, kAvx2, kAvx512 };
bool DecodeKernelRuns(DecodeKernel kernel);
void DecodeScoresOn(DecodeKernel kernel, const float* q, const float* k, int64_t keys,
                    int64_t head_dim, float* s);
void DecodeScoresOn(DecodeKernel kernel, const float* q, const Bf16* k, int64_t keys,
                    int64_t head_dim, float* s);
void DecodeValuesOn(DecodeKernel kernel, const float* p, const float* v, int64_t keys,
                    int64_t head_dim, float alpha, float* acc);
void DecodeValuesOn(DecodeKernel kernel, const float* p, const Bf16* v, int64_t keys,
                    int64_t head_dim, float alpha, float* acc);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_DECODE_DECODE_KERNELS_H_
