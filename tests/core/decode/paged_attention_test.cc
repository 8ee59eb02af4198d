// PagedAttention against the double-precision reference of full causal
// attention over the whole sequence so far (decode_reference.h), computed
// from the same K/V (BF16 caches: from the BF16-rounded K/V).
//
// Tolerances, as max |error| / max |expected| over a step's output (and over
// its maps): 1e-5 for FP32 caches and for BF16 caches against the rounded
// reference where the kernels widen BF16 exactly; 3e-5 where the scores of
// BF16 keys multiply a query split into BF16 hi + lo instead (CPUs with
// AVX512_BF16, head_dim a multiple of 32: 16 significant bits of the query,
// not FP32's 24; seed 7358742316852768724 gave 1.02e-5 at 4 threads); a BF16
// cache against the unrounded reference within kBf16Tolerance (2e-2; K and V
// rounding alone moves it about 2^-9 relative). Map rows sum to 1 within 1e-5.
#include "core/decode/paged_attention.h"

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/decode/decode_kernels.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "core/decode/layer_kv_cache.h"
#include "core/decode/paged_attention_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/decode/decode_reference.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::DecodeReference;
using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::MaxAbsErrorRelative;
using ::attnserve::testing::MaxRowSumError;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::ReferenceDecodeRows;
using ::attnserve::testing::SeedTrace;
using ::attnserve::testing::SequenceHistory;
using ::attnserve::testing::StatusIs;

constexpr double kTolerance = 1e-5;
constexpr double kBf16SplitQueryTolerance = 3e-5;
constexpr double kBf16UnroundedTolerance = ::attnserve::testing::kBf16Tolerance;

struct Shape {
  std::string name;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  KvPrecision precision = KvPrecision::kFp32;
  int block_tokens = 16;

  KvLayout layout() const { return KvLayout{kv_heads, head_dim, precision}; }
  bool bf16() const { return precision == KvPrecision::kBf16; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }
  friend void PrintTo(const Shape& shape, std::ostream* os) { *os << shape.name; }
};

std::unique_ptr<KvBlockPool> MakePool(int block_tokens) {
  return KvBlockPool::Create(KvBlockPoolOptions{int64_t{1} << 30, block_tokens}).value();
}

// A sequence under test: its cache, what was appended, and one step's
// queries and outputs.
struct Sequence {
  Sequence(KvBlockPool* pool, const Shape& s) : shape(s) {
    cache = LayerKvCache::Create(pool, shape.layout()).value();
    history.num_kv_heads = shape.kv_heads;
    history.head_dim = shape.head_dim;
  }

  // Appends n random tokens and draws n new query rows.
  void Step(int64_t n, bool with_map, std::mt19937_64& rng) {
    const size_t kv = static_cast<size_t>(n * shape.kv_heads * shape.head_dim);
    const std::vector<float> k = RandomNormal(kv, rng), v = RandomNormal(kv, rng);
    ASSERT_THAT(cache->Append(k, v, n), IsOk());
    history.Append(k, v);
    new_tokens = n;
    q = RandomNormal(static_cast<size_t>(n * shape.heads * shape.head_dim), rng);
    out.assign(q.size(), std::nanf(""));
    map.assign(with_map ? static_cast<size_t>(shape.heads * n * cache->length()) : 0,
               std::nanf(""));
  }

  PagedAttentionItem Item() {
    return PagedAttentionItem{cache.get(), shape.heads, new_tokens, shape.scale(), q,
                              absl::MakeSpan(out), absl::MakeSpan(map), head_mask};
  }

  // The reference's rows with head h's weights times head_mask[h].
  DecodeReference Reference(bool bf16_kv) const {
    DecodeReference r =
        ReferenceDecodeRows(history, q, new_tokens, shape.heads, shape.scale(), bf16_kv);
    if (head_mask.empty()) return r;
    const int64_t hd = shape.head_dim, length = history.length();
    for (int64_t i = 0; i < new_tokens; ++i) {
      for (int64_t h = 0; h < shape.heads; ++h) {
        for (int64_t e = 0; e < hd; ++e) r.out[(i * shape.heads + h) * hd + e] *= head_mask[h];
        for (int64_t j = 0; j < length; ++j) {
          r.maps[(h * new_tokens + i) * length + j] *= head_mask[h];
        }
      }
    }
    return r;
  }

  // The step's out (and map) against the reference.
  void ExpectMatchesReference() const {
    SCOPED_TRACE(absl::StrCat(shape.name, ", length ", history.length(), ", new ", new_tokens));
    const DecodeReference expected = Reference(shape.bf16());
    const bool split_query = shape.bf16() && shape.head_dim % 32 == 0 &&
                             internal::DecodeKernelRuns(internal::DecodeKernel::kAvx512Bf16);
    const double tolerance = split_query ? kBf16SplitQueryTolerance : kTolerance;
    EXPECT_LE(MaxAbsErrorRelative(out, expected.out), tolerance);
    if (shape.bf16()) {
      EXPECT_LE(MaxAbsErrorRelative(out, Reference(false).out), kBf16UnroundedTolerance);
    }
    if (map.empty()) return;
    EXPECT_LE(MaxAbsErrorRelative(map, expected.maps), tolerance);
    if (head_mask.empty()) {
      EXPECT_LE(MaxRowSumError(map, history.length()), kTolerance);
      return;
    }
    const int64_t length = history.length();
    for (int64_t h = 0; h < shape.heads; ++h) {
      for (int64_t i = 0; i < new_tokens; ++i) {
        double sum = 0.0;
        for (int64_t j = 0; j < length; ++j) sum += map[(h * new_tokens + i) * length + j];
        EXPECT_NEAR(sum, head_mask[h], kTolerance) << "head " << h << " row " << i;
      }
    }
  }

  Shape shape;
  std::unique_ptr<LayerKvCache> cache;
  SequenceHistory history;
  int64_t new_tokens = 0;
  std::vector<float> q, out, map;
  std::vector<float> head_mask;  // empty: all 1
};

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    const std::string p = precision == KvPrecision::kFp32 ? "Fp32" : "Bf16";
    shapes.push_back({"Mha4Hd64" + p, 4, 4, 64, precision, 16});
    shapes.push_back({"Gqa8to2Hd64" + p, 8, 2, 64, precision, 16});
    shapes.push_back({"Mqa8to1Hd64" + p, 8, 1, 64, precision, 7});
    shapes.push_back({"Gqa8to2Hd40" + p, 8, 2, 40, precision, 5});
    shapes.push_back({"Mha3Hd40" + p, 3, 3, 40, precision, 32});
    // Blocks longer than a softmax span (128 keys), and the head_dims of the
    // AVX-512 kernels' other row lengths (6 and 8 vectors of 16, unmasked).
    shapes.push_back({"Gqa8to2Hd128Bt200" + p, 8, 2, 128, precision, 200});
    shapes.push_back({"Mha2Hd96" + p, 2, 2, 96, precision, 48});
  }
  return shapes;
}

class PagedAttentionShapes : public ::testing::TestWithParam<Shape> {};

// Random mixes of decode steps (n = 1) and prefill chunks, appended step by
// step from length 0 (the first step may be length 1), crossing block
// boundaries; every step's rows against full causal attention so far.
TEST_P(PagedAttentionShapes, StepByStepMatchesFullCausalAttentionSoFar) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<KvBlockPool> pool = MakePool(GetParam().block_tokens);
  Sequence sequence(pool.get(), GetParam());
  std::bernoulli_distribution decode_step(0.6), with_map(0.5);
  std::uniform_int_distribution<int64_t> chunk(2, 24);
  while (sequence.history.length() < 140) {
    sequence.Step(decode_step(rng) ? 1 : chunk(rng), with_map(rng), rng);
    const PagedAttentionItem item = sequence.Item();
    ASSERT_THAT(PagedAttention({&item, 1}), IsOk());
    sequence.ExpectMatchesReference();
    if (HasFailure()) return;
  }
}

// Long prefill chunks: tiles of 8 or more new rows run on the strip kernels
// (ProcessSpanStrips; head_dims that are multiples of 16, on AVX-512 CPUs),
// over several spans and strips, a chunk of a fresh sequence and chunks over a
// cached prefix, with a head mask, maps on some; then a decode step.
TEST_P(PagedAttentionShapes, LongPrefillChunksMatchReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<KvBlockPool> pool = MakePool(GetParam().block_tokens);
  Sequence sequence(pool.get(), GetParam());
  std::uniform_real_distribution<float> gate(0.0f, 2.0f);
  for (int h = 0; h < GetParam().heads; ++h) sequence.head_mask.push_back(gate(rng));
  const struct {
    int64_t n;
    bool map;
  } steps[] = {{300, false}, {77, true}, {9, false}, {1, true}};
  for (const auto& step : steps) {
    sequence.Step(step.n, step.map, rng);
    const PagedAttentionItem item = sequence.Item();
    ASSERT_THAT(PagedAttention({&item, 1}), IsOk());
    sequence.ExpectMatchesReference();
    if (HasFailure()) return;
  }
}

TEST_P(PagedAttentionShapes, SequenceOfLengthOneAttendsToItself) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<KvBlockPool> pool = MakePool(GetParam().block_tokens);
  Sequence sequence(pool.get(), GetParam());
  sequence.Step(1, /*with_map=*/true, rng);
  const PagedAttentionItem item = sequence.Item();
  ASSERT_THAT(PagedAttention({&item, 1}), IsOk());
  sequence.ExpectMatchesReference();
  for (float p : sequence.map) EXPECT_EQ(p, 1.0f);
}

INSTANTIATE_TEST_SUITE_P(AllShapes, PagedAttentionShapes, ::testing::ValuesIn(Shapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return info.param.name;
                         });

// Runs `f` with `threads` OpenMP threads, then restores the previous count.
template <typename F>
void WithThreads(int threads, F f) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(before);
}

// One long decode session: too few units for the threads, so its keys are
// split into ranges whose softmax states are merged. A decode unit holds
// every KV head and reads a span in each before the next span: one KV head
// (MQA), four and sixteen, each split's states of every head merged -- with
// the map, FP32 and BF16 (the BF16 rows prefetched across KV heads), one and
// three new rows.
TEST(PagedAttention, SplitKeyRangesOfOneLongContextMatchReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    const std::pair<Shape, int64_t> sessions[] = {
        {Shape{"Mqa8to1Hd64Long", 8, 1, 64, precision, 32}, 2997},
        {Shape{"Gqa16to4Hd64Long", 16, 4, 64, precision, 32}, 1400},
        {Shape{"Mha16Hd64Long", 16, 16, 64, precision, 32}, 1400}};
    for (const auto& [shape, prefix] : sessions) {
      SCOPED_TRACE(shape.name);
      std::unique_ptr<KvBlockPool> pool = MakePool(shape.block_tokens);
      Sequence sequence(pool.get(), shape);
      sequence.Step(prefix, /*with_map=*/false, rng);
      for (int64_t n : {int64_t{1}, int64_t{3}}) {
        sequence.Step(n, /*with_map=*/true, rng);
        const PagedAttentionItem item = sequence.Item();
        EXPECT_GT(internal::PagedAttentionSplits({&item, 1}, 2)[0], 1);
        WithThreads(2, [&] { ASSERT_THAT(PagedAttention({&item, 1}), IsOk()); });
        sequence.ExpectMatchesReference();
      }
    }
  }
}

// Several long sequences of several KV heads on more threads than cores:
// many splits and merges in one call, each merge run by whichever thread
// finishes its last split, often between units of other merges.
TEST(PagedAttention, ManyMergesFinishedByWhicheverThreadEndsTheLastSplitMatchReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<KvBlockPool> pool = MakePool(32);
  const std::vector<Shape> shapes = {{"Gqa8to2Hd64Long", 8, 2, 64, KvPrecision::kFp32, 32},
                                     {"Mha4Hd32Long", 4, 4, 32, KvPrecision::kBf16, 32},
                                     {"Gqa6to3Hd40Long", 6, 3, 40, KvPrecision::kFp32, 32}};
  const int64_t prefix[] = {2500, 1800, 3100};
  std::vector<std::unique_ptr<Sequence>> batch;
  for (size_t i = 0; i < shapes.size(); ++i) {
    batch.push_back(std::make_unique<Sequence>(pool.get(), shapes[i]));
    batch.back()->Step(prefix[i], /*with_map=*/false, rng);
    batch.back()->Step(1 + static_cast<int64_t>(i), /*with_map=*/i != 1, rng);
  }
  std::vector<PagedAttentionItem> items;
  for (auto& sequence : batch) items.push_back(sequence->Item());
  for (int64_t splits : internal::PagedAttentionSplits(items, 4)) EXPECT_GT(splits, 1);
  WithThreads(4, [&] { ASSERT_THAT(PagedAttention(items), IsOk()); });
  for (auto& sequence : batch) sequence->ExpectMatchesReference();
}

// Sequences of different shapes, precisions and lengths (1 to a few hundred,
// decode steps and chunks) in one call: each as its own reference says.
TEST(PagedAttention, MicroBatchMixingLengthsMatchesEachSequenceAlone) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  const std::vector<Shape> shapes = Shapes();
  std::vector<std::unique_ptr<Sequence>> batch;
  const int64_t prefix[] = {0, 36, 299, 16, 1, 77, 150, 5, 0, 47, 130, 3, 260, 0};
  const int64_t steps[] = {1, 1, 5, 1, 12, 1, 1, 3, 9, 1, 1, 7, 1, 2};
  ASSERT_EQ(shapes.size(), std::size(prefix));
  for (size_t i = 0; i < shapes.size(); ++i) {
    Shape shape = shapes[i];
    shape.block_tokens = 16;
    batch.push_back(std::make_unique<Sequence>(pool.get(), shape));
    if (prefix[i] > 0) batch.back()->Step(prefix[i], false, rng);
    batch.back()->Step(steps[i], /*with_map=*/i % 2 == 0, rng);
  }
  std::vector<PagedAttentionItem> items;
  for (auto& sequence : batch) items.push_back(sequence->Item());
  WithThreads(2, [&] { ASSERT_THAT(PagedAttention(items), IsOk()); });
  for (auto& sequence : batch) sequence->ExpectMatchesReference();
}

// head_mask[h] gates head h's weights: out and map rows times it (0 removes
// the head), on whole units and on split key ranges alike.
TEST(PagedAttention, HeadMaskGatesEachHeadsWeights) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    const Shape shape{"Gqa8to2Hd64", 8, 2, 64, precision, 16};
    std::unique_ptr<KvBlockPool> pool = MakePool(shape.block_tokens);
    Sequence sequence(pool.get(), shape);
    sequence.head_mask = {0.0f, 0.5f, 1.0f, 2.0f, 0.25f, 0.0f, 3.0f, 1.0f};
    for (int64_t n : {40, 1, 7}) {
      sequence.Step(n, /*with_map=*/true, rng);
      const PagedAttentionItem item = sequence.Item();
      ASSERT_THAT(PagedAttention({&item, 1}), IsOk());
      sequence.ExpectMatchesReference();
    }
    const Shape long_shape{"Mqa8to1Hd64Long", 8, 1, 64, precision, 32};
    Sequence long_sequence(pool.get(), long_shape);
    long_sequence.head_mask = sequence.head_mask;
    long_sequence.Step(2000, /*with_map=*/false, rng);
    long_sequence.Step(2, /*with_map=*/true, rng);
    const PagedAttentionItem item = long_sequence.Item();
    EXPECT_GT(internal::PagedAttentionSplits({&item, 1}, 2)[0], 1);
    WithThreads(2, [&] { ASSERT_THAT(PagedAttention({&item, 1}), IsOk()); });
    long_sequence.ExpectMatchesReference();
  }
}

TEST(PagedAttention, NoItemsIsNothingToDo) { EXPECT_THAT(PagedAttention({}), IsOk()); }

// Each malformed field is refused by name, and nothing is written, also to
// the valid item before it.
TEST(PagedAttention, MalformedItemsAreRefusedNamingTheFieldAndNothingIsWritten) {
  std::mt19937_64 rng(FreshSeed());
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  const Shape shape{"Gqa", 8, 2, 64, KvPrecision::kFp32, 16};
  Sequence good(pool.get(), shape), bad(pool.get(), shape);
  good.Step(3, true, rng);
  bad.Step(3, true, rng);
  struct Defect {
    std::string field;
    std::function<void(PagedAttentionItem&)> apply;
  };
  std::vector<float> short_span(7);
  const std::vector<float> negative_gate = {1, 1, -1, 1, 1, 1, 1, 1};
  const std::vector<Defect> defects = {
      {"items[1].cache", [](PagedAttentionItem& i) { i.cache = nullptr; }},
      {"items[1].num_heads", [](PagedAttentionItem& i) { i.num_heads = 7; }},
      {"items[1].num_heads", [](PagedAttentionItem& i) { i.num_heads = 0; }},
      {"items[1].new_tokens", [](PagedAttentionItem& i) { i.new_tokens = 0; }},
      {"items[1].new_tokens", [](PagedAttentionItem& i) { i.new_tokens = 4; }},
      {"items[1].scale", [](PagedAttentionItem& i) { i.scale = 0.0f; }},
      {"items[1].scale", [](PagedAttentionItem& i) { i.scale = std::nanf(""); }},
      {"items[1].q", [&](PagedAttentionItem& i) { i.q = short_span; }},
      {"items[1].out", [&](PagedAttentionItem& i) { i.out = absl::MakeSpan(short_span); }},
      {"items[1].attention_map",
       [&](PagedAttentionItem& i) { i.attention_map = absl::MakeSpan(short_span); }},
      {"items[1].head_mask", [&](PagedAttentionItem& i) { i.head_mask = short_span; }},
      {"items[1].head_mask[2]", [&](PagedAttentionItem& i) { i.head_mask = negative_gate; }},
  };
  for (const Defect& defect : defects) {
    std::vector<PagedAttentionItem> items = {good.Item(), bad.Item()};
    defect.apply(items[1]);
    EXPECT_THAT(PagedAttention(items), StatusIs(absl::StatusCode::kInvalidArgument, defect.field));
    for (float x : good.out) ASSERT_TRUE(std::isnan(x)) << defect.field;
    for (float x : good.map) ASSERT_TRUE(std::isnan(x)) << defect.field;
  }
}

}  // namespace
}  // namespace attnserve::core
