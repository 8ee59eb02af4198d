#ifndef ATTNSERVE_CORE_DECODE_LATEST_ATTENTION_H_
#define ATTNSERVE_CORE_DECODE_LATEST_ATTENTION_H_

// What a cache's latest token attends to: the weights of its kept query
// (LayerKvCache::latest_query) over every cached key, read without
// extending the cache.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/decode/layer_kv_cache.h"

namespace attnserve::core {

// With L = cache.length(), hd = the cache's head_dim, Hkv its num_kv_heads,
// G = num_heads / Hkv and q = cache.latest_query() [num_heads, hd]:
//   s_hj = q_h . K_g[j] * scale  (g = h / G, every j < L),
//   maps[h, :] = softmax(s_h)    [num_heads, L] FP32 row-major (no head mask),
//   entropy[h] = -sum_j maps[h, j] ln maps[h, j],  max_weight[h] = max_j maps[h, j]
// (entropy and max_weight: empty, or [num_heads] each). Scores as the decode
// attention computes them (core/decode/paged_attention.h: the same dot
// products over FP32 or widened BF16 rows, the same exponential), the sum in
// double: the rows equal the maps Extend returned for the token's step, with
// no head mask, to float rounding.
//
// FAILED_PRECONDITION when the cache holds no query of its last token;
// INVALID_ARGUMENT naming the argument when num_heads is not a positive
// multiple of num_kv_heads with num_heads * hd the query's size, scale is
// not finite and positive, or a span's size does not match. Nothing is
// written then.
// Thread-safe while the cache does not change.
absl::Status LatestAttention(const LayerKvCache& cache, int num_heads, float scale,
                             absl::Span<float> maps, absl::Span<float> entropy,
                             absl::Span<float> max_weight);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_DECODE_LATEST_ATTENTION_H_
