#ifndef ATTNSERVE_CORE_KERNELS_MATERIALIZED_SDPA_H_
#define ATTNSERVE_CORE_KERNELS_MATERIALIZED_SDPA_H_

// Private to core/: the materialized scaled dot-product attention, the route
// that returns maps and statistics.

#include <cstdint>

#include "absl/status/status.h"
#include "core/head_config.h"
#include "core/kernels/sdpa_call.h"
#include "core/kernels/workspace_state.h"

namespace attnserve::core::internal {

// Attention for sequences [first, first + n) of `call` (!call.blocked), per
// head h with g = h / G (G = num_heads / num_kv_heads):
//   P_h = softmax(Q_h K_g^T * scale + mask)   (rows with every key masked: 0)
//   P_h *= head_mask[h]
//   context_h = P_h V_g
// q: [n, num_heads, S, head_dim], k, v: [n, num_kv_heads, T, head_dim],
// dense, FP32 or BF16 as call.bf16, padding positions finite (zero).
// context: [n, num_heads, S, head_dim] FP32; rows past a query length are 0.
// Fills the chunk's part of call's maps and statistics. The scores, masks and
// BF16 probabilities are the workspace's kScores, kMask, kDeadRows and
// kProbsBf16 (reserved by the route for chunks of n sequences).
absl::Status MaterializedSdpa(const HeadConfig& config, const SdpaCall& call, int64_t first,
                              int64_t n, const void* q, const void* k, const void* v,
                              float* context, WorkspaceState& workspace);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_MATERIALIZED_SDPA_H_
