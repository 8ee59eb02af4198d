#include "core/attention_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/attention_weights.h"
#include "core/head_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::MaxRowSumError;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::StatusIs;

// FP32 against the double-precision reference.
constexpr double kTolerance = 1e-5;

// A fresh seed per run; tests print it so a failure can be reproduced.
uint64_t FreshSeed() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) | device();
}

std::string SeedTrace(uint64_t seed) { return absl::StrCat("random seed ", seed); }

std::vector<float> RandomNormal(size_t n, std::mt19937_64& rng, double stddev = 1.0) {
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<float> values(n);
  for (float& v : values) v = static_cast<float>(normal(rng));
  return values;
}

// Random weights of the usual magnitude (uniform in +-1/sqrt(fan_in)),
// independent of SeededWeights.
AttentionWeights RandomWeights(const HeadConfig& config, std::mt19937_64& rng) {
  auto uniform = [&rng](size_t n, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::uniform_real_distribution<double> dist(-bound, bound);
    std::vector<float> values(n);
    for (float& v : values) v = static_cast<float>(dist(rng));
    return values;
  };
  const size_t d = static_cast<size_t>(config.d_model);
  const size_t q = static_cast<size_t>(config.q_width());
  const size_t kv = static_cast<size_t>(config.kv_width());
  AttentionWeights w;
  w.w_q = uniform(d * q, config.d_model);
  w.b_q = uniform(q, config.d_model);
  w.w_k = uniform(d * kv, config.d_model);
  w.b_k = uniform(kv, config.d_model);
  w.w_v = uniform(d * kv, config.d_model);
  w.b_v = uniform(kv, config.d_model);
  w.w_o = uniform(q * d, config.q_width());
  w.b_o = uniform(d, config.q_width());
  return w;
}

HeadConfig MakeConfig(int64_t d_model, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  HeadConfig config;
  config.d_model = d_model;
  config.num_heads = num_heads;
  config.num_kv_heads = num_kv_heads;
  config.head_dim = head_dim;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  EXPECT_THAT(resolved, IsOk());
  return resolved.value_or(HeadConfig{});
}

// The buffers of one Forward call.
struct Buffers {
  std::vector<float> output;
  std::vector<float> maps;
};

Buffers MakeBuffers(const HeadConfig& config, AttentionShape shape, AttentionMapMode mode) {
  Buffers buffers;
  buffers.output.assign(static_cast<size_t>(shape.batch * shape.seq_len * config.d_model), NAN);
  buffers.maps.assign(static_cast<size_t>(*AttentionMapElements(config, shape, mode)), NAN);
  return buffers;
}

absl::StatusOr<ForwardInfo> RunLayer(AttentionLayer& layer, const std::vector<float>& hidden,
                                     AttentionShape shape, AttentionMapMode mode,
                                     Buffers& buffers) {
  ForwardOptions options;
  options.attention_maps = mode;
  return layer.Forward(
      hidden, shape, options,
      ForwardOutputs{absl::MakeSpan(buffers.output), absl::MakeSpan(buffers.maps)});
}

// Runs `layer` in every map mode on `hidden` and checks each result against the
// reference, and the mean maps against the mean of the per-head maps.
void ExpectMatchesReference(AttentionLayer& layer, const AttentionWeights& weights,
                            const std::vector<float>& hidden, AttentionShape shape) {
  const HeadConfig& config = layer.config();
  const ReferenceResult reference = ReferenceAttention(config, weights, hidden, shape);

  Buffers none = MakeBuffers(config, shape, AttentionMapMode::kNone);
  ASSERT_THAT(RunLayer(layer, hidden, shape, AttentionMapMode::kNone, none), IsOk());
  EXPECT_LE(RelativeFrobeniusError(none.output, reference.output), kTolerance) << "output, no maps";

  Buffers per_head = MakeBuffers(config, shape, AttentionMapMode::kPerHead);
  const absl::StatusOr<ForwardInfo> info =
      RunLayer(layer, hidden, shape, AttentionMapMode::kPerHead, per_head);
  ASSERT_THAT(info, IsOk());
  EXPECT_EQ(info->kernel_path, "fp32/materialized");
  EXPECT_LE(RelativeFrobeniusError(per_head.output, reference.output), kTolerance)
      << "output, per-head maps";
  EXPECT_LE(RelativeFrobeniusError(per_head.maps, reference.per_head_maps), kTolerance)
      << "per-head maps";
  EXPECT_LE(MaxRowSumError(per_head.maps, shape.seq_len), kTolerance) << "per-head row sums";

  Buffers mean = MakeBuffers(config, shape, AttentionMapMode::kMeanOverHeads);
  ASSERT_THAT(RunLayer(layer, hidden, shape, AttentionMapMode::kMeanOverHeads, mean), IsOk());
  EXPECT_LE(RelativeFrobeniusError(mean.output, reference.output), kTolerance)
      << "output, mean maps";
  EXPECT_LE(RelativeFrobeniusError(mean.maps, reference.mean_maps), kTolerance) << "mean maps";
  EXPECT_LE(MaxRowSumError(mean.maps, shape.seq_len), kTolerance) << "mean row sums";

  // The mean map is the mean of the layer's own per-head maps.
  const int64_t s2 = shape.seq_len * shape.seq_len;
  std::vector<double> mean_of_heads(mean.maps.size(), 0.0);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < config.num_heads; ++h) {
      for (int64_t e = 0; e < s2; ++e) {
        mean_of_heads[b * s2 + e] += per_head.maps[(b * config.num_heads + h) * s2 + e] /
                                     static_cast<double>(config.num_heads);
      }
    }
  }
  EXPECT_LE(RelativeFrobeniusError(mean.maps, mean_of_heads), 1e-6) << "mean of per-head maps";
}

struct ShapeCase {
  std::string name;
  int64_t batch;
  int64_t seq_len;
  int64_t d_model;
  int64_t num_heads;
  int64_t num_kv_heads;  // 0: num_heads
  int64_t head_dim;      // 0: d_model / num_heads
};

// Names the case in test listings instead of dumping its bytes.
void PrintTo(const ShapeCase& c, std::ostream* os) {
  *os << c.name << " {batch " << c.batch << ", seq_len " << c.seq_len << ", d_model " << c.d_model
      << ", num_heads " << c.num_heads << ", num_kv_heads " << c.num_kv_heads << ", head_dim "
      << c.head_dim << "}";
}

class AttentionLayerShapes : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(AttentionLayerShapes, AllMapModesMatchReferenceOnRandomWeights) {
  const ShapeCase& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const HeadConfig config = MakeConfig(c.d_model, c.num_heads, c.num_kv_heads, c.head_dim);
  const AttentionWeights weights = RandomWeights(config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer = AttentionLayer::Create(config, weights);
  ASSERT_THAT(layer, IsOk());
  const AttentionShape shape{c.batch, c.seq_len};
  const std::vector<float> hidden =
      RandomNormal(static_cast<size_t>(c.batch * c.seq_len * c.d_model), rng);
  ExpectMatchesReference(**layer, weights, hidden, shape);
}

TEST_P(AttentionLayerShapes, AllMapModesMatchReferenceOnSeededWeights) {
  const ShapeCase& c = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const HeadConfig config = MakeConfig(c.d_model, c.num_heads, c.num_kv_heads, c.head_dim);
  const AttentionWeights weights = SeededWeights(config, seed);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer = AttentionLayer::Create(config, weights);
  ASSERT_THAT(layer, IsOk());
  const AttentionShape shape{c.batch, c.seq_len};
  const std::vector<float> hidden =
      RandomNormal(static_cast<size_t>(c.batch * c.seq_len * c.d_model), rng);
  ExpectMatchesReference(**layer, weights, hidden, shape);
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionLayerShapes,
                         ::testing::Values(
                             // name, batch, seq_len, d_model, num_heads, num_kv_heads, head_dim
                             ShapeCase{"OneTokenOneHead", 1, 1, 16, 1, 0, 0},
                             ShapeCase{"OneTokenPerSequenceInABatch", 3, 1, 24, 2, 0, 0},
                             ShapeCase{"OddLengthBatchOfTwo", 2, 7, 32, 2, 0, 16},
                             ShapeCase{"TwelveHeadsOddLength", 3, 33, 48, 12, 0, 4},
                             ShapeCase{"HeadDimOneNarrowerThanDModel", 2, 5, 8, 2, 0, 1},
                             ShapeCase{"HeadDimThreeNarrowerThanDModel", 2, 9, 10, 2, 0, 3},
                             ShapeCase{"HeadDim128WiderThanDModel", 1, 17, 64, 1, 0, 128},
                             ShapeCase{"HeadDim64WiderThanDModel", 2, 16, 96, 2, 0, 64},
                             ShapeCase{"MultiQueryFourHeads", 2, 11, 32, 4, 1, 8},
                             ShapeCase{"MultiQueryEightHeads", 1, 7, 64, 8, 1, 0},
                             ShapeCase{"GroupedEightHeadsTwoKv", 2, 13, 64, 8, 2, 8},
                             ShapeCase{"GroupedFourHeadsTwoKvHeadDim64", 1, 33, 48, 4, 2, 64},
                             ShapeCase{"BertBaseSeq16", 1, 16, 768, 12, 0, 0},
                             ShapeCase{"BertBaseSeq33", 1, 33, 768, 12, 0, 0},
                             ShapeCase{"BertBaseBatch2Seq64", 2, 64, 768, 12, 0, 0},
                             // 12 * 256 * 256 scores per sequence: chunks of 5 sequences, then 2.
                             ShapeCase{"ManySequencesRunInChunks", 7, 256, 48, 12, 0, 0},
                             // 8 * 300 * 300 scores per sequence: chunks of 5 sequences, then 1.
                             ShapeCase{"GroupedHeadsRunInChunks", 6, 300, 16, 8, 2, 2}),
                         [](const ::testing::TestParamInfo<ShapeCase>& info) {
                           return info.param.name;
                         });

// A small layer with random weights for the tests below.
struct SmallLayer {
  HeadConfig config;
  AttentionWeights weights;
  std::unique_ptr<AttentionLayer> layer;
};

SmallLayer MakeSmallLayer(std::mt19937_64& rng, int64_t num_kv_heads = 0) {
  SmallLayer small;
  small.config = MakeConfig(32, 4, num_kv_heads, 0);
  small.weights = RandomWeights(small.config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
      AttentionLayer::Create(small.config, small.weights);
  EXPECT_THAT(layer, IsOk());
  if (layer.ok()) small.layer = *std::move(layer);
  return small;
}

TEST(AttentionLayer, CachedPrimitivesServeRepeatedAndAlternatingShapes) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  for (AttentionShape shape : {AttentionShape{2, 9}, AttentionShape{2, 9}, AttentionShape{3, 4},
                               AttentionShape{2, 9}, AttentionShape{1, 9}, AttentionShape{3, 4}}) {
    SCOPED_TRACE(absl::StrCat("batch ", shape.batch, ", seq_len ", shape.seq_len));
    const std::vector<float> hidden =
        RandomNormal(static_cast<size_t>(shape.batch * shape.seq_len * 32), rng);
    ExpectMatchesReference(*small.layer, small.weights, hidden, shape);
  }
}

TEST(AttentionLayer, PerHeadMapsMatchReferenceForGroupedHeads) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 1);
  ASSERT_NE(small.layer, nullptr);
  const AttentionShape shape{2, 6};
  const std::vector<float> hidden = RandomNormal(2 * 6 * 32, rng);
  const ReferenceResult reference = ReferenceAttention(small.config, small.weights, hidden, shape);
  Buffers buffers = MakeBuffers(small.config, shape, AttentionMapMode::kPerHead);
  ASSERT_THAT(RunLayer(*small.layer, hidden, shape, AttentionMapMode::kPerHead, buffers), IsOk());
  EXPECT_LE(RelativeFrobeniusError(buffers.maps, reference.per_head_maps), kTolerance);
  EXPECT_LE(RelativeFrobeniusError(buffers.output, reference.output), kTolerance);
}

TEST(AttentionLayer, LargeScoresStayFiniteAndNormalized) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng);
  ASSERT_NE(small.layer, nullptr);
  const AttentionShape shape{1, 12};
  // Scores in the thousands: exp() overflows unless the softmax subtracts the max.
  const std::vector<float> hidden = RandomNormal(12 * 32, rng, 300.0);
  Buffers buffers = MakeBuffers(small.config, shape, AttentionMapMode::kPerHead);
  ASSERT_THAT(RunLayer(*small.layer, hidden, shape, AttentionMapMode::kPerHead, buffers), IsOk());
  for (float v : buffers.output) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LE(MaxRowSumError(buffers.maps, shape.seq_len), kTolerance);
}

TEST(AttentionLayer, ConcurrentCallersAreSerializedAndCorrect) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  const AttentionShape shapes[2] = {{2, 5}, {1, 11}};
  std::vector<float> hidden[2];
  ReferenceResult reference[2];
  for (int t = 0; t < 2; ++t) {
    hidden[t] = RandomNormal(static_cast<size_t>(shapes[t].batch * shapes[t].seq_len * 32), rng);
    reference[t] = ReferenceAttention(small.config, small.weights, hidden[t], shapes[t]);
  }
  double worst[2] = {0.0, 0.0};
  bool all_ok[2] = {true, true};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        Buffers buffers = MakeBuffers(small.config, shapes[t], AttentionMapMode::kMeanOverHeads);
        if (!RunLayer(*small.layer, hidden[t], shapes[t], AttentionMapMode::kMeanOverHeads, buffers)
                 .ok()) {
          all_ok[t] = false;
          return;
        }
        worst[t] = std::max({worst[t], RelativeFrobeniusError(buffers.output, reference[t].output),
                             RelativeFrobeniusError(buffers.maps, reference[t].mean_maps)});
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 2; ++t) {
    EXPECT_TRUE(all_ok[t]);
    EXPECT_LE(worst[t], kTolerance);
  }
}

TEST(AttentionLayer, ConfigIsResolved) {
  HeadConfig config;
  config.d_model = 16;
  config.num_heads = 4;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  ASSERT_THAT(resolved, IsOk());
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
      AttentionLayer::Create(config, SeededWeights(*resolved, 1));
  ASSERT_THAT(layer, IsOk());
  EXPECT_EQ((*layer)->config().num_kv_heads, 4);
  EXPECT_EQ((*layer)->config().head_dim, 4);
  EXPECT_EQ((*layer)->config().scale, 0.5f);
}

TEST(AttentionLayer, CreateRejectsABadConfig) {
  HeadConfig config;
  config.d_model = 768;
  config.num_heads = 12;
  config.num_kv_heads = 5;
  EXPECT_THAT(AttentionLayer::Create(config, AttentionWeights{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_kv_heads"));
}

TEST(AttentionLayer, CreateRejectsBadWeights) {
  const HeadConfig config = MakeConfig(16, 2, 0, 0);
  AttentionWeights weights = SeededWeights(config, 1);
  weights.w_v.pop_back();
  EXPECT_THAT(AttentionLayer::Create(config, weights),
              StatusIs(absl::StatusCode::kInvalidArgument, "w_v"));
  weights = SeededWeights(config, 1);
  weights.b_o[3] = NAN;
  EXPECT_THAT(AttentionLayer::Create(config, weights),
              StatusIs(absl::StatusCode::kInvalidArgument, "b_o"));
}

class AttentionLayerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(1);
    small_ = MakeSmallLayer(rng);
    ASSERT_NE(small_.layer, nullptr);
    hidden_ = RandomNormal(static_cast<size_t>(shape_.batch * shape_.seq_len * 32), rng);
  }

  absl::StatusOr<ForwardInfo> Forward(absl::Span<const float> hidden, AttentionShape shape,
                                      AttentionMapMode mode, size_t output_size, size_t maps_size,
                                      std::function<bool()> should_stop = nullptr) {
    output_.assign(output_size, 0.0f);
    maps_.assign(maps_size, 0.0f);
    ForwardOptions options;
    options.attention_maps = mode;
    options.should_stop = std::move(should_stop);
    return small_.layer->Forward(hidden, shape, options,
                                 ForwardOutputs{absl::MakeSpan(output_), absl::MakeSpan(maps_)});
  }

  SmallLayer small_;
  const AttentionShape shape_{2, 3};
  const size_t tokens_size_ = 2 * 3 * 32;
  const size_t per_head_size_ = 2 * 4 * 3 * 3;
  const size_t mean_size_ = 2 * 3 * 3;
  std::vector<float> hidden_;
  std::vector<float> output_;
  std::vector<float> maps_;
};

TEST_F(AttentionLayerErrors, WrongHiddenStatesSizeIsInvalidArgument) {
  std::vector<float> short_hidden(hidden_.begin(), hidden_.end() - 1);
  EXPECT_THAT(Forward(short_hidden, shape_, AttentionMapMode::kNone, tokens_size_, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "hidden_states"));
}

TEST_F(AttentionLayerErrors, WrongOutputSizeIsInvalidArgument) {
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kNone, tokens_size_ + 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "output"));
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kNone, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "output"));
}

TEST_F(AttentionLayerErrors, WrongAttentionMapsSizeIsInvalidArgument) {
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kPerHead, tokens_size_, mean_size_),
              StatusIs(absl::StatusCode::kInvalidArgument, "attention_maps"));
  EXPECT_THAT(
      Forward(hidden_, shape_, AttentionMapMode::kMeanOverHeads, tokens_size_, per_head_size_),
      StatusIs(absl::StatusCode::kInvalidArgument, "attention_maps"));
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kPerHead, tokens_size_, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "attention_maps"));
  // No maps asked for: the span must be empty.
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kNone, tokens_size_, mean_size_),
              StatusIs(absl::StatusCode::kInvalidArgument, "attention_maps"));
  // The right sizes work.
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kPerHead, tokens_size_, per_head_size_),
              IsOk());
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kMeanOverHeads, tokens_size_, mean_size_),
              IsOk());
}

TEST_F(AttentionLayerErrors, EmptyShapesAreInvalidArgument) {
  EXPECT_THAT(Forward({}, AttentionShape{0, 3}, AttentionMapMode::kNone, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "batch"));
  EXPECT_THAT(Forward({}, AttentionShape{2, 0}, AttentionMapMode::kNone, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "seq_len"));
  EXPECT_THAT(Forward({}, AttentionShape{-1, -3}, AttentionMapMode::kNone, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "batch"));
}

TEST_F(AttentionLayerErrors, OverflowingShapesAreInvalidArgument) {
  const int64_t huge = int64_t{1} << 40;
  EXPECT_THAT(
      Forward(hidden_, AttentionShape{huge, huge}, AttentionMapMode::kNone, tokens_size_, 0),
      StatusIs(absl::StatusCode::kInvalidArgument, "overflows"));
  // hidden_states fits int64 but the per-head maps do not.
  EXPECT_THAT(Forward(hidden_, AttentionShape{1, int64_t{1} << 31}, AttentionMapMode::kPerHead,
                      tokens_size_, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "hidden_states"));
}

TEST_F(AttentionLayerErrors, ShouldStopBeforeTheFirstStageIsCancelled) {
  int polls = 0;
  EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kPerHead, tokens_size_, per_head_size_,
                      [&polls] {
                        ++polls;
                        return true;
                      }),
              StatusIs(absl::StatusCode::kCancelled, ""));
  EXPECT_EQ(polls, 1);
}

TEST_F(AttentionLayerErrors, ShouldStopIsPolledBetweenStagesAndLaterStopsAreCancelled) {
  // Count the polls of a full run, then stop at each of them in turn.
  int total_polls = 0;
  ASSERT_THAT(Forward(hidden_, shape_, AttentionMapMode::kNone, tokens_size_, 0,
                      [&total_polls] {
                        ++total_polls;
                        return false;
                      }),
              IsOk());
  EXPECT_GE(total_polls, 3);
  for (int stop_at = 1; stop_at <= total_polls; ++stop_at) {
    SCOPED_TRACE(absl::StrCat("stop at poll ", stop_at));
    int polls = 0;
    EXPECT_THAT(Forward(hidden_, shape_, AttentionMapMode::kNone, tokens_size_, 0,
                        [&polls, stop_at] { return ++polls == stop_at; }),
                StatusIs(absl::StatusCode::kCancelled, ""));
  }
  // The layer still works after cancelled calls.
  const ReferenceResult reference =
      ReferenceAttention(small_.config, small_.weights, hidden_, shape_);
  ASSERT_THAT(Forward(hidden_, shape_, AttentionMapMode::kNone, tokens_size_, 0), IsOk());
  EXPECT_LE(RelativeFrobeniusError(output_, reference.output), kTolerance);
}

TEST(AttentionMapElements, CountsEachModeAndReportsOverflow) {
  const HeadConfig config = MakeConfig(64, 8, 2, 0);
  EXPECT_EQ(AttentionMapElements(config, {3, 5}, AttentionMapMode::kNone), 0);
  EXPECT_EQ(AttentionMapElements(config, {3, 5}, AttentionMapMode::kPerHead), 3 * 8 * 5 * 5);
  EXPECT_EQ(AttentionMapElements(config, {3, 5}, AttentionMapMode::kMeanOverHeads), 3 * 5 * 5);
  const int64_t huge = int64_t{1} << 32;
  EXPECT_EQ(AttentionMapElements(config, {1, huge}, AttentionMapMode::kPerHead), std::nullopt);
  EXPECT_EQ(AttentionMapElements(config, {huge, huge}, AttentionMapMode::kMeanOverHeads),
            std::nullopt);
}

}  // namespace
}  // namespace attnserve::core
