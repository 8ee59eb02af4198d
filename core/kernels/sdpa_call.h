#ifndef ATTNSERVE_CORE_KERNELS_SDPA_CALL_H_
#define ATTNSERVE_CORE_KERNELS_SDPA_CALL_H_

// Private to core/: what the attention kernels are given -- one call over a
// batch, made from a Route -- and where they find an operand's rows.

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_inputs.h"

namespace attnserve::core::internal {

// One attention call over a batch, validated, in per-sequence coordinates:
// queries of sequence b are rows [0, q_lengths[b]) of a [q_len, ...] block,
// its keys rows [0, kv_lengths[b]) of a [kv_len, ...] block. The route's
// decisions (bf16, blocked, block sizes, own_block_kernels, threads) are
// copied in by MakeCall.
struct SdpaCall {
  int64_t batch = 0;
  int64_t q_len = 0;                // S, the queries' max_length
  int64_t kv_len = 0;               // T, the keys' max_length
  std::vector<int64_t> q_lengths;   // [batch]
  std::vector<int64_t> kv_lengths;  // [batch]
  bool causal = false;
  ExplicitMask mask;
  absl::Span<const float> head_mask;  // empty or [num_heads]
  const MapSelection* maps = nullptr;
  bool statistics = false;
  bool bf16 = false;  // operands of the matmuls in BF16 (softmax stays FP32)
  // The blocked (flash-style) path: no maps, no statistics.
  bool blocked = false;
  int64_t block_queries = 0;
  int64_t block_keys = 0;
  bool own_block_kernels = false;
  // The OpenMP threads of the blocked path (its per-thread buffers are sized
  // for them).
  int threads = 1;
  // The caller's buffers (sizes validated): maps as MapSelection says,
  // statistics [batch, num_heads].
  absl::Span<float> attention_maps;
  absl::Span<float> head_entropy;
  absl::Span<float> head_max_weight;
};

// Where the blocked path finds one operand's rows: row `pos` of head h of
// the chunk's sequence c starts at element
//   (first_rows[c] + pos) * row_stride + h * head_stride
// of `data`. Dense [n, heads, len, head_dim] operands are one case
// (DenseHeadRows); the projections' token-major rows [tokens, heads *
// head_dim] another (TokenHeadRows). Inputs are only read.
struct HeadRows {
  void* data = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
  std::vector<int64_t> first_rows;  // [n]

  // Row `pos` of head h of sequence c, elements of element_bytes each.
  char* Row(int64_t c, int64_t pos, int64_t h, int64_t element_bytes) const {
    return static_cast<char*>(data) +
           ((first_rows[c] + pos) * row_stride + h * head_stride) * element_bytes;
  }
};

// The explicit mask's value for (sequence b, query i, key j), broadcasting.
inline float ExplicitValue(const ExplicitMask& mask, int64_t b, int64_t i, int64_t j) {
  const int64_t mb = mask.batch_dim == 1 ? 0 : b;
  const int64_t mi = mask.q_dim == 1 ? 0 : i;
  const int64_t mj = mask.kv_dim == 1 ? 0 : j;
  return mask.values[(mb * mask.q_dim + mi) * mask.kv_dim + mj];
}

// data as [n, heads, len, head_dim], dense.
HeadRows DenseHeadRows(const void* data, int64_t n, int64_t heads, int64_t len, int64_t head_dim);

// Token-major rows [tokens, width] of `data` for sequences [first, first + n)
// of `layout`: head h at column h * head_dim.
HeadRows TokenHeadRows(void* data, int64_t width, int64_t head_dim, const SequenceLayout& layout,
                       int64_t first, int64_t n);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_SDPA_CALL_H_
