#include "core/kernels/blocked_sdpa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/bf16.h"
#include "core/kernels/block_kernels.h"
#include "core/kernels/online_softmax.h"

namespace attnserve::core::internal {
namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();

int64_t Line(int64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace

HeadRows DenseHeadRows(const void* data, int64_t n, int64_t heads, int64_t len, int64_t head_dim) {
  HeadRows rows;
  rows.data = const_cast<void*>(data);
  rows.row_stride = head_dim;
  rows.head_stride = len * head_dim;
  rows.first_rows.resize(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) rows.first_rows[c] = c * heads * len;
  return rows;
}

HeadRows TokenHeadRows(void* data, int64_t width, int64_t head_dim, const SequenceLayout& layout,
                       int64_t first, int64_t n) {
  HeadRows rows;
  rows.data = data;
  rows.row_stride = width;
  rows.head_stride = head_dim;
  rows.first_rows.resize(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) rows.first_rows[c] = layout.row_offset(first + c);
  return rows;
}

const BlockedSdpa& BlockedSdpaFor(bool own_block_kernels) {
  return own_block_kernels ? OwnBlocks() : OneDnnBlocks();
}

int64_t StripStride(int64_t block_keys) {
  return (block_keys + kKeyTile - 1) / kKeyTile * kKeyTile + kKeyTile;
}

int64_t BlockWorkspaceBytes(bool own_block_kernels, bool bf16, int64_t block_queries,
                            int64_t block_keys, int64_t head_dim) {
  const int64_t bq = block_queries;
  const int64_t bk = block_keys;
  const int64_t common = Line(bq * head_dim * 4) + Line(3 * bq * 4);
  if (own_block_kernels) {
    const int64_t strip = kStripRows * StripStride(bk);
    return Line(strip * 4) + (bf16 ? Line(strip * 2) : 0) + common;
  }
  return Line(bq * bk * 4) + (bf16 ? Line(bq * bk * 2) : 0) + Line(bq * head_dim * 4) + common;
}

int64_t PackedBlocksBytes(bool bf16, int64_t block_keys, int64_t head_dim) {
  return PackedBlockElements(block_keys, head_dim) * (bf16 ? 2 * 2 : 4);
}

BlockedShape::BlockedShape(const HeadConfig& config, const SdpaCall& call, int64_t n)
    : heads(config.num_heads),
      kv_heads(config.num_kv_heads),
      g(config.group_size()),
      s(call.q_len),
      t(call.kv_len),
      hd(config.head_dim),
      bq(call.block_queries),
      bk(call.block_keys),
      operand_bytes(call.bf16 ? 2 : 4),
      has_mask(call.mask.kind != ExplicitMask::Kind::kNone),
      q_blocks((s + bq - 1) / bq),
      items(n * heads * q_blocks),
      thread_bytes(BlockWorkspaceBytes(call.own_block_kernels, call.bf16, bq, bk, hd)) {}

BlockedItem DecodeItem(const BlockedShape& shape, int64_t item) {
  const int64_t i0 = item % shape.q_blocks * shape.bq;
  return {item / (shape.heads * shape.q_blocks), item / shape.q_blocks % shape.heads, i0,
          std::min(shape.bq, shape.s - i0)};
}

// Keys of key block [j0, j0 + mk) that query row i of sequence b sees before
// the explicit mask: those before the sequence's end and (causal) not after i.
int64_t VisibleKeys(const SdpaCall& call, int64_t b, int64_t i, int64_t j0, int64_t mk) {
  int64_t limit = std::clamp<int64_t>(call.kv_lengths[b] - j0, 0, mk);
  if (call.causal) limit = std::clamp<int64_t>(i + 1 - j0, 0, limit);
  return limit;
}

// Scales the scores x [limit] of row i against keys [j0, j0 + limit) and
// applies the explicit mask to them: x * scale + mask (additive) or -inf where
// the mask disallows.
void ApplyExplicitMask(const ExplicitMask& mask, int64_t b, int64_t i, int64_t j0, int64_t limit,
                       float scale, float* x) {
  for (int64_t j = 0; j < limit; ++j) {
    const float value = ExplicitValue(mask, b, i, j0 + j);
    if (mask.kind == ExplicitMask::Kind::kAllowed) {
      x[j] = value == 0.0f ? kMasked : x[j] * scale;
    } else {
      x[j] = x[j] * scale + value;
    }
  }
}

void WriteContextRows(const SdpaCall& call, const BlockedOperands& operands, int64_t b,
                      const BlockedItem& item, int64_t hd, const float* acc,
                      const float* row_sum) {
  const auto [c, h, i0, mq] = item;
  const HeadRows& context = operands.context;
  const bool context_bf16 = operands.context_bf16;
  const bool zero_rows_past_length = operands.zero_rows_past_length;
  const float weight = call.head_mask.empty() ? 1.0f : call.head_mask[h];
  const int64_t context_bytes = context_bf16 ? 2 : 4;
  for (int64_t r = 0; r < mq; ++r) {
    const bool past_length = i0 + r >= call.q_lengths[b];
    if (past_length && !zero_rows_past_length) continue;
    char* const row = context.Row(c, i0 + r, h, context_bytes);
    const float l = row_sum[r];
    if (past_length || !(l > 0.0f) || !std::isfinite(l)) {
      std::memset(row, 0, static_cast<size_t>(hd * context_bytes));
      continue;
    }
    const float* const o = acc + r * hd;
    if (context_bf16) {
      ScaledFloatsToBf16(o, hd, weight / l, reinterpret_cast<Bf16*>(row));
    } else {
      ScaleInto(o, hd, weight / l, reinterpret_cast<float*>(row));
    }
  }
}

}  // namespace attnserve::core::internal
