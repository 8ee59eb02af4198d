#include "core/decode/kv_layout.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/head_config.h"

namespace attnserve::core {
namespace {

// Bytes of one KV head's rows of one part (K or V) of a block.
int64_t HeadRowsBytes(const KvLayout& layout, int block_tokens) {
  return int64_t{block_tokens} * layout.head_dim * layout.element_bytes();
}

}  // namespace

absl::Status ValidateKvLayout(const KvLayout& layout) {
  if (layout.num_kv_heads < 1 || layout.num_kv_heads > kMaxHeads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_layout.num_kv_heads: must be in [1, ", kMaxHeads, "], got ", layout.num_kv_heads));
  }
  if (layout.head_dim < 1 || layout.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_layout.head_dim: must be in [1, ", kMaxHeadDim, "], got ", layout.head_dim));
  }
  if (layout.precision != KvPrecision::kFp32 && layout.precision != KvPrecision::kBf16) {
    return absl::InvalidArgumentError(absl::StrCat("kv_layout.precision: unknown value ",
                                                   static_cast<int>(layout.precision)));
  }
  return absl::OkStatus();
}

int64_t KvBlockBytes(const KvLayout& layout, int block_tokens) {
  const int64_t bytes = 2 * int64_t{layout.num_kv_heads} * HeadRowsBytes(layout, block_tokens);
  return (bytes + kKvBlockAlignment - 1) / kKvBlockAlignment * kKvBlockAlignment;
}

int64_t KvKeyRowsOffset(const KvLayout& layout, int block_tokens, int kv_head) {
  return int64_t{kv_head} * HeadRowsBytes(layout, block_tokens);
}

int64_t KvValueRowsOffset(const KvLayout& layout, int block_tokens, int kv_head) {
  return (int64_t{layout.num_kv_heads} + kv_head) * HeadRowsBytes(layout, block_tokens);
}

}  // namespace attnserve::core
