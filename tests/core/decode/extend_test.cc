// AttentionLayer::Extend, the decode route, against the independent
// double-precision layer (testing::ReferenceLayer) run over the whole
// sequence so far, causal, from the sequence's first RoPE position: every
// step's output rows (and map rows) are the matching rows of that full
// layer.
//
// Tolerances, as max |error| / max |expected| over a step's output (and its
// maps): 1e-5 with FP32 KV caches and FP32 projections; 2e-2
// (kBf16Tolerance) with BF16 KV caches (K and V rounded to BF16 as they are
// cached; the reference keeps them exact). BF16 projections: relative
// Frobenius error within kBf16Tolerance, as Forward's BF16 tests. Map rows
// sum to the head's head_mask weight within 1e-5.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/decode/extend.h"
#include "core/decode/kv_block_pool.h"
#include "core/decode/kv_layout.h"
#include "core/decode/latest_attention.h"
#include "core/decode/layer_kv_cache.h"
#include "core/head_config.h"
#include "core/route.h"
#include "core/validation.h"
#include "core/workspace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/decode/decode_reference.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kBf16Tolerance;
using ::attnserve::testing::MaxAbsErrorRelative;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::RandomWeights;
using ::attnserve::testing::ReferenceLayer;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::ReferenceRowStatistics;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::RowStatistics;
using ::attnserve::testing::SeedTrace;
using ::attnserve::testing::StatusIs;
using ::testing::Contains;

constexpr double kFp32KvTolerance = 1e-5;
constexpr double kRowSumTolerance = 1e-5;
constexpr float kUnwritten = std::numeric_limits<float>::quiet_NaN();

// A layer under test with its weights (the reference's input too).
struct TestLayer {
  HeadConfig config;
  AttentionWeights weights;
  std::unique_ptr<AttentionLayer> layer;
};

TestLayer MakeLayer(const HeadConfig& requested, std::mt19937_64& rng) {
  TestLayer t;
  t.config = ResolveHeadConfig(requested).value();
  t.weights = RandomWeights(t.config, rng);
  t.layer = AttentionLayer::Create(t.config, t.weights).value();
  return t;
}

std::unique_ptr<KvBlockPool> MakePool(int block_tokens, int64_t budget = int64_t{1} << 30) {
  return KvBlockPool::Create(KvBlockPoolOptions{budget, block_tokens}).value();
}

KvLayout LayoutFor(const HeadConfig& config, KvPrecision precision) {
  return KvLayout{static_cast<int>(config.num_kv_heads), static_cast<int>(config.head_dim),
                  precision};
}

// A sequence under test: its cache, every token's hidden states so far, the
// RoPE position of its token 0, and one step's inputs and buffers.
struct Session {
  Session(KvBlockPool* pool, const HeadConfig& c, KvPrecision precision, int64_t start)
      : config(c), start_position(start) {
    cache = LayerKvCache::Create(pool, LayoutFor(config, precision)).value();
  }
  // A fork of `parent`: the same tokens, the cache's blocks shared.
  struct ForkOf {
    const Session& parent;
  };
  explicit Session(ForkOf fork)
      : config(fork.parent.config),
        cache(fork.parent.cache->Fork()),
        history(fork.parent.history),
        start_position(fork.parent.start_position) {}

  int64_t length() const { return static_cast<int64_t>(history.size()) / config.d_model; }
  bool bf16_kv() const { return cache->layout().precision == KvPrecision::kBf16; }

  // Draws n new tokens and the step's output (and map) buffers, unwritten.
  void Draw(int64_t n_new, bool with_map, std::mt19937_64& rng) {
    n = n_new;
    hidden = RandomNormal(static_cast<size_t>(n * config.d_model), rng);
    output.assign(hidden.size(), kUnwritten);
    map.assign(with_map ? static_cast<size_t>(config.num_heads * n * (length() + n)) : 0,
               kUnwritten);
  }
  ExtendItem Item() {
    ExtendItem item;
    item.cache = cache.get();
    item.hidden_states = hidden;
    item.first_position = start_position + cache->length();
    item.output = absl::MakeSpan(output);
    item.attention_map = absl::MakeSpan(map);
    return item;
  }
  // The step ran: its tokens join the history.
  void Commit() { history.insert(history.end(), hidden.begin(), hidden.end()); }

  // The full causal layer over the history from start_position.
  ReferenceResult Reference(const TestLayer& layer, absl::Span<const float> head_mask) const {
    LayerInputs inputs;
    inputs.layout = SequenceLayout::Packed({length()}).value();
    inputs.hidden_states = history;
    inputs.causal = true;
    inputs.head_mask = head_mask;
    if (config.rotary.rotary_dim > 0) {
      inputs.position_offsets = absl::MakeConstSpan(&start_position, 1);
    }
    return ReferenceLayer(layer.config, layer.weights, inputs);
  }

  // The committed step's output (and map) against the matching rows of the
  // full layer; map rows sum to their head's weight.
  void ExpectMatchesReference(const TestLayer& layer, absl::Span<const float> head_mask = {},
                              bool frobenius = false) const {
    const int64_t length_now = length(), d = config.d_model, heads = config.num_heads;
    SCOPED_TRACE(absl::StrCat(bf16_kv() ? "BF16" : "FP32", " KV, length ", length_now, ", new ",
                              n, ", first position ", start_position));
    const ReferenceResult expected = Reference(layer, head_mask);
    const std::vector<double> rows(expected.output.end() - n * d, expected.output.end());
    const double tolerance = bf16_kv() ? kBf16Tolerance : kFp32KvTolerance;
    EXPECT_LE(frobenius ? RelativeFrobeniusError(output, rows) : MaxAbsErrorRelative(output, rows),
              frobenius ? kBf16Tolerance : tolerance);
    if (map.empty()) return;
    std::vector<double> map_rows;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = length_now - n; i < length_now; ++i) {
        const auto row = expected.per_head_maps.begin() + (h * length_now + i) * length_now;
        map_rows.insert(map_rows.end(), row, row + length_now);
      }
    }
    EXPECT_LE(MaxAbsErrorRelative(map, map_rows), frobenius ? kBf16Tolerance : tolerance);
    for (int64_t h = 0; h < heads; ++h) {
      const double gate = head_mask.empty() ? 1.0 : head_mask[h];
      for (int64_t i = 0; i < n; ++i) {
        double sum = 0.0;
        for (int64_t j = 0; j < length_now; ++j) sum += map[(h * n + i) * length_now + j];
        EXPECT_NEAR(sum, gate, kRowSumTolerance) << "head " << h << " row " << i;
      }
    }
  }

  HeadConfig config;
  std::unique_ptr<LayerKvCache> cache;
  std::vector<float> history;  // [length, d_model]
  int64_t start_position = 0;
  int64_t n = 0;
  std::vector<float> hidden, output, map;
};

// Runs one Extend over `sessions`; each must come out OK (then committed).
void StepAll(const TestLayer& layer, std::vector<Session*> sessions, const ExtendOptions& options,
             Workspace* workspace = nullptr) {
  std::vector<ExtendItem> items;
  for (Session* s : sessions) items.push_back(s->Item());
  const absl::StatusOr<ForwardInfo> info = layer.layer->Extend(absl::MakeSpan(items), options,
                                                               workspace);
  ASSERT_THAT(info, IsOk());
  for (size_t i = 0; i < items.size(); ++i) {
    ASSERT_THAT(items[i].status, IsOk()) << "items[" << i << "]";
    sessions[i]->Commit();
  }
}

struct Shape {
  std::string name;
  HeadConfig config;
  int block_tokens = 16;
  KvPrecision precision = KvPrecision::kFp32;
  friend void PrintTo(const Shape& shape, std::ostream* os) { *os << shape.name; }
};

HeadConfig Config(int64_t d_model, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t rotary_dim) {
  HeadConfig config;
  config.d_model = d_model;
  config.num_heads = heads;
  config.num_kv_heads = kv_heads;
  config.head_dim = head_dim;
  config.rotary.rotary_dim = rotary_dim;
  return config;
}

std::vector<Shape> Shapes() {
  std::vector<Shape> shapes;
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    const std::string p = precision == KvPrecision::kFp32 ? "Fp32Kv" : "Bf16Kv";
    shapes.push_back({"Mha4" + p, Config(64, 4, 4, 0, 0), 16, precision});
    shapes.push_back({"Gqa12to4FullRope" + p, Config(192, 12, 4, 0, 16), 16, precision});
    // q_width 128 != d_model 64; blocks of 7 tokens.
    shapes.push_back({"Mqa8to1PartialRope" + p, Config(64, 8, 1, 16, 8), 7, precision});
    shapes.push_back({"Gqa4to2Hd64PartialRope" + p, Config(128, 4, 2, 64, 32), 32, precision});
  }
  // Q, K and V weights of over 1 MiB: a one-token step's projection runs
  // RowLinear (core/kernels/row_linear.h) where the CPU has AVX-512.
  shapes.push_back({"Mha6D384Fp32Kv", Config(384, 6, 6, 0, 64), 16, KvPrecision::kFp32});
  return shapes;
}

class ExtendShapes : public ::testing::TestWithParam<Shape> {};

// Random mixes of prefill chunks and single decode steps from an empty
// cache, at a nonzero first position: every step's rows are the full causal
// layer's rows so far.
TEST_P(ExtendShapes, EveryStepMatchesTheFullCausalLayerSoFar) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const Shape& shape = GetParam();
  const TestLayer layer = MakeLayer(shape.config, rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(shape.block_tokens);
  Session session(pool.get(), layer.config, shape.precision,
                  std::uniform_int_distribution<int64_t>(1, 5000)(rng));
  std::bernoulli_distribution decode_step(0.6), with_map(0.5);
  std::uniform_int_distribution<int64_t> chunk(2, 24);
  while (session.length() < 100) {
    session.Draw(decode_step(rng) ? 1 : chunk(rng), with_map(rng), rng);
    StepAll(layer, {&session}, {});
    if (HasFatalFailure()) return;
    session.ExpectMatchesReference(layer);
    if (HasFailure()) return;
  }
}

// The read of the latest token's attention (LatestAttention over the query
// Extend keeps) after every step: the last row of each head's map of that
// step (1e-6 absolute: the same scores and exponential) and of the full
// layer's (the step's map tolerance); a fork reads the same.
TEST_P(ExtendShapes, LatestAttentionIsTheLastMapRowOfEveryStep) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const Shape& shape = GetParam();
  const TestLayer layer = MakeLayer(shape.config, rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(shape.block_tokens);
  Session session(pool.get(), layer.config, shape.precision,
                  std::uniform_int_distribution<int64_t>(1, 5000)(rng));
  const int64_t heads = layer.config.num_heads;
  EXPECT_TRUE(session.cache->latest_query().empty());
  std::bernoulli_distribution decode_step(0.7);
  std::uniform_int_distribution<int64_t> chunk(2, 24);
  while (session.length() < 60) {
    session.Draw(decode_step(rng) ? 1 : chunk(rng), /*with_map=*/true, rng);
    StepAll(layer, {&session}, {});
    if (HasFatalFailure()) return;
    const int64_t length = session.length(), n = session.n;
    SCOPED_TRACE(absl::StrCat("length ", length, ", new ", n));
    ASSERT_EQ(session.cache->latest_query().size(), static_cast<size_t>(layer.config.q_width()));
    std::vector<float> maps(static_cast<size_t>(heads * length), kUnwritten);
    std::vector<float> entropy(static_cast<size_t>(heads)), max_weight(entropy.size());
    ASSERT_THAT(LatestAttention(*session.cache, static_cast<int>(heads), layer.config.scale,
                                absl::MakeSpan(maps), absl::MakeSpan(entropy),
                                absl::MakeSpan(max_weight)),
                IsOk());
    const ReferenceResult expected = session.Reference(layer, {});
    std::vector<double> reference_rows;
    for (int64_t h = 0; h < heads; ++h) {
      double h_entropy = 0.0;
      float h_max = 0.0f;
      for (int64_t j = 0; j < length; ++j) {
        const float p = maps[static_cast<size_t>(h * length + j)];
        EXPECT_NEAR(p, session.map[static_cast<size_t>((h * n + n - 1) * length + j)], 1e-6)
            << "head " << h << " key " << j;
        reference_rows.push_back(
            expected.per_head_maps[static_cast<size_t>((h * length + length - 1) * length + j)]);
        if (p > 0.0f) h_entropy -= p * std::log(double{p});
        h_max = std::max(h_max, p);
      }
      EXPECT_NEAR(entropy[static_cast<size_t>(h)], h_entropy, 1e-5);
      EXPECT_EQ(max_weight[static_cast<size_t>(h)], h_max);
    }
    EXPECT_LE(MaxAbsErrorRelative(maps, reference_rows),
              session.bf16_kv() ? kBf16Tolerance : kFp32KvTolerance);
    Session fork(Session::ForkOf{session});
    std::vector<float> forked(maps.size());
    ASSERT_THAT(LatestAttention(*fork.cache, static_cast<int>(heads), layer.config.scale,
                                absl::MakeSpan(forked), {}, {}),
                IsOk());
    EXPECT_EQ(forked, maps);
    if (HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(AllShapes, ExtendShapes, ::testing::ValuesIn(Shapes()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return info.param.name;
                         });

// Sequences of different lengths, KV precisions and first positions share
// each call: a first call of prefill chunks of different sizes, then steps
// mixing single tokens and chunks. Each as its own reference says.
TEST(Extend, MicroBatchMixingLengthsAndKvPrecisionsMatchesEachSequence) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(192, 12, 4, 0, 8), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  const int64_t prefill[] = {3, 37, 5, 120, 1, 64};
  std::vector<std::unique_ptr<Session>> sessions;
  std::vector<Session*> all;
  for (size_t i = 0; i < std::size(prefill); ++i) {
    const KvPrecision precision = i % 2 == 0 ? KvPrecision::kFp32 : KvPrecision::kBf16;
    sessions.push_back(
        std::make_unique<Session>(pool.get(), layer.config, precision, 1 + 100 * int64_t(i)));
    sessions.back()->Draw(prefill[i], /*with_map=*/i % 3 == 0, rng);
    all.push_back(sessions.back().get());
  }
  std::bernoulli_distribution decode_step(0.7);
  std::uniform_int_distribution<int64_t> chunk(2, 17);
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE(absl::StrCat("call ", step));
    StepAll(layer, all, {});
    ASSERT_FALSE(HasFatalFailure());
    for (Session* s : all) s->ExpectMatchesReference(layer);
    for (size_t i = 0; i < all.size(); ++i) {
      all[i]->Draw(decode_step(rng) ? 1 : chunk(rng), (i + step) % 2 == 0, rng);
    }
  }
}

// Head h's weights times head_mask[h] (0 removes it), as in Forward: the
// outputs and the maps (rows summing to the weight) are the reference's.
TEST(Extend, HeadMaskGatesEachHeadsWeightsAndMaps) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(96, 6, 2, 0, 16), rng);
  const std::vector<float> head_mask = {0.0f, 0.5f, 1.0f, 2.0f, 0.0f, 0.25f};
  ExtendOptions options;
  options.head_mask = head_mask;
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    Session session(pool.get(), layer.config, precision, 7);
    for (int64_t n : {20, 1, 1, 5, 1}) {
      session.Draw(n, /*with_map=*/true, rng);
      StepAll(layer, {&session}, options);
      ASSERT_FALSE(HasFatalFailure());
      session.ExpectMatchesReference(layer, head_mask);
    }
  }
}

// Each new row's head statistics (entropy and max weight of its gated
// weights, [num_heads, n]) are those of the reference's map rows, in double:
// with the map asked for too, and without it (the map then lives in scratch
// for the call); FP32 KV within 1e-5, BF16 KV within kBf16Tolerance.
TEST(Extend, HeadStatisticsOfTheNewRowsMatchTheReferenceWithOrWithoutMaps) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(96, 6, 2, 0, 16), rng);
  const std::vector<float> head_mask = {1.0f, 0.5f, 0.0f, 2.0f, 1.0f, 0.25f};
  const int64_t heads = layer.config.num_heads;
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    for (bool masked : {false, true}) {
      SCOPED_TRACE(absl::StrCat(precision == KvPrecision::kBf16 ? "BF16" : "FP32", " KV, ",
                                masked ? "head mask" : "no head mask"));
      ExtendOptions options;
      if (masked) options.head_mask = head_mask;
      const absl::Span<const float> mask = options.head_mask;
      Session with_map(pool.get(), layer.config, precision, 3);
      Session without_map(pool.get(), layer.config, precision, 0);
      for (int64_t n : {9, 1, 4, 1}) {
        with_map.Draw(n, /*with_map=*/true, rng);
        without_map.Draw(n + 1, /*with_map=*/false, rng);
        std::vector<ExtendItem> items = {with_map.Item(), without_map.Item()};
        std::vector<std::vector<float>> entropy, max_weight;
        for (const Session* s : {&with_map, &without_map}) {
          entropy.emplace_back(static_cast<size_t>(heads * s->n), kUnwritten);
          max_weight.emplace_back(static_cast<size_t>(heads * s->n), kUnwritten);
        }
        for (size_t k = 0; k < items.size(); ++k) {
          items[k].head_entropy = absl::MakeSpan(entropy[k]);
          items[k].head_max_weight = absl::MakeSpan(max_weight[k]);
        }
        ASSERT_THAT(layer.layer->Extend(absl::MakeSpan(items), options), IsOk());
        Session* const sessions[] = {&with_map, &without_map};
        for (size_t k = 0; k < items.size(); ++k) {
          ASSERT_THAT(items[k].status, IsOk());
          Session& s = *sessions[k];
          s.Commit();
          s.ExpectMatchesReference(layer, mask);
          const ReferenceResult expected = s.Reference(layer, mask);
          const int64_t length = s.length();
          const RowStatistics want =
              ReferenceRowStatistics(expected.per_head_maps, heads, length, length - s.n, s.n);
          const std::vector<double>& want_entropy = want.entropy;
          const std::vector<double>& want_max = want.max_weight;
          const double tolerance =
              precision == KvPrecision::kBf16 ? kBf16Tolerance : kFp32KvTolerance;
          EXPECT_LE(MaxAbsErrorRelative(entropy[k], want_entropy), tolerance) << "entropy " << k;
          EXPECT_LE(MaxAbsErrorRelative(max_weight[k], want_max), tolerance) << "max " << k;
          if (masked) {  // head 2 is removed: its weights are all 0
            for (int64_t i = 0; i < s.n; ++i) {
              EXPECT_EQ(entropy[k][2 * s.n + i], 0.0f);
              EXPECT_EQ(max_weight[k][2 * s.n + i], 0.0f);
            }
          }
        }
        if (HasFailure()) return;
      }
    }
  }
}

// The bytes of block `b` of a cache.
std::vector<std::byte> BlockBytes(const LayerKvCache& cache, size_t b) {
  const std::byte* data = cache.blocks()[b].data;
  return std::vector<std::byte>(data, data + KvBlockBytes(cache.layout(), cache.block_tokens()));
}

// A fork extended differently from its parent, in the same calls: each
// matches its own reference, and the blocks they share stay as they were.
TEST(Extend, ForkExtendedDifferentlyFromItsParentMatchesItsOwnReference) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(64, 8, 2, 0, 8), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  for (KvPrecision precision : {KvPrecision::kFp32, KvPrecision::kBf16}) {
    Session parent(pool.get(), layer.config, precision, 3);
    parent.Draw(37, false, rng);  // two full blocks and a partial one
    StepAll(layer, {&parent}, {});
    ASSERT_FALSE(HasFatalFailure());
    Session child(Session::ForkOf{parent});
    const std::vector<std::byte> shared0 = BlockBytes(*parent.cache, 0);
    const std::vector<std::byte> shared1 = BlockBytes(*parent.cache, 1);
    for (int step = 0; step < 3; ++step) {
      parent.Draw(step == 0 ? 1 : 4, true, rng);
      child.Draw(step == 0 ? 6 : 1, true, rng);
      StepAll(layer, {&parent, &child}, {});
      ASSERT_FALSE(HasFatalFailure());
      parent.ExpectMatchesReference(layer);
      child.ExpectMatchesReference(layer);
    }
    for (const Session* s : {&parent, &child}) {
      EXPECT_EQ(s->cache->blocks()[0].data, child.cache->blocks()[0].data);
      EXPECT_EQ(s->cache->blocks()[1].data, child.cache->blocks()[1].data);
      EXPECT_EQ(pool->ReferenceCount(s->cache->blocks()[0]), 2);
    }
    EXPECT_EQ(BlockBytes(*parent.cache, 0), shared0);
    EXPECT_EQ(BlockBytes(*parent.cache, 1), shared1);
    EXPECT_NE(parent.cache->blocks()[2].data, child.cache->blocks()[2].data);
  }
}

// An item whose pool refuses its next block: RESOURCE_EXHAUSTED, its cache
// and output as they were; its neighbours in the call are right. Once the
// pool has room again, it carries on from where it was.
TEST(Extend, ItemThePoolRefusesFailsAloneAndItsCacheIsUnchanged) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(64, 4, 2, 0, 16), rng);
  const KvLayout layout = LayoutFor(layer.config, KvPrecision::kFp32);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  std::unique_ptr<KvBlockPool> full_pool = MakePool(16, 2 * KvBlockBytes(layout, 16));
  Session before(pool.get(), layer.config, KvPrecision::kBf16, 0);
  Session victim(full_pool.get(), layer.config, KvPrecision::kFp32, 0);
  Session after(pool.get(), layer.config, KvPrecision::kFp32, 50);
  before.Draw(9, false, rng);
  victim.Draw(16, false, rng);  // fills one block of its pool
  after.Draw(30, false, rng);
  StepAll(layer, {&before, &victim, &after}, {});
  ASSERT_FALSE(HasFatalFailure());
  std::unique_ptr<LayerKvCache> hog = LayerKvCache::Create(full_pool.get(), layout).value();
  const std::vector<float> one_token(static_cast<size_t>(layout.num_kv_heads * layout.head_dim));
  ASSERT_THAT(hog->Append(one_token, one_token, 1), IsOk());  // takes the other block
  const KvBlockHandle victim_block = victim.cache->blocks()[0];
  for (int step = 0; step < 2; ++step) {
    before.Draw(1, true, rng);
    victim.Draw(step == 0 ? 1 : 3, true, rng);
    after.Draw(step == 0 ? 1 : 5, true, rng);
    std::vector<ExtendItem> items = {before.Item(), victim.Item(), after.Item()};
    ASSERT_THAT(layer.layer->Extend(absl::MakeSpan(items), {}), IsOk());
    EXPECT_THAT(items[0].status, IsOk());
    EXPECT_THAT(items[1].status, StatusIs(absl::StatusCode::kResourceExhausted, "items[1].cache"));
    EXPECT_THAT(items[2].status, IsOk());
    EXPECT_EQ(victim.cache->length(), 16);
    ASSERT_EQ(victim.cache->blocks().size(), 1u);
    EXPECT_EQ(victim.cache->blocks()[0].data, victim_block.data);
    for (float x : victim.output) ASSERT_TRUE(std::isnan(x));
    for (float x : victim.map) ASSERT_TRUE(std::isnan(x));
    before.Commit();
    after.Commit();
    before.ExpectMatchesReference(layer);
    after.ExpectMatchesReference(layer);
  }
  hog.reset();
  victim.Draw(3, true, rng);
  after.Draw(1, true, rng);
  StepAll(layer, {&victim, &after}, {});
  ASSERT_FALSE(HasFatalFailure());
  victim.ExpectMatchesReference(layer);
  after.ExpectMatchesReference(layer);
}

// One malformed item at a time: refused by name, its cache unchanged, and
// the items around it run.
TEST(Extend, MalformedItemIsRefusedByNameWhileTheOthersRun) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(64, 4, 2, 0, 16), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  Session first(pool.get(), layer.config, KvPrecision::kFp32, 0);
  Session bad(pool.get(), layer.config, KvPrecision::kFp32, 0);
  Session last(pool.get(), layer.config, KvPrecision::kBf16, 9);
  for (Session* s : {&first, &bad, &last}) s->Draw(5, false, rng);
  StepAll(layer, {&first, &bad, &last}, {});
  ASSERT_FALSE(HasFatalFailure());
  std::unique_ptr<LayerKvCache> other_shape =
      LayerKvCache::Create(pool.get(), KvLayout{4, 16, KvPrecision::kFp32}).value();
  std::vector<float> short_span(7), nan_states;
  std::vector<float> stats_span(static_cast<size_t>(layer.config.num_heads * 2));
  struct Defect {
    std::string field;
    std::function<void(std::vector<ExtendItem>&)> apply;
  };
  const std::vector<Defect> defects = {
      {"items[1].cache", [](auto& items) { items[1].cache = nullptr; }},
      {"items[1].cache", [&](auto& items) { items[1].cache = other_shape.get(); }},
      {"items[1].cache", [](auto& items) { items[1].cache = items[0].cache; }},
      {"items[1].hidden_states", [&](auto& items) { items[1].hidden_states = short_span; }},
      {"items[1].hidden_states", [](auto& items) { items[1].hidden_states = {}; }},
      {"items[1].hidden_states", [&](auto& items) { items[1].hidden_states = nan_states; }},
      {"items[1].output", [&](auto& items) { items[1].output = absl::MakeSpan(short_span); }},
      {"items[1].attention_map",
       [&](auto& items) { items[1].attention_map = absl::MakeSpan(short_span); }},
      {"items[1].head_entropy",
       [&](auto& items) {
         items[1].head_entropy = absl::MakeSpan(short_span);
         items[1].head_max_weight = absl::MakeSpan(short_span);
       }},
      {"items[1].head_max_weight",
       [&](auto& items) {
         items[1].head_entropy = absl::MakeSpan(stats_span);
         items[1].head_max_weight = {};
       }},
      {"items[1].first_position", [](auto& items) { items[1].first_position = -1; }},
      {"items[1].first_position",
       [](auto& items) { items[1].first_position = kMaxPositionOffset + 1; }},
  };
  for (const Defect& defect : defects) {
    SCOPED_TRACE(defect.field);
    for (Session* s : {&first, &bad, &last}) s->Draw(2, true, rng);
    nan_states = bad.hidden;
    nan_states[nan_states.size() - 3] = std::nanf("");
    std::vector<ExtendItem> items = {first.Item(), bad.Item(), last.Item()};
    defect.apply(items);
    ASSERT_THAT(layer.layer->Extend(absl::MakeSpan(items), {}), IsOk());
    EXPECT_THAT(items[0].status, IsOk());
    EXPECT_THAT(items[1].status, StatusIs(absl::StatusCode::kInvalidArgument, defect.field));
    EXPECT_THAT(items[2].status, IsOk());
    EXPECT_EQ(bad.cache->length(), 5);
    for (float x : bad.output) ASSERT_TRUE(std::isnan(x));
    first.Commit();
    last.Commit();
    first.ExpectMatchesReference(layer);
    last.ExpectMatchesReference(layer);
    if (HasFailure()) return;
  }
}

// should_stop answering true at each poll in turn: CANCELLED, every item's
// status too, and every cache back at its length before the call (the next
// step runs from there and matches the reference).
TEST(Extend, ShouldStopCancelsAndLeavesEveryCacheAsItWas) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(64, 4, 1, 0, 16), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(8);
  Session a(pool.get(), layer.config, KvPrecision::kFp32, 11);
  Session b(pool.get(), layer.config, KvPrecision::kBf16, 0);
  a.Draw(15, false, rng);
  b.Draw(16, false, rng);
  StepAll(layer, {&a, &b}, {});
  ASSERT_FALSE(HasFatalFailure());
  int cancelled = 0;
  for (int stop_at = 1;; ++stop_at) {
    SCOPED_TRACE(absl::StrCat("stop at poll ", stop_at));
    a.Draw(1, true, rng);   // a fills its partial block
    b.Draw(9, true, rng);   // b takes two fresh blocks
    int polls = 0;
    ExtendOptions options;
    options.should_stop = [&] { return ++polls == stop_at; };
    std::vector<ExtendItem> items = {a.Item(), b.Item()};
    const absl::StatusOr<ForwardInfo> info = layer.layer->Extend(absl::MakeSpan(items), options);
    if (info.ok()) {
      a.Commit();
      b.Commit();
      a.ExpectMatchesReference(layer);
      b.ExpectMatchesReference(layer);
      break;
    }
    ++cancelled;
    EXPECT_THAT(info, StatusIs(absl::StatusCode::kCancelled, "should_stop"));
    for (const ExtendItem& item : items) {
      EXPECT_THAT(item.status, StatusIs(absl::StatusCode::kCancelled, ""));
    }
    EXPECT_EQ(a.cache->length(), 15);
    EXPECT_EQ(b.cache->length(), 16);
    EXPECT_EQ(a.cache->blocks().size(), 2u);
    EXPECT_EQ(b.cache->blocks().size(), 2u);
    ASSERT_LT(stop_at, 20) << "should_stop polled without end";
  }
  EXPECT_EQ(cancelled, 4);  // before the projections, the appends, the attention, the output
}

// A call that stops part-way keeps each cache's latest query, the one of the
// step before (the truncate that rolls the call back does not drop it).
TEST(Extend, AStoppedStepKeepsTheLatestQueryOfTheStepBefore) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(64, 4, 2, 0, 16), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(8);
  Session a(pool.get(), layer.config, KvPrecision::kFp32, 3);
  a.Draw(5, false, rng);
  StepAll(layer, {&a}, {});
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<float> before(a.cache->latest_query().begin(), a.cache->latest_query().end());
  ASSERT_EQ(before.size(), 64u);
  for (int stop_at = 1; stop_at <= 4; ++stop_at) {
    a.Draw(1, false, rng);
    int polls = 0;
    ExtendOptions options;
    options.should_stop = [&] { return ++polls == stop_at; };
    std::vector<ExtendItem> items = {a.Item()};
    EXPECT_THAT(layer.layer->Extend(absl::MakeSpan(items), options),
                StatusIs(absl::StatusCode::kCancelled, "should_stop"));
    EXPECT_EQ(a.cache->length(), 5);
    EXPECT_EQ(std::vector<float>(a.cache->latest_query().begin(), a.cache->latest_query().end()),
              before)
        << "stopped at poll " << stop_at;
  }
}

// Errors of the call itself: every item gets the error, no cache changes.
TEST(Extend, CallErrorsNameTheFieldAndChangeNoCache) {
  std::mt19937_64 rng(FreshSeed());
  const TestLayer layer = MakeLayer(Config(64, 4, 2, 0, 0), rng);
  HeadConfig cross_config = Config(64, 4, 2, 0, 0);
  cross_config.context_dim = 32;
  const TestLayer cross = MakeLayer(cross_config, rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  Session session(pool.get(), layer.config, KvPrecision::kFp32, 0);
  session.Draw(3, false, rng);
  const std::vector<float> wrong_size = {1.0f, 1.0f};
  const std::vector<float> negative = {1.0f, -1.0f, 1.0f, 1.0f};
  struct Case {
    const TestLayer* layer;
    ExtendOptions options;
    std::string field;
  };
  // Each field set on its own: GCC 12 at -O3 takes a braced Case temporary's
  // std::function for maybe-uninitialized (a false -Wmaybe-uninitialized).
  std::vector<Case> cases(4);
  const TestLayer* layers[] = {&cross, &layer, &layer, &layer};
  const char* fields[] = {"context_dim", "options.head_mask", "options.head_mask[1]",
                          "options.precision"};
  for (size_t i = 0; i < cases.size(); ++i) {
    cases[i].layer = layers[i];
    cases[i].field = fields[i];
  }
  cases[1].options.head_mask = wrong_size;
  cases[2].options.head_mask = negative;
  cases[3].options.precision = static_cast<Precision>(7);
  for (const Case& c : cases) {
    std::vector<ExtendItem> items = {session.Item()};
    EXPECT_THAT(c.layer->layer->Extend(absl::MakeSpan(items), c.options),
                StatusIs(absl::StatusCode::kInvalidArgument, c.field));
    EXPECT_THAT(items[0].status, StatusIs(absl::StatusCode::kInvalidArgument, c.field));
    EXPECT_EQ(session.cache->length(), 0);
  }
  const absl::StatusOr<ForwardInfo> nothing = layer.layer->Extend({}, {});
  ASSERT_THAT(nothing, IsOk());
  EXPECT_EQ(nothing->kernel_path, "fp32/paged");
}

// BF16 projections (where the CPU has BF16): the route says so, and the
// result is within BF16's tolerance of the reference, for both KV precisions.
TEST(Extend, Bf16ProjectionsMatchReferenceWithinBf16Tolerance) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(128, 8, 2, 0, 16), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  ExtendOptions options;
  options.precision = Precision::kBf16;
  Session a(pool.get(), layer.config, KvPrecision::kFp32, 5);
  Session b(pool.get(), layer.config, KvPrecision::kBf16, 0);
  for (int64_t n : {24, 1, 3, 1}) {
    a.Draw(n, true, rng);
    b.Draw(n == 1 ? 2 : 1, true, rng);
    std::vector<ExtendItem> items = {a.Item(), b.Item()};
    const absl::StatusOr<ForwardInfo> info = layer.layer->Extend(absl::MakeSpan(items), options);
    ASSERT_THAT(info, IsOk());
    EXPECT_EQ(info->kernel_path, "bf16/paged");
    a.Commit();
    b.Commit();
    a.ExpectMatchesReference(layer, {}, /*frobenius=*/true);
    b.ExpectMatchesReference(layer, {}, /*frobenius=*/true);
  }
}

// The paged paths are among the kernel paths metrics are made for.
TEST(ExtendRoute, KernelPathNamesIncludeThePagedPaths) {
  const std::vector<std::string> names = KernelPathNames();
  EXPECT_THAT(names, Contains("fp32/paged"));
  if (Bf16Supported()) {
    EXPECT_THAT(names, Contains("bf16/paged"));
  }
}

TEST(ExtendRoute, OverflowingSizesAreRefused) {
  const HeadConfig config = ResolveHeadConfig(Config(64, 4, 2, 0, 16)).value();
  EXPECT_THAT(MakeExtendRoute(config, int64_t{1} << 60, Precision::kFp32),
              StatusIs(absl::StatusCode::kInvalidArgument, "items"));
  const absl::StatusOr<Route> none = MakeExtendRoute(config, 0, Precision::kFp32);
  ASSERT_THAT(none, IsOk());
  EXPECT_EQ(none->scratch_bytes(), 0);
}

// One route decides the step's scratch: a step on a new workspace reserves
// exactly what MakeExtendRoute says for its items' new tokens (a refused
// item's not counted), and a workspace kept across steps of random sizes
// never holds more than the largest of their routes.
TEST(ExtendRoute, RouteScratchIsWhatTheStepReserves) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const TestLayer layer = MakeLayer(Config(96, 6, 2, 0, 8), rng);
  std::unique_ptr<KvBlockPool> pool = MakePool(16);
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(PrecisionName(precision));
    ExtendOptions options;
    options.precision = precision;
    std::unique_ptr<Workspace> kept = Workspace::Create().value();
    int64_t largest = 0;
    std::vector<std::unique_ptr<Session>> sessions;
    for (int i = 0; i < 3; ++i) {
      sessions.push_back(std::make_unique<Session>(
          pool.get(), layer.config, i == 1 ? KvPrecision::kBf16 : KvPrecision::kFp32, 0));
    }
    std::uniform_int_distribution<int64_t> tokens(1, 40);
    for (int step = 0; step < 6; ++step) {
      int64_t valid_tokens = 0;
      for (auto& s : sessions) s->Draw(tokens(rng), step % 2 == 0, rng);
      std::vector<ExtendItem> items;
      for (auto& s : sessions) items.push_back(s->Item());
      items[2].output = {};  // refused: not part of the step's route
      for (int i = 0; i < 2; ++i) valid_tokens += sessions[static_cast<size_t>(i)]->n;
      const absl::StatusOr<Route> route =
          MakeExtendRoute(layer.config, valid_tokens, precision);
      ASSERT_THAT(route, IsOk());
      largest = std::max(largest, route->scratch_bytes());
      std::unique_ptr<Workspace> fresh = Workspace::Create().value();
      for (Workspace* workspace : {fresh.get(), kept.get()}) {
        for (auto& s : sessions) s->cache->Truncate(s->length()).IgnoreError();
        items = {sessions[0]->Item(), sessions[1]->Item(), sessions[2]->Item()};
        items[2].output = {};
        const absl::StatusOr<ForwardInfo> info =
            layer.layer->Extend(absl::MakeSpan(items), options, workspace);
        ASSERT_THAT(info, IsOk());
        EXPECT_EQ(info->kernel_path, route->kernel_path());
        EXPECT_THAT(items[2].status, StatusIs(absl::StatusCode::kInvalidArgument, "output"));
      }
      EXPECT_EQ(fresh->route_bytes(), route->scratch_bytes());
      EXPECT_EQ(kept->route_bytes(), largest);
      // The second run (on `kept`) is the one the sessions keep.
      for (int i = 0; i < 2; ++i) sessions[static_cast<size_t>(i)]->Commit();
      sessions[0]->ExpectMatchesReference(layer, {}, precision == Precision::kBf16);
    }
  }
}

}  // namespace
}  // namespace attnserve::core
