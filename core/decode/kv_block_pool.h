#ifndef ATTNSERVE_CORE_DECODE_KV_BLOCK_POOL_H_
#define ATTNSERVE_CORE_DECODE_KV_BLOCK_POOL_H_

// The memory of the KV cache: fixed-size token blocks (vLLM-style paging, on
// CPU memory), bounded by a byte budget. LayerKvCache
// (core/decode/layer_kv_cache.h) builds one layer's cache of one sequence
// out of them; the server (later) evicts sessions when the pool refuses.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/decode/kv_layout.h"

namespace attnserve::core {

namespace internal {
class KvBlockSlabs;
}  // namespace internal

struct KvBlockPoolOptions {
  // Bytes the pool may hold (blocks in use and free-listed together); > 0.
  int64_t budget_bytes = 0;
  // Tokens per block, in [1, kMaxKvBlockTokens].
  int block_tokens = 32;
};

// A block of the pool: which one (the pool's id) and where its K and V start
// (kKvBlockAlignment-aligned; see core/decode/kv_layout.h for what lies
// there). Valid while its reference count is positive.
struct KvBlockHandle {
  int32_t id = -1;
  std::byte* data = nullptr;
};

// What the pool holds, read together (for metrics).
struct KvBlockPoolStats {
  int64_t bytes_in_use = 0;  // blocks with a positive reference count
  int64_t bytes_held = 0;    // in use + free-listed: what the budget bounds
  int64_t blocks_in_use = 0;
  int64_t free_blocks = 0;   // free-listed, any layout
  int64_t shared_blocks = 0;  // in use with a reference count > 1 (forks share them)
};

// A pool of KV blocks, each of one KvLayout, with a reference count (forks
// share blocks; a shared block is copied before it is written, by its
// LayerKvCache). A block whose count drops to 0 goes to the free list of its
// layout and is handed out again by the next Allocate of that layout, the
// lowest in memory first; Trim
// gives free-listed memory back to the system. The pool never holds more
// than budget_bytes: an allocation that would pass it first frees blocks
// free-listed for other layouts, and is refused if that is not enough.
//
// Bookkeeping is per block, never per token: 16 bytes in the pool and a
// 16-byte handle in each block table that holds the block, against a block's
// 2 * block_tokens * num_kv_heads * head_dim * element bytes (8 KiB for 32
// tokens of one BF16 KV head of 64: 0.4%).
//
// The blocks of one layout lie one after another in slabs the pool maps
// itself (core/decode/kv_block_slabs.h): a decode step streams them faster
// than blocks taken one at a time from the process's allocator.
//
// Thread-safe (one mutex; the memory is allocated and freed outside it). The
// pool must outlive every block handle it gave out (every LayerKvCache over it).
class KvBlockPool {
 public:
  // INVALID_ARGUMENT naming the field ("kv_block_pool.budget_bytes",
  // "kv_block_pool.block_tokens") when an option is out of range.
  static absl::StatusOr<std::unique_ptr<KvBlockPool>> Create(const KvBlockPoolOptions& options);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  int block_tokens() const { return options_.block_tokens; }
  int64_t budget_bytes() const { return options_.budget_bytes; }

  // One block of `layout` with reference count 1 (contents undefined).
  // INVALID_ARGUMENT for an invalid layout (ValidateKvLayout);
  // RESOURCE_EXHAUSTED when it would take the pool past its budget (nothing
  // is allocated; the caller may free blocks and retry) or the system has no
  // memory for it.
  absl::StatusOr<KvBlockHandle> Allocate(const KvLayout& layout);
  // `count` (>= 0) blocks of `layout`, appended to `blocks`, all or none: on
  // an error nothing is allocated and `blocks` is unchanged. Errors as
  // Allocate's; INVALID_ARGUMENT also for a negative count.
  absl::Status AllocateBlocks(const KvLayout& layout, int64_t count,
                              std::vector<KvBlockHandle>& blocks);

  // Adds one reference to each block (each must be in use).
  void Share(absl::Span<const KvBlockHandle> blocks);
  void Share(const KvBlockHandle& block) { Share(absl::MakeConstSpan(&block, 1)); }
  // Drops one reference from each block (each must be in use); a block whose
  // count reaches 0 is free-listed and its handle is no longer valid.
  void Release(absl::Span<const KvBlockHandle> blocks);
  void Release(const KvBlockHandle& block) { Release(absl::MakeConstSpan(&block, 1)); }
  // The reference count of a block in use (> 1: shared, must not be written).
  int ReferenceCount(const KvBlockHandle& block) const;
  // Whether one of `blocks` (each in use) has a reference count of 1, looked
  // at from the last: a fork's own blocks follow the prefix it shares.
  bool AnyUnshared(absl::Span<const KvBlockHandle> blocks) const;

  // Frees every free-listed block's memory; returns the bytes freed.
  int64_t Trim();

  KvBlockPoolStats stats() const;

 private:
  // One block's bookkeeping (16 bytes).
  struct Record {
    std::byte* data = nullptr;  // nullptr: the record is vacant
    int32_t references = 0;
    int32_t layout_index = 0;
  };
  // The blocks of one layout not in use, and the memory of all of them.
  struct LayoutFreeList {
    KvLayout layout;
    int64_t block_bytes = 0;
    // A min-heap by the blocks' addresses (PushFreeLocked, PopLowestFreeLocked).
    std::vector<int32_t> free_ids;
    std::unique_ptr<internal::KvBlockSlabs> slabs;
  };
  // A block's memory on its way back to its slabs.
  struct BlockMemory {
    internal::KvBlockSlabs* slabs = nullptr;
    std::byte* data = nullptr;
  };
  static void FreeAll(absl::Span<const BlockMemory> memory);

  explicit KvBlockPool(const KvBlockPoolOptions& options);

  // The index of `layout` in free_lists_, added if new.
  int LayoutIndexLocked(const KvLayout& layout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes room for `bytes` more within the budget by taking free-listed
  // blocks of layouts other than `keep` out of the pool (their memory is
  // appended to `to_free`); false, with nothing taken, when even that is not
  // enough.
  bool MakeRoomLocked(int64_t bytes, int keep, std::vector<BlockMemory>& to_free)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A record for a block of fresh memory `data` in use by one reference.
  KvBlockHandle AddRecordLocked(std::byte* data, int layout_index)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free-lists block `id`, and takes out the free-listed block lowest in
  // memory: a sequence's blocks then follow one another upwards in memory as
  // blocks fresh from the slabs do, whatever order blocks were released in.
  // (Handed out last-released first, the blocks of sessions closed in a row
  // came back in descending order and their decode steps ran 12-23% slower:
  // docs/measurements.md, "The KV pool hands out its lowest free block".)
  void PushFreeLocked(LayoutFreeList& list, int32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The heap's order: the block lowest in memory on top.
  auto LowestOnTopLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int32_t PopLowestFreeLocked(LayoutFreeList& list) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes free-listed block `id` out of the pool; returns its memory.
  BlockMemory RemoveFreeBlockLocked(int32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const KvBlockPoolOptions options_;

  mutable absl::Mutex mu_;
  std::vector<Record> records_ ABSL_GUARDED_BY(mu_);  // indexed by block id
  std::vector<int32_t> vacant_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<LayoutFreeList> free_lists_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_in_use_ ABSL_GUARDED_BY(mu_) = 0;
  // In use + free-listed + reserved by allocations under way.
  int64_t bytes_held_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t blocks_in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t free_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t shared_blocks_ ABSL_GUARDED_BY(mu_) = 0;  // references > 1
};

}  // namespace attnserve::core

#endif  // ATTNSERVE_CORE_DECODE_KV_BLOCK_POOL_H_
