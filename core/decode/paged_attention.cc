#include "core/decode/paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/checked_math.h"
#include "core/decode/decode_kernels.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "core/decode/paged_attention_plan.h"
#include "core/head_config.h"
#include "core/kernels/block_kernels.h"
#include "core/kernels/online_softmax.h"
#include "core/status_macros.h"
#include "core/validation.h"

namespace attnserve::core {
namespace {

// Query rows (the G heads of a group times new rows) that share one pass over
// a unit's keys; a tile's accumulators ([rows, head_dim] FP32) stay in L1/L2.
constexpr int64_t kTileRows = 32;
// Below this many units per thread, long contexts are split into key ranges.
constexpr int64_t kUnitsPerThread = 4;
// The fewest keys a split covers: shorter ranges cost more to merge than they
// spread.
constexpr int64_t kMinSplitKeys = 256;
// Keys that share one online-softmax step (whole blocks, at least one).
constexpr int64_t kSpanKeys = 128;
// Tiles of at least this many new rows (a prefill's chunk; not a decode
// step's single row, whatever its group) run on the strip kernels
// (ProcessSpanStrips).
constexpr int64_t kStripNewRows = 8;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// An item's sizes, resolved once.
struct ItemView {
  const PagedAttentionItem* item = nullptr;
  const LayerKvCache* cache = nullptr;
  int64_t heads = 0;
  int64_t group = 0;  // G = heads / num_kv_heads
  int64_t head_dim = 0;
  int64_t n = 0;
  int64_t length = 0;  // L
  int64_t first = 0;   // L - n: the position of new row 0
  int64_t block_tokens = 0;
  bool bf16 = false;
  // Head h's weights are multiplied by this (head_mask[h], or 1).
  float gate(int64_t h) const { return item->head_mask.empty() ? 1.0f : item->head_mask[h]; }
  // The row of query head h and new row i, of q and out; of the map.
  int64_t q_row(int64_t i, int64_t h) const { return (i * heads + h) * head_dim; }
  int64_t map_row(int64_t i, int64_t h) const { return (h * n + i) * length; }
};

// Keys [key_begin, key_end) of KV heads [kv_begin, kv_end) of one item: all
// of them (partial < 0: the unit writes out and maps), or one split whose
// softmax states go to the partial states at `partial` floats (PartialRow).
// A decode item's unit holds all its KV heads and reads a span of keys in
// every one of them before the next span: the span's blocks, which hold every
// KV head's rows, are read from one end to the other (reading one KV head's
// rows through all blocks first read memory at 0.55-0.93 of the rate of reading
// it in order; docs/measurements.md, "Decode reads a span in every KV head").
// A prefill chunk's unit holds one KV head: its rows are read once per tile
// of new rows, and the heads spread the causal work over the threads.
struct Unit {
  int64_t item = 0;
  int64_t kv_begin = 0;
  int64_t kv_end = 0;
  int64_t key_begin = 0;
  int64_t key_end = 0;
  int64_t partial = -1;
  int64_t merge = -1;  // the Merge of its splits (a split unit)
};

// The splits of one (item, KV heads) to merge: units [first_unit, first_unit + splits).
struct Merge {
  int64_t item = 0;
  int64_t kv_begin = 0;
  int64_t kv_end = 0;
  int64_t first_unit = 0;
  int64_t splits = 0;
};

// The floats, from a split unit's `partial`, of the softmax state (m, l,
// acc [head_dim]) of new row i and query head h (of KV head g in [kv_begin,
// kv_end)).
int64_t PartialRow(const Unit& unit, int64_t group, int64_t head_dim, int64_t i, int64_t h) {
  const int64_t first_head = unit.kv_begin * group;
  const int64_t heads = (unit.kv_end - unit.kv_begin) * group;
  return unit.partial + (i * heads + h - first_head) * (head_dim + 2);
}

// One thread's online-softmax state of a tile of rows, and the scores of a
// span of keys ([rows, stride]: the span's width rounded up to whole key
// tiles, and one tile more, which the strip kernels write past a short
// block's keys), and the tile's query rows for the strip kernels.
struct TileState {
  std::vector<float> m, l, acc, scores, alpha;
  std::vector<int64_t> limits;
  int64_t stride = 0;
  std::vector<float> q_rows;
  void Reset(int64_t rows, int64_t head_dim, int64_t span_width) {
    m.assign(static_cast<size_t>(rows), kMinusInf);
    l.assign(static_cast<size_t>(rows), 0.0f);
    acc.assign(static_cast<size_t>(rows * head_dim), 0.0f);
    alpha.resize(static_cast<size_t>(rows));
    limits.resize(static_cast<size_t>(rows));
    stride = (span_width + internal::kKeyTile - 1) / internal::kKeyTile * internal::kKeyTile +
             internal::kKeyTile;
    if (scores.size() < static_cast<size_t>(rows * stride)) {
      scores.resize(static_cast<size_t>(rows * stride));
    }
  }
};

absl::Status Invalid(int64_t index, absl::string_view field, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("items[", index, "].", field, ": ", message));
}

// OK when `span_size` is the product of `dims`; INVALID_ARGUMENT naming the field otherwise.
absl::Status CheckSize(int64_t index, absl::string_view field, size_t span_size,
                       std::initializer_list<int64_t> dims, absl::string_view shape) {
  const std::optional<int64_t> expected = CheckedProduct(dims);
  if (!expected || static_cast<int64_t>(span_size) != *expected) {
    return Invalid(index, field,
                   absl::StrCat("has ", span_size, " floats, expected ", shape, " = ",
                                expected.value_or(-1)));
  }
  return absl::OkStatus();
}

absl::Status ValidateItem(const PagedAttentionItem& item, int64_t index) {
  if (item.cache == nullptr) return Invalid(index, "cache", "must not be null");
  const KvLayout& layout = item.cache->layout();
  if (item.num_heads < 1 || item.num_heads > kMaxHeads ||
      item.num_heads % layout.num_kv_heads != 0) {
    return Invalid(index, "num_heads",
                   absl::StrCat("must be a multiple of the cache's num_kv_heads ",
                                layout.num_kv_heads, " in [1, ", kMaxHeads, "], got ",
                                item.num_heads));
  }
  const int64_t length = item.cache->length();
  if (item.new_tokens < 1 || item.new_tokens > length) {
    return Invalid(index, "new_tokens",
                   absl::StrCat("must be in [1, cache length ", length, "], got ",
                                item.new_tokens));
  }
  if (!std::isfinite(item.scale) || item.scale <= 0.0f) {
    return Invalid(index, "scale", absl::StrCat("must be finite and positive, got ", item.scale));
  }
  const int64_t n = item.new_tokens, h = item.num_heads, hd = layout.head_dim;
  ATTNSERVE_RETURN_IF_ERROR(CheckSize(index, "q", item.q.size(), {n, h, hd},
                                      "new_tokens * num_heads * head_dim"));
  ATTNSERVE_RETURN_IF_ERROR(CheckSize(index, "out", item.out.size(), {n, h, hd},
                                      "new_tokens * num_heads * head_dim"));
  if (!item.attention_map.empty()) {
    ATTNSERVE_RETURN_IF_ERROR(CheckSize(index, "attention_map", item.attention_map.size(),
                                        {h, n, length}, "num_heads * new_tokens * length"));
  }
  if (!item.head_mask.empty()) {
    return ValidateHeadMask(item.head_mask, h, absl::StrCat("items[", index, "].head_mask"));
  }
  return absl::OkStatus();
}

ItemView ViewOf(const PagedAttentionItem& item) {
  ItemView view;
  view.item = &item;
  view.cache = item.cache;
  const KvLayout& layout = item.cache->layout();
  view.heads = item.num_heads;
  view.group = item.num_heads / layout.num_kv_heads;
  view.head_dim = layout.head_dim;
  view.n = item.new_tokens;
  view.length = item.cache->length();
  view.first = view.length - view.n;
  view.block_tokens = item.cache->block_tokens();
  view.bf16 = layout.precision == KvPrecision::kBf16;
  return view;
}

// The KV heads one unit of the item holds (Unit): all of them for decode
// rows, one for a prefill chunk.
int64_t KvHeadsPerUnit(const ItemView& view) {
  return view.n >= kStripNewRows ? 1 : view.heads / view.group;
}

// Keys per split: unlimited when the items' units already give every thread a
// few; otherwise the keys of all units spread over that many, and at least
// kMinSplitKeys.
int64_t SplitKeys(absl::Span<const ItemView> views, int64_t threads) {
  constexpr int64_t kNoSplit = std::numeric_limits<int64_t>::max();
  int64_t units = 0, keys = 0;
  for (const ItemView& view : views) {
    const int64_t per_item = view.heads / view.group / KvHeadsPerUnit(view);
    units += per_item;
    keys += per_item * view.length;
  }
  const int64_t target = threads * kUnitsPerThread;
  if (threads <= 1 || units >= target) return kNoSplit;
  return std::max(kMinSplitKeys, (keys + target - 1) / target);
}

// Keys per split of an item: split_keys rounded down to whole blocks (at
// least one), or all of them.
int64_t SplitChunk(const ItemView& view, int64_t split_keys) {
  if (split_keys >= view.length) return view.length;
  return std::max<int64_t>(1, split_keys / view.block_tokens) * view.block_tokens;
}

// The units of every item (and the merges of split ones); returns the floats
// of partial state the splits need.
int64_t PlanUnits(absl::Span<const ItemView> views, int64_t threads, std::vector<Unit>& units,
                  std::vector<Merge>& merges) {
  const int64_t split_keys = SplitKeys(views, threads);
  int64_t partial_floats = 0;
  for (size_t index = 0; index < views.size(); ++index) {
    const ItemView& view = views[index];
    const int64_t item = static_cast<int64_t>(index);
    const int64_t chunk = SplitChunk(view, split_keys);
    const int64_t splits = (view.length + chunk - 1) / chunk;
    const int64_t per_unit = KvHeadsPerUnit(view);
    for (int64_t g = 0; g < view.heads / view.group; g += per_unit) {
      if (splits == 1) {
        units.push_back(Unit{item, g, g + per_unit, 0, view.length, -1});
        continue;
      }
      const int64_t merge = static_cast<int64_t>(merges.size());
      merges.push_back(Merge{item, g, g + per_unit, static_cast<int64_t>(units.size()), splits});
      for (int64_t s = 0; s < splits; ++s) {
        units.push_back(Unit{item, g, g + per_unit, s * chunk,
                             std::min(view.length, (s + 1) * chunk), partial_floats, merge});
        partial_floats += per_unit * view.group * view.n * (view.head_dim + 2);
      }
    }
  }
  return partial_floats;
}

// Map row [L] of a query row that sees `visible` keys, holding their raw
// scores: becomes gate exp(scale (s_j - m)) / l, and 0 past them.
void NormalizeMapRow(float* row, int64_t visible, int64_t length, float m, float l, float scale,
                     float gate) {
  const float inv_l = gate / l;
  for (int64_t j = 0; j < visible; ++j) row[j] = internal::FastExp((row[j] - m) * scale) * inv_l;
  std::fill(row + visible, row + length, 0.0f);
}

// Scores of query row q against FP32 keys [j0, j1) of KV head g (one
// block's) into s.
void BlockScores(const ItemView& view, int64_t g, int64_t j0, int64_t j1, const float* q,
                 float* s) {
  const int64_t block = j0 / view.block_tokens;
  const int64_t offset = (j0 - block * view.block_tokens) * view.head_dim;
  const std::byte* k = view.cache->key_rows(block, static_cast<int>(g));
  internal::DecodeScores(q, reinterpret_cast<const float*>(k) + offset, j1 - j0, view.head_dim, s);
}

// acc = acc alpha + p V over FP32 keys [j0, j1) of KV head g (one block's).
void BlockValues(const ItemView& view, int64_t g, int64_t j0, int64_t j1, const float* p,
                 float alpha, float* acc) {
  const int64_t block = j0 / view.block_tokens;
  const int64_t offset = (j0 - block * view.block_tokens) * view.head_dim;
  const std::byte* v = view.cache->value_rows(block, static_cast<int>(g));
  internal::DecodeValues(p, reinterpret_cast<const float*>(v) + offset, j1 - j0, view.head_dim,
                         alpha, acc);
}

// FP32 caches: keys [j0, j1) (token positions, a span of whole blocks but at
// its end) against the tile's new rows [i0, i1) of KV head g: the scores of
// every row of the tile (its G heads), one online-softmax step for them all
// (rows together: their dependency chains overlap), then P V; raw scores to
// the map. A span of several blocks shares one softmax step: its fixed cost
// is paid per span, not per block. The row kernels run per head and block:
// on FP32 caches the group kernels of ProcessSpan (below) measured slower
// (docs/measurements.md, "Decode with BF16 KV: group kernels").
void ProcessSpanByBlock(const ItemView& view, int64_t g, int64_t j0, int64_t j1, int64_t i0,
                        int64_t i1, int64_t width, TileState& state) {
  const PagedAttentionItem& item = *view.item;
  const int64_t bt = view.block_tokens;
  const int64_t rows = (i1 - i0) * view.group;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t visible = std::max<int64_t>(0, std::min(j1, view.first + i + 1) - j0);
    for (int64_t hl = 0; hl < view.group; ++hl) {
      const int64_t r = (i - i0) * view.group + hl;
      const int64_t h = g * view.group + hl;
      state.limits[static_cast<size_t>(r)] = visible;
      float* s = state.scores.data() + r * state.stride;
      const float* q = item.q.data() + view.q_row(i, h);
      for (int64_t a = j0; a < j0 + visible; a = (a / bt + 1) * bt) {
        BlockScores(view, g, a, std::min(j0 + visible, (a / bt + 1) * bt), q, s + (a - j0));
      }
      if (!item.attention_map.empty() && visible > 0) {
        std::memcpy(item.attention_map.data() + view.map_row(i, h) + j0, s,
                    static_cast<size_t>(visible) * sizeof(float));
      }
    }
  }
  internal::OnlineSoftmaxStrip(state.scores.data(), state.stride, rows, state.limits.data(), width,
                               item.scale, state.m.data(), state.l.data(), state.alpha.data(),
                               nullptr);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = state.limits[static_cast<size_t>(r)];
    const float* p = state.scores.data() + r * state.stride;
    float* acc = state.acc.data() + r * view.head_dim;
    float alpha = state.alpha[static_cast<size_t>(r)];
    for (int64_t a = j0; a < j0 + visible; a = (a / bt + 1) * bt) {
      BlockValues(view, g, a, std::min(j0 + visible, (a / bt + 1) * bt), p + (a - j0), alpha, acc);
      alpha = 1.0f;
    }
  }
}

// The K (V) rows of KV head g over the span of keys from j0 (a block's first
// key), for the group kernels: blocks[b] is the rows of the span's block b.
template <typename T>
void SpanBlocks(const ItemView& view, int64_t g, int64_t j0, int64_t j1, bool values,
                const T** blocks) {
  const int64_t bt = view.block_tokens;
  for (int64_t b = 0; j0 + b * bt < j1; ++b) {
    const int64_t block = j0 / bt + b;
    const std::byte* rows = values ? view.cache->value_rows(block, static_cast<int>(g))
                                   : view.cache->key_rows(block, static_cast<int>(g));
    blocks[b] = reinterpret_cast<const T*>(rows);
  }
}

// Keys [begin, end) of KV head kv_head (begin a block's first key): the span
// a unit reads next (none when begin >= end).
struct NextSpan {
  int64_t kv_head = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// The rows of keys [j0, j1) of KV head g in `blocks`, and those of the span
// the unit reads next in `next_blocks` (prefetched as the span's rows are
// read).
template <typename T>
internal::BlockRows<T> SpanRows(const ItemView& view, int64_t g, int64_t j0, int64_t j1,
                                const NextSpan& next, bool values, const T** blocks,
                                const T** next_blocks) {
  SpanBlocks(view, g, j0, j1, values, blocks);
  if (next.end > next.begin) {
    SpanBlocks(view, next.kv_head, next.begin, next.end, values, next_blocks);
  }
  return internal::BlockRows<T>{blocks, view.block_tokens, next_blocks,
                                std::max<int64_t>(0, next.end - next.begin)};
}

// Keys [j0, j1) (token positions, a span of whole blocks but at its end, j0 a
// block's first key) against the tile's new rows [i0, i1) of KV head g: the
// scores of every row of the tile (its G heads, each K row read once for
// them), one online-softmax step for them all (rows together: their
// dependency chains overlap), then P V (each V row read once for the G
// heads); raw scores to the map. A span of several blocks shares one softmax
// step and one kernel call: their fixed costs are paid per span, not per
// block.
template <typename T>
void ProcessSpan(const ItemView& view, int64_t g, int64_t j0, int64_t j1, const NextSpan& next_span,
                 int64_t i0, int64_t i1, int64_t width, TileState& state) {
  const PagedAttentionItem& item = *view.item;
  const int64_t rows = (i1 - i0) * view.group;
  const int64_t hd = view.head_dim;
  // At most kSpanKeys blocks (a span is kSpanKeys keys, or one block).
  const T* blocks[kSpanKeys];
  const T* next[kSpanKeys];
  const internal::BlockRows<T> k =
      SpanRows(view, g, j0, j1, next_span, /*values=*/false, blocks, next);
  for (int64_t i = i0; i < i1; ++i) {
    // The G rows of new row i see the same keys.
    const int64_t visible = std::max<int64_t>(0, std::min(j1, view.first + i + 1) - j0);
    const int64_t r0 = (i - i0) * view.group;
    for (int64_t hl = 0; hl < view.group; ++hl) {
      state.limits[static_cast<size_t>(r0 + hl)] = visible;
    }
    if (visible == 0) continue;
    float* s = state.scores.data() + r0 * state.stride;
    internal::DecodeGroupScores(item.q.data() + view.q_row(i, g * view.group), view.group, k,
                                visible, hd, s, state.stride);
    if (!item.attention_map.empty()) {
      for (int64_t hl = 0; hl < view.group; ++hl) {
        std::memcpy(item.attention_map.data() + view.map_row(i, g * view.group + hl) + j0,
                    s + hl * state.stride, static_cast<size_t>(visible) * sizeof(float));
      }
    }
  }
  internal::OnlineSoftmaxStrip(state.scores.data(), state.stride, rows, state.limits.data(), width,
                               item.scale, state.m.data(), state.l.data(), state.alpha.data(),
                               nullptr);
  const internal::BlockRows<T> v =
      SpanRows(view, g, j0, j1, next_span, /*values=*/true, blocks, next);
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r0 = (i - i0) * view.group;
    const int64_t visible = state.limits[static_cast<size_t>(r0)];
    float* acc = state.acc.data() + r0 * hd;
    const float* alpha = state.alpha.data() + r0;
    if (visible == 0) continue;  // no key of the span: the rows keep their state
    internal::DecodeGroupValues(state.scores.data() + r0 * state.stride, state.stride, view.group,
                                v, visible, hd, alpha, acc);
  }
}

// to [n] = the BF16 values rows [n] as FP32.
void WidenRows(const Bf16* rows, int64_t n, float* to) {
  for (int64_t e = 0; e < n; ++e) to[e] = Bfloat16ToFloat(rows[e]);
}

// The rows of one KV head of a block as FP32: FP32 rows where they are, BF16
// ones widened into `widened` ([keys, head_dim]).
const float* BlockRowsFp32(const float* rows, int64_t, int64_t, std::vector<float>&) {
  return rows;
}
const float* BlockRowsFp32(const Bf16* rows, int64_t keys, int64_t head_dim,
                           std::vector<float>& widened) {
  widened.resize(static_cast<size_t>(keys * head_dim));
  WidenRows(rows, keys * head_dim, widened.data());
  return widened.data();
}

// One thread's blocks of one KV head of a strip unit as the strip kernels
// read them -- K packed (K^T in tiles of 16 keys, BF16 rows widened first),
// BF16 V rows widened -- made the first time a tile of the unit reads a
// block and read as they are by its later tiles: a prefill chunk of n new
// rows reads each block of its context in up to n / kTileRows tiles, and
// packing K per tile took 8% of an FP32 prefill's CPU time, widening BF16 V
// per tile about 6% of a BF16 one's (docs/measurements.md, "A prefill chunk
// packs its keys once"). A block is made with every key of it the unit sees
// (a tile that sees fewer reads the same rows: the softmax ignores a row's
// scores past its visible keys, and P V reads only the keys seen). At most
// one KV head's K (and BF16 V) rows of one sequence, as FP32.
struct StripBlocks {
  const ItemView* view = nullptr;
  int64_t kv_head = -1;
  int64_t first_block = 0;
  int64_t key_end = 0;  // the unit's keys end here: a block holds keys up to it
  int64_t key_elements = 0, value_elements = 0;  // of one block
  std::vector<char> keys_made, values_made;      // of each block
  std::vector<float> keys, values, widened;

  // Forgets the blocks of the unit before, and makes room for the blocks of
  // keys [key_begin, end) (key_begin a block's first) of KV head g.
  void Reset(const ItemView& v, int64_t g, int64_t key_begin, int64_t end) {
    view = &v;
    kv_head = g;
    first_block = key_begin / v.block_tokens;
    key_end = end;
    const auto blocks =
        static_cast<size_t>((end - key_begin + v.block_tokens - 1) / v.block_tokens);
    key_elements = internal::PackedBlockElements(v.block_tokens, v.head_dim);
    value_elements = v.bf16 ? v.block_tokens * v.head_dim : 0;
    keys_made.assign(blocks, 0);
    values_made.assign(blocks, 0);
    if (keys.size() < blocks * static_cast<size_t>(key_elements)) {
      keys.resize(blocks * static_cast<size_t>(key_elements));
    }
    if (values.size() < blocks * static_cast<size_t>(value_elements)) {
      values.resize(blocks * static_cast<size_t>(value_elements));
    }
  }

  // Block `block`'s K packed (of the KV head and unit of the last Reset).
  template <typename T>
  const float* Keys(int64_t block) {
    const ItemView& v = *view;
    const auto b = static_cast<size_t>(block - first_block);
    float* const to = keys.data() + b * static_cast<size_t>(key_elements);
    if (!keys_made[b]) {
      const int64_t n = KeysOf(block);
      const int64_t tiles = (n + internal::kKeyTile - 1) / internal::kKeyTile;
      const T* k =
          reinterpret_cast<const T*>(v.cache->key_rows(block, static_cast<int>(kv_head)));
      internal::PackKeyBlock(BlockRowsFp32(k, n, v.head_dim, widened), v.head_dim,
                             tiles * internal::kKeyTile, n, v.head_dim, /*bf16=*/false, to);
      keys_made[b] = 1;
    }
    return to;
  }

  // Block `block`'s V rows as FP32: where they are (FP32 caches), or widened.
  template <typename T>
  const float* Values(int64_t block) {
    const ItemView& v = *view;
    const T* rows =
        reinterpret_cast<const T*>(v.cache->value_rows(block, static_cast<int>(kv_head)));
    if constexpr (std::is_same_v<T, float>) {
      return rows;
    } else {
      const auto b = static_cast<size_t>(block - first_block);
      float* const to = values.data() + b * static_cast<size_t>(value_elements);
      if (!values_made[b]) {
        WidenRows(rows, KeysOf(block) * v.head_dim, to);
        values_made[b] = 1;
      }
      return to;
    }
  }

 private:
  // The keys of `block` the unit sees.
  int64_t KeysOf(int64_t block) const {
    return std::min<int64_t>(view->block_tokens, key_end - block * view->block_tokens);
  }
};

// The query rows of the tile's new rows [i0, i1) and KV head g, contiguous
// in state.q_rows ([rows, hd], row r = (i - i0) G + hl), for the strip
// kernels: gathered once per tile, read by each of its spans.
void GatherTileQueries(const ItemView& view, int64_t g, int64_t i0, int64_t i1, TileState& state) {
  const int64_t hd = view.head_dim;
  const int64_t row = view.group * hd;
  state.q_rows.resize(static_cast<size_t>((i1 - i0) * row));
  for (int64_t i = i0; i < i1; ++i) {
    std::memcpy(state.q_rows.data() + (i - i0) * row,
                view.item->q.data() + view.q_row(i, g * view.group),
                static_cast<size_t>(row) * sizeof(float));
  }
}

// A tile of at least kStripNewRows new rows (a prefill's chunk) on the
// blocked path's own kernels (core/kernels/block_kernels.h) instead of one
// row at a time: each block's K rows packed once for the unit (StripBlocks:
// K^T in tiles of 16 keys; BF16 rows widened first), the scores of
// kStripRows query rows at a time against them, so that every packed key is
// loaded once for a strip of rows, then P V a strip of rows at a time over
// the block's V rows (BF16 rows widened once for the unit too). FP32
// throughout, as the row kernels, with the same online-softmax step; raw
// scores to the map. j0 is a block's first key; the tile's query rows are in
// state.q_rows (GatherTileQueries).
template <typename T>
void ProcessSpanStrips(const ItemView& view, int64_t g, int64_t j0, int64_t j1, int64_t i0,
                       int64_t i1, int64_t width, TileState& state, StripBlocks& blocks) {
  constexpr int64_t kStrip = internal::kStripRows;
  const PagedAttentionItem& item = *view.item;
  const int64_t bt = view.block_tokens;
  const int64_t hd = view.head_dim;
  const int64_t rows = (i1 - i0) * view.group;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t visible = std::max<int64_t>(0, std::min(j1, view.first + i + 1) - j0);
    const int64_t r0 = (i - i0) * view.group;
    for (int64_t hl = 0; hl < view.group; ++hl) {
      state.limits[static_cast<size_t>(r0 + hl)] = visible;
    }
  }
  // The most keys of block [a, a + keys) any of rows [r0, r1) sees.
  auto keys_seen = [&](int64_t r0, int64_t r1, int64_t a, int64_t keys) {
    int64_t most = 0;
    for (int64_t r = r0; r < r1; ++r) {
      most = std::max(most, state.limits[static_cast<size_t>(r)] - (a - j0));
    }
    return std::clamp<int64_t>(most, 0, keys);
  };
  for (int64_t a = j0; a < j1; a += bt) {
    const int64_t keys = std::min(j1, a + bt) - a;
    const int64_t tiles = (keys + internal::kKeyTile - 1) / internal::kKeyTile;
    const float* const packed = blocks.Keys<T>(a / bt);
    for (int64_t r0 = 0; r0 < rows; r0 += kStrip) {
      if (keys_seen(r0, std::min(rows, r0 + kStrip), a, keys) == 0) continue;
      internal::BlockScores(/*bf16=*/false, state.q_rows.data() + r0 * hd, hd,
                            std::min(kStrip, rows - r0), packed, tiles, hd,
                            state.scores.data() + r0 * state.stride + (a - j0), state.stride);
    }
  }
  if (!item.attention_map.empty()) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = state.limits[static_cast<size_t>(r)];
      if (visible == 0) continue;
      const int64_t i = i0 + r / view.group;
      const int64_t h = g * view.group + r % view.group;
      std::memcpy(item.attention_map.data() + view.map_row(i, h) + j0,
                  state.scores.data() + r * state.stride,
                  static_cast<size_t>(visible) * sizeof(float));
    }
  }
  internal::OnlineSoftmaxStrip(state.scores.data(), state.stride, rows, state.limits.data(), width,
                               item.scale, state.m.data(), state.l.data(), state.alpha.data(),
                               nullptr);
  // alpha scales a strip's accumulators once, at the span's first block that
  // reaches the strip (a row no key of the span reaches has alpha 1).
  static constexpr std::array<float, kStrip> kOnes = [] {
    std::array<float, kStrip> ones{};
    ones.fill(1.0f);
    return ones;
  }();
  // Bit k: strip k was scaled. A tile on this path has at most kTileRows rows
  // (kStripNewRows new rows or more means a group of at most kTileRows / 8).
  static_assert(kTileRows <= 32 * kStrip);
  uint32_t scaled = 0;
  for (int64_t a = j0; a < j1; a += bt) {
    const int64_t keys = std::min(j1, a + bt) - a;
    if (keys_seen(0, rows, a, keys) == 0) continue;
    const float* v_rows = blocks.Values<T>(a / bt);
    for (int64_t r0 = 0; r0 < rows; r0 += kStrip) {
      const int64_t seen = keys_seen(r0, std::min(rows, r0 + kStrip), a, keys);
      if (seen == 0) continue;
      const uint32_t bit = uint32_t{1} << (r0 / kStrip);
      internal::BlockValuesFp32(state.scores.data() + r0 * state.stride + (a - j0), state.stride,
                                std::min(kStrip, rows - r0), seen, v_rows, hd, hd,
                                (scaled & bit) != 0 ? kOnes.data() : state.alpha.data() + r0,
                                /*first=*/false, state.acc.data() + r0 * hd, hd);
      scaled |= bit;
    }
  }
}

// The tile's rows of KV head g done: out (and map rows) for a whole unit,
// their softmax states for a split.
void FinishTile(const ItemView& view, const Unit& unit, int64_t g, int64_t i0, int64_t i1,
                const TileState& state, float* partials) {
  const PagedAttentionItem& item = *view.item;
  const int64_t hd = view.head_dim;
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t hl = 0; hl < view.group; ++hl) {
      const int64_t r = (i - i0) * view.group + hl;
      const int64_t h = g * view.group + hl;
      const float* acc = state.acc.data() + r * hd;
      if (unit.partial >= 0) {
        float* to = partials + PartialRow(unit, view.group, hd, i, h);
        to[0] = state.m[r];
        to[1] = state.l[r];
        std::memcpy(to + 2, acc, static_cast<size_t>(hd) * sizeof(float));
        continue;
      }
      internal::ScaleInto(acc, hd, view.gate(h) / state.l[r],
                          item.out.data() + view.q_row(i, h));
      if (!item.attention_map.empty()) {
        NormalizeMapRow(item.attention_map.data() + view.map_row(i, h), view.first + i + 1,
                        view.length, state.m[r], state.l[r], item.scale, view.gate(h));
      }
    }
  }
}

// Runs a unit: tile by tile of new rows, span by span of keys, in each span
// KV head by KV head (states[g - unit.kv_begin] holds KV head g's tile).
void RunUnit(const ItemView& view, const Unit& unit, std::vector<TileState>& states,
             StripBlocks& blocks, float* partials) {
  const int64_t tile = std::max<int64_t>(1, kTileRows / view.group);
  const int64_t bt = view.block_tokens;
  // Whole blocks per span (unit.key_begin is a block's first key).
  const int64_t span = std::max<int64_t>(1, kSpanKeys / bt) * bt;
  if (states.size() < static_cast<size_t>(unit.kv_end - unit.kv_begin)) {
    states.resize(static_cast<size_t>(unit.kv_end - unit.kv_begin));
  }
  // A unit of kStripNewRows new rows or more holds one KV head (KvHeadsPerUnit).
  const bool strip_unit = view.n >= kStripNewRows &&
                          internal::OwnBlockKernelsAvailable(/*bf16=*/false, view.head_dim);
  if (strip_unit) blocks.Reset(view, unit.kv_begin, unit.key_begin, unit.key_end);
  for (int64_t i0 = 0; i0 < view.n; i0 += tile) {
    const int64_t i1 = std::min(view.n, i0 + tile);
    const bool strips = strip_unit && i1 - i0 >= kStripNewRows;
    for (int64_t g = unit.kv_begin; g < unit.kv_end; ++g) {
      TileState& state = states[static_cast<size_t>(g - unit.kv_begin)];
      state.Reset((i1 - i0) * view.group, view.head_dim, span);
      if (strips) GatherTileQueries(view, g, i0, i1, state);
    }
    // The tile's last row sees keys before first + i1.
    const int64_t key_end = std::min(unit.key_end, view.first + i1);
    for (int64_t j0 = unit.key_begin; j0 < key_end; j0 += span) {
      const int64_t j1 = std::min(key_end, j0 + span);
      for (int64_t g = unit.kv_begin; g < unit.kv_end; ++g) {
        TileState& state = states[static_cast<size_t>(g - unit.kv_begin)];
        if (strips && view.bf16) {
          ProcessSpanStrips<Bf16>(view, g, j0, j1, i0, i1, span, state, blocks);
        } else if (strips) {
          ProcessSpanStrips<float>(view, g, j0, j1, i0, i1, span, state, blocks);
        } else if (view.bf16) {
          // Next: this span in the next KV head, or the next span in the first.
          const NextSpan next = g + 1 < unit.kv_end
                                    ? NextSpan{g + 1, j0, j1}
                                    : NextSpan{unit.kv_begin, j1, std::min(key_end, j1 + span)};
          ProcessSpan<Bf16>(view, g, j0, j1, next, i0, i1, span, state);
        } else {
          ProcessSpanByBlock(view, g, j0, j1, i0, i1, span, state);
        }
      }
    }
    for (int64_t g = unit.kv_begin; g < unit.kv_end; ++g) {
      FinishTile(view, unit, g, i0, i1, states[static_cast<size_t>(g - unit.kv_begin)], partials);
    }
  }
}

// Merges the splits' softmax states of one (item, KV heads) into out (and
// normalizes its map rows, which hold every split's raw scores):
//   M = max_s m_s, w_s = exp(scale (m_s - M)), l = sum_s w_s l_s,
//   out = head_mask[h] sum_s w_s acc_s / l.
void MergeSplits(const ItemView& view, const Merge& merge, absl::Span<const Unit> units,
                 const float* partials, std::vector<float>& acc) {
  const PagedAttentionItem& item = *view.item;
  const int64_t hd = view.head_dim;
  acc.resize(static_cast<size_t>(hd));
  for (int64_t i = 0; i < view.n; ++i) {
    for (int64_t h = merge.kv_begin * view.group; h < merge.kv_end * view.group; ++h) {
      auto state_of = [&](int64_t s) {
        const Unit& unit = units[static_cast<size_t>(merge.first_unit + s)];
        return partials + PartialRow(unit, view.group, hd, i, h);
      };
      float m = kMinusInf;
      for (int64_t s = 0; s < merge.splits; ++s) m = std::max(m, state_of(s)[0]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t s = 0; s < merge.splits; ++s) {
        const float* state = state_of(s);
        if (state[1] == 0.0f) continue;  // no key of the split is visible to the row
        const float w = internal::FastExp((state[0] - m) * item.scale);
        l += w * state[1];
        for (int64_t d = 0; d < hd; ++d) acc[static_cast<size_t>(d)] += w * state[2 + d];
      }
      internal::ScaleInto(acc.data(), hd, view.gate(h) / l, item.out.data() + view.q_row(i, h));
      if (!item.attention_map.empty()) {
        NormalizeMapRow(item.attention_map.data() + view.map_row(i, h), view.first + i + 1,
                        view.length, m, l, item.scale, view.gate(h));
      }
    }
  }
}

}  // namespace

namespace internal {

std::vector<int64_t> PagedAttentionSplits(absl::Span<const PagedAttentionItem> items,
                                          int64_t threads) {
  std::vector<ItemView> views;
  for (const PagedAttentionItem& item : items) views.push_back(ViewOf(item));
  const int64_t split_keys = SplitKeys(views, threads);
  std::vector<int64_t> splits;
  for (const ItemView& view : views) {
    const int64_t chunk = SplitChunk(view, split_keys);
    splits.push_back((view.length + chunk - 1) / chunk);
  }
  return splits;
}

}  // namespace internal

absl::Status PagedAttention(absl::Span<const PagedAttentionItem> items) {
  std::vector<ItemView> views;
  views.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    ATTNSERVE_RETURN_IF_ERROR(ValidateItem(items[i], static_cast<int64_t>(i)));
    views.push_back(ViewOf(items[i]));
  }
  std::vector<Unit> units;
  std::vector<Merge> merges;
  const int64_t threads = omp_get_max_threads();
  const int64_t partial_floats = PlanUnits(views, threads, units, merges);
  std::vector<float> partials(static_cast<size_t>(partial_floats));
  const int64_t unit_count = static_cast<int64_t>(units.size());
  // The thread that finishes the last split of a merge merges the splits at
  // once: no barrier between the splits and the merges. Under the server's
  // PASSIVE wait each barrier is a futex sleep and wake-up, ~80 us on a
  // 2-vCPU virtual machine (docs/measurements.md, "Decode steps: copies that
  // forked"). The splits' partial states, and the raw scores they write into
  // map rows, are written before the release of their count and read after
  // the last one's acquire.
  std::vector<std::atomic<int64_t>> splits_left(merges.size());
  for (size_t m = 0; m < merges.size(); ++m) {
    splits_left[m].store(merges[m].splits, std::memory_order_relaxed);
  }
#pragma omp parallel if (unit_count > 1)
  {
    std::vector<TileState> states;
    StripBlocks blocks;
    std::vector<float> merged;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t u = 0; u < unit_count; ++u) {
      const Unit& unit = units[static_cast<size_t>(u)];
      const ItemView& view = views[static_cast<size_t>(unit.item)];
      RunUnit(view, unit, states, blocks, partials.data());
      if (unit.merge >= 0 &&
          splits_left[static_cast<size_t>(unit.merge)].fetch_sub(1, std::memory_order_acq_rel) ==
              1) {
        MergeSplits(view, merges[static_cast<size_t>(unit.merge)], units, partials.data(),
                    merged);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve::core
