#include "core/decode/kv_block_slabs.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>

#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace attnserve::core::internal {
namespace {

// A block of the built-in model's FP32 KV: 12 heads of 64, 32 tokens.
constexpr int64_t kBlockBytes = 196608;

// Whether every whole page of [block, block + bytes) is resident.
bool PagesResident(const std::byte* block, int64_t bytes, bool* any) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  const auto start = reinterpret_cast<uintptr_t>(block);
  const uintptr_t first = (start + page - 1) / page * page;
  const uintptr_t last = (start + static_cast<uintptr_t>(bytes)) / page * page;
  std::vector<unsigned char> resident((last - first) / page);
  EXPECT_EQ(mincore(reinterpret_cast<void*>(first), last - first, resident.data()), 0);
  *any = std::any_of(resident.begin(), resident.end(), [](unsigned char r) { return r & 1; });
  return std::all_of(resident.begin(), resident.end(), [](unsigned char r) { return r & 1; });
}

TEST(KvBlockSlabs, BlocksTakenOneAfterAnotherLieOneAfterAnotherInSlabs) {
  KvBlockSlabs slabs(kBlockBytes);
  // 8 MiB of 192 KiB blocks: 42 a slab.
  EXPECT_EQ(slabs.slab_blocks(), 42);
  std::vector<std::byte*> blocks;
  for (int i = 0; i < 100; ++i) {
    blocks.push_back(slabs.Allocate());
    ASSERT_NE(blocks.back(), nullptr);
  }
  EXPECT_EQ(slabs.slab_count(), 3);
  EXPECT_EQ(slabs.mapped_bytes(), 3 * 42 * kBlockBytes);
  for (int i = 0; i < 100; ++i) {
    if (i % 42 == 0) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(blocks[i]) % sysconf(_SC_PAGESIZE), 0u) << i;
    } else {
      EXPECT_EQ(blocks[i] - blocks[i - 1], kBlockBytes) << i;
    }
  }
  for (std::byte* block : blocks) slabs.Free(block);
  EXPECT_EQ(slabs.slab_count(), 0);
}

TEST(KvBlockSlabs, BlocksNeverOverlapThroughChurn) {
  // Small blocks (a slab of 4096) and large ones (one a slab), each filled
  // with its own pattern and checked after random frees and allocations.
  for (const int64_t block_bytes : {int64_t{64}, int64_t{4160}, int64_t{9} << 20}) {
    KvBlockSlabs slabs(block_bytes);
    std::mt19937 random(static_cast<uint32_t>(block_bytes));
    struct Held {
      std::byte* block;
      unsigned char pattern;
    };
    std::vector<Held> held;
    auto check = [&](const Held& h) {
      for (int64_t at : {int64_t{0}, block_bytes / 2, block_bytes - 1}) {
        ASSERT_EQ(static_cast<unsigned char>(h.block[at]), h.pattern) << block_bytes;
      }
    };
    const int rounds = block_bytes > (1 << 20) ? 16 : 3000;
    for (int round = 0; round < rounds; ++round) {
      if (!held.empty() && random() % 3 == 0) {
        const size_t victim = random() % held.size();
        check(held[victim]);
        slabs.Free(held[victim].block);
        held[victim] = held.back();
        held.pop_back();
        continue;
      }
      std::byte* block = slabs.Allocate();
      ASSERT_NE(block, nullptr);
      ASSERT_EQ(reinterpret_cast<uintptr_t>(block) % kKvBlockAlignment, 0u);
      const auto pattern = static_cast<unsigned char>(random());
      std::memset(block, pattern, static_cast<size_t>(block_bytes));
      held.push_back({block, pattern});
    }
    for (const Held& h : held) check(h);
    for (const Held& h : held) slabs.Free(h.block);
    EXPECT_EQ(slabs.slab_count(), 0) << block_bytes;
  }
}

TEST(KvBlockSlabs, AFreedBlocksPagesGoBackToTheSystemAndItsSlotIsTheNextTaken) {
  KvBlockSlabs slabs(kBlockBytes);
  std::byte* first = slabs.Allocate();
  std::byte* second = slabs.Allocate();
  std::byte* third = slabs.Allocate();
  std::memset(second, 1, kBlockBytes);
  bool any = false;
  EXPECT_TRUE(PagesResident(second, kBlockBytes, &any));
  slabs.Free(second);
  PagesResident(second, kBlockBytes, &any);
  EXPECT_FALSE(any) << "the freed block's pages are still resident";
  // The lowest free slot comes first.
  EXPECT_EQ(slabs.Allocate(), second);
  slabs.Free(first);
  slabs.Free(second);
  slabs.Free(third);
  EXPECT_EQ(slabs.slab_count(), 0);
}

TEST(KvBlockSlabsDeathTest, FreeingABlockNotInUseStopsTheProcess) {
  KvBlockSlabs slabs(kBlockBytes);
  std::byte* kept = slabs.Allocate();
  std::byte* block = slabs.Allocate();
  slabs.Free(block);
  EXPECT_DEATH(slabs.Free(block), "not a block of these slabs in use");
  EXPECT_DEATH(slabs.Free(kept + 64), "not a block of these slabs in use");
  std::byte elsewhere[64];
  EXPECT_DEATH(slabs.Free(elsewhere), "not a block of these slabs in use");
  slabs.Free(kept);
}

#if defined(__SANITIZE_ADDRESS__)
// Under AddressSanitizer a block's memory is poisoned while no one holds it:
// a cache that kept a pointer into a block it gave back is caught.
TEST(KvBlockSlabsDeathTest, TouchingAFreedBlockIsCaughtUnderAddressSanitizer) {
  KvBlockSlabs slabs(kBlockBytes);
  std::byte* kept = slabs.Allocate();
  std::byte* block = slabs.Allocate();
  kept[0] = std::byte{1};
  slabs.Free(block);
  EXPECT_DEATH(
      {
        volatile std::byte* stale = block;
        stale[kBlockBytes / 2] = std::byte{1};
      },
      "use-after-poison");
  slabs.Free(kept);
}
#endif

// Whether this kernel populates pages on request (MADV_POPULATE_WRITE, Linux
// 5.14); without it a block's pages fault in as they are written.
bool KernelPopulatesPages() {
  const int64_t page = sysconf(_SC_PAGESIZE);
  void* probe = mmap(nullptr, static_cast<size_t>(page), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe == MAP_FAILED) return false;
  const bool populates = madvise(probe, static_cast<size_t>(page), MADV_POPULATE_WRITE) == 0;
  munmap(probe, static_cast<size_t>(page));
  return populates;
}

// A block's pages are resident when it is handed out, before anything writes
// it (no page fault at each page's first write), also a slot's whose pages a
// freed block gave back; the neighbouring free slot's whole pages stay given
// back. Blocks of 64 bytes more than 48 pages, so that they share pages at
// their ends.
TEST(KvBlockSlabs, AHandedOutBlocksPagesAreResidentBeforeItIsWritten) {
  if (!KernelPopulatesPages()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE";
  constexpr int64_t kOddBlockBytes = kBlockBytes + 64;
  KvBlockSlabs slabs(kOddBlockBytes);
  std::byte* first = slabs.Allocate();
  std::byte* second = slabs.Allocate();
  std::byte* third = slabs.Allocate();
  bool any = false;
  for (std::byte* block : {first, second, third}) {
    EXPECT_TRUE(PagesResident(block, kOddBlockBytes, &any)) << "block " << block - first;
  }
  slabs.Free(second);
  slabs.Free(third);
  PagesResident(second, kOddBlockBytes, &any);
  ASSERT_FALSE(any) << "the freed block's pages are still resident";
  ASSERT_EQ(slabs.Allocate(), second);
  EXPECT_TRUE(PagesResident(second, kOddBlockBytes, &any));
  PagesResident(third, kOddBlockBytes, &any);
  EXPECT_FALSE(any) << "populating a block made its free neighbour's pages resident";
  slabs.Free(first);
  slabs.Free(second);
  EXPECT_EQ(slabs.slab_count(), 0);
}

// The pool's blocks of one layout come from its slabs: a sequence's blocks
// taken one after another are adjacent, and Trim gives their pages back.
TEST(KvBlockSlabs, ThePoolsBlocksOfOneLayoutAreAdjacentAndTrimReleasesTheirPages) {
  const KvLayout layout{12, 64, KvPrecision::kFp32};
  ASSERT_EQ(KvBlockBytes(layout, 32), kBlockBytes);
  std::unique_ptr<KvBlockPool> pool = KvBlockPool::Create({64 * kBlockBytes, 32}).value();
  std::vector<KvBlockHandle> kept, released;
  ASSERT_TRUE(pool->AllocateBlocks(layout, 4, kept).ok());
  ASSERT_TRUE(pool->AllocateBlocks(layout, 4, released).ok());
  for (size_t i = 1; i < kept.size(); ++i) EXPECT_EQ(kept[i].data - kept[i - 1].data, kBlockBytes);
  for (const KvBlockHandle& block : released) std::memset(block.data, 7, kBlockBytes);
  pool->Release(released);
  EXPECT_EQ(pool->Trim(), 4 * kBlockBytes);
  for (const KvBlockHandle& block : released) {
    bool any = false;
    PagesResident(block.data, kBlockBytes, &any);
    EXPECT_FALSE(any);
  }
  pool->Release(kept);
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// When the system maps no more memory, the pool refuses the whole request
// (RESOURCE_EXHAUSTED) and holds what it held before. In a child process
// whose address space is capped 64 MiB above what it maps (the sanitizers
// reserve terabytes of shadow memory, so not under them).
// Exits 0 when the refusal is as it should be, with another code naming the
// check that failed otherwise.
[[noreturn]] void AllocatePastAnAddressSpaceCap() {
  const KvLayout layout{12, 64, KvPrecision::kFp32};
  std::unique_ptr<KvBlockPool> pool = KvBlockPool::Create({int64_t{1} << 40, 32}).value();
  std::vector<KvBlockHandle> kept;
  if (!pool->AllocateBlocks(layout, 1, kept).ok()) _exit(2);
  int64_t mapped_pages = 0;
  std::ifstream("/proc/self/statm") >> mapped_pages;
  const rlimit cap{static_cast<rlim_t>(mapped_pages * sysconf(_SC_PAGESIZE) + (64 << 20)),
                   RLIM_INFINITY};
  if (mapped_pages == 0 || setrlimit(RLIMIT_AS, &cap) != 0) _exit(3);
  // 4096 blocks of 192 KiB: 768 MiB, far past the cap.
  std::vector<KvBlockHandle> blocks;
  const absl::Status status = pool->AllocateBlocks(layout, 4096, blocks);
  if (status.code() != absl::StatusCode::kResourceExhausted) _exit(4);
  const KvBlockPoolStats stats = pool->stats();
  if (!blocks.empty() || stats.blocks_in_use != 1 || stats.bytes_held != kBlockBytes) _exit(5);
  _exit(0);
}

TEST(KvBlockSlabsDeathTest, WhenTheSystemMapsNoMoreThePoolRefusesAndKeepsWhatItHeld) {
  EXPECT_EXIT(AllocatePastAnAddressSpaceCap(), ::testing::ExitedWithCode(0), "");
}
#endif

}  // namespace
}  // namespace attnserve::core::internal
