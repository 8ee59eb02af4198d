// Several threads, each with its own caches, over one shared pool: allocate,
// append, fork, diverge, truncate, attend and release, with the pool often
// refusing. Labelled `tsan`: deploy/sanitize.sh runs it under ThreadSanitizer
// (with OMP_NUM_THREADS=1, so the kernel's parallel regions stay on the
// calling thread).
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "core/decode/paged_attention.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::SeedTrace;

constexpr KvLayout kLayout{2, 32, KvPrecision::kBf16};
constexpr int kBlockTokens = 8;
constexpr int kThreads = 4;
constexpr int kRounds = 60;

// Appends n random tokens; RESOURCE_EXHAUSTED (the shared pool is full) is
// an expected answer, anything else a failure. Returns whether it appended.
bool AppendRandom(LayerKvCache& cache, int64_t n, std::mt19937_64& rng) {
  const size_t size = static_cast<size_t>(n * kLayout.num_kv_heads * kLayout.head_dim);
  const absl::Status status = cache.Append(RandomNormal(size, rng), RandomNormal(size, rng), n);
  EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kResourceExhausted) << status;
  return status.ok();
}

// The last token of `cache` attended by 4 query heads: finite outputs.
void AttendLast(const LayerKvCache& cache, std::mt19937_64& rng) {
  if (cache.length() == 0) return;
  const int heads = 4;
  const std::vector<float> q = RandomNormal(static_cast<size_t>(heads * kLayout.head_dim), rng);
  std::vector<float> out(q.size());
  const PagedAttentionItem item{&cache, heads, 1, 0.25f, q, absl::MakeSpan(out), {}, {}};
  ASSERT_THAT(PagedAttention({&item, 1}), IsOk());
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
}

void Churn(KvBlockPool* pool, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> tokens(1, 40);
  for (int round = 0; round < kRounds; ++round) {
    std::unique_ptr<LayerKvCache> parent = LayerKvCache::Create(pool, kLayout).value();
    AppendRandom(*parent, tokens(rng), rng);
    std::unique_ptr<LayerKvCache> child = parent->Fork();
    AppendRandom(*child, tokens(rng), rng);
    AppendRandom(*parent, 1, rng);
    AttendLast(*child, rng);
    ASSERT_THAT(child->Truncate(child->length() / 2), IsOk());
    AppendRandom(*child, 3, rng);
    AttendLast(*parent, rng);
    if (round % 10 == 0) pool->Trim();
    (void)pool->stats();
  }
}

TEST(KvCacheThreads, ThreadsWithTheirOwnCachesShareOnePool) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  // Room for about 16 blocks: threads run into the budget now and then.
  std::unique_ptr<KvBlockPool> pool =
      KvBlockPool::Create({16 * KvBlockBytes(kLayout, kBlockTokens), kBlockTokens}).value();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(Churn, pool.get(), seed + t);
  for (std::thread& thread : threads) thread.join();
  const KvBlockPoolStats stats = pool->stats();
  EXPECT_EQ(stats.blocks_in_use, 0);
  EXPECT_EQ(stats.bytes_in_use, 0);
  EXPECT_LE(stats.bytes_held, pool->budget_bytes());
}

}  // namespace
}  // namespace attnserve::core
