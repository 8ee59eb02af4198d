#include "core/decode/layer_kv_cache.h"

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/bf16.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/decode/decode_reference.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::RoundToBf16;
using ::attnserve::testing::SeedTrace;
using ::attnserve::testing::SequenceHistory;
using ::attnserve::testing::StatusIs;

constexpr int kBlockTokens = 16;
constexpr KvLayout kFp32{2, 40, KvPrecision::kFp32};
constexpr KvLayout kBf16{2, 40, KvPrecision::kBf16};

std::unique_ptr<KvBlockPool> PoolOfBlocks(const KvLayout& layout, int64_t blocks) {
  return KvBlockPool::Create({blocks * KvBlockBytes(layout, kBlockTokens), kBlockTokens}).value();
}

// Element e of token t's K (or V) row of kv head g, read back from the blocks.
float CachedAt(const LayerKvCache& cache, bool value, int64_t t, int g, int64_t e) {
  const int64_t block = t / cache.block_tokens();
  const std::byte* rows = value ? cache.value_rows(block, g) : cache.key_rows(block, g);
  const int64_t index = (t % cache.block_tokens()) * cache.layout().head_dim + e;
  if (cache.layout().precision == KvPrecision::kBf16) {
    Bf16 bits;
    std::memcpy(&bits, rows + index * 2, sizeof(bits));
    return Bfloat16ToFloat(bits);
  }
  float x;
  std::memcpy(&x, rows + index * 4, sizeof(x));
  return x;
}

// The cache holds exactly what `history` says (BF16: rounded to nearest even).
void ExpectHolds(const LayerKvCache& cache, const SequenceHistory& history) {
  ASSERT_EQ(cache.length(), history.length());
  ASSERT_EQ(static_cast<int64_t>(cache.blocks().size()),
            (history.length() + cache.block_tokens() - 1) / cache.block_tokens());
  const bool bf16 = cache.layout().precision == KvPrecision::kBf16;
  const int heads = cache.layout().num_kv_heads, hd = cache.layout().head_dim;
  for (int64_t t = 0; t < history.length(); ++t) {
    for (int g = 0; g < heads; ++g) {
      for (int e = 0; e < hd; ++e) {
        const size_t i = static_cast<size_t>((t * heads + g) * hd + e);
        const float k = bf16 ? static_cast<float>(RoundToBf16(history.k[i])) : history.k[i];
        const float v = bf16 ? static_cast<float>(RoundToBf16(history.v[i])) : history.v[i];
        ASSERT_EQ(CachedAt(cache, false, t, g, e), k) << "token " << t << " head " << g;
        ASSERT_EQ(CachedAt(cache, true, t, g, e), v) << "token " << t << " head " << g;
      }
    }
  }
}

// Appends n random tokens to the cache and the history.
absl::Status AppendRandom(LayerKvCache& cache, SequenceHistory& history, int64_t n,
                          std::mt19937_64& rng) {
  const size_t size =
      static_cast<size_t>(n * cache.layout().num_kv_heads * cache.layout().head_dim);
  const std::vector<float> k = RandomNormal(size, rng), v = RandomNormal(size, rng);
  absl::Status status = cache.Append(k, v, n);
  if (status.ok()) history.Append(k, v);
  return status;
}

SequenceHistory HistoryOf(const KvLayout& layout) {
  SequenceHistory history;
  history.num_kv_heads = layout.num_kv_heads;
  history.head_dim = layout.head_dim;
  return history;
}

class LayerKvCachePrecisions : public ::testing::TestWithParam<KvLayout> {};

TEST_P(LayerKvCachePrecisions, AppendedRowsLieWhereTheBlockAccessorsPoint) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(GetParam(), 64);
  std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), GetParam()).value();
  SequenceHistory history = HistoryOf(GetParam());
  for (int64_t n : {1, 15, 1, 16, 33, 0, 7}) {
    ASSERT_THAT(AppendRandom(*cache, history, n, rng), IsOk());
    ExpectHolds(*cache, history);
  }
  EXPECT_EQ(pool->stats().blocks_in_use, static_cast<int64_t>(cache->blocks().size()));
}

// An append of kParallelWriteBytes or more (a prefill chunk's) is written on
// the OpenMP threads: from a length inside a block, across many blocks, on 1,
// 2 and 4 threads, every row where the block accessors say and nothing else
// changed; then a small append after it.
TEST_P(LayerKvCachePrecisions, ALargeAppendWrittenOnTheThreadsLiesWhereASmallOneWould) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const int64_t large = LayerKvCache::kParallelWriteBytes / GetParam().token_bytes() + 37;
  const int before = omp_get_max_threads();
  for (int threads : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat(threads, " threads"));
    omp_set_num_threads(threads);
    std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(GetParam(), large / kBlockTokens + 16);
    std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), GetParam()).value();
    SequenceHistory history = HistoryOf(GetParam());
    for (int64_t n : {int64_t{5}, large, int64_t{3}}) {
      ASSERT_THAT(AppendRandom(*cache, history, n, rng), IsOk());
      ExpectHolds(*cache, history);
    }
  }
  omp_set_num_threads(before);
}

INSTANTIATE_TEST_SUITE_P(Fp32AndBf16, LayerKvCachePrecisions, ::testing::Values(kFp32, kBf16),
                         [](const ::testing::TestParamInfo<KvLayout>& info) {
                           return info.param.precision == KvPrecision::kBf16 ? "Bf16" : "Fp32";
                         });

TEST(LayerKvCache, CreateRefusesANullPoolAndAnInvalidLayout) {
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 1);
  EXPECT_THAT(LayerKvCache::Create(nullptr, kFp32),
              StatusIs(absl::StatusCode::kInvalidArgument, "pool"));
  EXPECT_THAT(LayerKvCache::Create(pool.get(), {2, 0, KvPrecision::kFp32}),
              StatusIs(absl::StatusCode::kInvalidArgument, "kv_layout.head_dim"));
}

TEST(LayerKvCache, MismatchedRowsAreRefusedAndChangeNothing) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 4);
  std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*cache, history, 3, rng), IsOk());
  const std::vector<float> row(80), two_rows(160);
  EXPECT_THAT(cache->Append(two_rows, row, 2), StatusIs(absl::StatusCode::kInvalidArgument, "v"));
  EXPECT_THAT(cache->Append(row, two_rows, 2), StatusIs(absl::StatusCode::kInvalidArgument, "k"));
  EXPECT_THAT(cache->Append(row, row, -1), StatusIs(absl::StatusCode::kInvalidArgument, "n"));
  ExpectHolds(*cache, history);
}

// The pool refuses: nothing is appended, no block is taken, rows unchanged.
TEST(LayerKvCache, AppendPastTheBudgetIsResourceExhaustedAndAllOrNothing) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 3);
  std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*cache, history, 20, rng), IsOk());  // 2 blocks, 12 rows free
  const KvBlockPoolStats before = pool->stats();
  // 29 more tokens need 2 more blocks; only 1 fits.
  EXPECT_THAT(AppendRandom(*cache, history, 29, rng),
              StatusIs(absl::StatusCode::kResourceExhausted, "budget"));
  ExpectHolds(*cache, history);
  EXPECT_EQ(pool->stats().blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(pool->stats().bytes_held, before.bytes_held);
  ASSERT_THAT(AppendRandom(*cache, history, 28, rng), IsOk());  // exactly fills 3 blocks
  ExpectHolds(*cache, history);
}

TEST(LayerKvCache, ForkSharesEveryBlockWithoutCopying) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kBf16, 8);
  std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool.get(), kBf16).value();
  SequenceHistory history = HistoryOf(kBf16);
  ASSERT_THAT(AppendRandom(*parent, history, 50, rng), IsOk());
  const KvBlockPoolStats before = pool->stats();
  std::unique_ptr<LayerKvCache> child = parent->Fork();
  EXPECT_EQ(pool->stats().blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(pool->stats().bytes_held, before.bytes_held);
  ASSERT_EQ(child->blocks().size(), parent->blocks().size());
  for (size_t b = 0; b < parent->blocks().size(); ++b) {
    EXPECT_EQ(child->blocks()[b].data, parent->blocks()[b].data);
    EXPECT_EQ(pool->ReferenceCount(parent->blocks()[b]), 2);
  }
  ExpectHolds(*child, history);
  child.reset();
  EXPECT_EQ(pool->stats().blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(pool->ReferenceCount(parent->blocks()[0]), 1);
}

// 50 tokens = 3 full blocks and 2 rows: the child's append copies the last
// block only; parent and child then diverge without seeing each other's rows.
TEST(LayerKvCache, ForksDivergeByCopyingOnlyTheLastPartialBlock) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 16);
  std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory parent_history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*parent, parent_history, 50, rng), IsOk());
  std::unique_ptr<LayerKvCache> child = parent->Fork();
  SequenceHistory child_history = parent_history;
  const int64_t blocks_before = pool->stats().blocks_in_use;

  ASSERT_THAT(AppendRandom(*child, child_history, 1, rng), IsOk());
  EXPECT_EQ(pool->stats().blocks_in_use, blocks_before + 1);
  for (size_t b = 0; b < 3; ++b) EXPECT_EQ(child->blocks()[b].data, parent->blocks()[b].data);
  EXPECT_NE(child->blocks()[3].data, parent->blocks()[3].data);
  EXPECT_EQ(pool->ReferenceCount(parent->blocks()[3]), 1);
  ExpectHolds(*parent, parent_history);
  ExpectHolds(*child, child_history);

  // The parent's last block is its own again: written in place, no copy.
  ASSERT_THAT(AppendRandom(*parent, parent_history, 5, rng), IsOk());
  EXPECT_EQ(pool->stats().blocks_in_use, blocks_before + 1);
  ExpectHolds(*parent, parent_history);
  ExpectHolds(*child, child_history);
  ASSERT_THAT(AppendRandom(*child, child_history, 40, rng), IsOk());
  ExpectHolds(*parent, parent_history);
  ExpectHolds(*child, child_history);
}

// Forked at a block boundary, a child's append takes a fresh block and
// copies nothing.
TEST(LayerKvCache, ForkAtABlockBoundaryAppendsWithoutCopying) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 4);
  std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*parent, history, 32, rng), IsOk());
  std::unique_ptr<LayerKvCache> child = parent->Fork();
  SequenceHistory child_history = history;
  ASSERT_THAT(AppendRandom(*child, child_history, 1, rng), IsOk());
  EXPECT_EQ(pool->stats().blocks_in_use, 3);
  EXPECT_EQ(pool->ReferenceCount(child->blocks()[1]), 2);
  ExpectHolds(*parent, history);
  ExpectHolds(*child, child_history);
}

// A full pool refuses the copy a shared partial block needs: nothing changes.
TEST(LayerKvCache, CopyOnWriteRefusedByThePoolLeavesBothCachesUnchanged) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 2);
  std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*parent, history, 20, rng), IsOk());
  std::unique_ptr<LayerKvCache> child = parent->Fork();
  SequenceHistory child_history = history;
  EXPECT_THAT(AppendRandom(*child, child_history, 1, rng),
              StatusIs(absl::StatusCode::kResourceExhausted, "budget"));
  ExpectHolds(*child, history);
  EXPECT_EQ(pool->ReferenceCount(parent->blocks()[1]), 2);
  EXPECT_EQ(pool->stats().blocks_in_use, 2);
}

TEST(LayerKvCache, TruncateReleasesBlocksPastTheLength) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kBf16, 8);
  std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), kBf16).value();
  SequenceHistory history = HistoryOf(kBf16);
  ASSERT_THAT(AppendRandom(*cache, history, 70, rng), IsOk());
  EXPECT_EQ(pool->stats().blocks_in_use, 5);
  EXPECT_THAT(cache->Truncate(71), StatusIs(absl::StatusCode::kInvalidArgument, "length"));
  EXPECT_THAT(cache->Truncate(-1), StatusIs(absl::StatusCode::kInvalidArgument, "length"));
  ASSERT_THAT(cache->Truncate(20), IsOk());
  history.Truncate(20);
  EXPECT_EQ(pool->stats().blocks_in_use, 2);
  ExpectHolds(*cache, history);
  ASSERT_THAT(AppendRandom(*cache, history, 13, rng), IsOk());  // over the truncated rows
  ExpectHolds(*cache, history);
  ASSERT_THAT(cache->Truncate(0), IsOk());
  EXPECT_EQ(pool->stats().blocks_in_use, 0);
  EXPECT_TRUE(cache->blocks().empty());
}

// A fork truncated into a shared block copies it before writing there.
TEST(LayerKvCache, TruncatedForkCopiesTheSharedBlockItWritesInto) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 8);
  std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*parent, history, 40, rng), IsOk());
  std::unique_ptr<LayerKvCache> child = parent->Fork();
  SequenceHistory child_history = history;
  ASSERT_THAT(child->Truncate(21), IsOk());
  child_history.Truncate(21);
  ASSERT_THAT(AppendRandom(*child, child_history, 4, rng), IsOk());
  ExpectHolds(*parent, history);
  ExpectHolds(*child, child_history);
  EXPECT_EQ(pool->stats().blocks_in_use, 4);
}

// The latest query belongs to the token that was last when it was kept:
// forks copy it, appends without one hide it (a truncate back shows it
// again), a truncate below its token drops it.
TEST(LayerKvCache, TheLatestQueryFollowsItsToken) {
  std::unique_ptr<KvBlockPool> pool =
      KvBlockPool::Create(KvBlockPoolOptions{int64_t{1} << 20, 4}).value();
  std::unique_ptr<LayerKvCache> cache =
      LayerKvCache::Create(pool.get(), KvLayout{2, 8, KvPrecision::kFp32}).value();
  const std::vector<float> rows(2 * 2 * 8, 0.25f), query = {1, 2, 3, 4};
  cache->SetLatestQuery(query);  // no token yet: nothing kept
  EXPECT_TRUE(cache->latest_query().empty());
  ASSERT_TRUE(cache->Append(rows, rows, 2).ok());
  cache->SetLatestQuery(query);
  EXPECT_EQ(std::vector<float>(cache->latest_query().begin(), cache->latest_query().end()), query);
  EXPECT_EQ(cache->latest_query_bytes(), 16);
  std::unique_ptr<LayerKvCache> fork = cache->Fork();
  EXPECT_EQ(std::vector<float>(fork->latest_query().begin(), fork->latest_query().end()), query);
  ASSERT_TRUE(cache->Append(rows, rows, 2).ok());
  EXPECT_TRUE(cache->latest_query().empty());
  EXPECT_EQ(fork->latest_query().size(), 4u);
  ASSERT_TRUE(cache->Truncate(2).ok());
  EXPECT_EQ(cache->latest_query().size(), 4u);
  ASSERT_TRUE(cache->Truncate(1).ok());
  EXPECT_TRUE(cache->latest_query().empty());
  EXPECT_EQ(cache->latest_query_bytes(), 0);
  const std::vector<float> row(2 * 8, 0.5f);
  ASSERT_TRUE(cache->Append(row, row, 1).ok());
  EXPECT_TRUE(cache->latest_query().empty());  // not the token it was kept for
  EXPECT_EQ(fork->latest_query().size(), 4u);
}

// How many neighbours in the cache's block table do not lie one block apart
// in memory.
int64_t BreaksInMemory(const LayerKvCache& cache) {
  const int64_t block_bytes = KvBlockBytes(cache.layout(), cache.block_tokens());
  int64_t breaks = 0;
  for (size_t b = 1; b < cache.blocks().size(); ++b) {
    if (cache.blocks()[b].data - cache.blocks()[b - 1].data != block_bytes) ++breaks;
  }
  return breaks;
}

// Two caches growing a block at a time in turns, as sessions decoding in step
// do: with runs, each cache's blocks lie mostly one after another (runs of
// kMaxRunBlocks once it has taken 32 blocks); one block at a time, they
// alternate with the other cache's at every block.
TEST(LayerKvCache, CachesGrowingInTurnsTakeRunsThatLieOneAfterAnother) {
  for (const LayerKvCache::BlocksAhead ahead :
       {LayerKvCache::BlocksAhead::kTake, LayerKvCache::BlocksAhead::kNone}) {
    const bool runs = ahead == LayerKvCache::BlocksAhead::kTake;
    SCOPED_TRACE(runs ? "runs" : "one block at a time");
    std::mt19937_64 rng(FreshSeed());
    std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 2 * (64 + 8));
    std::vector<std::unique_ptr<LayerKvCache>> caches;
    std::vector<SequenceHistory> histories;
    for (int c = 0; c < 2; ++c) {
      caches.push_back(LayerKvCache::Create(pool.get(), kFp32).value());
      histories.push_back(HistoryOf(kFp32));
    }
    const size_t row = static_cast<size_t>(kFp32.num_kv_heads * kFp32.head_dim);
    for (int64_t token = 0; token < 64 * kBlockTokens; ++token) {
      for (size_t c = 0; c < caches.size(); ++c) {
        LayerKvCache& cache = *caches[c];
        const std::vector<float> k = RandomNormal(row, rng), v = RandomNormal(row, rng);
        const int64_t blocks_before = cache.blocks_held();
        const int64_t expected = cache.BlocksToTake(1, ahead);
        ASSERT_THAT(cache.Append(k, v, 1, ahead), IsOk());
        histories[c].Append(k, v);
        ASSERT_EQ(cache.blocks_held() - blocks_before, expected) << "token " << token;
        ASSERT_LE(static_cast<int64_t>(cache.blocks_ahead().size()),
                  LayerKvCache::kMaxRunBlocks - 1);
        ASSERT_LE(4 * static_cast<int64_t>(cache.blocks_ahead().size()),
                  static_cast<int64_t>(cache.blocks().size()));
        if (!runs) {
          ASSERT_TRUE(cache.blocks_ahead().empty());
        }
      }
      ASSERT_EQ(pool->stats().blocks_in_use, caches[0]->blocks_held() + caches[1]->blocks_held());
    }
    for (size_t c = 0; c < caches.size(); ++c) {
      ExpectHolds(*caches[c], histories[c]);
      if (runs) {
        // Runs as the cache grows: 8 of 1 block, then of 2, 2, 3, 3, 4, 5, 6,
        // 8, 8, 8 and 8 (a quarter of what it took): 18 breaks at most.
        EXPECT_LE(BreaksInMemory(*caches[c]), 18) << "cache " << c;
      } else {
        EXPECT_EQ(BreaksInMemory(*caches[c]), 63) << "cache " << c;
      }
    }
  }
}

TEST(LayerKvCache, AForkGrowsByOneBlockAndItsParentByARunAhead) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kBf16, 64 + 8 + 1);
  std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool.get(), kBf16).value();
  SequenceHistory history = HistoryOf(kBf16);
  ASSERT_THAT(AppendRandom(*parent, history, 64 * kBlockTokens, rng), IsOk());  // 64 blocks
  EXPECT_TRUE(parent->blocks_ahead().empty());
  std::unique_ptr<LayerKvCache> child = parent->Fork();
  SequenceHistory child_history = history;

  // The fork has taken nothing itself: its first new block comes alone.
  using BlocksAhead = LayerKvCache::BlocksAhead;
  EXPECT_EQ(child->BlocksToTake(1, BlocksAhead::kTake), 1);
  ASSERT_THAT(AppendRandom(*child, child_history, 1, rng), IsOk());
  EXPECT_EQ(child->blocks_held(), 65);
  EXPECT_TRUE(child->blocks_ahead().empty());
  EXPECT_EQ(pool->stats().blocks_in_use, 65);

  // The parent took 64: a run of 8, 7 of them ahead, lying after its new block.
  EXPECT_EQ(parent->BlocksToTake(1, BlocksAhead::kNone), 1);
  EXPECT_EQ(parent->BlocksToTake(1, BlocksAhead::kTake), 8);
  ASSERT_THAT(AppendRandom(*parent, history, 1, rng), IsOk());
  ASSERT_EQ(parent->blocks_ahead().size(), 7u);
  EXPECT_EQ(parent->blocks_ahead().front().data - parent->blocks().back().data,
            KvBlockBytes(kBf16, kBlockTokens));
  EXPECT_EQ(pool->stats().blocks_in_use, 65 + 8);
  // The next 7 blocks' tokens come from those ahead.
  EXPECT_EQ(parent->BlocksToTake(7 * kBlockTokens, BlocksAhead::kTake), 0);
  ASSERT_THAT(AppendRandom(*parent, history, 7 * kBlockTokens, rng), IsOk());
  EXPECT_TRUE(parent->blocks_ahead().empty());
  EXPECT_EQ(pool->stats().blocks_in_use, 65 + 8);
  EXPECT_EQ(BreaksInMemory(*parent), 1);  // the fork's block lies between
  ExpectHolds(*parent, history);
  ExpectHolds(*child, child_history);
}

TEST(LayerKvCache, ARunThePoolHasNoRoomForShrinksToTheBlockNeeded) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 33);
  std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), kFp32).value();
  SequenceHistory history = HistoryOf(kFp32);
  ASSERT_THAT(AppendRandom(*cache, history, 32 * kBlockTokens, rng), IsOk());
  EXPECT_EQ(cache->BlocksToTake(1, LayerKvCache::BlocksAhead::kTake), 8);
  ASSERT_THAT(AppendRandom(*cache, history, 1, rng), IsOk());
  EXPECT_EQ(cache->blocks_held(), 33);
  EXPECT_TRUE(cache->blocks_ahead().empty());
  ExpectHolds(*cache, history);
}

TEST(LayerKvCache, TruncateAndTheDestructorGiveBackTheBlocksAhead) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 64);
  {
    std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), kFp32).value();
    SequenceHistory history = HistoryOf(kFp32);
    ASSERT_THAT(AppendRandom(*cache, history, 16 * kBlockTokens, rng), IsOk());
    ASSERT_THAT(AppendRandom(*cache, history, 1, rng), IsOk());  // a run of 4
    ASSERT_EQ(cache->blocks_ahead().size(), 3u);
    EXPECT_EQ(pool->stats().blocks_in_use, 20);
    ASSERT_THAT(cache->Truncate(16 * kBlockTokens + 1), IsOk());  // nothing past the length
    EXPECT_TRUE(cache->blocks_ahead().empty());
    EXPECT_EQ(pool->stats().blocks_in_use, 17);
    // It has taken 20: a run of 5.
    ASSERT_THAT(AppendRandom(*cache, history, kBlockTokens, rng), IsOk());
    ASSERT_EQ(cache->blocks_ahead().size(), 4u);
    EXPECT_EQ(pool->stats().blocks_in_use, 22);
    ExpectHolds(*cache, history);
  }
  EXPECT_EQ(pool->stats().blocks_in_use, 0);
}

TEST(LayerKvCache, DestructorReleasesItsBlocks) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = PoolOfBlocks(kFp32, 8);
  {
    std::unique_ptr<LayerKvCache> cache = LayerKvCache::Create(pool.get(), kFp32).value();
    SequenceHistory history = HistoryOf(kFp32);
    ASSERT_THAT(AppendRandom(*cache, history, 100, rng), IsOk());
    std::unique_ptr<LayerKvCache> child = cache->Fork();
    EXPECT_EQ(pool->stats().blocks_in_use, 7);
  }
  EXPECT_EQ(pool->stats().blocks_in_use, 0);
  EXPECT_EQ(pool->stats().free_blocks, 7);
}

}  // namespace
}  // namespace attnserve::core
