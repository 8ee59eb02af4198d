#ifndef ATTNSERVE_CORE_DECODE_EXTEND_H_
#define ATTNSERVE_CORE_DECODE_EXTEND_H_

// The inputs of AttentionLayer::Extend (core/attention_layer.h), the decode
// route: one step of a micro-batch of sequences whose keys and values live in
// LayerKvCaches (core/decode/layer_kv_cache.h), one cache per sequence and
// layer.

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/decode/layer_kv_cache.h"

namespace attnserve::core {

// One sequence's step in AttentionLayer::Extend. With n the new tokens, L0
// the cache's length before the step and L = L0 + n after it:
struct ExtendItem {
  // This layer's cache of the sequence; its layout's num_kv_heads and
  // head_dim must be the layer's (its precision, FP32 or BF16 KV, is the
  // caller's choice). No two items of a call may name the same cache (forks
  // are different caches).
  LayerKvCache* cache = nullptr;
  // The new tokens' hidden states, [n, d_model] row-major, n >= 1 (n = 1: a
  // decode step; n > 1: a prefill chunk); finite.
  absl::Span<const float> hidden_states;
  // The RoPE position of the first new token (the sequence's first position +
  // L0), in [0, kMaxPositionOffset] (core/validation.h); new token i is at
  // first_position + i. Ignored by layers without RoPE.
  int64_t first_position = 0;
  // [n, d_model] row-major: the layer's output for the new tokens.
  absl::Span<float> output;
  // Empty, or [num_heads, n, L] row-major: the new rows' attention maps
  // (after head_mask; entries past a row's own position are 0).
  absl::Span<float> attention_map;
  // Both empty, or both [num_heads, n] row-major: each new row's head
  // statistics from its attention weights after head_mask (as
  // internal::StatisticsOfRow, the definition Forward's statistics average):
  // entropy -sum_j p_j ln p_j (nats) and max_j p_j. Computed from the row's
  // map: when attention_map is empty, the map is computed into a scratch
  // buffer of [num_heads, n, L] floats for the call (callers budget it).
  absl::Span<float> head_entropy;
  absl::Span<float> head_max_weight;
  // Whether the cache may take a run of blocks ahead of its tokens when it
  // grows (LayerKvCache::Append); kNone: only the blocks the new tokens need
  // (a caller whose memory budget has no room for more).
  LayerKvCache::BlocksAhead blocks_ahead = LayerKvCache::BlocksAhead::kTake;
  // Set by Extend: OK when the item ran; otherwise why it did not --
  // INVALID_ARGUMENT naming "items[i].<field>" (validation, before anything
  // ran), RESOURCE_EXHAUSTED when the pool refused its blocks (nothing was
  // appended to its cache), or the call's own error when Extend returns one.
  // Other items run regardless of one item's error.
  absl::Status status;
};

struct ExtendOptions {
  // [num_heads]: head h's attention weights are multiplied by head_mask[h]
  // (as in Forward), each finite and >= 0. Empty: all 1.
  absl::Span<const float> head_mask;
  // Of the projections (the attention itself accumulates in FP32 over the
  // cache's FP32 or BF16 K/V). kBf16 runs BF16 only where Bf16Supported(),
  // FP32 elsewhere (ForwardInfo says which).
  Precision precision = Precision::kFp32;
  // Polled between stages; when it returns true the call stops with
  // CANCELLED (every cache as it was before the call). Empty: never stops.
  std::function<bool()> should_stop;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_DECODE_EXTEND_H_
