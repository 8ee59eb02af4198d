#include "core/decode/kv_block_pool.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "core/decode/kv_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;

constexpr KvLayout kLayout{2, 64, KvPrecision::kFp32};
constexpr int kBlockTokens = 16;
// 2 (K, V) * 2 heads * 16 tokens * 64 * 4 bytes.
constexpr int64_t kBlockBytes = 16384;

std::unique_ptr<KvBlockPool> PoolOfBlocks(int64_t blocks) {
  return KvBlockPool::Create(KvBlockPoolOptions{blocks * kBlockBytes, kBlockTokens}).value();
}

TEST(KvBlockPool, OptionsOutOfRangeAreRefusedNamingTheField) {
  EXPECT_THAT(KvBlockPool::Create({0, 32}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_block_pool.budget_bytes"));
  EXPECT_THAT(KvBlockPool::Create({1 << 20, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_block_pool.block_tokens"));
  EXPECT_THAT(KvBlockPool::Create({1 << 20, kMaxKvBlockTokens + 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_block_pool.block_tokens"));
}

TEST(KvBlockPool, InvalidLayoutsAreRefusedNamingTheField) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(4);
  EXPECT_THAT(pool->Allocate({0, 64, KvPrecision::kFp32}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_layout.num_kv_heads"));
  EXPECT_THAT(pool->Allocate({2, 0, KvPrecision::kFp32}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_layout.head_dim"));
  EXPECT_THAT(pool->Allocate({2, 64, static_cast<KvPrecision>(7)}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_layout.precision"));
  std::vector<KvBlockHandle> blocks;
  EXPECT_THAT(pool->AllocateBlocks(kLayout, -1, blocks),
              StatusIs(absl::StatusCode::kInvalidArgument, "count"));
}

TEST(KvBlockPool, BlocksHoldKThenVOfEveryHeadAndAre64ByteAligned) {
  EXPECT_EQ(KvBlockBytes(kLayout, kBlockTokens), kBlockBytes);
  EXPECT_EQ(KvKeyRowsOffset(kLayout, kBlockTokens, 1), 4096);
  EXPECT_EQ(KvValueRowsOffset(kLayout, kBlockTokens, 0), 8192);
  // 2 * 1 head * 3 tokens * 5 * 2 bytes = 60, rounded up to a cache line.
  EXPECT_EQ(KvBlockBytes({1, 5, KvPrecision::kBf16}, 3), 64);
  // One token's K and V over every head, unpadded: 2 * 1 * 5 * 2 bytes.
  EXPECT_EQ((KvLayout{1, 5, KvPrecision::kBf16}.token_bytes()), 20);
  EXPECT_EQ((KvLayout{4, 64, KvPrecision::kFp32}.token_bytes()), 2048);
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(8);
  std::vector<KvBlockHandle> blocks;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 8, blocks), IsOk());
  for (const KvBlockHandle& block : blocks) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(block.data) % kKvBlockAlignment, 0u);
    EXPECT_EQ(pool->ReferenceCount(block), 1);
  }
  const KvBlockPoolStats stats = pool->stats();
  EXPECT_EQ(stats.blocks_in_use, 8);
  EXPECT_EQ(stats.bytes_in_use, 8 * kBlockBytes);
  EXPECT_EQ(stats.bytes_held, 8 * kBlockBytes);
  pool->Release(blocks);
}

TEST(KvBlockPool, AllocationPastTheBudgetIsResourceExhaustedAndAllocatesNothing) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(3);
  std::vector<KvBlockHandle> blocks;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 2, blocks), IsOk());
  const KvBlockPoolStats before = pool->stats();
  EXPECT_THAT(pool->AllocateBlocks(kLayout, 2, blocks),
              StatusIs(absl::StatusCode::kResourceExhausted, "budget"));
  EXPECT_EQ(blocks.size(), 2u);
  EXPECT_EQ(pool->stats().bytes_held, before.bytes_held);
  EXPECT_EQ(pool->stats().blocks_in_use, 2);
  absl::StatusOr<KvBlockHandle> third = pool->Allocate(kLayout);
  ASSERT_THAT(third, IsOk());
  EXPECT_THAT(pool->Allocate(kLayout), StatusIs(absl::StatusCode::kResourceExhausted, "budget"));
  EXPECT_EQ(pool->stats().bytes_held, 3 * kBlockBytes);
  pool->Release(*third);
  pool->Release(blocks);
}

TEST(KvBlockPool, ReleasedBlocksAreReusedSoBytesHeldStayFlatOverChurn) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(16);
  std::vector<KvBlockHandle> first;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 4, first), IsOk());
  std::set<std::byte*> memory;
  for (const KvBlockHandle& block : first) memory.insert(block.data);
  pool->Release(first);
  EXPECT_EQ(pool->stats().free_blocks, 4);
  EXPECT_EQ(pool->stats().bytes_in_use, 0);
  for (int round = 0; round < 1000; ++round) {
    std::vector<KvBlockHandle> blocks;
    ASSERT_THAT(pool->AllocateBlocks(kLayout, 1 + round % 4, blocks), IsOk());
    for (const KvBlockHandle& block : blocks) ASSERT_EQ(memory.count(block.data), 1u);
    ASSERT_EQ(pool->stats().bytes_held, 4 * kBlockBytes);
    pool->Release(blocks);
  }
}

// Sessions closed one after another release their blocks in table order;
// handed out last-released first, the next sessions' blocks ran downwards in
// memory, and their decode steps slowed (docs/measurements.md, "The KV pool
// hands out its lowest free block").
TEST(KvBlockPool, FreeListedBlocksAreHandedOutLowestInMemoryFirst) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(64);
  std::vector<KvBlockHandle> first, second;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 24, first), IsOk());
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 24, second), IsOk());
  std::vector<std::byte*> addresses;
  for (const auto* blocks : {&first, &second}) {
    for (const KvBlockHandle& block : *blocks) addresses.push_back(block.data);
  }
  std::sort(addresses.begin(), addresses.end());
  // Released as two closed sessions release them, and one in a shuffled order.
  pool->Release(second);
  pool->Release(first);
  std::vector<KvBlockHandle> again;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 8, again), IsOk());
  std::vector<KvBlockHandle> one;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 8, one), IsOk());
  std::vector<KvBlockHandle> mixed = {one[5], one[2], one[7], one[0], one[3], one[6], one[1], one[4]};
  pool->Release(mixed);
  std::vector<KvBlockHandle> rest;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 40, rest), IsOk());
  for (size_t i = 0; i < again.size(); ++i) EXPECT_EQ(again[i].data, addresses[i]) << i;
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i].data, addresses[8 + i]) << i;
  pool->Release(again);
  pool->Release(rest);
}

TEST(KvBlockPool, TrimReturnsFreeListedMemoryOnly) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(8);
  std::vector<KvBlockHandle> kept, released;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 2, kept), IsOk());
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 3, released), IsOk());
  pool->Release(released);
  EXPECT_EQ(pool->stats().bytes_held, 5 * kBlockBytes);
  EXPECT_EQ(pool->Trim(), 3 * kBlockBytes);
  const KvBlockPoolStats stats = pool->stats();
  EXPECT_EQ(stats.bytes_held, 2 * kBlockBytes);
  EXPECT_EQ(stats.bytes_in_use, 2 * kBlockBytes);
  EXPECT_EQ(stats.free_blocks, 0);
  EXPECT_EQ(pool->Trim(), 0);
  pool->Release(kept);
}

TEST(KvBlockPool, ASharedBlockCountsAsSharedAndIsFreedByItsLastReleaseOnly) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(2);
  absl::StatusOr<KvBlockHandle> block = pool->Allocate(kLayout);
  ASSERT_THAT(block, IsOk());
  absl::StatusOr<KvBlockHandle> alone = pool->Allocate(kLayout);
  ASSERT_THAT(alone, IsOk());
  EXPECT_EQ(pool->stats().shared_blocks, 0);
  pool->Share(*block);
  EXPECT_EQ(pool->stats().shared_blocks, 1);
  pool->Share(*block);
  EXPECT_EQ(pool->ReferenceCount(*block), 3);
  EXPECT_FALSE(pool->AnyUnshared({*block}));
  EXPECT_TRUE(pool->AnyUnshared({*block, *alone}));
  EXPECT_TRUE(pool->AnyUnshared({*alone, *block}));
  EXPECT_FALSE(pool->AnyUnshared({}));
  EXPECT_EQ(pool->stats().blocks_in_use, 2);
  EXPECT_EQ(pool->stats().shared_blocks, 1);  // a block, however many share it
  pool->Release(*block);
  EXPECT_EQ(pool->stats().shared_blocks, 1);
  pool->Release(*block);
  EXPECT_EQ(pool->ReferenceCount(*block), 1);
  EXPECT_EQ(pool->stats().shared_blocks, 0);
  EXPECT_EQ(pool->stats().free_blocks, 0);
  pool->Release(*block);
  EXPECT_EQ(pool->stats().free_blocks, 1);
  EXPECT_EQ(pool->stats().blocks_in_use, 1);
  EXPECT_EQ(pool->stats().shared_blocks, 0);
}

// Free-listed blocks of one layout give way to another layout's allocation
// rather than holding the budget.
TEST(KvBlockPool, AnotherLayoutReclaimsFreeListedBlocksWithinTheBudget) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(4);
  std::vector<KvBlockHandle> fp32;
  ASSERT_THAT(pool->AllocateBlocks(kLayout, 4, fp32), IsOk());
  pool->Release(fp32);
  const KvLayout bf16{4, 64, KvPrecision::kBf16};  // the same bytes per block
  std::vector<KvBlockHandle> blocks;
  ASSERT_THAT(pool->AllocateBlocks(bf16, 3, blocks), IsOk());
  KvBlockPoolStats stats = pool->stats();
  EXPECT_EQ(stats.bytes_held, 4 * kBlockBytes);
  EXPECT_EQ(stats.free_blocks, 1);
  EXPECT_THAT(pool->AllocateBlocks(bf16, 2, blocks),
              StatusIs(absl::StatusCode::kResourceExhausted, "budget"));
  EXPECT_EQ(pool->stats().free_blocks, 1);  // a refusal reclaims nothing
  pool->Release(blocks);
}

TEST(KvBlockPool, HandlesAreSixteenBytesAndNoTokenHasBookkeeping) {
  // A handle in a block table and a 16-byte record in the pool per block of
  // at least 32 tokens: 0.4% of a block of one BF16 head of 64.
  EXPECT_EQ(sizeof(KvBlockHandle), 16u);
  EXPECT_LE(2.0 * 16 / static_cast<double>(KvBlockBytes({1, 64, KvPrecision::kBf16}, 32)), 0.02);
}

TEST(KvBlockPoolDeathTest, ReleasingABlockNotInUseStopsTheProcess) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(1);
  absl::StatusOr<KvBlockHandle> block = pool->Allocate(kLayout);
  ASSERT_THAT(block, IsOk());
  pool->Release(*block);
  EXPECT_DEATH(pool->Release(*block), "not in use");
  EXPECT_DEATH(pool->Share(KvBlockHandle{42, nullptr}), "not in use");
}

}  // namespace
}  // namespace attnserve::core
