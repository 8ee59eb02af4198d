#ifndef ATTNSERVE_CORE_DECODE_KV_BLOCK_SLABS_H_
#define ATTNSERVE_CORE_DECODE_KV_BLOCK_SLABS_H_

// Private to core/decode: the memory of KvBlockPool's blocks of one size
// (core/decode/kv_block_pool.h). A decode step streams every cached block of
// every sequence in its batch once, so where the blocks lie decides how fast
// it runs: taken one at a time from the process's allocator (jemalloc, the
// server's), the 192 KiB blocks of a 32-session step streamed 20-35% slower
// than from glibc's heap with transparent huge pages (docs/measurements.md,
// "The KV pool's memory").
//
// So blocks come from slabs: regions of whole 2 MiB pages mapped from the
// system (aligned to 2 MiB and advised to be backed by huge pages where the
// system allows it, MADV_HUGEPAGE), cut into slots one block apart. A slab's
// lowest free slot is handed out first, so the blocks a sequence takes one
// after another lie one after another. Freeing a block gives its whole pages
// back to the system at once (MADV_DONTNEED; the slot stays mapped for the
// next block), and a slab with no block left is unmapped.
//
// Thread-safe (one mutex). Every block must be freed before the slabs are
// destroyed; the destructor unmaps every slab regardless.

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attnserve::core::internal {

class KvBlockSlabs {
 public:
  // The alignment of a slab and the size its mapping is a multiple of: a huge
  // page of x86-64 (and of most 64-bit systems with 4 KiB base pages).
  static constexpr int64_t kSlabAlignment = int64_t{2} << 20;
  // A slab holds this many bytes of blocks (at most kMaxSlabBlocks of them),
  // or one block when a block is larger.
  static constexpr int64_t kSlabTargetBytes = int64_t{8} << 20;
  static constexpr int64_t kMaxSlabBlocks = 4096;

  // Slabs of blocks of `block_bytes` (> 0, a multiple of kKvBlockAlignment).
  explicit KvBlockSlabs(int64_t block_bytes);
  ~KvBlockSlabs();
  KvBlockSlabs(const KvBlockSlabs&) = delete;
  KvBlockSlabs& operator=(const KvBlockSlabs&) = delete;

  int64_t block_bytes() const { return block_bytes_; }
  // Blocks per slab.
  int64_t slab_blocks() const { return slab_blocks_; }

  // Memory for one block (contents undefined, kSlabAlignment-aligned slabs,
  // so every block is aligned to the largest power of two dividing
  // block_bytes), or nullptr when the system maps no more memory.
  std::byte* Allocate();
  // Gives back a block this object allocated (anything else stops the
  // process: a pool's broken invariant).
  void Free(std::byte* block);

  // Bytes mapped from the system (whole slabs; a slot's pages are resident
  // only while it holds a block or until they are first touched).
  int64_t mapped_bytes() const;
  int64_t slab_count() const;

 private:
  struct Slab {
    int64_t mapping_bytes = 0;
    std::vector<int32_t> free_slots;  // a min-heap (std::greater): front() is the lowest
    std::vector<bool> in_use;         // by slot
    int64_t used = 0;
  };

  const int64_t block_bytes_;
  const int64_t slab_blocks_;
  const int64_t mapping_bytes_;

  mutable absl::Mutex mu_;
  // By base address.
  std::map<std::byte*, Slab> slabs_ ABSL_GUARDED_BY(mu_);
  // The bases of slabs with a free slot, lowest first.
  std::set<std::byte*> with_room_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_DECODE_KV_BLOCK_SLABS_H_
