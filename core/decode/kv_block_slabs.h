#ifndef ATTNSERVE_CORE_DECODE_KV_BLOCK_SLABS_H_
#define ATTNSERVE_CORE_DECODE_KV_BLOCK_SLABS_H_

// Private to core/decode: the memory of KvBlockPool's blocks of one size
// (core/decode/kv_block_pool.h). A decode step streams every cached block of
// every sequence in its batch once, so where the blocks lie decides how fast
// it runs: taken one at a time from the process's allocator (jemalloc, the
// server's), the 192 KiB blocks of a 32-session step streamed 20-35% slower
// than from glibc's heap (docs/measurements.md, "The KV pool's memory").
//
// So blocks come from slabs: regions of about kSlabTargetBytes mapped from
// the system, cut into slots one block apart. A slab's lowest free slot is
// handed out first, so the blocks a sequence takes one after another lie one
// after another. A block's pages are made resident in one call when it is
// handed out, where the kernel can (MADV_POPULATE_WRITE, Linux 5.14), not
// faulted in one by one as its rows are written. Freeing a
// block gives its whole pages back to the system at once (MADV_DONTNEED; the
// slot stays mapped for the next block), and a slab with no block left is
// unmapped: the memory resident is the blocks held (and at most one page more
// each), which is what the pool's budget counts.
//
// Not advised into huge pages (MADV_HUGEPAGE): with that advice the kernel's
// khugepaged fills a 2 MiB range back in, freed blocks and all, as soon as one
// block in it is still held, and the budget would no longer bound memory (on
// a system whose transparent huge pages are "always", that is the system's
// choice for all of the process's memory).
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

  // Memory for one block, its pages made resident where the kernel can
  // (contents undefined; slabs start at a page, so a block is aligned to the
  // largest power of two dividing block_bytes, up to the page size), or
  // nullptr when the system maps no more memory.
  std::byte* Allocate();
  // Gives back a block this object allocated (anything else stops the
  // process: a pool's broken invariant).
  void Free(std::byte* block);

  // Bytes mapped from the system (whole slabs; a slot's pages are resident
  // from when its block is allocated -- on a kernel without
  // MADV_POPULATE_WRITE, first written -- until it is freed).
  int64_t mapped_bytes() const;
  int64_t slab_count() const;

 private:
  // Allocate's slot, its pages as the slot left them.
  std::byte* AllocateSlot();

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
