#ifndef ATTNSERVE_CORE_DECODE_PAGED_ATTENTION_H_
#define ATTNSERVE_CORE_DECODE_PAGED_ATTENTION_H_

// Decode attention over the paged KV cache: the attention of a micro-batch of
// sequences' new query rows against everything each sequence has cached.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/decode/layer_kv_cache.h"

namespace attnserve::core {

// One sequence of a micro-batch. With L = cache->length() (the new tokens'
// K/V already appended), n = new_tokens, hd = the cache's head_dim, Hkv its
// num_kv_heads and G = num_heads / Hkv:
//   q:   [n, num_heads, hd] FP32 row-major (RoPE already applied)
//   out: [n, num_heads, hd] FP32 row-major
//   attention_map: empty, or [num_heads, n, L] FP32 row-major
//   head_mask: empty (all 1), or [num_heads], each finite and >= 0
// New query i (0-based) sits at position L - n + i and sees keys
// j <= L - n + i. For query head h and g = h / G:
//   s_ij = q_ih . K_g[j] * scale (j <= L - n + i),
//   P_i = softmax(s_i) * head_mask[h]  (the head's weights gated, as in
//                                       AttentionLayer::Forward),
//   out_ih = sum_j P_ij V_g[j],  attention_map[h, i, j] = P_ij (0 for later j).
struct PagedAttentionItem {
  const LayerKvCache* cache = nullptr;
  int num_heads = 0;
  int64_t new_tokens = 0;
  float scale = 0.0f;
  absl::Span<const float> q;
  absl::Span<float> out;
  absl::Span<float> attention_map;
  absl::Span<const float> head_mask;
};

// Runs the items on the calling thread's OpenMP threads, in units: a decode
// item's (fewer than 8 new rows) all its KV heads, a span of keys in every
// KV head before the next span (the span's cache blocks read from one end to
// the other); a prefill chunk's one KV head each. The G query heads and n new
// rows of a group go together, so that each K/V row is read once per call
// (per 32 / G new rows in long prefill chunks). When there are fewer units
// than a few per thread, long contexts are split into key ranges whose
// partial softmax states are merged afterwards (flash-decoding). Online
// softmax with FP32 accumulation; BF16 K/V widened as it is read. Decode rows
// run on the row kernels (decode_kernels.h); tiles of 8 or more new rows
// (prefill chunks) on the blocked path's strip kernels
// (core/kernels/block_kernels.h), each block's keys packed once per tile.
//
// INVALID_ARGUMENT naming the field ("items[i].q", ...) when a cache is null,
// num_heads is not a positive multiple of the cache's num_kv_heads (at most
// kMaxHeads), new_tokens is not in [1, L], scale is not finite and positive,
// a span's size does not match, or a head_mask value is negative or not
// finite; nothing is written then.
// Thread-safe for calls whose outputs differ, while no cache they read
// changes.
absl::Status PagedAttention(absl::Span<const PagedAttentionItem> items);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_DECODE_PAGED_ATTENTION_H_
