#ifndef ATTNSERVE_CORE_DECODE_LAYER_KV_CACHE_H_
#define ATTNSERVE_CORE_DECODE_LAYER_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"

namespace attnserve::core {

// One layer's keys and values of one sequence, in blocks of a KvBlockPool: a
// block table (blocks in token order) and a length in tokens. Token t lies in
// block t / block_tokens at row t % block_tokens of each KV head's K and V
// rows (core/decode/kv_layout.h). Blocks may be shared with forks
// (copy on write): a block whose reference count is above 1 is never written;
// Append copies it first.
//
// Blocks in runs: a cache that grows a block at a time (a decode step's one
// token crossing a block boundary) takes a run of blocks at once and keeps
// those it does not need yet ahead of its tokens, so its blocks lie one after
// another in memory while other caches grow in turn beside it. Blocks whose
// rows alternate in memory with other sequences' made a 32-session decode
// step up to a third slower (docs/measurements.md). The run grows with what
// the cache has taken itself (a quarter of it, at most kMaxRunBlocks): a
// fresh fork takes one block, not a run; a cache holds at most
// kMaxRunBlocks - 1 blocks ahead, and at most a quarter of those it took.
// Blocks ahead are the pool's in use (its budget counts them); Truncate and
// the destructor give them back.
//
// Not thread-safe: one owner at a time (different caches may be used from
// different threads, also caches that share blocks: the pool is
// thread-safe). The pool must outlive the cache.
class LayerKvCache {
 public:
  // An empty cache. INVALID_ARGUMENT for a null pool or an invalid layout
  // (ValidateKvLayout).
  static absl::StatusOr<std::unique_ptr<LayerKvCache>> Create(KvBlockPool* pool,
                                                              const KvLayout& layout);
  // Releases its blocks.
  ~LayerKvCache();
  LayerKvCache(const LayerKvCache&) = delete;
  LayerKvCache& operator=(const LayerKvCache&) = delete;

  // The longest run of blocks an Append takes at once.
  static constexpr int64_t kMaxRunBlocks = 8;
  // An Append of at least this many bytes of rows writes them on the OpenMP
  // threads (a prefill chunk's), a smaller one on the calling thread.
  static constexpr int64_t kParallelWriteBytes = int64_t{1} << 20;
  // Whether an Append may take a run of blocks ahead of its tokens.
  enum class BlocksAhead { kTake, kNone };

  // Appends n >= 0 tokens:
  //   k, v: [n, num_kv_heads, head_dim] FP32 row-major
  // (rounded to BF16, to nearest even, when the layout is BF16), taking
  // blocks from the pool as needed (those held ahead first; with kTake, a
  // run when it must take one block and the pool has room for it) and
  // copying a shared last block first.
  // All or nothing: INVALID_ARGUMENT when n < 0 or a span's size is not
  // n * num_kv_heads * head_dim; RESOURCE_EXHAUSTED when the pool refuses the
  // blocks; the cache is unchanged on either.
  absl::Status Append(absl::Span<const float> k, absl::Span<const float> v, int64_t n,
                      BlocksAhead ahead = BlocksAhead::kTake);

  // The blocks Append(n, ahead) would take from the pool now (a copy of a
  // shared last block and a run's blocks ahead included; 0 when the blocks
  // held ahead cover the n tokens). n >= 0.
  int64_t BlocksToTake(int64_t n, BlocksAhead ahead) const;

  // Keeps the first `length` tokens and releases the blocks past them (and
  // those held ahead); the latest query goes when the token it belongs to
  // does (length below it).
  // INVALID_ARGUMENT (nothing changed) unless 0 <= length <= length().
  absl::Status Truncate(int64_t length);

  // A new cache with the same tokens (and latest query), sharing every block
  // of the table (reference counts incremented, nothing copied; none ahead);
  // either may then append without changing the other's rows. Cannot fail.
  std::unique_ptr<LayerKvCache> Fork() const;

  // The query of the cache's last token as its step's attention used it
  // (Extend keeps it: [num_heads, head_dim] FP32, RoPE applied), for a read
  // of what that token attends to (core/decode/latest_attention.h). Empty
  // when the last token's query is not kept: no step kept one, the cache was
  // truncated below its token, or tokens were appended after it without one.
  absl::Span<const float> latest_query() const {
    return latest_query_length_ == length_ ? absl::MakeConstSpan(latest_query_)
                                           : absl::Span<const float>();
  }
  // Keeps `query` as the last token's (length() >= 1; a no-op when empty).
  void SetLatestQuery(absl::Span<const float> query);
  // Bytes the kept query takes (also while a later append hides it).
  int64_t latest_query_bytes() const {
    return static_cast<int64_t>(latest_query_.size() * sizeof(float));
  }

  int64_t length() const { return length_; }
  const KvLayout& layout() const { return layout_; }
  int block_tokens() const { return block_tokens_; }
  KvBlockPool* pool() const { return pool_; }
  // The block table: ceil(length / block_tokens) blocks, in token order.
  absl::Span<const KvBlockHandle> blocks() const { return blocks_; }
  // Blocks taken ahead of the tokens (unshared, holding no rows), the next
  // first.
  absl::Span<const KvBlockHandle> blocks_ahead() const { return ahead_; }
  // Every block the cache holds a reference to: the table and those ahead.
  int64_t blocks_held() const {
    return static_cast<int64_t>(blocks_.size() + ahead_.size());
  }

  // The K (and V) rows of `kv_head` in block `block` (both in range):
  // [block_tokens, head_dim] in the layout's precision (float or Bf16), of
  // which the first min(block_tokens, length - block * block_tokens) hold
  // tokens. Valid until the cache next changes.
  const std::byte* key_rows(int64_t block, int kv_head) const {
    return blocks_[static_cast<size_t>(block)].data + kv_head * head_rows_bytes_;
  }
  const std::byte* value_rows(int64_t block, int kv_head) const {
    return blocks_[static_cast<size_t>(block)].data +
           (layout_.num_kv_heads + kv_head) * head_rows_bytes_;
  }

 private:
  LayerKvCache(KvBlockPool* pool, const KvLayout& layout);

  // Copies the first `tokens` rows of every KV head's K and V from one block
  // to another of this layout.
  void CopyRows(const KvBlockHandle& from, const KvBlockHandle& to, int64_t tokens) const;
  // Writes token rows [0, n) of k and v at positions length_ ... (blocks
  // present and unshared).
  void WriteRows(const float* k, const float* v, int64_t n);

  // Constant after construction.
  KvBlockPool* const pool_;
  const KvLayout layout_;
  const int block_tokens_;
  // Bytes of one KV head's K (or V) rows in a block: kv_head's K rows start
  // kv_head times this from the block's start, its V rows num_kv_heads +
  // kv_head times (KvKeyRowsOffset, KvValueRowsOffset).
  const int64_t head_rows_bytes_;

  // Whether the next append must copy the last block first: it is partly
  // filled and a fork shares it.
  bool CopiesLastBlock() const;
  // Blocks appending n tokens puts into the table, a copy of the last
  // included (from those ahead or the pool).
  int64_t BlocksNeeded(int64_t n, bool copy_last) const;
  // How many blocks Append takes for `fresh` blocks it needs: with kTake, a
  // run when fresh is 1 and the cache has taken enough itself.
  int64_t RunFor(int64_t fresh, BlocksAhead ahead) const;

  std::vector<KvBlockHandle> blocks_;
  // Taken ahead, in the order the pool gave them; Append uses the front
  // first.
  std::vector<KvBlockHandle> ahead_;
  // Blocks this cache took from the pool itself (not shared by a fork).
  int64_t taken_ = 0;
  int64_t length_ = 0;
  // The latest query and the length the cache had when it was kept (0:
  // none); it is the last token's while that length is length_.
  std::vector<float> latest_query_;
  int64_t latest_query_length_ = 0;
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_DECODE_LAYER_KV_CACHE_H_
