#include "core/decode/decode_kernels.h"

#include <cstdint>

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

}  // namespace

ATTNSERVE_CLONES
void DecodeScores(const float* q, const float* k, int64_t keys, int64_t head_dim, float* s) {
  Scores(q, k, keys, head_dim, s);
}

ATTNSERVE_CLONES
void DecodeScores(const float* q, const Bf16* k, int64_t keys, int64_t head_dim, float* s) {
  Scores(q, k, keys, head_dim, s);
}

ATTNSERVE_CLONES
void DecodeValues(const float* p, const float* v, int64_t keys, int64_t head_dim, float alpha,
                  float* acc) {
  Values(p, v, keys, head_dim, alpha, acc);
}

ATTNSERVE_CLONES
void DecodeValues(const float* p, const Bf16* v, int64_t keys, int64_t head_dim, float alpha,
                  float* acc) {
  Values(p, v, keys, head_dim, alpha, acc);
}

}  // namespace attnserve::core::internal
