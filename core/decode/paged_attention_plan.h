#ifndef ATTNSERVE_CORE_DECODE_PAGED_ATTENTION_PLAN_H_
#define ATTNSERVE_CORE_DECODE_PAGED_ATTENTION_PLAN_H_

// Private to core/ (and its tests): how PagedAttention divides its work.

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/decode/paged_attention.h"

namespace attnserve::core::internal {

// The key ranges each item's (item, KV head) units are split into when
// PagedAttention runs `items` (valid) on `threads` OpenMP threads: 1 = whole.
// Thread-safe.
std::vector<int64_t> PagedAttentionSplits(absl::Span<const PagedAttentionItem> items,
                                          int64_t threads);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_DECODE_PAGED_ATTENTION_PLAN_H_
