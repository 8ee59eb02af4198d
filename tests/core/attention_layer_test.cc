#include "core/attention_layer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
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
#include "core/attention_inputs.h"
#include "core/attention_weights.h"
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
using ::attnserve::testing::MaxRowSumError;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::RandomStates;
using ::attnserve::testing::RandomWeights;
using ::attnserve::testing::ReferenceLayer;
using ::attnserve::testing::ReferenceResult;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::SeedTrace;
using ::attnserve::testing::SelectMaps;
using ::attnserve::testing::SequenceRows;
using ::attnserve::testing::StatusIs;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

HeadConfig MakeConfig(int64_t d_model, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t rotary_dim = 0, int64_t context_dim = 0) {
  HeadConfig config;
  config.d_model = d_model;
  config.num_heads = num_heads;
  config.num_kv_heads = num_kv_heads;
  config.head_dim = head_dim;
  config.rotary.rotary_dim = rotary_dim;
  config.context_dim = context_dim;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  EXPECT_THAT(resolved, IsOk());
  return resolved.value_or(HeadConfig{});
}

SequenceLayout Padded(int64_t batch, int64_t padded_len, std::vector<int64_t> lengths = {}) {
  absl::StatusOr<SequenceLayout> layout =
      SequenceLayout::Padded(batch, padded_len, std::move(lengths));
  EXPECT_THAT(layout, IsOk());
  return layout.value_or(SequenceLayout());
}

SequenceLayout Packed(std::vector<int64_t> lengths) {
  absl::StatusOr<SequenceLayout> layout = SequenceLayout::Packed(std::move(lengths));
  EXPECT_THAT(layout, IsOk());
  return layout.value_or(SequenceLayout());
}

// The caller's buffers of one Forward call, sized for `inputs` and `options`
// (NaN-filled, so that an element left unwritten shows).
struct Buffers {
  std::vector<float> output, maps, entropy, max_weight, contribution;

  ForwardOutputs Outputs() {
    return ForwardOutputs{absl::MakeSpan(output), absl::MakeSpan(maps), absl::MakeSpan(entropy),
                          absl::MakeSpan(max_weight), absl::MakeSpan(contribution)};
  }
};

// Runs that differ only in padding values: every output finite and, in every
// buffer, equal to the first run's bit for bit.
void ExpectFiniteAndIdentical(const std::vector<Buffers>& results) {
  for (const Buffers& run : results) {
    for (float v : run.output) ASSERT_TRUE(std::isfinite(v));
    for (float v : run.maps) ASSERT_TRUE(std::isfinite(v));
  }
  for (size_t r = 1; r < results.size(); ++r) {
    EXPECT_EQ(results[r].output, results[0].output);
    EXPECT_EQ(results[r].maps, results[0].maps);
    EXPECT_EQ(results[r].entropy, results[0].entropy);
    EXPECT_EQ(results[r].max_weight, results[0].max_weight);
    EXPECT_EQ(results[r].contribution, results[0].contribution);
  }
}

Buffers MakeBuffers(const HeadConfig& config, const LayerInputs& inputs,
                    const ForwardOptions& options) {
  const SequenceLayout& keys = inputs.context_layout ? *inputs.context_layout : inputs.layout;
  Buffers buffers;
  buffers.output.assign(static_cast<size_t>(inputs.layout.rows() * config.d_model), kNaN);
  buffers.maps.assign(
      static_cast<size_t>(
          AttentionMapElements(config, inputs.layout, keys, options.maps).value_or(0)),
      kNaN);
  if (options.head_statistics) {
    const size_t stats = static_cast<size_t>(inputs.layout.batch() * config.num_heads);
    buffers.entropy.assign(stats, kNaN);
    buffers.max_weight.assign(stats, kNaN);
    buffers.contribution.assign(stats, kNaN);
  }
  return buffers;
}

// Outputs with only `output` (and `maps`) given.
ForwardOutputs OutputOnly(std::vector<float>& output, std::vector<float>* maps = nullptr) {
  ForwardOutputs outputs;
  outputs.output = absl::MakeSpan(output);
  if (maps != nullptr) outputs.attention_maps = absl::MakeSpan(*maps);
  return outputs;
}

absl::StatusOr<ForwardInfo> RunLayer(AttentionLayer& layer, const LayerInputs& inputs,
                                     const ForwardOptions& options, Buffers& buffers) {
  buffers = MakeBuffers(layer.config(), inputs, options);
  return layer.Forward(inputs, options, buffers.Outputs());
}

// Checks every output of a layer's call against the reference.
void ExpectMatches(const HeadConfig& config, const LayerInputs& inputs,
                   const ForwardOptions& options, const Buffers& buffers,
                   const ReferenceResult& reference, double tolerance) {
  const SequenceLayout& keys = inputs.context_layout ? *inputs.context_layout : inputs.layout;
  EXPECT_LE(RelativeFrobeniusError(buffers.output, reference.output), tolerance) << "output";
  // Padding rows are exactly 0.
  for (int64_t b = 0; b < inputs.layout.batch() && inputs.layout.is_padded(); ++b) {
    for (int64_t i = inputs.layout.length(b); i < inputs.layout.max_length(); ++i) {
      for (int64_t e = 0; e < config.d_model; ++e) {
        ASSERT_EQ(buffers.output[(inputs.layout.row_offset(b) + i) * config.d_model + e], 0.0f)
            << "padding row " << i << " of sequence " << b;
      }
    }
  }
  if (options.maps.mode != AttentionMapMode::kNone) {
    EXPECT_LE(
        RelativeFrobeniusError(
            buffers.maps, SelectMaps(reference, config, inputs.layout.batch(),
                                     inputs.layout.max_length(), keys.max_length(), options.maps)),
        tolerance)
        << "attention maps";
  }
  if (options.head_statistics) {
    EXPECT_LE(RelativeFrobeniusError(buffers.entropy, reference.entropy), tolerance) << "entropy";
    EXPECT_LE(RelativeFrobeniusError(buffers.max_weight, reference.max_weight), tolerance)
        << "max_weight";
    EXPECT_LE(RelativeFrobeniusError(buffers.contribution, reference.contribution), tolerance)
        << "contribution";
  }
}

// ---------------------------------------------------------------------------
// Table-driven: every mode alone and in combination, FP32 and BF16.

struct Scenario {
  std::string name;
  // With 4 heads, head_dim 16: the blocked path's own block kernels (the
  // scenarios with head_dim 8 or 24 run their blocks on oneDNN).
  int64_t d_model = 64;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  std::vector<int64_t> lengths = {5};
  bool packed = false;
  int64_t padded_len = 0;  // 0: the longest length
  // Non-empty: cross-attention on a context of these lengths, context_dim
  // wide (0: d_model).
  std::vector<int64_t> context_lengths;
  int64_t context_dim = 0;
  bool context_packed = false;
  int64_t context_padded_len = 0;
  bool causal = false;
  ExplicitMask::Kind mask = ExplicitMask::Kind::kNone;
  // Which of the mask's dims (batch, q, kv) are full; the others are 1.
  bool mask_batch = true, mask_q = true, mask_kv = true;
  bool head_mask = false;
  bool position_offsets = false;
  AttentionMapMode maps = AttentionMapMode::kPerHead;
  std::vector<int64_t> map_heads, map_rows;
  bool statistics = true;
};

void PrintTo(const Scenario& s, std::ostream* os) { *os << s.name; }

SequenceLayout MakeLayout(const std::vector<int64_t>& lengths, bool packed, int64_t padded_len) {
  if (packed) return Packed(lengths);
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  return Padded(static_cast<int64_t>(lengths.size()), padded_len == 0 ? longest : padded_len,
                lengths);
}

// A random mask for `kind`: allowed with probability 3/4, additive N(0, 1)
// with -inf one time in five.
std::vector<float> RandomMask(ExplicitMask::Kind kind, size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> values(n);
  for (float& v : values) {
    if (kind == ExplicitMask::Kind::kAllowed) {
      v = uniform(rng) < 0.75 ? 1.0f : 0.0f;
    } else {
      v = uniform(rng) < 0.2 ? -kInf : static_cast<float>(normal(rng));
    }
  }
  return values;
}

// Everything one scenario's call needs, owning the data the spans view.
struct ScenarioCall {
  HeadConfig config;
  AttentionWeights weights;
  std::vector<float> hidden, context, mask_values, head_mask;
  std::vector<int64_t> offsets;
  LayerInputs inputs;
  ForwardOptions options;
};

ScenarioCall MakeScenarioCall(const Scenario& s, std::mt19937_64& rng, Precision precision) {
  ScenarioCall call;
  call.config =
      MakeConfig(s.d_model, s.num_heads, s.num_kv_heads, s.head_dim, s.rotary_dim, s.context_dim);
  call.weights = RandomWeights(call.config, rng);
  LayerInputs& in = call.inputs;
  in.layout = MakeLayout(s.lengths, s.packed, s.padded_len);
  call.hidden = RandomStates(in.layout, s.d_model, rng);  // NaN padding
  in.hidden_states = call.hidden;
  if (!s.context_lengths.empty()) {
    in.context_layout = MakeLayout(s.context_lengths, s.context_packed, s.context_padded_len);
    call.context = RandomStates(*in.context_layout, call.config.context_dim, rng);
    in.context = call.context;
  }
  const SequenceLayout& keys = in.context_layout ? *in.context_layout : in.layout;
  in.causal = s.causal;
  if (s.mask != ExplicitMask::Kind::kNone) {
    in.mask.kind = s.mask;
    in.mask.batch_dim = s.mask_batch ? in.layout.batch() : 1;
    in.mask.q_dim = s.mask_q ? in.layout.max_length() : 1;
    in.mask.kv_dim = s.mask_kv ? keys.max_length() : 1;
    call.mask_values = RandomMask(
        s.mask, static_cast<size_t>(in.mask.batch_dim * in.mask.q_dim * in.mask.kv_dim), rng);
    in.mask.values = call.mask_values;
  }
  if (s.head_mask) {
    std::uniform_real_distribution<double> weight(0.0, 2.0);
    for (int64_t h = 0; h < call.config.num_heads; ++h) {
      call.head_mask.push_back(h == 1 ? 0.0f : static_cast<float>(weight(rng)));
    }
    in.head_mask = call.head_mask;
  }
  if (s.position_offsets) {
    std::uniform_int_distribution<int64_t> offset(0, 1000);
    for (int64_t b = 0; b < in.layout.batch(); ++b) call.offsets.push_back(offset(rng));
    in.position_offsets = call.offsets;
  }
  call.options.maps.mode = s.maps;
  call.options.maps.heads = s.map_heads;
  call.options.maps.query_rows = s.map_rows;
  call.options.head_statistics = s.statistics;
  call.options.precision = precision;
  return call;
}

// The path a scenario runs on: as asked (maps and statistics: materialized),
// or forced onto the blocked path without maps and statistics, with small
// blocks so that block edges fall inside the sequences (the last blocks
// shorter, causal diagonals inside blocks), on the block kernels the route
// picks (attnserve's own where the CPU and head_dim allow) or on oneDNN's
// (ForwardOptions::block_kernels kOneDnn).
enum class PathUnderTest { kAsAsked, kBlocked, kBlockedOnOneDnn };

class AttentionLayerScenarios : public ::testing::TestWithParam<Scenario> {
 protected:
  void Check(Precision precision, double tolerance, PathUnderTest path = PathUnderTest::kAsAsked) {
    const uint64_t seed = FreshSeed();
    SCOPED_TRACE(SeedTrace(seed));
    std::mt19937_64 rng(seed);
    ScenarioCall call = MakeScenarioCall(GetParam(), rng, precision);
    std::string expected_path = "materialized";
    if (path != PathUnderTest::kAsAsked) {
      call.options.maps = {};
      call.options.head_statistics = false;
      call.options.attention_path = AttentionPath::kBlocked;
      call.options.block_queries = 4;
      call.options.block_keys = 3;
      if (path == PathUnderTest::kBlockedOnOneDnn) {
        call.options.block_kernels = BlockKernels::kOneDnn;
      }
      expected_path = "blocked";
    } else if (call.options.maps.mode == AttentionMapMode::kNone && !call.options.head_statistics) {
      expected_path = "blocked";  // kAuto's choice
    }
    absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
        AttentionLayer::Create(call.config, call.weights);
    ASSERT_THAT(layer, IsOk());
    Buffers buffers;
    const absl::StatusOr<ForwardInfo> info = RunLayer(**layer, call.inputs, call.options, buffers);
    ASSERT_THAT(info, IsOk());
    EXPECT_EQ(info->precision, precision);
    EXPECT_EQ(info->kernel_path, absl::StrCat(PrecisionName(precision), "/", expected_path));
    const ReferenceResult reference = ReferenceLayer(call.config, call.weights, call.inputs);
    ExpectMatches(call.config, call.inputs, call.options, buffers, reference, tolerance);
  }
};

TEST_P(AttentionLayerScenarios, Fp32MatchesReference) { Check(Precision::kFp32, kFp32Tolerance); }

TEST_P(AttentionLayerScenarios, Bf16MatchesReference) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  Check(Precision::kBf16, kBf16Tolerance);
}

TEST_P(AttentionLayerScenarios, Fp32BlockedMatchesReference) {
  Check(Precision::kFp32, kFp32Tolerance, PathUnderTest::kBlocked);
}

TEST_P(AttentionLayerScenarios, Bf16BlockedMatchesReference) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  Check(Precision::kBf16, kBf16Tolerance, PathUnderTest::kBlocked);
}

TEST_P(AttentionLayerScenarios, Fp32BlockedOnOneDnnMatchesReference) {
  Check(Precision::kFp32, kFp32Tolerance, PathUnderTest::kBlockedOnOneDnn);
}

TEST_P(AttentionLayerScenarios, Bf16BlockedOnOneDnnMatchesReference) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  Check(Precision::kBf16, kBf16Tolerance, PathUnderTest::kBlockedOnOneDnn);
}

// One route decides every scratch buffer's size: what MakeRoute says a
// forward needs is what a forward reserves in a new workspace, exactly, on
// every route a scenario can take, and a second forward of the same request
// grows nothing.
TEST_P(AttentionLayerScenarios, RouteScratchIsWhatTheForwardReserves) {
  std::mt19937_64 rng(FreshSeed());
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    for (const PathUnderTest path :
         {PathUnderTest::kAsAsked, PathUnderTest::kBlocked, PathUnderTest::kBlockedOnOneDnn}) {
      SCOPED_TRACE(absl::StrCat(PrecisionName(precision), " path ", static_cast<int>(path)));
      ScenarioCall call = MakeScenarioCall(GetParam(), rng, precision);
      if (path != PathUnderTest::kAsAsked) {
        call.options.maps = {};
        call.options.head_statistics = false;
        call.options.attention_path = AttentionPath::kBlocked;
        if (path == PathUnderTest::kBlockedOnOneDnn) {
          call.options.block_kernels = BlockKernels::kOneDnn;
        }
      }
      absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
          AttentionLayer::Create(call.config, call.weights);
      ASSERT_THAT(layer, IsOk());
      RouteRequest request;
      request.queries = call.inputs.layout;
      request.cross_attention = call.inputs.context_layout.has_value();
      request.keys = request.cross_attention ? *call.inputs.context_layout : call.inputs.layout;
      request.causal = call.inputs.causal;
      request.mask = call.inputs.mask.kind;
      const absl::StatusOr<Route> route = MakeRoute((*layer)->config(), request, call.options);
      ASSERT_THAT(route, IsOk());
      absl::StatusOr<std::unique_ptr<Workspace>> workspace = Workspace::Create();
      ASSERT_THAT(workspace, IsOk());
      Buffers buffers = MakeBuffers((*layer)->config(), call.inputs, call.options);
      for (int forward = 0; forward < 2; ++forward) {
        const absl::StatusOr<ForwardInfo> info =
            (*layer)->Forward(call.inputs, call.options, buffers.Outputs(), workspace->get());
        ASSERT_THAT(info, IsOk());
        EXPECT_EQ(info->kernel_path, route->kernel_path());
        EXPECT_EQ((*workspace)->route_bytes(), route->scratch_bytes());
      }
    }
  }
}

// The projections' rows are whole 64-byte lines, an odd number of them (so
// that rows read at that stride spread over every L1 set), at most two lines
// past the width.
TEST(ProjectionRowStride, IsAnOddNumberOfLinesJustPastTheWidth) {
  for (const int64_t element_bytes : {2, 4}) {
    for (int64_t width = 1; width <= 5000; ++width) {
      SCOPED_TRACE(absl::StrCat(width, " elements of ", element_bytes, " bytes"));
      const int64_t stride = ProjectionRowStride(width, element_bytes);
      const int64_t bytes = stride * element_bytes;
      EXPECT_GE(stride, width);
      EXPECT_EQ(bytes % 64, 0);
      EXPECT_EQ(bytes / 64 % 2, 1);
      EXPECT_LT(bytes - width * element_bytes, 128);
    }
  }
  EXPECT_EQ(ProjectionRowStride(3 * 1024, 4), 3088);  // D=1024 QKV: 193 lines, not 192
}

using Kind = ExplicitMask::Kind;
using Maps = AttentionMapMode;

std::vector<Scenario> Scenarios() {
  std::vector<Scenario> all;
  auto add = [&all](std::string name, auto&& edit) {
    Scenario s;
    s.name = std::move(name);
    edit(s);
    all.push_back(std::move(s));
  };
  add("OneToken", [](Scenario& s) { s.lengths = {1}; });
  add("PaddedUniform", [](Scenario& s) { s.lengths = {6, 6}; });
  add("PaddedRagged", [](Scenario& s) { s.lengths = {5, 2, 7}, s.padded_len = 8; });
  add("PackedRagged", [](Scenario& s) { s.lengths = {5, 1, 7, 3}, s.packed = true; });
  add("Causal", [](Scenario& s) { s.lengths = {9}, s.causal = true; });
  add("CausalPaddedRaggedMeanMaps", [](Scenario& s) {
    s.lengths = {4, 9}, s.causal = true, s.maps = Maps::kMeanOverHeads;
  });
  add("HeadMask", [](Scenario& s) { s.lengths = {6, 3}, s.head_mask = true; });
  add("Rope", [](Scenario& s) {
    s.head_dim = 8, s.rotary_dim = 8, s.lengths = {7, 7}, s.position_offsets = true;
  });
  add("PartialRopeDefaultPositions", [](Scenario& s) {
    s.head_dim = 16, s.rotary_dim = 6, s.lengths = {5, 8};
  });
  add("MultiQueryCausal", [](Scenario& s) {
    s.num_kv_heads = 1, s.lengths = {6, 2}, s.causal = true;
  });
  add("CausalGqaPackedRopeHeadMask", [](Scenario& s) {
    s.d_model = 64, s.num_heads = 8, s.num_kv_heads = 2, s.head_dim = 8, s.rotary_dim = 8;
    s.lengths = {7, 3, 11}, s.packed = true, s.causal = true, s.head_mask = true;
    s.position_offsets = true;
  });
  add("CrossPaddedMeanMaps", [](Scenario& s) {
    s.lengths = {4, 6}, s.context_lengths = {9, 3}, s.context_padded_len = 10;
    s.maps = Maps::kMeanOverHeads;
  });
  add("CrossPackedCausalRopeGqa", [](Scenario& s) {
    s.num_kv_heads = 2, s.head_dim = 8, s.rotary_dim = 4, s.position_offsets = true;
    s.lengths = {5, 2}, s.packed = true, s.context_lengths = {3, 8}, s.context_packed = true;
    s.causal = true;
  });
  add("CrossMoreQueriesThanKeysCausal",
      [](Scenario& s) { s.lengths = {8}, s.context_lengths = {3}, s.causal = true; });
  add("CrossAdditiveMaskHeadMask", [](Scenario& s) {
    s.lengths = {3, 5}, s.context_lengths = {6, 4}, s.context_packed = true;
    s.mask = Kind::kAdditive, s.head_mask = true;
  });
  // A context of another width than d_model (torch's kdim = vdim): W_q and
  // [W_k | W_v] apart.
  add("CrossNarrowerContextPaddedRagged", [](Scenario& s) {
    s.context_dim = 24, s.lengths = {4, 6, 1}, s.padded_len = 7;
    s.context_lengths = {9, 3, 5}, s.context_padded_len = 10;
  });
  add("CrossWiderContextPackedCausalRopeGqa", [](Scenario& s) {
    s.context_dim = 80, s.num_kv_heads = 2, s.head_dim = 8, s.rotary_dim = 8;
    s.position_offsets = true, s.lengths = {5, 2}, s.packed = true;
    s.context_lengths = {3, 8}, s.context_packed = true, s.causal = true;
  });
  add("CrossOddContextMultiQueryMaskMeanMaps", [](Scenario& s) {
    s.context_dim = 7, s.num_kv_heads = 1, s.lengths = {6, 3}, s.context_lengths = {2, 5};
    s.mask = Kind::kAllowed, s.head_mask = true, s.maps = Maps::kMeanOverHeads;
  });
  add("CrossContextOneWidePerHeadSubset", [](Scenario& s) {
    s.context_dim = 1, s.lengths = {3, 4}, s.packed = true, s.context_lengths = {5, 1};
    s.map_heads = {2, 0}, s.map_rows = {3, 1};
  });
  add("CrossNarrowerContextBertBaseWidths", [](Scenario& s) {
    s.d_model = 768, s.num_heads = 12, s.context_dim = 512, s.lengths = {17, 9};
    s.context_lengths = {40, 23}, s.context_packed = true, s.maps = Maps::kMeanOverHeads;
  });
  // Explicit masks, each broadcast pattern, with causal and padding.
  add("AllowedMaskFullCausalPadded", [](Scenario& s) {
    s.lengths = {7, 4}, s.causal = true, s.mask = Kind::kAllowed;
  });
  add("AllowedMaskPerSequenceKeysPacked", [](Scenario& s) {
    s.lengths = {6, 2, 5}, s.packed = true, s.mask = Kind::kAllowed, s.mask_q = false;
  });
  add("AllowedMaskSharedCausalPadded", [](Scenario& s) {
    s.lengths = {8, 5}, s.padded_len = 9, s.causal = true, s.mask = Kind::kAllowed;
    s.mask_batch = false;
  });
  add("AllowedMaskPerQueryRowGqa", [](Scenario& s) {
    s.num_kv_heads = 2, s.lengths = {5, 6}, s.mask = Kind::kAllowed, s.mask_kv = false;
  });
  add("AdditiveMaskFullCausalPacked", [](Scenario& s) {
    s.lengths = {6, 9}, s.packed = true, s.causal = true, s.mask = Kind::kAdditive;
  });
  add("AdditiveMaskPerSequenceKeysPadded", [](Scenario& s) {
    s.lengths = {7, 3}, s.mask = Kind::kAdditive, s.mask_q = false;
  });
  add("AdditiveMaskSharedRaggedPadded", [](Scenario& s) {
    s.lengths = {4, 8, 2}, s.mask = Kind::kAdditive, s.mask_batch = false;
  });
  add("AdditiveMaskPerQueryRowCausal", [](Scenario& s) {
    s.lengths = {6}, s.causal = true, s.mask = Kind::kAdditive, s.mask_kv = false;
  });
  add("AdditiveMaskSharedKeysOnly", [](Scenario& s) {
    s.lengths = {5, 5}, s.mask = Kind::kAdditive, s.mask_batch = false, s.mask_q = false;
  });
  add("AdditiveMaskScalar", [](Scenario& s) {
    s.lengths = {4, 2}, s.packed = true, s.mask = Kind::kAdditive, s.mask_batch = false;
    s.mask_q = false, s.mask_kv = false;
  });
  // Map selections.
  add("PerHeadMapSubset", [](Scenario& s) {
    s.lengths = {6, 3}, s.padded_len = 7, s.map_heads = {3, 0, 3}, s.map_rows = {4, 0};
  });
  add("MeanMapRowSubsetCausal", [](Scenario& s) {
    s.lengths = {5, 8}, s.packed = true, s.causal = true, s.maps = Maps::kMeanOverHeads;
    s.map_rows = {7, 2};
  });
  add("NoMapsNoStatistics", [](Scenario& s) {
    s.lengths = {3, 7}, s.maps = Maps::kNone, s.statistics = false;
  });
  add("HeadDimWiderThanDModel", [](Scenario& s) {
    s.d_model = 16, s.num_heads = 2, s.head_dim = 24, s.lengths = {5, 3}, s.causal = true;
  });
  // Uniform lengths without RoPE: in BF16 the blocked path reads Q/K/V where
  // the projection writes them (up to four query blocks); GQA, MQA, head mask,
  // cross-attention and packed layouts on that route, and a uniform batch
  // past four query blocks (staged again).
  add("GroupedUniformHeadMaskNoMaps", [](Scenario& s) {
    s.d_model = 64, s.num_heads = 8, s.num_kv_heads = 2, s.head_dim = 8, s.lengths = {6, 6};
    s.head_mask = true, s.maps = Maps::kNone, s.statistics = false;
  });
  add("MultiQueryPackedUniformCausalNoMaps", [](Scenario& s) {
    s.num_kv_heads = 1, s.lengths = {5, 5, 5}, s.packed = true, s.causal = true;
    s.maps = Maps::kNone, s.statistics = false;
  });
  add("CrossUniformNarrowerContextGqaNoMaps", [](Scenario& s) {
    s.context_dim = 24, s.num_kv_heads = 2, s.lengths = {4, 4}, s.context_lengths = {7, 7};
    s.maps = Maps::kNone, s.statistics = false;
  });
  add("UniformPastFourQueryBlocksNoMaps", [](Scenario& s) {
    s.lengths = {17, 17}, s.maps = Maps::kNone, s.statistics = false;
  });
  // Larger: BERT-base widths, and enough sequences to run in several chunks.
  add("BertBasePackedRaggedCausal", [](Scenario& s) {
    s.d_model = 768, s.num_heads = 12, s.lengths = {33, 16}, s.packed = true, s.causal = true;
    s.maps = Maps::kMeanOverHeads;
  });
  // 12 * 256 * 256 scores per sequence: chunks of 5 sequences, then 2.
  add("RaggedCausalInChunks", [](Scenario& s) {
    s.d_model = 48, s.num_heads = 12, s.lengths = {256, 200, 256, 13, 256, 100, 256};
    s.packed = true, s.causal = true, s.maps = Maps::kNone;
  });
  return all;
}

INSTANTIATE_TEST_SUITE_P(Modes, AttentionLayerScenarios, ::testing::ValuesIn(Scenarios()),
                         [](const ::testing::TestParamInfo<Scenario>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------
// Uniform shapes (bidirectional, no mask: the mask-free primitives).

struct ShapeCase {
  std::string name;
  int64_t batch;
  int64_t seq_len;
  int64_t d_model;
  int64_t num_heads;
  int64_t num_kv_heads;  // 0: num_heads
  int64_t head_dim;      // 0: d_model / num_heads
};

void PrintTo(const ShapeCase& c, std::ostream* os) { *os << c.name; }

// Runs `layer` in every map mode on `hidden` ([batch, seq_len, d_model]: a
// padded layout with full lengths) and checks each result against the
// reference, and the mean maps against the mean of the per-head maps.
void ExpectAllMapModesMatch(AttentionLayer& layer, const AttentionWeights& weights,
                            const std::vector<float>& hidden, int64_t batch, int64_t seq_len) {
  const HeadConfig& config = layer.config();
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = Padded(batch, seq_len);
  const ReferenceResult reference = ReferenceLayer(config, weights, inputs);
  Buffers per_head;
  for (AttentionMapMode mode : {Maps::kNone, Maps::kPerHead, Maps::kMeanOverHeads}) {
    SCOPED_TRACE(absl::StrCat("map mode ", static_cast<int>(mode)));
    ForwardOptions options;
    options.maps.mode = mode;
    Buffers buffers;
    const absl::StatusOr<ForwardInfo> info = RunLayer(layer, inputs, options, buffers);
    ASSERT_THAT(info, IsOk());
    // Without maps kAuto runs the blocked path.
    EXPECT_EQ(info->kernel_path, mode == Maps::kNone ? "fp32/blocked" : "fp32/materialized");
    ExpectMatches(config, inputs, options, buffers, reference, kFp32Tolerance);
    if (mode == Maps::kNone) {
      options.attention_path = AttentionPath::kMaterialized;
      Buffers materialized;
      const absl::StatusOr<ForwardInfo> forced = RunLayer(layer, inputs, options, materialized);
      ASSERT_THAT(forced, IsOk());
      EXPECT_EQ(forced->kernel_path, "fp32/materialized");
      ExpectMatches(config, inputs, options, materialized, reference, kFp32Tolerance);
    }
    if (mode != Maps::kNone) {
      EXPECT_LE(MaxRowSumError(buffers.maps, seq_len), 1e-5);
    }
    if (mode == Maps::kPerHead) per_head = buffers;
    if (mode == Maps::kMeanOverHeads) {
      const int64_t s2 = seq_len * seq_len;
      std::vector<double> mean_of_heads(buffers.maps.size(), 0.0);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < config.num_heads; ++h) {
          for (int64_t e = 0; e < s2; ++e) {
            mean_of_heads[b * s2 + e] += per_head.maps[(b * config.num_heads + h) * s2 + e] /
                                         static_cast<double>(config.num_heads);
          }
        }
      }
      EXPECT_LE(RelativeFrobeniusError(buffers.maps, mean_of_heads), 1e-6);
    }
  }
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
  const std::vector<float> hidden =
      RandomNormal(static_cast<size_t>(c.batch * c.seq_len * c.d_model), rng);
  ExpectAllMapModesMatch(**layer, weights, hidden, c.batch, c.seq_len);
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
  const std::vector<float> hidden =
      RandomNormal(static_cast<size_t>(c.batch * c.seq_len * c.d_model), rng);
  ExpectAllMapModesMatch(**layer, weights, hidden, c.batch, c.seq_len);
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
                             ShapeCase{"MultiQueryFourHeads", 2, 11, 32, 4, 1, 8},
                             ShapeCase{"GroupedEightHeadsTwoKv", 2, 13, 64, 8, 2, 8},
                             ShapeCase{"BertBaseBatch2Seq64", 2, 64, 768, 12, 0, 0},
                             // 8 * 300 * 300 scores per sequence: chunks of 5, then 1.
                             ShapeCase{"GroupedHeadsRunInChunks", 6, 300, 16, 8, 2, 2}),
                         [](const ::testing::TestParamInfo<ShapeCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------
// Properties.

// A small layer with random weights for the tests below.
struct SmallLayer {
  HeadConfig config;
  AttentionWeights weights;
  std::unique_ptr<AttentionLayer> layer;
};

SmallLayer MakeSmallLayer(std::mt19937_64& rng, int64_t num_kv_heads = 0, int64_t rotary_dim = 0,
                          int64_t head_dim = 0) {
  SmallLayer small;
  small.config = MakeConfig(32, 4, num_kv_heads, head_dim, rotary_dim);
  small.weights = RandomWeights(small.config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
      AttentionLayer::Create(small.config, small.weights);
  EXPECT_THAT(layer, IsOk());
  if (layer.ok()) small.layer = *std::move(layer);
  return small;
}

TEST(AttentionLayer, RaggedPaddedAndPackedEqualEachSequenceSentAlone) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2, 4, 8);
  ASSERT_NE(small.layer, nullptr);
  const std::vector<int64_t> lengths = {5, 1, 8, 3};
  const std::vector<int64_t> offsets = {3, 0, 17, 2};
  for (const bool causal : {false, true}) {
    for (const SequenceLayout& layout : {Padded(4, 9, lengths), Packed(lengths)}) {
      SCOPED_TRACE(
          absl::StrCat(layout.is_padded() ? "padded" : "packed", causal ? ", causal" : ""));
      const std::vector<float> hidden = RandomStates(layout, 32, rng);
      LayerInputs inputs;
      inputs.hidden_states = hidden;
      inputs.layout = layout;
      inputs.causal = causal;
      inputs.position_offsets = offsets;
      ForwardOptions options;
      options.head_statistics = true;
      Buffers together;
      ASSERT_THAT(RunLayer(*small.layer, inputs, options, together), IsOk());
      for (int64_t b = 0; b < layout.batch(); ++b) {
        SCOPED_TRACE(absl::StrCat("sequence ", b));
        const std::vector<float> rows = SequenceRows(hidden, layout, b, 32);
        LayerInputs alone;
        alone.hidden_states = rows;
        alone.layout = Packed({lengths[b]});
        alone.causal = causal;
        alone.position_offsets = absl::MakeConstSpan(&offsets[b], 1);
        Buffers single;
        ASSERT_THAT(RunLayer(*small.layer, alone, options, single), IsOk());
        const std::vector<float> expected = SequenceRows(together.output, layout, b, 32);
        EXPECT_LE(RelativeFrobeniusError(single.output,
                                         std::vector<double>(expected.begin(), expected.end())),
                  kFp32Tolerance);
        for (int64_t h = 0; h < 4; ++h) {
          EXPECT_NEAR(single.entropy[h], together.entropy[b * 4 + h], 1e-5);
          EXPECT_NEAR(single.contribution[h], together.contribution[b * 4 + h],
                      1e-5 * (1.0 + std::abs(single.contribution[h])));
        }
      }
    }
  }
}

TEST(AttentionLayer, PaddingValuesNeverInfluenceResults) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout queries = Padded(3, 7, {7, 2, 5});
  const SequenceLayout context = Padded(3, 6, {1, 6, 4});
  const std::vector<float> hidden_nan = RandomStates(queries, 32, rng, kNaN);
  const std::vector<float> context_nan = RandomStates(context, 32, rng, kNaN);
  auto with_padding = [](std::vector<float> values, const std::vector<float>& like, float fill) {
    for (size_t i = 0; i < values.size(); ++i) {
      if (std::isnan(like[i])) values[i] = fill;
    }
    return values;
  };
  for (const bool cross : {false, true}) {
    SCOPED_TRACE(cross ? "cross-attention" : "self-attention");
    ForwardOptions options;
    options.maps.mode = Maps::kPerHead;
    options.head_statistics = true;
    std::vector<Buffers> results;
    for (const float fill : {kNaN, 1e30f, 0.0f}) {
      const std::vector<float> hidden = with_padding(hidden_nan, hidden_nan, fill);
      const std::vector<float> ctx = with_padding(context_nan, context_nan, fill);
      LayerInputs inputs;
      inputs.hidden_states = hidden;
      inputs.layout = queries;
      inputs.causal = true;
      if (cross) {
        inputs.context = ctx;
        inputs.context_layout = context;
      }
      Buffers buffers;
      ASSERT_THAT(RunLayer(*small.layer, inputs, options, buffers), IsOk());
      results.push_back(std::move(buffers));
    }
    ExpectFiniteAndIdentical(results);
  }
}

TEST(AttentionLayer, FullyMaskedRowsGetZeroWeightsAndNoNaN) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout layout = Padded(2, 5, {5, 4});
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  for (const Kind kind : {Kind::kAllowed, Kind::kAdditive}) {
    SCOPED_TRACE(kind == Kind::kAllowed ? "allowed" : "additive");
    const float forbid = kind == Kind::kAllowed ? 0.0f : -kInf;
    const float allow = kind == Kind::kAllowed ? 1.0f : 0.5f;
    std::vector<float> mask(2 * 5 * 5, allow);
    for (int64_t j = 0; j < 5; ++j) {
      mask[(0 * 5 + 2) * 5 + j] = forbid;  // sequence 0, query 2: nothing
      mask[(1 * 5 + 0) * 5 + j] = forbid;  // sequence 1, query 0: nothing
    }
    // Sequence 1, query 3 may only see key 4, past its length: nothing either.
    for (int64_t j = 0; j < 4; ++j) mask[(1 * 5 + 3) * 5 + j] = forbid;
    LayerInputs inputs;
    inputs.hidden_states = hidden;
    inputs.layout = layout;
    inputs.mask = ExplicitMask{kind, mask, 2, 5, 5};
    for (const bool causal : {false, true}) {
      inputs.causal = causal;
      ForwardOptions options;
      options.maps.mode = Maps::kPerHead;
      options.head_statistics = true;
      Buffers buffers;
      ASSERT_THAT(RunLayer(*small.layer, inputs, options, buffers), IsOk());
      for (float v : buffers.output) ASSERT_FALSE(std::isnan(v));
      for (float v : buffers.maps) ASSERT_FALSE(std::isnan(v));
      for (int64_t h = 0; h < 4; ++h) {
        for (const auto& [b, i] : {std::pair<int64_t, int64_t>{0, 2}, {1, 0}, {1, 3}}) {
          for (int64_t j = 0; j < 5; ++j) {
            EXPECT_EQ(buffers.maps[(((b * 4 + h) * 5) + i) * 5 + j], 0.0f);
          }
        }
      }
      // The heads add nothing for those rows: the output is the bias.
      for (int64_t e = 0; e < 32; ++e) {
        EXPECT_FLOAT_EQ(buffers.output[2 * 32 + e], small.weights.b_o[e]);
        EXPECT_FLOAT_EQ(buffers.output[5 * 32 + e], small.weights.b_o[e]);
      }
      const ReferenceResult reference = ReferenceLayer(small.config, small.weights, inputs);
      ExpectMatches(small.config, inputs, options, buffers, reference, kFp32Tolerance);
    }
  }
}

TEST(AttentionLayer, HeadMaskZeroRemovesTheHead) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  const int64_t hd = small.config.head_dim;
  // The same layer with head 1's rows of W^O zeroed.
  AttentionWeights pruned = small.weights;
  std::fill(pruned.w_o.begin() + 1 * hd * 32, pruned.w_o.begin() + 2 * hd * 32, 0.0f);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> pruned_layer =
      AttentionLayer::Create(small.config, pruned);
  ASSERT_THAT(pruned_layer, IsOk());

  const SequenceLayout layout = Packed({6, 3});
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  const std::vector<float> head_mask = {1.0f, 0.0f, 1.0f, 1.0f};
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = layout;
  inputs.causal = true;
  inputs.head_mask = head_mask;
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  options.head_statistics = true;
  Buffers masked;
  ASSERT_THAT(RunLayer(*small.layer, inputs, options, masked), IsOk());

  LayerInputs unmasked = inputs;
  unmasked.head_mask = {};
  Buffers expected;
  ASSERT_THAT(RunLayer(**pruned_layer, unmasked, options, expected), IsOk());
  EXPECT_LE(RelativeFrobeniusError(
                masked.output, std::vector<double>(expected.output.begin(), expected.output.end())),
            kFp32Tolerance);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t e = 0; e < 6 * 6; ++e) EXPECT_EQ(masked.maps[(b * 4 + 1) * 36 + e], 0.0f);
    EXPECT_EQ(masked.entropy[b * 4 + 1], 0.0f);
    EXPECT_EQ(masked.max_weight[b * 4 + 1], 0.0f);
    EXPECT_EQ(masked.contribution[b * 4 + 1], 0.0f);
    EXPECT_GT(masked.contribution[b * 4 + 0], 0.0f);
  }
}

TEST(AttentionLayer, MapSubsetsAreSlicesOfTheFullMaps) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 1);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout queries = Packed({4, 7, 2});
  const SequenceLayout keys = Padded(3, 6, {6, 2, 5});
  const std::vector<float> hidden = RandomStates(queries, 32, rng);
  const std::vector<float> context = RandomStates(keys, 32, rng);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = queries;
  inputs.context = context;
  inputs.context_layout = keys;
  inputs.causal = true;
  const int64_t s = 7;
  const int64_t t = 6;

  ForwardOptions full_options;
  full_options.maps.mode = Maps::kPerHead;
  Buffers full;
  ASSERT_THAT(RunLayer(*small.layer, inputs, full_options, full), IsOk());
  full_options.maps.mode = Maps::kMeanOverHeads;
  Buffers full_mean;
  ASSERT_THAT(RunLayer(*small.layer, inputs, full_options, full_mean), IsOk());

  const std::vector<int64_t> heads = {2, 0, 2};
  const std::vector<int64_t> rows = {6, 1, 3};
  ForwardOptions options;
  options.maps = {Maps::kPerHead, heads, rows};
  Buffers subset;
  ASSERT_THAT(RunLayer(*small.layer, inputs, options, subset), IsOk());
  ASSERT_EQ(subset.maps.size(), 3u * heads.size() * rows.size() * t);
  for (int64_t b = 0; b < 3; ++b) {
    for (size_t sh = 0; sh < heads.size(); ++sh) {
      for (size_t r = 0; r < rows.size(); ++r) {
        for (int64_t j = 0; j < t; ++j) {
          EXPECT_FLOAT_EQ(subset.maps[((b * 3 + sh) * 3 + r) * t + j],
                          full.maps[((b * 4 + heads[sh]) * s + rows[r]) * t + j]);
        }
      }
    }
  }
  options.maps = {Maps::kMeanOverHeads, {}, rows};
  ASSERT_THAT(RunLayer(*small.layer, inputs, options, subset), IsOk());
  for (int64_t b = 0; b < 3; ++b) {
    for (size_t r = 0; r < rows.size(); ++r) {
      for (int64_t j = 0; j < t; ++j) {
        EXPECT_FLOAT_EQ(subset.maps[(b * 3 + r) * t + j],
                        full_mean.maps[(b * s + rows[r]) * t + j]);
      }
    }
  }
  // Rows past a sequence's length are 0 (sequence 0 has 4 queries).
  for (int64_t j = 0; j < t; ++j) EXPECT_EQ(subset.maps[(0 * 3 + 0) * t + j], 0.0f);
}

TEST(AttentionLayer, CausalQueriesIgnoreLaterTokens) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2, 8, 8);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout full_layout = Packed({9});
  const std::vector<float> hidden = RandomStates(full_layout, 32, rng);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = full_layout;
  inputs.causal = true;
  Buffers full;
  ASSERT_THAT(RunLayer(*small.layer, inputs, {}, full), IsOk());
  // The first 4 tokens alone give the same first 4 rows.
  const std::vector<float> prefix(hidden.begin(), hidden.begin() + 4 * 32);
  inputs.hidden_states = prefix;
  inputs.layout = Packed({4});
  Buffers short_run;
  ASSERT_THAT(RunLayer(*small.layer, inputs, {}, short_run), IsOk());
  EXPECT_LE(
      RelativeFrobeniusError(
          short_run.output, std::vector<double>(full.output.begin(), full.output.begin() + 4 * 32)),
      kFp32Tolerance);
}

TEST(AttentionLayer, RopeDependsOnlyOnRelativePositionsInSelfAttention) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 0, 8, 8);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout layout = Packed({6});
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = layout;
  Buffers at_zero, shifted;
  ASSERT_THAT(RunLayer(*small.layer, inputs, {}, at_zero), IsOk());
  const int64_t offset = 37;
  inputs.position_offsets = absl::MakeConstSpan(&offset, 1);
  ASSERT_THAT(RunLayer(*small.layer, inputs, {}, shifted), IsOk());
  EXPECT_LE(RelativeFrobeniusError(
                shifted.output, std::vector<double>(at_zero.output.begin(), at_zero.output.end())),
            kFp32Tolerance);
  // ...and RoPE does change the result against a layer without it.
  HeadConfig plain = small.config;
  plain.rotary.rotary_dim = 0;
  absl::StatusOr<std::unique_ptr<AttentionLayer>> no_rope =
      AttentionLayer::Create(plain, small.weights);
  ASSERT_THAT(no_rope, IsOk());
  Buffers without;
  inputs.position_offsets = {};  // a layer without RoPE takes none
  ASSERT_THAT(RunLayer(**no_rope, inputs, {}, without), IsOk());
  EXPECT_GT(RelativeFrobeniusError(
                without.output, std::vector<double>(at_zero.output.begin(), at_zero.output.end())),
            1e-3);
}

TEST(AttentionLayer, CrossAttentionRotatesKeysFromPositionZero) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 0, 8, 8);
  ASSERT_NE(small.layer, nullptr);
  // The context is the query sequence itself: with the queries at offset 0
  // this is self-attention, with another offset it is not.
  const SequenceLayout layout = Packed({5});
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  LayerInputs self;
  self.hidden_states = hidden;
  self.layout = layout;
  LayerInputs cross = self;
  cross.context = hidden;
  cross.context_layout = layout;
  Buffers self_out, cross_out;
  ASSERT_THAT(RunLayer(*small.layer, self, {}, self_out), IsOk());
  ASSERT_THAT(RunLayer(*small.layer, cross, {}, cross_out), IsOk());
  EXPECT_LE(RelativeFrobeniusError(cross_out.output, std::vector<double>(self_out.output.begin(),
                                                                         self_out.output.end())),
            kFp32Tolerance);
  const int64_t offset = 3;
  cross.position_offsets = absl::MakeConstSpan(&offset, 1);
  ASSERT_THAT(RunLayer(*small.layer, cross, {}, cross_out), IsOk());
  const ReferenceResult reference = ReferenceLayer(small.config, small.weights, cross);
  EXPECT_LE(RelativeFrobeniusError(cross_out.output, reference.output), kFp32Tolerance);
  EXPECT_GT(RelativeFrobeniusError(cross_out.output, std::vector<double>(self_out.output.begin(),
                                                                         self_out.output.end())),
            1e-4);
}

// ---------------------------------------------------------------------------
// Cross-attention on a context of another width (context_dim != d_model).

// A layer with d_model 32, 4 heads (2 key/value heads) and a context
// `context_dim` wide, random weights.
SmallLayer MakeContextLayer(std::mt19937_64& rng, int64_t context_dim, int64_t rotary_dim = 0) {
  SmallLayer small;
  small.config = MakeConfig(32, 4, 2, 8, rotary_dim, context_dim);
  small.weights = RandomWeights(small.config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
      AttentionLayer::Create(small.config, small.weights);
  EXPECT_THAT(layer, IsOk());
  if (layer.ok()) small.layer = *std::move(layer);
  return small;
}

TEST(AttentionLayer, ContextDimIsResolvedAndShapesTheKeyValueWeights) {
  const HeadConfig config = MakeConfig(32, 4, 2, 8, 0, 20);
  EXPECT_EQ(config.context_dim, 20);
  EXPECT_EQ(MakeConfig(32, 4, 2, 8).context_dim, 32);  // 0: d_model
  const AttentionWeights weights = SeededWeights(config, 3);
  EXPECT_EQ(weights.w_q.size(), 32u * 32u);
  EXPECT_EQ(weights.w_k.size(), 20u * 16u);
  EXPECT_EQ(weights.w_v.size(), 20u * 16u);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer = AttentionLayer::Create(config, weights);
  ASSERT_THAT(layer, IsOk());
  EXPECT_EQ((*layer)->config().context_dim, 20);
}

TEST(AttentionLayer, RaggedContextOfAnotherWidthEqualsEachSequenceSentAlone) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  constexpr int64_t kContextDim = 20;
  SmallLayer small = MakeContextLayer(rng, kContextDim, /*rotary_dim=*/4);
  ASSERT_NE(small.layer, nullptr);
  const std::vector<int64_t> lengths = {5, 1, 8};
  const std::vector<int64_t> context_lengths = {3, 9, 1};
  const std::vector<int64_t> offsets = {2, 0, 11};
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    if (precision == Precision::kBf16 && !::attnserve::testing::Bf16CasesRun()) continue;
    for (const bool packed : {false, true}) {
      SCOPED_TRACE(absl::StrCat(PrecisionName(precision), packed ? ", packed" : ", padded"));
      const SequenceLayout queries = packed ? Packed(lengths) : Padded(3, 9, lengths);
      const SequenceLayout keys = packed ? Packed(context_lengths) : Padded(3, 10, context_lengths);
      const std::vector<float> hidden = RandomStates(queries, 32, rng);
      const std::vector<float> context = RandomStates(keys, kContextDim, rng);
      LayerInputs inputs;
      inputs.hidden_states = hidden;
      inputs.layout = queries;
      inputs.context = context;
      inputs.context_layout = keys;
      inputs.causal = true;
      inputs.position_offsets = offsets;
      ForwardOptions options;
      options.head_statistics = true;
      options.precision = precision;
      const double tolerance = precision == Precision::kFp32 ? kFp32Tolerance : kBf16Tolerance;
      Buffers together;
      ASSERT_THAT(RunLayer(*small.layer, inputs, options, together), IsOk());
      ExpectMatches(small.config, inputs, options, together,
                    ReferenceLayer(small.config, small.weights, inputs), tolerance);
      for (int64_t b = 0; b < queries.batch(); ++b) {
        SCOPED_TRACE(absl::StrCat("sequence ", b));
        const std::vector<float> rows = SequenceRows(hidden, queries, b, 32);
        const std::vector<float> context_rows = SequenceRows(context, keys, b, kContextDim);
        LayerInputs alone;
        alone.hidden_states = rows;
        alone.layout = Packed({lengths[b]});
        alone.context = context_rows;
        alone.context_layout = Packed({context_lengths[b]});
        alone.causal = true;
        alone.position_offsets = absl::MakeConstSpan(&offsets[b], 1);
        Buffers single;
        ASSERT_THAT(RunLayer(*small.layer, alone, options, single), IsOk());
        const std::vector<float> expected = SequenceRows(together.output, queries, b, 32);
        EXPECT_LE(RelativeFrobeniusError(single.output,
                                         std::vector<double>(expected.begin(), expected.end())),
                  tolerance);
        for (int64_t h = 0; h < 4; ++h) {
          EXPECT_NEAR(single.entropy[h], together.entropy[b * 4 + h], tolerance);
        }
      }
    }
  }
}

TEST(AttentionLayer, ContextPaddingOfAnotherWidthNeverInfluencesResults) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  constexpr int64_t kContextDim = 12;
  SmallLayer small = MakeContextLayer(rng, kContextDim);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout queries = Padded(3, 7, {7, 2, 5});
  const SequenceLayout keys = Padded(3, 6, {1, 6, 4});
  const std::vector<float> hidden = RandomStates(queries, 32, rng, 0.0f);
  const std::vector<float> context_nan = RandomStates(keys, kContextDim, rng, kNaN);
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  options.head_statistics = true;
  std::vector<Buffers> results;
  for (const float fill : {kNaN, 1e30f, 0.0f}) {
    std::vector<float> context = context_nan;
    for (float& v : context) {
      if (std::isnan(v)) v = fill;
    }
    LayerInputs inputs;
    inputs.hidden_states = hidden;
    inputs.layout = queries;
    inputs.context = context;
    inputs.context_layout = keys;
    Buffers buffers;
    ASSERT_THAT(RunLayer(*small.layer, inputs, options, buffers), IsOk());
    results.push_back(std::move(buffers));
  }
  ExpectFiniteAndIdentical(results);
}

// The separate-weights path (context_dim != d_model) against the fused one:
// a context widened by columns of zeros, with any weights for them, is the
// same attention as the d_model-wide context on the fused layer.
TEST(AttentionLayer, ZeroContextColumnsMakeTheSeparateWeightsPathEqualTheFusedOne) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  constexpr int64_t kExtra = 9;
  constexpr int64_t kWide = 32 + kExtra;
  SmallLayer fused = MakeSmallLayer(rng, 2);
  ASSERT_NE(fused.layer, nullptr);
  HeadConfig wide_config = fused.config;
  wide_config.context_dim = kWide;
  AttentionWeights wide_weights = fused.weights;
  const int64_t kv = fused.config.kv_width();
  for (std::vector<float>* w : {&wide_weights.w_k, &wide_weights.w_v}) {
    const std::vector<float> extra_rows = RandomNormal(static_cast<size_t>(kExtra * kv), rng);
    w->insert(w->end(), extra_rows.begin(), extra_rows.end());  // rows d_model.. of [kWide, kv]
  }
  absl::StatusOr<std::unique_ptr<AttentionLayer>> wide =
      AttentionLayer::Create(wide_config, wide_weights);
  ASSERT_THAT(wide, IsOk());

  const SequenceLayout queries = Packed({4, 6});
  const SequenceLayout keys = Padded(2, 7, {7, 3});
  const std::vector<float> hidden = RandomStates(queries, 32, rng);
  const std::vector<float> context = RandomStates(keys, 32, rng);
  std::vector<float> wide_context(static_cast<size_t>(keys.rows() * kWide), 0.0f);
  for (int64_t r = 0; r < keys.rows(); ++r) {
    std::copy_n(context.begin() + r * 32, 32, wide_context.begin() + r * kWide);
  }
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    if (precision == Precision::kBf16 && !::attnserve::testing::Bf16CasesRun()) continue;
    SCOPED_TRACE(PrecisionName(precision));
    LayerInputs inputs;
    inputs.hidden_states = hidden;
    inputs.layout = queries;
    inputs.context = context;
    inputs.context_layout = keys;
    ForwardOptions options;
    options.maps.mode = Maps::kPerHead;
    options.precision = precision;
    Buffers expected, actual;
    ASSERT_THAT(RunLayer(*fused.layer, inputs, options, expected), IsOk());
    inputs.context = wide_context;
    ASSERT_THAT(RunLayer(**wide, inputs, options, actual), IsOk());
    // The same products summed in another order: rounding apart.
    const double tolerance = precision == Precision::kFp32 ? kFp32Tolerance : kBf16Tolerance;
    EXPECT_LE(RelativeFrobeniusError(actual.output, std::vector<double>(expected.output.begin(),
                                                                        expected.output.end())),
              tolerance);
    EXPECT_LE(RelativeFrobeniusError(
                  actual.maps, std::vector<double>(expected.maps.begin(), expected.maps.end())),
              tolerance);
  }
}

TEST(AttentionLayer, ContextOfAnotherWidthIsInvalidArgumentWhereItDoesNotFit) {
  std::mt19937_64 rng(5);
  SmallLayer small = MakeContextLayer(rng, 24);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout layout = Padded(2, 3, {3, 2});
  const SequenceLayout keys = Packed({4, 1});
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  const std::vector<float> context_d_model = RandomStates(keys, 32, rng);
  const std::vector<float> context = RandomStates(keys, 24, rng);
  std::vector<float> output(hidden.size());
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = layout;
  // Self-attention would project hidden_states (d_model wide) with W_k
  // [context_dim, ...].
  EXPECT_THAT(small.layer->Forward(inputs, {}, OutputOnly(output)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "context: a layer with context_dim 24 needs context states (self-attention "
                       "needs context_dim == d_model)"));
  // A context as wide as d_model is not one context_dim wide.
  inputs.context = context_d_model;
  inputs.context_layout = keys;
  EXPECT_THAT(small.layer->Forward(inputs, {}, OutputOnly(output)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "context: size 160 does not match [context_layout.rows 5, context_dim 24]"));
  inputs.context = context;
  EXPECT_THAT(small.layer->Forward(inputs, {}, OutputOnly(output)), IsOk());
  // A context given without its layout is still that error first.
  inputs.context_layout.reset();
  EXPECT_THAT(small.layer->Forward(inputs, {}, OutputOnly(output)),
              StatusIs(absl::StatusCode::kInvalidArgument, "context_layout: required"));
}

TEST(AttentionLayer, CreateRejectsKeyValueWeightsOfTheWrongWidth) {
  const HeadConfig config = MakeConfig(32, 4, 2, 8, 0, 24);
  // Weights made for d_model-wide keys and values.
  const AttentionWeights d_model_wide = SeededWeights(MakeConfig(32, 4, 2, 8), 1);
  EXPECT_THAT(AttentionLayer::Create(config, d_model_wide),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "w_k: size 512 does not match the expected [24, 16] = 384"));
  AttentionWeights weights = SeededWeights(config, 1);
  weights.w_v.resize(32 * 16);
  EXPECT_THAT(AttentionLayer::Create(config, weights),
              StatusIs(absl::StatusCode::kInvalidArgument, "w_v: size 512"));
  HeadConfig bad = config;
  for (const int64_t context_dim : {int64_t{-1}, kMaxDModel + 1}) {
    bad.context_dim = context_dim;
    EXPECT_THAT(AttentionLayer::Create(bad, SeededWeights(config, 1)),
                StatusIs(absl::StatusCode::kInvalidArgument, "head_config.context_dim"));
  }
}

// A BF16 request runs in BF16 where the machine has AVX512-BF16 and no ISA
// cap (read from /proc/cpuinfo and the environment, apart from the core),
// else in FP32 with FP32's accuracy, and says which. The CTest
// attention_layer_test.Bf16FallbackWithoutCpuSupport runs this test alone
// under ONEDNN_MAX_CPU_ISA=AVX2 and requires the line it prints.
TEST(AttentionLayer, Bf16AsksRunBf16WhereSupportedAndFp32Elsewhere) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout layout = Packed({7, 4});
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = layout;
  inputs.causal = true;
  ForwardOptions options;
  options.precision = Precision::kBf16;
  Buffers buffers;
  const absl::StatusOr<ForwardInfo> info = RunLayer(*small.layer, inputs, options, buffers);
  ASSERT_THAT(info, IsOk());
  const ReferenceResult reference = ReferenceLayer(small.config, small.weights, inputs);
  const bool bf16 = ::attnserve::testing::MachineRunsBf16();
  EXPECT_EQ(Bf16Supported(), bf16);
  if (bf16) {
    EXPECT_EQ(info->precision, Precision::kBf16);
    EXPECT_EQ(info->kernel_path, "bf16/blocked");
    const double error = RelativeFrobeniusError(buffers.output, reference.output);
    EXPECT_LE(error, kBf16Tolerance);
    EXPECT_GT(error, 1e-6) << "BF16 should not be as exact as FP32";
  } else {
    EXPECT_EQ(info->precision, Precision::kFp32);
    EXPECT_EQ(info->kernel_path, "fp32/blocked");
    EXPECT_LE(RelativeFrobeniusError(buffers.output, reference.output), kFp32Tolerance);
  }
  if (!::testing::Test::HasFailure()) {
    std::cout << "A BF16 request ran as " << PrecisionName(info->precision) << " on "
              << info->kernel_path << "\n";
  }
}

TEST(AttentionLayer, BlockedPathAskedWithMapsOrStatisticsIsInvalidArgumentNamingAttentionPath) {
  std::mt19937_64 rng(7);
  SmallLayer small = MakeSmallLayer(rng);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout layout = Padded(2, 5);
  const std::vector<float> hidden = RandomStates(layout, 32, rng);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = layout;
  for (const bool statistics : {false, true}) {
    SCOPED_TRACE(statistics ? "head statistics" : "per-head maps");
    ForwardOptions options;
    options.attention_path = AttentionPath::kBlocked;
    if (statistics) {
      options.head_statistics = true;
    } else {
      options.maps.mode = AttentionMapMode::kPerHead;
    }
    Buffers buffers;
    EXPECT_THAT(RunLayer(*small.layer, inputs, options, buffers),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         "attention_path: the blocked path returns neither maps nor head "
                         "statistics"));
    // The same request on kAuto runs (materialized).
    options.attention_path = AttentionPath::kAuto;
    const absl::StatusOr<ForwardInfo> info = RunLayer(*small.layer, inputs, options, buffers);
    ASSERT_THAT(info, IsOk());
    EXPECT_EQ(info->kernel_path, "fp32/materialized");
  }
}

TEST(AttentionLayer, CachedPrimitivesServeRepeatedAndAlternatingShapes) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  for (const auto& [batch, seq_len] :
       std::vector<std::pair<int64_t, int64_t>>{{2, 9}, {2, 9}, {3, 4}, {2, 9}, {1, 9}, {3, 4}}) {
    SCOPED_TRACE(absl::StrCat("batch ", batch, ", seq_len ", seq_len));
    const std::vector<float> hidden = RandomNormal(static_cast<size_t>(batch * seq_len * 32), rng);
    ExpectAllMapModesMatch(*small.layer, small.weights, hidden, batch, seq_len);
  }
}

TEST(AttentionLayer, LargeScoresStayFiniteAndNormalized) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng);
  ASSERT_NE(small.layer, nullptr);
  // Scores in the thousands: exp() overflows unless the softmax subtracts the max.
  const std::vector<float> hidden = RandomNormal(12 * 32, rng, 300.0);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = Padded(1, 12);
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  Buffers buffers;
  ASSERT_THAT(RunLayer(*small.layer, inputs, options, buffers), IsOk());
  for (float v : buffers.output) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LE(MaxRowSumError(buffers.maps, 12), 1e-5);
}

// A layer holds only its weights (and their BF16 copies and Gram matrices,
// made once): callers on several threads, each with a workspace of its own,
// compute side by side and each gets its own correct result.
TEST(AttentionLayer, ConcurrentCallersWithTheirOwnWorkspacesAreCorrect) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  const SequenceLayout layouts[2] = {Packed({5, 2}), Padded(1, 11)};
  std::vector<float> hidden[2];
  ReferenceResult reference[2];
  LayerInputs inputs[2];
  for (int t = 0; t < 2; ++t) {
    hidden[t] = RandomStates(layouts[t], 32, rng);
    inputs[t].hidden_states = hidden[t];
    inputs[t].layout = layouts[t];
    inputs[t].causal = t == 0;
    reference[t] = ReferenceLayer(small.config, small.weights, inputs[t]);
  }
  double worst[2] = {0.0, 0.0};
  bool all_ok[2] = {true, true};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      ForwardOptions options;
      options.maps.mode = Maps::kMeanOverHeads;
      absl::StatusOr<std::unique_ptr<Workspace>> workspace = Workspace::Create();
      if (!workspace.ok()) {
        all_ok[t] = false;
        return;
      }
      for (int i = 0; i < 20; ++i) {
        Buffers buffers = MakeBuffers(small.config, inputs[t], options);
        if (!small.layer->Forward(inputs[t], options, buffers.Outputs(), workspace->get()).ok()) {
          all_ok[t] = false;
          return;
        }
        worst[t] =
            std::max({worst[t], RelativeFrobeniusError(buffers.output, reference[t].output),
                      RelativeFrobeniusError(
                          buffers.maps, SelectMaps(reference[t], small.config, layouts[t].batch(),
                                                   layouts[t].max_length(), layouts[t].max_length(),
                                                   options.maps))});
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 2; ++t) {
    EXPECT_TRUE(all_ok[t]);
    EXPECT_LE(worst[t], kFp32Tolerance);
  }
}

// A dense [batch, seq_len, d_model] tensor is a padded layout with full
// lengths: its maps are [batch, num_heads, seq_len, seq_len].
TEST(AttentionLayer, DenseBatchIsAPaddedLayoutWithFullLengths) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SmallLayer small = MakeSmallLayer(rng, 2);
  ASSERT_NE(small.layer, nullptr);
  const std::vector<float> hidden = RandomNormal(3 * 5 * 32, rng);
  LayerInputs inputs;
  inputs.hidden_states = hidden;
  inputs.layout = Padded(3, 5);
  const ReferenceResult reference = ReferenceLayer(small.config, small.weights, inputs);
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  std::vector<float> output(hidden.size());
  std::vector<float> maps(static_cast<size_t>(
      *AttentionMapElements(small.config, inputs.layout, inputs.layout, options.maps)));
  ASSERT_EQ(maps.size(), 3u * 4u * 5u * 5u);
  ASSERT_THAT(small.layer->Forward(inputs, options, OutputOnly(output, &maps)), IsOk());
  EXPECT_LE(RelativeFrobeniusError(output, reference.output), kFp32Tolerance);
  EXPECT_LE(RelativeFrobeniusError(maps, reference.per_head_maps), kFp32Tolerance);
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
  config.num_kv_heads = 0;
  config.rotary.rotary_dim = 7;
  EXPECT_THAT(AttentionLayer::Create(config, AttentionWeights{}),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.rotary.rotary_dim"));
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

// ---------------------------------------------------------------------------
// Validation: INVALID_ARGUMENT naming the field.

class AttentionLayerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(1);
    small_ = MakeSmallLayer(rng, 2, 4, 0);
    ASSERT_NE(small_.layer, nullptr);
    hidden_ = RandomStates(layout_, 32, rng);
    context_ = RandomStates(context_layout_, 32, rng);
    inputs_.hidden_states = hidden_;
    inputs_.layout = layout_;
  }

  // Forward with buffers sized for the inputs and options (then `edit`ed).
  absl::StatusOr<ForwardInfo> Forward(const LayerInputs& inputs, const ForwardOptions& options,
                                      const std::function<void(Buffers&)>& edit = nullptr) {
    buffers_ = MakeBuffers(small_.config, inputs, options);
    if (edit) edit(buffers_);
    return small_.layer->Forward(inputs, options, buffers_.Outputs());
  }

  absl::StatusOr<ForwardInfo> ForwardWithOutputSize(size_t output_size) {
    return Forward(inputs_, {}, [output_size](Buffers& b) { b.output.resize(output_size); });
  }

  static constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  SmallLayer small_;
  const SequenceLayout layout_ = Padded(2, 3, {3, 2});
  const SequenceLayout context_layout_ = Packed({4, 1});
  std::vector<float> hidden_, context_;
  LayerInputs inputs_;
  Buffers buffers_;
};

TEST_F(AttentionLayerErrors, WrongHiddenStatesSizeIsInvalidArgument) {
  std::vector<float> short_hidden(hidden_.begin(), hidden_.end() - 1);
  LayerInputs inputs = inputs_;
  inputs.hidden_states = short_hidden;
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "hidden_states"));
}

TEST_F(AttentionLayerErrors, AnEmptyLayoutIsInvalidArgument) {
  LayerInputs inputs;
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "layout"));
}

TEST_F(AttentionLayerErrors, WrongOutputSizeIsInvalidArgument) {
  EXPECT_THAT(ForwardWithOutputSize(hidden_.size() + 1), StatusIs(kInvalid, "output"));
  EXPECT_THAT(ForwardWithOutputSize(0), StatusIs(kInvalid, "output"));
}

TEST_F(AttentionLayerErrors, BadContextIsInvalidArgument) {
  LayerInputs inputs = inputs_;
  inputs.context = context_;
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "context_layout: required"));
  inputs.context_layout = Packed({4, 1, 2});
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "context_layout: batch 3"));
  inputs.context_layout = Packed({4, 2});
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "context: size"));
  inputs.context = {};
  inputs.context_layout = context_layout_;
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "context: size 0"));
  inputs.context = context_;
  EXPECT_THAT(Forward(inputs, {}), IsOk());
}

TEST_F(AttentionLayerErrors, BadMasksAreInvalidArgument) {
  struct Case {
    ExplicitMask::Kind kind;
    int64_t batch_dim, q_dim, kv_dim;
    size_t size;
    float value;
    const char* field;
  };
  for (const Case& c : {
           Case{Kind::kAllowed, 3, 3, 3, 27, 1.0f, "mask.batch_dim"},
           Case{Kind::kAllowed, 2, 2, 3, 12, 1.0f, "mask.q_dim"},
           Case{Kind::kAdditive, 1, 3, 4, 12, 0.0f, "mask.kv_dim"},
           Case{Kind::kAdditive, 2, 3, 3, 17, 0.0f, "mask.values: size 17"},
           Case{Kind::kAdditive, 1, 1, 3, 3, NAN, "mask.values[0]"},
           Case{Kind::kAllowed, 1, 1, 1, 1, NAN, "mask.values[0]"},
           Case{Kind::kAdditive, 1, 1, 1, 1, INFINITY, "mask.values[0]"},
           Case{Kind::kNone, 1, 1, 1, 1, 1.0f, "mask.values"},
           Case{static_cast<Kind>(7), 1, 1, 1, 1, 1.0f, "mask.kind"},
       }) {
    SCOPED_TRACE(c.field);
    const std::vector<float> values(c.size, c.value);
    LayerInputs inputs = inputs_;
    inputs.mask = ExplicitMask{c.kind, values, c.batch_dim, c.q_dim, c.kv_dim};
    EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, c.field));
  }
  // In cross-attention kv_dim is the context's max_length (4), q_dim the queries' (3).
  LayerInputs inputs = inputs_;
  inputs.context = context_;
  inputs.context_layout = context_layout_;
  const std::vector<float> values(2 * 3 * 4, -INFINITY);
  inputs.mask = ExplicitMask{Kind::kAdditive, values, 2, 3, 4};
  EXPECT_THAT(Forward(inputs, {}), IsOk());
  inputs.mask = ExplicitMask{Kind::kAdditive, absl::MakeConstSpan(values).subspan(0, 18), 2, 3, 3};
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "mask.kv_dim"));
}

TEST_F(AttentionLayerErrors, BadHeadMaskIsInvalidArgument) {
  for (const std::vector<float>& head_mask :
       {std::vector<float>{1, 1, 1}, std::vector<float>{1, 1, 1, 1, 1},
        std::vector<float>{1, NAN, 1, 1}, std::vector<float>{1, 1, -0.5f, 1}}) {
    LayerInputs inputs = inputs_;
    inputs.head_mask = head_mask;
    EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "head_mask"));
  }
}

TEST_F(AttentionLayerErrors, BadPositionOffsetsAreInvalidArgument) {
  LayerInputs inputs = inputs_;
  const std::vector<int64_t> one = {3};
  inputs.position_offsets = one;
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "position_offsets"));
  const std::vector<int64_t> negative = {3, -1};
  inputs.position_offsets = negative;
  EXPECT_THAT(Forward(inputs, {}), StatusIs(kInvalid, "position_offsets[1]"));
}

TEST_F(AttentionLayerErrors, BadMapSelectionsAreInvalidArgument) {
  ForwardOptions options;
  options.maps = {Maps::kPerHead, {0, 4}, {}};
  EXPECT_THAT(Forward(inputs_, options), StatusIs(kInvalid, "maps.heads[1]"));
  options.maps = {Maps::kPerHead, {-1}, {}};
  EXPECT_THAT(Forward(inputs_, options), StatusIs(kInvalid, "maps.heads[0]"));
  options.maps = {Maps::kPerHead, {}, {2, 3}};
  EXPECT_THAT(Forward(inputs_, options), StatusIs(kInvalid, "maps.query_rows[1]"));
  options.maps = {Maps::kMeanOverHeads, {1}, {}};
  EXPECT_THAT(Forward(inputs_, options), StatusIs(kInvalid, "maps.heads"));
  options.maps = {Maps::kNone, {}, {0}};
  EXPECT_THAT(Forward(inputs_, options), StatusIs(kInvalid, "maps.query_rows"));
  options.maps = {static_cast<Maps>(9), {}, {}};
  EXPECT_THAT(Forward(inputs_, options, [](Buffers& b) { b.maps.clear(); }),
              StatusIs(kInvalid, "maps.mode"));
}

TEST_F(AttentionLayerErrors, UnknownPrecisionIsInvalidArgument) {
  ForwardOptions options;
  options.precision = static_cast<Precision>(3);
  EXPECT_THAT(Forward(inputs_, options), StatusIs(kInvalid, "precision"));
}

TEST_F(AttentionLayerErrors, WrongAttentionMapsSizeIsInvalidArgument) {
  ForwardOptions per_head;
  per_head.maps.mode = Maps::kPerHead;
  ForwardOptions mean;
  mean.maps.mode = Maps::kMeanOverHeads;
  const size_t per_head_size = 2 * 4 * 3 * 3;
  const size_t mean_size = 2 * 3 * 3;
  auto sized = [](size_t n) { return [n](Buffers& b) { b.maps.resize(n); }; };
  EXPECT_THAT(Forward(inputs_, per_head, sized(mean_size)), StatusIs(kInvalid, "attention_maps"));
  EXPECT_THAT(Forward(inputs_, mean, sized(per_head_size)), StatusIs(kInvalid, "attention_maps"));
  EXPECT_THAT(Forward(inputs_, per_head, sized(0)), StatusIs(kInvalid, "attention_maps"));
  // No maps asked for: the span must be empty.
  EXPECT_THAT(Forward(inputs_, {}, sized(mean_size)), StatusIs(kInvalid, "attention_maps"));
  EXPECT_THAT(Forward(inputs_, per_head, sized(per_head_size)), IsOk());
  EXPECT_THAT(Forward(inputs_, mean, sized(mean_size)), IsOk());
}

TEST_F(AttentionLayerErrors, WrongStatisticsSizesAreInvalidArgument) {
  ForwardOptions stats;
  stats.head_statistics = true;
  EXPECT_THAT(Forward(inputs_, stats, [](Buffers& b) { b.entropy.pop_back(); }),
              StatusIs(kInvalid, "head_entropy"));
  EXPECT_THAT(Forward(inputs_, stats, [](Buffers& b) { b.max_weight.clear(); }),
              StatusIs(kInvalid, "head_max_weight"));
  EXPECT_THAT(Forward(inputs_, stats, [](Buffers& b) { b.contribution.push_back(0); }),
              StatusIs(kInvalid, "head_contribution"));
  // Not asked for: the spans must be empty.
  EXPECT_THAT(Forward(inputs_, {}, [](Buffers& b) { b.entropy.resize(8); }),
              StatusIs(kInvalid, "head_entropy"));
  EXPECT_THAT(Forward(inputs_, stats), IsOk());
}

TEST_F(AttentionLayerErrors, EmptyShapesAreInvalidArgument) {
  // No layout with an empty batch or empty sequences can be made...
  EXPECT_THAT(SequenceLayout::Padded(0, 3), StatusIs(kInvalid, "batch"));
  EXPECT_THAT(SequenceLayout::Padded(2, 0), StatusIs(kInvalid, "padded_len"));
  EXPECT_THAT(SequenceLayout::Padded(-1, -3), StatusIs(kInvalid, "batch"));
  EXPECT_THAT(SequenceLayout::Packed({}), StatusIs(kInvalid, ""));
  // ...and the layer rejects the default (empty) one and empty states.
  std::vector<float> output;
  LayerInputs inputs;
  EXPECT_THAT(small_.layer->Forward(inputs, {}, OutputOnly(output)), StatusIs(kInvalid, "layout"));
  inputs.layout = Padded(2, 3);
  EXPECT_THAT(small_.layer->Forward(inputs, {}, OutputOnly(output)),
              StatusIs(kInvalid, "hidden_states"));
}

TEST_F(AttentionLayerErrors, OverflowingShapesAreInvalidArgument) {
  // 2^59 rows fit int64; rows * d_model (32) does not.
  std::vector<float> output(hidden_.size());
  LayerInputs inputs;
  inputs.hidden_states = hidden_;
  inputs.layout = Padded(1, int64_t{1} << 59);
  EXPECT_THAT(small_.layer->Forward(inputs, {}, OutputOnly(output)),
              StatusIs(kInvalid,
                       "hidden_states: [layout.rows 576460752303423488, d_model 32] "
                       "overflows int64"));
  // hidden_states fits int64 but does not match.
  ForwardOptions options;
  options.maps.mode = Maps::kPerHead;
  inputs.layout = Padded(1, int64_t{1} << 31);
  EXPECT_THAT(small_.layer->Forward(inputs, options, OutputOnly(output)),
              StatusIs(kInvalid, "hidden_states"));
}

TEST_F(AttentionLayerErrors, ShouldStopBeforeTheFirstStageIsCancelled) {
  int polls = 0;
  ForwardOptions options;
  options.should_stop = [&polls] {
    ++polls;
    return true;
  };
  EXPECT_THAT(Forward(inputs_, options), StatusIs(absl::StatusCode::kCancelled, ""));
  EXPECT_EQ(polls, 1);
}

TEST_F(AttentionLayerErrors, ShouldStopIsPolledBetweenStagesAndLaterStopsAreCancelled) {
  // Count the polls of a full run, then stop at each of them in turn.
  int total_polls = 0;
  ForwardOptions options;
  options.should_stop = [&total_polls] {
    ++total_polls;
    return false;
  };
  ASSERT_THAT(Forward(inputs_, options), IsOk());
  EXPECT_GE(total_polls, 3);
  for (int stop_at = 1; stop_at <= total_polls; ++stop_at) {
    SCOPED_TRACE(absl::StrCat("stop at poll ", stop_at));
    int polls = 0;
    options.should_stop = [&polls, stop_at] { return ++polls == stop_at; };
    EXPECT_THAT(Forward(inputs_, options), StatusIs(absl::StatusCode::kCancelled, ""));
  }
  // The layer still works after cancelled calls.
  const ReferenceResult reference = ReferenceLayer(small_.config, small_.weights, inputs_);
  ASSERT_THAT(Forward(inputs_, {}), IsOk());
  EXPECT_LE(RelativeFrobeniusError(buffers_.output, reference.output), kFp32Tolerance);
}

TEST(AttentionMapElements, CountsSelectionsAndReportsOverflow) {
  const HeadConfig config = MakeConfig(64, 8, 2, 0);
  const SequenceLayout queries = Packed({3, 5});  // max_length 5
  const SequenceLayout keys = Padded(2, 7, {7, 1});
  EXPECT_EQ(AttentionMapElements(config, queries, keys, {Maps::kNone, {}, {}}), 0);
  EXPECT_EQ(AttentionMapElements(config, queries, keys, {Maps::kPerHead, {}, {}}), 2 * 8 * 5 * 7);
  EXPECT_EQ(AttentionMapElements(config, queries, keys, {Maps::kPerHead, {1, 1, 3}, {0}}),
            2 * 3 * 1 * 7);
  EXPECT_EQ(AttentionMapElements(config, queries, keys, {Maps::kMeanOverHeads, {}, {}}), 2 * 5 * 7);
  EXPECT_EQ(AttentionMapElements(config, queries, keys, {Maps::kMeanOverHeads, {}, {4, 2}}),
            2 * 2 * 7);
  const int64_t huge = int64_t{1} << 32;
  const SequenceLayout long_layout = Padded(1, huge);
  EXPECT_EQ(AttentionMapElements(config, long_layout, long_layout, {Maps::kPerHead, {}, {}}),
            std::nullopt);
  // A dense batch (padded, full lengths) in self-attention.
  const SequenceLayout dense = Padded(3, 5);
  EXPECT_EQ(AttentionMapElements(config, dense, dense, {Maps::kPerHead, {}, {}}), 3 * 8 * 5 * 5);
  EXPECT_EQ(AttentionMapElements(config, dense, dense, {Maps::kMeanOverHeads, {}, {}}), 3 * 5 * 5);
  EXPECT_EQ(AttentionMapElements(config, long_layout, long_layout, {Maps::kMeanOverHeads, {}, {}}),
            std::nullopt);
}

}  // namespace
}  // namespace attnserve::core
