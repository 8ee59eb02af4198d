#include "core/decode/kv_block_slabs.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <utility>

#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define ATTNSERVE_POISON(address, bytes) ASAN_POISON_MEMORY_REGION(address, bytes)
#define ATTNSERVE_UNPOISON(address, bytes) ASAN_UNPOISON_MEMORY_REGION(address, bytes)
#else
#define ATTNSERVE_POISON(address, bytes) ((void)(address), (void)(bytes))
#define ATTNSERVE_UNPOISON(address, bytes) ((void)(address), (void)(bytes))
#endif

namespace attnserve::core::internal {
namespace {

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// `bytes` (a multiple of the page size) of fresh zeroed memory, or nullptr.
std::byte* Map(int64_t bytes) {
  void* mapped = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return mapped == MAP_FAILED ? nullptr : static_cast<std::byte*>(mapped);
}

int64_t PageBytes() {
  static const int64_t page = sysconf(_SC_PAGESIZE);
  return page;
}

// Gives the whole pages of [block, block + bytes) back to the system; they
// read as zeros when touched again.
void ReleasePages(std::byte* block, int64_t bytes) {
  const int64_t page = PageBytes();
  const auto start = reinterpret_cast<uintptr_t>(block);
  const uintptr_t first = RoundUp(static_cast<int64_t>(start), page);
  const uintptr_t last = (start + static_cast<uintptr_t>(bytes)) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// Makes the pages under [block, block + bytes) resident now, in one call
// into the kernel (MADV_POPULATE_WRITE, Linux 5.14), instead of one page
// fault at each page's first write: on the virtual machine measured, a fault
// took 12-13 us and a page populated about 1 us, and a decode step that
// crossed a page in every session's block took hundreds of faults
// (docs/measurements.md, "A block's pages come in one call"). There the first
// write to a populated page still cost 5.5-6.5 us (BM_FreshPages): populating
// halves a fresh page's cost, it does not remove it. A hint: on a kernel
// without it, the pages fault in as they are written. The pages at the ends
// may be shared with the neighbouring slots, which ReleasePages never gives
// back anyway.
void PopulatePages(std::byte* block, int64_t bytes) {
  const int64_t page = PageBytes();
  const auto start = reinterpret_cast<uintptr_t>(block);
  const uintptr_t first = start / page * page;
  const uintptr_t last = RoundUp(static_cast<int64_t>(start) + bytes, page);
  madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_WRITE);
}

[[noreturn]] void DieOnForeignBlock(const void* block) {
  std::fprintf(stderr, "KvBlockSlabs::Free: %p is not a block of these slabs in use\n", block);
  std::abort();
}

}  // namespace

KvBlockSlabs::KvBlockSlabs(int64_t block_bytes)
    : block_bytes_(block_bytes),
      slab_blocks_(std::clamp<int64_t>(kSlabTargetBytes / block_bytes, 1, kMaxSlabBlocks)),
      mapping_bytes_(RoundUp(slab_blocks_ * block_bytes, PageBytes())) {}

KvBlockSlabs::~KvBlockSlabs() {
  absl::MutexLock lock(&mu_);
  for (auto& [base, slab] : slabs_) {
    ATTNSERVE_UNPOISON(base, slab.mapping_bytes);
    munmap(base, static_cast<size_t>(slab.mapping_bytes));
  }
}

std::byte* KvBlockSlabs::Allocate() {
  std::byte* block = AllocateSlot();
  if (block != nullptr) PopulatePages(block, block_bytes_);
  return block;
}

std::byte* KvBlockSlabs::AllocateSlot() {
  absl::MutexLock lock(&mu_);
  if (with_room_.empty()) {
    std::byte* base = Map(mapping_bytes_);
    if (base == nullptr) return nullptr;
    Slab slab;
    slab.mapping_bytes = mapping_bytes_;
    // Ascending: already a min-heap.
    for (int64_t slot = 0; slot < slab_blocks_; ++slot) {
      slab.free_slots.push_back(static_cast<int32_t>(slot));
    }
    slab.in_use.assign(static_cast<size_t>(slab_blocks_), false);
    ATTNSERVE_POISON(base, mapping_bytes_);
    slabs_.emplace(base, std::move(slab));
    with_room_.insert(base);
  }
  std::byte* base = *with_room_.begin();
  Slab& slab = slabs_.at(base);
  std::pop_heap(slab.free_slots.begin(), slab.free_slots.end(), std::greater<>());
  const int32_t slot = slab.free_slots.back();
  slab.free_slots.pop_back();
  slab.in_use[static_cast<size_t>(slot)] = true;
  ++slab.used;
  if (slab.free_slots.empty()) with_room_.erase(base);
  std::byte* block = base + slot * block_bytes_;
  ATTNSERVE_UNPOISON(block, block_bytes_);
  return block;
}

void KvBlockSlabs::Free(std::byte* block) {
  absl::MutexLock lock(&mu_);
  auto it = slabs_.upper_bound(block);
  if (it == slabs_.begin()) DieOnForeignBlock(block);
  --it;
  std::byte* base = it->first;
  Slab& slab = it->second;
  const int64_t offset = block - base;
  if (offset % block_bytes_ != 0 || offset / block_bytes_ >= slab_blocks_) {
    DieOnForeignBlock(block);
  }
  const auto slot = static_cast<int32_t>(offset / block_bytes_);
  if (!slab.in_use[static_cast<size_t>(slot)]) DieOnForeignBlock(block);
  slab.in_use[static_cast<size_t>(slot)] = false;
  if (--slab.used == 0) {
    with_room_.erase(base);
    ATTNSERVE_UNPOISON(base, slab.mapping_bytes);
    munmap(base, static_cast<size_t>(slab.mapping_bytes));
    slabs_.erase(it);
    return;
  }
  ReleasePages(block, block_bytes_);
  ATTNSERVE_POISON(block, block_bytes_);
  slab.free_slots.push_back(slot);
  std::push_heap(slab.free_slots.begin(), slab.free_slots.end(), std::greater<>());
  with_room_.insert(base);
}

int64_t KvBlockSlabs::mapped_bytes() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(slabs_.size()) * mapping_bytes_;
}

int64_t KvBlockSlabs::slab_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(slabs_.size());
}

}  // namespace attnserve::core::internal
