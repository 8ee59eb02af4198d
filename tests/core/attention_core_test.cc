// AttentionCore: scaled dot-product attention on heads projected elsewhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/head_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kBf16Tolerance;
using ::attnserve::testing::kFp32Tolerance;
using ::attnserve::testing::RandomStates;
using ::attnserve::testing::RandomWeights;
using ::attnserve::testing::ReferenceCore;
using ::attnserve::testing::ReferenceLayer;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::SeedTrace;
using ::attnserve::testing::SelectMaps;
using ::attnserve::testing::StatusIs;
using Kind = ExplicitMask::Kind;
using Maps = AttentionMapMode;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

HeadConfig CoreConfig(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  HeadConfig config;
  config.num_heads = num_heads;
  config.num_kv_heads = num_kv_heads;
  config.head_dim = head_dim;
  config.d_model = num_heads * head_dim;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  EXPECT_THAT(resolved, IsOk());
  return resolved.value_or(HeadConfig{});
}

// Dense head-major [batch, heads, len, hd]: N(0, 1) within `lengths`, NaN past them.
std::vector<float> RandomHeads(int64_t batch, int64_t heads, int64_t len, int64_t hd,
                               const std::vector<int64_t>& lengths, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> values(static_cast<size_t>(batch * heads * len * hd), kNaN);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t valid = lengths.empty() ? len : lengths[b];
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < valid * hd; ++i) {
        values[((b * heads + h) * len) * hd + i] = static_cast<float>(normal(rng));
      }
    }
  }
  return values;
}

struct CoreBuffers {
  std::vector<float> output, maps, entropy, max_weight, contribution;
  ForwardOutputs Outputs() {
    return ForwardOutputs{absl::MakeSpan(output), absl::MakeSpan(maps), absl::MakeSpan(entropy),
                          absl::MakeSpan(max_weight), absl::MakeSpan(contribution)};
  }
};

CoreBuffers MakeCoreBuffers(const HeadConfig& config, const CoreInputs& inputs,
                            const ForwardOptions& options) {
  CoreBuffers buffers;
  buffers.output.assign(inputs.q.size(), kNaN);
  std::vector<int64_t> q_lengths(inputs.q_lengths.begin(), inputs.q_lengths.end());
  std::vector<int64_t> kv_lengths(inputs.kv_lengths.begin(), inputs.kv_lengths.end());
  const SequenceLayout queries =
      SequenceLayout::Padded(inputs.batch, inputs.q_len, q_lengths).value();
  const SequenceLayout keys =
      SequenceLayout::Padded(inputs.batch, inputs.kv_len, kv_lengths).value();
  buffers.maps.assign(
      static_cast<size_t>(*AttentionMapElements(config, queries, keys, options.maps)), kNaN);
  if (options.head_statistics) {
    buffers.entropy.assign(static_cast<size_t>(inputs.batch * config.num_heads), kNaN);
    buffers.max_weight.assign(buffers.entropy.size(), kNaN);
  }
  return buffers;
}

struct CoreCase {
  std::string name;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 8;
  int64_t batch = 2;
  int64_t q_len = 5;
  int64_t kv_len = 5;
  std::vector<int64_t> q_lengths, kv_lengths;
  bool causal = false;
  Kind mask = Kind::kNone;
  bool mask_batch = true, mask_q = true, mask_kv = true;
  bool head_mask = false;
  AttentionMapMode maps = Maps::kPerHead;
  std::vector<int64_t> map_heads, map_rows;
  bool statistics = true;
};

void PrintTo(const CoreCase& c, std::ostream* os) { *os << c.name; }

class AttentionCoreCases : public ::testing::TestWithParam<CoreCase> {
 protected:
  // blocked: forced onto the blocked path (no maps, no statistics) with
  // small blocks, so that block edges fall inside the sequences.
  void Check(Precision precision, double tolerance, bool blocked = false) {
    CoreCase c = GetParam();
    if (blocked) c.maps = Maps::kNone, c.map_heads = {}, c.map_rows = {}, c.statistics = false;
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(SeedTrace(seed));
    std::mt19937_64 rng(seed);
    const HeadConfig config = CoreConfig(c.num_heads, c.num_kv_heads, c.head_dim);
    absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(config);
    ASSERT_THAT(core, IsOk());
    const std::vector<float> q =
        RandomHeads(c.batch, config.num_heads, c.q_len, c.head_dim, c.q_lengths, rng);
    const std::vector<float> k =
        RandomHeads(c.batch, config.num_kv_heads, c.kv_len, c.head_dim, c.kv_lengths, rng);
    const std::vector<float> v =
        RandomHeads(c.batch, config.num_kv_heads, c.kv_len, c.head_dim, c.kv_lengths, rng);
    CoreInputs inputs;
    inputs.q = q;
    inputs.k = k;
    inputs.v = v;
    inputs.batch = c.batch;
    inputs.q_len = c.q_len;
    inputs.kv_len = c.kv_len;
    inputs.q_lengths = c.q_lengths;
    inputs.kv_lengths = c.kv_lengths;
    inputs.causal = c.causal;
    std::vector<float> mask_values;
    if (c.mask != Kind::kNone) {
      inputs.mask.kind = c.mask;
      inputs.mask.batch_dim = c.mask_batch ? c.batch : 1;
      inputs.mask.q_dim = c.mask_q ? c.q_len : 1;
      inputs.mask.kv_dim = c.mask_kv ? c.kv_len : 1;
      std::uniform_real_distribution<double> uniform(0.0, 1.0);
      mask_values.resize(
          static_cast<size_t>(inputs.mask.batch_dim * inputs.mask.q_dim * inputs.mask.kv_dim));
      for (float& m : mask_values) {
        const double u = uniform(rng);
        m = c.mask == Kind::kAllowed ? (u < 0.75 ? 1.0f : 0.0f)
                                     : (u < 0.2 ? -INFINITY : static_cast<float>(4 * u - 2));
      }
      inputs.mask.values = mask_values;
    }
    std::vector<float> head_mask;
    if (c.head_mask) {
      for (int64_t h = 0; h < config.num_heads; ++h) head_mask.push_back(h == 0 ? 0.0f : 0.5f * h);
      inputs.head_mask = head_mask;
    }
    ForwardOptions options;
    options.maps = {c.maps, c.map_heads, c.map_rows};
    options.head_statistics = c.statistics;
    options.precision = precision;
    if (blocked) {
      options.attention_path = AttentionPath::kBlocked;
      options.block_queries = 3;
      options.block_keys = 4;
    }
    CoreBuffers buffers = MakeCoreBuffers(config, inputs, options);
    const absl::StatusOr<ForwardInfo> info = (*core)->Run(inputs, options, buffers.Outputs());
    ASSERT_THAT(info, IsOk());
    const bool runs_blocked = c.maps == Maps::kNone && !c.statistics;  // kAuto's choice too
    EXPECT_EQ(info->kernel_path, absl::StrCat(PrecisionName(precision), "/",
                                              runs_blocked ? "blocked" : "materialized"));

    const ReferenceResult reference = ReferenceCore(config, inputs);
    EXPECT_LE(RelativeFrobeniusError(buffers.output, reference.output), tolerance) << "output";
    if (c.maps != Maps::kNone) {
      EXPECT_LE(RelativeFrobeniusError(buffers.maps, SelectMaps(reference, config, c.batch, c.q_len,
                                                                c.kv_len, options.maps)),
                tolerance)
          << "maps";
    }
    if (c.statistics) {
      EXPECT_LE(RelativeFrobeniusError(buffers.entropy, reference.entropy), tolerance);
      EXPECT_LE(RelativeFrobeniusError(buffers.max_weight, reference.max_weight), tolerance);
    }
  }
};

TEST_P(AttentionCoreCases, Fp32MatchesReference) { Check(Precision::kFp32, kFp32Tolerance); }

TEST_P(AttentionCoreCases, Bf16MatchesReference) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  Check(Precision::kBf16, kBf16Tolerance);
}

TEST_P(AttentionCoreCases, Fp32BlockedMatchesReference) {
  Check(Precision::kFp32, kFp32Tolerance, /*blocked=*/true);
}

TEST_P(AttentionCoreCases, Bf16BlockedMatchesReference) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  Check(Precision::kBf16, kBf16Tolerance, /*blocked=*/true);
}

std::vector<CoreCase> CoreCases() {
  std::vector<CoreCase> all;
  auto add = [&all](std::string name, auto&& edit) {
    CoreCase c;
    c.name = std::move(name);
    edit(c);
    all.push_back(std::move(c));
  };
  add("Plain", [](CoreCase&) {});
  add("OneQueryOneKey", [](CoreCase& c) { c.q_len = 1, c.kv_len = 1, c.batch = 3; });
  add("CrossLengthsDiffer", [](CoreCase& c) { c.q_len = 3, c.kv_len = 9; });
  add("PaddedQueriesAndKeys", [](CoreCase& c) {
    c.batch = 3, c.q_len = 6, c.kv_len = 7, c.q_lengths = {6, 2, 4}, c.kv_lengths = {1, 7, 5};
  });
  add("CausalGqa", [](CoreCase& c) {
    c.num_heads = 8, c.num_kv_heads = 2, c.q_len = c.kv_len = 9, c.causal = true;
  });
  add("CausalPaddedMultiQueryHeadMask", [](CoreCase& c) {
    c.num_kv_heads = 1, c.q_len = 6, c.kv_len = 6, c.q_lengths = {6, 3}, c.kv_lengths = {6, 3};
    c.causal = true, c.head_mask = true, c.maps = Maps::kMeanOverHeads;
  });
  add("AllowedMaskPaddedCausal", [](CoreCase& c) {
    c.q_len = 7, c.kv_len = 7, c.kv_lengths = {7, 4}, c.causal = true, c.mask = Kind::kAllowed;
  });
  add("AdditiveMaskSharedGqa", [](CoreCase& c) {
    c.num_heads = 6, c.num_kv_heads = 3, c.kv_len = 8, c.mask = Kind::kAdditive;
    c.mask_batch = false;
  });
  add("AdditiveKeyMaskPerSequence", [](CoreCase& c) {
    c.kv_len = 6, c.kv_lengths = {6, 5}, c.mask = Kind::kAdditive, c.mask_q = false;
  });
  add("PerHeadSubset", [](CoreCase& c) {
    c.q_len = 6, c.q_lengths = {6, 2}, c.map_heads = {3, 1}, c.map_rows = {5, 0, 5};
  });
  add("NoMapsNoStatistics", [](CoreCase& c) { c.maps = Maps::kNone, c.statistics = false; });
  add("HeadDim64Long", [](CoreCase& c) {
    c.num_heads = 2, c.head_dim = 64, c.batch = 1, c.q_len = 100, c.kv_len = 130, c.causal = true;
  });
  return all;
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionCoreCases, ::testing::ValuesIn(CoreCases()),
                         [](const ::testing::TestParamInfo<CoreCase>& info) {
                           return info.param.name;
                         });

// The core on the layer's own projected (and rotated) heads gives the
// layer's maps and statistics, and the reference's concatenated heads.
TEST(AttentionCore, EqualsTheLayersAttentionOnItsProjectedHeads) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  HeadConfig config;
  config.d_model = 32;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.head_dim = 8;
  config.rotary.rotary_dim = 8;
  config = ResolveHeadConfig(config).value();
  const AttentionWeights weights = RandomWeights(config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer = AttentionLayer::Create(config, weights);
  ASSERT_THAT(layer, IsOk());
  absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(config);
  ASSERT_THAT(core, IsOk());

  const std::vector<int64_t> lengths = {6, 3};
  const std::vector<int64_t> offsets = {4, 11};
  const SequenceLayout layout = SequenceLayout::Packed(lengths).value();
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  const std::vector<float> mask = {1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1};  // [2, 1, 6]
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = layout;
  inputs.causal = true;
  inputs.mask = ExplicitMask{Kind::kAllowed, mask, 2, 1, 6};
  inputs.position_offsets = offsets;
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  options.head_statistics = true;
  std::vector<float> output(hidden.size()), maps(2 * 4 * 6 * 6), entropy(8), max_weight(8),
      contribution(8);
  ASSERT_THAT(
      (*layer)->Forward(inputs, options,
                        {absl::MakeSpan(output), absl::MakeSpan(maps), absl::MakeSpan(entropy),
                         absl::MakeSpan(max_weight), absl::MakeSpan(contribution)}),
      IsOk());

  const ReferenceResult reference = ReferenceLayer(config, weights, inputs);
  const std::vector<float> q(reference.q.begin(), reference.q.end());
  const std::vector<float> k(reference.k.begin(), reference.k.end());
  const std::vector<float> v(reference.v.begin(), reference.v.end());
  CoreInputs core_inputs;
  core_inputs.q = q;
  core_inputs.k = k;
  core_inputs.v = v;
  core_inputs.batch = 2;
  core_inputs.q_len = 6;
  core_inputs.kv_len = 6;
  core_inputs.q_lengths = lengths;
  core_inputs.kv_lengths = lengths;
  core_inputs.causal = true;
  core_inputs.mask = inputs.mask;
  std::vector<float> core_output(q.size()), core_maps(maps.size()), core_entropy(8),
      core_max_weight(8);
  ASSERT_THAT((*core)->Run(core_inputs, options,
                           {absl::MakeSpan(core_output),
                            absl::MakeSpan(core_maps),
                            absl::MakeSpan(core_entropy),
                            absl::MakeSpan(core_max_weight),
                            {}}),
              IsOk());
  EXPECT_LE(RelativeFrobeniusError(core_output, reference.context_heads), kFp32Tolerance);
  auto as_double = [](const std::vector<float>& f) {
    return std::vector<double>(f.begin(), f.end());
  };
  EXPECT_LE(RelativeFrobeniusError(core_maps, as_double(maps)), kFp32Tolerance);
  EXPECT_LE(RelativeFrobeniusError(core_entropy, as_double(entropy)), kFp32Tolerance);
  EXPECT_LE(RelativeFrobeniusError(core_max_weight, as_double(max_weight)), kFp32Tolerance);
}

TEST(AttentionCore, PaddingValuesNeverInfluenceResults) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const HeadConfig config = CoreConfig(4, 2, 8);
  absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(config);
  ASSERT_THAT(core, IsOk());
  const std::vector<int64_t> q_lengths = {2, 5}, kv_lengths = {4, 1};
  std::vector<float> q = RandomHeads(2, 4, 5, 8, q_lengths, rng);
  std::vector<float> k = RandomHeads(2, 2, 4, 8, kv_lengths, rng);
  std::vector<float> v = RandomHeads(2, 2, 4, 8, kv_lengths, rng);
  std::vector<CoreBuffers> results;
  for (const float fill : {kNaN, 1e30f, -3.0f}) {
    for (std::vector<float>* x : {&q, &k, &v}) {
      for (float& value : *x) {
        if (std::isnan(value) || value == 1e30f) value = fill;
      }
    }
    CoreInputs inputs{q, k, v, 2, 5, 4, q_lengths, kv_lengths, true, {}, {}};
    ForwardOptions options;
    options.maps.mode = Maps::kPerHead;
    options.head_statistics = true;
    CoreBuffers buffers = MakeCoreBuffers(config, inputs, options);
    ASSERT_THAT((*core)->Run(inputs, options, buffers.Outputs()), IsOk());
    for (float value : buffers.output) ASSERT_TRUE(std::isfinite(value));
    // Rows past a query length are 0.
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i = 2; i < 5; ++i) {
        for (int64_t e = 0; e < 8; ++e)
          ASSERT_EQ(buffers.output[((0 * 4 + h) * 5 + i) * 8 + e], 0.0f);
      }
    }
    results.push_back(std::move(buffers));
    if (fill == kNaN) {
      for (std::vector<float>* x : {&q, &k, &v}) {
        for (float& value : *x) {
          if (std::isnan(value)) value = 1e30f;
        }
      }
    }
  }
  for (size_t r = 1; r < results.size(); ++r) {
    EXPECT_EQ(results[r].output, results[0].output);
    EXPECT_EQ(results[r].maps, results[0].maps);
    EXPECT_EQ(results[r].entropy, results[0].entropy);
  }
}

TEST(AttentionCore, FullyMaskedRowsGiveZerosAndNoNaN) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const HeadConfig config = CoreConfig(4, 1, 8);
  absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(config);
  ASSERT_THAT(core, IsOk());
  const std::vector<float> q = RandomHeads(1, 4, 4, 8, {}, rng);
  const std::vector<float> k = RandomHeads(1, 1, 3, 8, {}, rng);
  const std::vector<float> v = RandomHeads(1, 1, 3, 8, {}, rng);
  // [1, 4, 3]: query 1 may see nothing; query 0 only key 2, which causal hides.
  const std::vector<float> mask = {0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0, 1};
  CoreInputs inputs{q, k, v, 1, 4, 3, {}, {}, true, ExplicitMask{Kind::kAllowed, mask, 1, 4, 3},
                    {}};
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  options.head_statistics = true;
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    options.precision = precision;
    CoreBuffers buffers = MakeCoreBuffers(config, inputs, options);
    ASSERT_THAT((*core)->Run(inputs, options, buffers.Outputs()), IsOk());
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i : {0, 1}) {
        for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(buffers.maps[(h * 4 + i) * 3 + j], 0.0f);
        for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(buffers.output[(h * 4 + i) * 8 + e], 0.0f);
      }
    }
    const ReferenceResult reference = ReferenceCore(config, inputs);
    EXPECT_LE(RelativeFrobeniusError(buffers.output, reference.output),
              precision == Precision::kFp32 ? kFp32Tolerance : kBf16Tolerance);
    EXPECT_LE(RelativeFrobeniusError(buffers.entropy, reference.entropy),
              precision == Precision::kFp32 ? kFp32Tolerance : kBf16Tolerance);
  }
}

TEST(AttentionCore, CreateTakesAConfigWithoutDModel) {
  HeadConfig config;
  config.num_heads = 6;
  config.num_kv_heads = 2;
  config.head_dim = 16;
  absl::StatusOr<std::unique_ptr<AttentionCore>> core = AttentionCore::Create(config);
  ASSERT_THAT(core, IsOk());
  EXPECT_EQ((*core)->config().head_dim, 16);
  EXPECT_EQ((*core)->config().scale, 0.25f);
  config.num_kv_heads = 4;
  EXPECT_THAT(AttentionCore::Create(config),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_kv_heads"));
}

class AttentionCoreErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = CoreConfig(4, 2, 8);
    core_ = AttentionCore::Create(config_).value();
    std::mt19937_64 rng(3);
    q_ = RandomHeads(2, 4, 3, 8, {}, rng);
    k_ = RandomHeads(2, 2, 5, 8, {}, rng);
    v_ = RandomHeads(2, 2, 5, 8, {}, rng);
    inputs_ = CoreInputs{q_, k_, v_, 2, 3, 5, {}, {}, false, {}, {}};
  }

  absl::StatusOr<ForwardInfo> Run(const CoreInputs& inputs, const ForwardOptions& options = {},
                                  const std::function<void(CoreBuffers&)>& edit = nullptr) {
    CoreBuffers buffers;
    buffers.output.assign(2 * 4 * 3 * 8, 0.0f);
    if (options.head_statistics) {
      buffers.entropy.assign(8, 0.0f);
      buffers.max_weight.assign(8, 0.0f);
    }
    if (options.maps.mode == Maps::kPerHead) buffers.maps.assign(2 * 4 * 3 * 5, 0.0f);
    if (edit) edit(buffers);
    return core_->Run(inputs, options, buffers.Outputs());
  }

  static constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  HeadConfig config_;
  std::unique_ptr<AttentionCore> core_;
  std::vector<float> q_, k_, v_;
  CoreInputs inputs_;
};

TEST_F(AttentionCoreErrors, TheValidCallWorks) { EXPECT_THAT(Run(inputs_), IsOk()); }

TEST_F(AttentionCoreErrors, BadSizesAreInvalidArgument) {
  CoreInputs inputs = inputs_;
  inputs.batch = 0;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "batch"));
  inputs = inputs_;
  inputs.q_len = 0;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "q_len"));
  inputs = inputs_;
  inputs.kv_len = -2;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "kv_len"));
  inputs = inputs_;
  inputs.q = absl::MakeConstSpan(q_).subspan(1);
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "q: size"));
  inputs = inputs_;
  inputs.k = absl::MakeConstSpan(q_);
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "k: size"));
  inputs = inputs_;
  inputs.v = {};
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "v: size"));
  EXPECT_THAT(Run(inputs_, {}, [](CoreBuffers& b) { b.output.pop_back(); }),
              StatusIs(kInvalid, "output"));
}

TEST_F(AttentionCoreErrors, BadLengthsAreInvalidArgument) {
  const std::vector<int64_t> three = {1, 2, 3}, too_long = {3, 4}, zero = {0, 5};
  CoreInputs inputs = inputs_;
  inputs.q_lengths = three;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "q_lengths"));
  inputs = inputs_;
  inputs.q_lengths = too_long;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "q_lengths[1]"));
  inputs = inputs_;
  inputs.kv_lengths = zero;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "kv_lengths[0]"));
}

TEST_F(AttentionCoreErrors, MaskAndHeadMaskAreChecked) {
  const std::vector<float> mask(2 * 3 * 3, 1.0f);
  CoreInputs inputs = inputs_;
  inputs.mask = ExplicitMask{Kind::kAllowed, mask, 2, 3, 3};
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "mask.kv_dim"));
  const std::vector<float> head_mask = {1, 1};
  inputs = inputs_;
  inputs.head_mask = head_mask;
  EXPECT_THAT(Run(inputs), StatusIs(kInvalid, "head_mask"));
}

TEST_F(AttentionCoreErrors, HeadContributionMustBeEmpty) {
  ForwardOptions options;
  options.head_statistics = true;
  EXPECT_THAT(Run(inputs_, options), IsOk());
  EXPECT_THAT(Run(inputs_, options, [](CoreBuffers& b) { b.contribution.assign(8, 0.0f); }),
              StatusIs(kInvalid, "head_contribution"));
}

TEST_F(AttentionCoreErrors, BadMapSelectionIsInvalidArgument) {
  ForwardOptions options;
  options.maps = {Maps::kPerHead, {4}, {}};
  EXPECT_THAT(Run(inputs_, options), StatusIs(kInvalid, "maps.heads[0]"));
  options.maps = {Maps::kPerHead, {}, {3}};
  EXPECT_THAT(Run(inputs_, options), StatusIs(kInvalid, "maps.query_rows[0]"));
}

TEST_F(AttentionCoreErrors, ShouldStopIsCancelled) {
  ForwardOptions options;
  int polls = 0;
  options.should_stop = [&polls] { return ++polls == 2; };
  EXPECT_THAT(Run(inputs_, options), StatusIs(absl::StatusCode::kCancelled, ""));
  EXPECT_EQ(polls, 2);
}

}  // namespace
}  // namespace attnserve::core
