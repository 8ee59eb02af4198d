// The BF16 layer against a double-precision reference fed the same BF16
// operands, rounded where the kernels round them
// (ReferenceLayerWithBf16Operands): the hidden states and the context, the
// projection weights, Q/K/V after the projections' bias and RoPE, the
// probabilities the P V product takes, the context heads before the output
// projection. Against that reference BF16 is held to
// kBf16RoundedOperandsTolerance, tight enough that a kernel truncating instead
// of rounding fails: the negative controls show it on every CPU (the truncating
// reference against the rounding one) and, where BF16 runs, on the layer
// itself. The looser comparison with the unrounded reference (kBf16Tolerance)
// stays in attention_layer_test.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_inputs.h"
#include "core/attention_layer.h"
#include "core/attention_weights.h"
#include "core/bf16.h"
#include "core/head_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"
#include "tests/core/reference_attention.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::Bf16Operands;
using ::attnserve::testing::Bf16Rounding;
using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::kBf16RoundedOperandsTolerance;
using ::attnserve::testing::kBf16Tolerance;
using ::attnserve::testing::RandomStates;
using ::attnserve::testing::RandomWeights;
using ::attnserve::testing::ReferenceLayer;
using ::attnserve::testing::ReferenceLayerWithBf16Operands;
using ::attnserve::testing::RelativeFrobeniusError;
using ::attnserve::testing::RoundToBf16;
using ::attnserve::testing::SeedTrace;
using Probabilities = Bf16Operands::Probabilities;

TEST(RoundToBf16, KeepsEightSignificantBitsRoundingTiesToEven) {
  // BF16 values 1 + k 2^-7 near 1; halfway points go to the even neighbour.
  EXPECT_EQ(RoundToBf16(1.0), 1.0);
  EXPECT_EQ(RoundToBf16(1.0 + 0x1p-8), 1.0);                     // tie, 1 is even
  EXPECT_EQ(RoundToBf16(1.0 + 3 * 0x1p-8), 1.0 + 0x1p-6);        // tie, 1 + 2^-6 is even
  EXPECT_EQ(RoundToBf16(1.0 + 0x1p-8 + 0x1p-20), 1.0 + 0x1p-7);  // past the tie
  EXPECT_EQ(RoundToBf16(-(1.0 + 0x1p-8 + 0x1p-20)), -(1.0 + 0x1p-7));
  EXPECT_EQ(RoundToBf16(255.5), 256.0);
  EXPECT_EQ(RoundToBf16(0.0), 0.0);
  EXPECT_TRUE(std::isnan(RoundToBf16(std::numeric_limits<double>::quiet_NaN())));
  EXPECT_EQ(RoundToBf16(std::numeric_limits<double>::infinity()),
            std::numeric_limits<double>::infinity());
}

TEST(RoundToBf16, TowardZeroTruncates) {
  EXPECT_EQ(RoundToBf16(1.0 + 0x1p-7 - 0x1p-20, Bf16Rounding::kTowardZero), 1.0);
  EXPECT_EQ(RoundToBf16(-(1.0 + 0x1p-7 - 0x1p-20), Bf16Rounding::kTowardZero), -1.0);
  EXPECT_EQ(RoundToBf16(255.9, Bf16Rounding::kTowardZero), 255.0);
}

// Two independent roundings, one from the format's definition in double, one
// on the bits of a float (core/bf16.h), agree on fresh random floats of every
// magnitude the layer meets.
TEST(RoundToBf16, EqualsTheCoresConversionOnRandomFloats) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log2_magnitude(-60.0, 60.0);
  std::uniform_int_distribution<uint32_t> low_bits(0, 0xffff);
  for (int i = 0; i < 100000; ++i) {
    float x = static_cast<float>(std::exp2(log2_magnitude(rng)) * (i % 2 == 0 ? 1.0 : -1.0));
    if (i % 4 == 0) {
      // Exact ties: the 16 bits below a BF16 value's last are 0x8000.
      uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof(bits));
      bits = (bits & 0xffff0000u) | 0x8000u;
      std::memcpy(&x, &bits, sizeof(bits));
    } else if (i % 4 == 1) {
      uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof(bits));
      bits = (bits & 0xffff0000u) | low_bits(rng);
      std::memcpy(&x, &bits, sizeof(bits));
    }
    ASSERT_EQ(RoundToBf16(x), static_cast<double>(Bfloat16ToFloat(FloatToBf16(x)))) << x;
  }
}

// One shape of the layer under test.
struct Bf16Case {
  std::string name;
  int64_t d_model = 64;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 4;
  int64_t head_dim = 16;
  int64_t rotary_dim = 0;
  int64_t context_dim = 0;  // > 0: cross-attention from a context of that width
  std::vector<int64_t> lengths;
  int64_t padded_len = 0;  // > 0: padded to it, else packed
  std::vector<int64_t> context_lengths;
  bool causal = false;
  std::vector<float> head_mask;
  std::vector<int64_t> position_offsets;
};

std::ostream& operator<<(std::ostream& os, const Bf16Case& c) { return os << c.name; }

// How the layer runs, and which probabilities the reference rounds to match.
struct PathUnderTest {
  const char* name;
  AttentionPath path;
  BlockKernels block_kernels;
  const char* kernel_path;
  Probabilities probabilities;
};

// Key blocks of the defaults (256 causal, 1024 otherwise) take every key of
// these shapes at once: one block, so the blocked path's probabilities are
// relative to the row's max, as the reference rounds them.
constexpr PathUnderTest kPaths[] = {
    {"materialized", AttentionPath::kMaterialized, BlockKernels::kAuto, "bf16/materialized",
     Probabilities::kNormalized},
    {"blocked", AttentionPath::kBlocked, BlockKernels::kAuto, "bf16/blocked",
     Probabilities::kRelativeToRowMax},
    {"blocked on oneDNN", AttentionPath::kBlocked, BlockKernels::kOneDnn, "bf16/blocked",
     Probabilities::kRelativeToRowMax},
};

// A layer, its weights and inputs for one case, from fresh random numbers.
struct Problem {
  HeadConfig config;
  AttentionWeights weights;
  std::unique_ptr<AttentionLayer> layer;
  std::vector<float> hidden, context;
  LayerInputs inputs;
};

SequenceLayout Layout(const std::vector<int64_t>& lengths, int64_t padded_len) {
  absl::StatusOr<SequenceLayout> layout =
      padded_len > 0
          ? SequenceLayout::Padded(static_cast<int64_t>(lengths.size()), padded_len, lengths)
          : SequenceLayout::Packed(lengths);
  EXPECT_THAT(layout, IsOk());
  return layout.value_or(SequenceLayout());
}

// `problem` must not move afterwards (inputs point into it).
void MakeProblem(const Bf16Case& c, std::mt19937_64& rng, Problem& problem) {
  HeadConfig config;
  config.d_model = c.d_model;
  config.num_heads = c.num_heads;
  config.num_kv_heads = c.num_kv_heads;
  config.head_dim = c.head_dim;
  config.rotary.rotary_dim = c.rotary_dim;
  config.context_dim = c.context_dim;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  ASSERT_THAT(resolved, IsOk());
  problem.config = *resolved;
  problem.weights = RandomWeights(problem.config, rng);
  absl::StatusOr<std::unique_ptr<AttentionLayer>> layer =
      AttentionLayer::Create(problem.config, problem.weights);
  ASSERT_THAT(layer, IsOk());
  problem.layer = std::move(*layer);
  const SequenceLayout layout = Layout(c.lengths, c.padded_len);
  problem.hidden = RandomStates(layout, c.d_model, rng);
  problem.inputs.hidden_states = problem.hidden;
  problem.inputs.layout = layout;
  if (c.context_dim > 0) {
    const SequenceLayout keys = Layout(c.context_lengths, 0);
    problem.context = RandomStates(keys, c.context_dim, rng);
    problem.inputs.context = problem.context;
    problem.inputs.context_layout = keys;
  }
  problem.inputs.causal = c.causal;
  problem.inputs.head_mask = c.head_mask;
  problem.inputs.position_offsets = c.position_offsets;
}

// The layer's output as the reference's type.
std::vector<float> AsFloats(const std::vector<double>& values) {
  return std::vector<float>(values.begin(), values.end());
}

class Bf16Layer : public ::testing::TestWithParam<Bf16Case> {};

// Where BF16 runs: the layer on each path against the reference with the same
// BF16 operands (tight), the unrounded reference (BF16's usual bound), and the
// truncating reference (the negative control: the tight comparison must fail
// against it, or it could not tell rounding from truncation).
TEST_P(Bf16Layer, MatchesTheReferenceFedTheSameBf16Operands) {
  ATTNSERVE_SKIP_WITHOUT_BF16();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  Problem problem;
  ASSERT_NO_FATAL_FAILURE(MakeProblem(GetParam(), rng, problem));
  const std::vector<double> unrounded =
      ReferenceLayer(problem.config, problem.weights, problem.inputs).output;
  for (const PathUnderTest& path : kPaths) {
    SCOPED_TRACE(path.name);
    ForwardOptions options;
    options.block_kernels = path.block_kernels;
    options.precision = Precision::kBf16;
    options.attention_path = path.path;
    std::vector<float> output(
        static_cast<size_t>(problem.inputs.layout.rows() * GetParam().d_model),
        std::numeric_limits<float>::quiet_NaN());
    ForwardOutputs outputs;
    outputs.output = absl::MakeSpan(output);
    const absl::StatusOr<ForwardInfo> info =
        problem.layer->Forward(problem.inputs, options, outputs);
    ASSERT_THAT(info, IsOk());
    ASSERT_EQ(info->kernel_path, path.kernel_path);
    Bf16Operands bf16;
    bf16.probabilities = path.probabilities;
    const double rounded_error = RelativeFrobeniusError(
        output,
        ReferenceLayerWithBf16Operands(problem.config, problem.weights, problem.inputs, bf16)
            .output);
    bf16.rounding = Bf16Rounding::kTowardZero;
    const double truncated_error = RelativeFrobeniusError(
        output,
        ReferenceLayerWithBf16Operands(problem.config, problem.weights, problem.inputs, bf16)
            .output);
    const double unrounded_error = RelativeFrobeniusError(output, unrounded);
    std::cout << GetParam().name << ", " << path.name << ": relative error against the reference "
              << "with the same BF16 operands " << rounded_error << ", with truncated operands "
              << truncated_error << ", unrounded " << unrounded_error << "\n";
    EXPECT_LE(rounded_error, kBf16RoundedOperandsTolerance);
    EXPECT_LE(unrounded_error, kBf16Tolerance);
    EXPECT_GT(truncated_error, kBf16RoundedOperandsTolerance);
  }
}

// On every CPU: truncating the reference's operands instead of rounding them
// moves its output past the tolerance (the measured distance is several
// times the tolerance), while rounding them keeps it within BF16's usual
// bound of the unrounded reference, and away from it (it rounds).
TEST_P(Bf16Layer, TruncatingTheOperandsMovesTheReferencePastTheTolerance) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  Problem problem;
  ASSERT_NO_FATAL_FAILURE(MakeProblem(GetParam(), rng, problem));
  const std::vector<double> unrounded =
      ReferenceLayer(problem.config, problem.weights, problem.inputs).output;
  for (const Probabilities probabilities :
       {Probabilities::kNormalized, Probabilities::kRelativeToRowMax}) {
    Bf16Operands bf16;
    bf16.probabilities = probabilities;
    const std::vector<double> rounded =
        ReferenceLayerWithBf16Operands(problem.config, problem.weights, problem.inputs, bf16)
            .output;
    bf16.rounding = Bf16Rounding::kTowardZero;
    const std::vector<double> truncated =
        ReferenceLayerWithBf16Operands(problem.config, problem.weights, problem.inputs, bf16)
            .output;
    const double truncation = RelativeFrobeniusError(AsFloats(truncated), rounded);
    const double rounding = RelativeFrobeniusError(AsFloats(rounded), unrounded);
    std::cout << GetParam().name
              << (probabilities == Probabilities::kNormalized ? ", normalized" : ", row max")
              << ": truncated against rounded operands " << truncation
              << ", rounded against unrounded " << rounding << "\n";
    EXPECT_GT(truncation, 2 * kBf16RoundedOperandsTolerance);
    EXPECT_LE(rounding, kBf16Tolerance);
    EXPECT_GT(rounding, kBf16RoundedOperandsTolerance / 4);
  }
}

std::vector<Bf16Case> Cases() {
  std::vector<Bf16Case> all;
  {
    Bf16Case c;
    c.name = "PackedGroupedHeads";
    c.num_kv_heads = 2;
    c.lengths = {23, 40, 7};
    all.push_back(c);
  }
  {
    Bf16Case c;
    c.name = "PaddedCausal";
    c.lengths = {33, 12, 20};
    c.padded_len = 33;
    c.causal = true;
    all.push_back(c);
  }
  {
    Bf16Case c;
    c.name = "CrossAttentionFromAnotherWidth";
    c.context_dim = 48;
    c.lengths = {9, 17};
    c.context_lengths = {30, 5};
    all.push_back(c);
  }
  {
    Bf16Case c;
    c.name = "RopeCausalWithOffsetsAndHeadMask";
    c.num_kv_heads = 1;
    c.rotary_dim = 8;
    c.lengths = {21, 16};
    c.causal = true;
    c.position_offsets = {3, 0};
    c.head_mask = {1.0f, 0.5f, 0.0f, 2.0f};
    all.push_back(c);
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bf16Layer, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Bf16Case>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace attnserve::core
