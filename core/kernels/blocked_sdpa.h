#ifndef ATTNSERVE_CORE_KERNELS_BLOCKED_SDPA_H_
#define ATTNSERVE_CORE_KERNELS_BLOCKED_SDPA_H_

// Private to core/: the blocked (flash-style) scaled dot-product attention,
// one interface with two implementations -- attnserve's own AVX-512 block
// kernels (own_blocks.cc) and oneDNN's block matmuls (onednn_blocks.cc) --
// chosen once, by the route (Route::own_block_kernels).
//
// Both compute, for sequences [first, first + n) of a call, per head h with
// g = h / G (G = num_heads / num_kv_heads), key block by key block with an
// online softmax (running max m, sum l; alpha = exp(m_old - m_new)):
//   context_h = softmax(Q_h K_g^T * scale + mask) V_g * head_mask[h]
// Rows with every key masked (l = 0), or whose scores overflow (l NaN or inf),
// get 0. Work items are (sequence c, query head h, query block [i0, i0 + mq))
// spread over the route's OpenMP threads; causal key blocks entirely after an
// item's last query row are never computed.

#include <cstdint>

#include "absl/status/status.h"
#include "core/head_config.h"
#include "core/kernels/sdpa_call.h"
#include "core/kernels/workspace_state.h"

namespace attnserve::core::internal {

// The operands of a blocked call: q [num_heads heads], k and v [num_kv_heads
// heads] in the call's operand type (padding rows inside a sequence's
// max_length finite; rows past the chunk's last sequence are never read when
// every sequence has the max length), and context [num_heads heads] written
// as FP32 or (context_bf16) BF16. Rows of a query past its sequence's length
// are written as zeros when zero_rows_past_length, else left as they are
// (token-major outputs, where such rows belong to padding or another
// sequence).
struct BlockedOperands {
  HeadRows q, k, v, context;
  bool context_bf16 = false;
  bool zero_rows_past_length = true;
};

class BlockedSdpa {
 public:
  virtual ~BlockedSdpa() = default;
  // The attention above for sequences [first, first + n) of `call`
  // (call.blocked), in the workspace's kBlockWorkspace (and, own kernels,
  // kBlockPacks and kPackStates), reserved by the route. INTERNAL when oneDNN
  // fails or the workspace is smaller than the call needs.
  virtual absl::Status Run(const HeadConfig& config, const SdpaCall& call, int64_t first,
                           int64_t n, const BlockedOperands& operands,
                           WorkspaceState& workspace) const = 0;
};

// The implementation the route chose. Stateless (its state is the
// workspace's); thread-safe.
const BlockedSdpa& BlockedSdpaFor(bool own_block_kernels);
const BlockedSdpa& OwnBlocks();
const BlockedSdpa& OneDnnBlocks();

// --- Sizes the route reserves.

// Bytes of one thread's workspace on the blocked path, each part rounded up
// to a cache line. oneDNN blocks: scores [bq, bk] FP32, P [bq, bk] BF16 (BF16
// only), P V [bq, hd] FP32. Own kernels: a strip's scores [kStripRows, padded
// bk] FP32 and P (BF16 only). Both: the output accumulator [bq, hd] FP32 and
// row state [3, bq] FP32.
int64_t BlockWorkspaceBytes(bool own_block_kernels, bool bf16, int64_t block_queries,
                            int64_t block_keys, int64_t head_dim);
// Elements per row of the own kernels' strip of scores (and of P): the key
// block rounded up to whole tiles, plus one tile so that the strip's rows do
// not all fall into the same L1 sets (at 1024 keys a power-of-two stride made
// the FP32 softmax of a strip 1.4x slower, BM_OnlineSoftmaxStrip).
int64_t StripStride(int64_t block_keys);
// Key blocks of kv_len keys (the last may be shorter).
inline int64_t KeyBlocks(int64_t kv_len, int64_t block_keys) {
  return (kv_len + block_keys - 1) / block_keys;
}
// Bytes of the own kernels' packed blocks per (sequence, key/value head, key
// block): the key block, and in BF16 the value block after it.
int64_t PackedBlocksBytes(bool bf16, int64_t block_keys, int64_t head_dim);

// --- Shared by the two implementations.

// What both implementations derive from the call before their blocks.
struct BlockedShape {
  BlockedShape(const HeadConfig& config, const SdpaCall& call, int64_t n);

  int64_t heads, kv_heads, g, s, t, hd, bq, bk;
  int64_t operand_bytes;
  bool has_mask;         // an explicit mask
  int64_t q_blocks;      // query blocks per head
  int64_t items;         // n * heads * q_blocks
  int64_t thread_bytes;  // one thread's part of kBlockWorkspace
};

// A work item: sequence c of the chunk, query head h, query rows
// [i0, i0 + mq). Items run c-major, then h, then query blocks.
struct BlockedItem {
  int64_t c, h, i0, mq;
};
BlockedItem DecodeItem(const BlockedShape& shape, int64_t item);

// Keys of key block [j0, j0 + mk) that query row i of sequence b sees before
// the explicit mask: those before the sequence's end and (causal) not after i.
int64_t VisibleKeys(const SdpaCall& call, int64_t b, int64_t i, int64_t j0, int64_t mk);

// Scales the scores x [limit] of row i against keys [j0, j0 + limit) and
// applies the explicit mask to them: x * scale + mask (additive) or -inf where
// the mask disallows.
void ApplyExplicitMask(const ExplicitMask& mask, int64_t b, int64_t i, int64_t j0, int64_t limit,
                       float scale, float* x);

// The end of a work item: rows [i0, i0 + mq) of head h of chunk sequence c
// (batch index b) of operands.context = acc * head_mask[h] / l, FP32 or BF16;
// rows with l = 0, NaN or inf: 0; rows past the query length: 0 or
// (!zero_rows_past_length) untouched. acc [mq, hd] is only read.
void WriteContextRows(const SdpaCall& call, const BlockedOperands& operands, int64_t b,
                      const BlockedItem& item, int64_t hd, const float* acc,
                      const float* row_sum);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_BLOCKED_SDPA_H_
