#ifndef ATTNSERVE_CORE_DECODE_KV_LAYOUT_H_
#define ATTNSERVE_CORE_DECODE_KV_LAYOUT_H_

// What one layer's cached keys and values look like, and where they lie in a
// block of the KV cache (core/decode/kv_block_pool.h). A block of
// `block_tokens` tokens holds, in the layout's precision,
//   K [num_kv_heads, block_tokens, head_dim] then V [num_kv_heads, block_tokens, head_dim]
// (row-major), so that attention for one KV head reads contiguous rows; its
// size is rounded up to kKvBlockAlignment bytes.

#include <cstdint>

#include "absl/status/status.h"

namespace attnserve::core {

enum class KvPrecision { kFp32, kBf16 };

struct KvLayout {
  int num_kv_heads = 0;
  int head_dim = 0;
  KvPrecision precision = KvPrecision::kFp32;

  friend bool operator==(const KvLayout&, const KvLayout&) = default;
  // Bytes of one cached element: 4 (FP32) or 2 (BF16).
  int64_t element_bytes() const { return precision == KvPrecision::kBf16 ? 2 : 4; }
  // Bytes of one cached token: its keys and values in every KV head.
  int64_t token_bytes() const { return 2 * int64_t{num_kv_heads} * head_dim * element_bytes(); }
};

// Blocks start at, and their sizes are multiples of, this (a cache line, the
// widest vector).
inline constexpr int64_t kKvBlockAlignment = 64;
// The most tokens a block may hold.
inline constexpr int kMaxKvBlockTokens = 4096;

// OK when num_kv_heads is in [1, kMaxHeads], head_dim in [1, kMaxHeadDim]
// (core/head_config.h) and precision is kFp32 or kBf16; INVALID_ARGUMENT
// naming the field ("kv_layout.<field>") otherwise. Thread-safe.
absl::Status ValidateKvLayout(const KvLayout& layout);

// Bytes of one block of a valid layout with block_tokens in [1,
// kMaxKvBlockTokens]: K and V, rounded up to kKvBlockAlignment (at most
// 2^(10+12+12+3) bytes, so no overflow). Thread-safe.
int64_t KvBlockBytes(const KvLayout& layout, int block_tokens);

// Byte offsets, from a block's start, of the K rows and of the V rows
// [block_tokens, head_dim] of `kv_head` (in [0, num_kv_heads)). Thread-safe.
int64_t KvKeyRowsOffset(const KvLayout& layout, int block_tokens, int kv_head);
int64_t KvValueRowsOffset(const KvLayout& layout, int block_tokens, int kv_head);

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_DECODE_KV_LAYOUT_H_
