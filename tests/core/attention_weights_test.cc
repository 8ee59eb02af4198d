#include "core/attention_weights.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/head_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;

HeadConfig Resolved(int64_t d_model, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t context_dim = 0) {
  HeadConfig config;
  config.d_model = d_model;
  config.num_heads = num_heads;
  config.num_kv_heads = num_kv_heads;
  config.head_dim = head_dim;
  config.context_dim = context_dim;
  absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
  EXPECT_TRUE(resolved.ok()) << resolved.status();
  return resolved.value_or(HeadConfig{});
}

uint32_t Bits(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// The documented recipe, written again independently of the library:
// splitmix64's finalizer over seed + stream * C1 + (index + 1) * C2.
double RecipeUniform(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t z = seed + stream * 0xD1B54A32D192ED03ull + (index + 1) * 0x9E3779B97F4A7C15ull;
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return std::ldexp(static_cast<double>(z >> 40), -24);
}

// Fields in AttentionWeights' order, with their names.
std::vector<std::pair<std::string, std::vector<float>*>> Fields(AttentionWeights& w) {
  return {{"w_q", &w.w_q}, {"b_q", &w.b_q}, {"w_k", &w.w_k}, {"b_k", &w.b_k},
          {"w_v", &w.w_v}, {"b_v", &w.b_v}, {"w_o", &w.w_o}, {"b_o", &w.b_o}};
}

TEST(SeededUniform, MatchesValuesComputedWithNumpy) {
  // From the NumPy recipe in docs/seeded_weights.md; the first is splitmix64's
  // well-known first output for state 0 (0xE220A8397B1DCDAF), top 24 bits.
  EXPECT_EQ(SeededUniform(0, 0, 0), 14819496.0 / (1 << 24));
  EXPECT_EQ(SeededUniform(0, 0, 1), 7239838.0 / (1 << 24));
  EXPECT_EQ(SeededUniform(42, 3, 7), 16561986.0 / (1 << 24));
  EXPECT_EQ(SeededUniform(0xFFFFFFFFFFFFFFFFull, 7, 123456789), 2727542.0 / (1 << 24));
  EXPECT_EQ(SeededUniform(12345, 1, 0), 1037584.0 / (1 << 24));
}

TEST(SeededUniform, MatchesTheDocumentedRecipe) {
  for (uint64_t seed : {0ull, 1ull, 2024ull, 0x8000000000000000ull, ~0ull}) {
    for (uint64_t stream = 0; stream < 8; ++stream) {
      for (uint64_t index : {0ull, 1ull, 2ull, 1000ull, 1ull << 40, ~0ull}) {
        ASSERT_EQ(SeededUniform(seed, stream, index), RecipeUniform(seed, stream, index))
            << "seed " << seed << " stream " << stream << " index " << index;
      }
    }
  }
}

TEST(SeededUniform, IsDeterministicAndHas24BitsInZeroToOne) {
  double sum = 0.0;
  constexpr int kCount = 100000;
  for (uint64_t i = 0; i < kCount; ++i) {
    const double u = SeededUniform(7, 2, i);
    ASSERT_EQ(u, SeededUniform(7, 2, i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    const double scaled = u * (1 << 24);
    ASSERT_EQ(scaled, std::floor(scaled)) << "more than 24 bits at index " << i;
    sum += u;
  }
  EXPECT_NEAR(sum / kCount, 0.5, 0.01);
}

TEST(SeededUniform, StreamsAndSeedsDiffer) {
  EXPECT_NE(SeededUniform(1, 0, 0), SeededUniform(2, 0, 0));
  EXPECT_NE(SeededUniform(1, 0, 0), SeededUniform(1, 1, 0));
  EXPECT_NE(SeededUniform(1, 0, 0), SeededUniform(1, 0, 1));
}

TEST(SeededWeights, MatchesValuesComputedWithNumpy) {
  // seeded_weights(d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, seed=7)
  // from the NumPy snippet in docs/seeded_weights.md, float32 bit patterns.
  const AttentionWeights small = SeededWeights(Resolved(8, 2, 1, 4), 7);
  ASSERT_EQ(small.w_q.size(), 64u);
  EXPECT_EQ(Bits(small.w_q[0 * 8 + 0]), 0xbd9f8b2cu);  // -0.0779021680355072
  EXPECT_EQ(Bits(small.w_q[7 * 8 + 7]), 0xbd8e8b8du);  // -0.0696021094918251
  EXPECT_EQ(Bits(small.b_k[3]), 0xbe548d0fu);          // -0.20756934583187103
  EXPECT_EQ(Bits(small.w_o[5 * 8 + 2]), 0x3c5e02f2u);  // 0.01355050690472126
  EXPECT_EQ(Bits(small.b_o[7]), 0x3e6dee6fu);          // 0.23235486447811127

  // BERT-base, seed 2024.
  const AttentionWeights bert = SeededWeights(Resolved(768, 12, 12, 64), 2024);
  EXPECT_EQ(Bits(bert.w_q[767 * 768 + 767]), 0x3c4ff1e1u);
  EXPECT_EQ(Bits(bert.w_v[100 * 768 + 5]), 0x3c5d2c5du);
  EXPECT_EQ(Bits(bert.w_o[0]), 0xbb985c60u);
  EXPECT_EQ(Bits(bert.b_o[767]), 0xbcbf075bu);
}

TEST(SeededWeights, MatchesValuesComputedWithNumpyForAContextOfAnotherWidth) {
  // seeded_weights(d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, seed=7,
  // context_dim=3) from the NumPy snippet: w_k, b_k, w_v, b_v are [3, 4] and
  // [4] with fan_in 3; the other tensors are those of context_dim 8.
  const AttentionWeights narrow = SeededWeights(Resolved(8, 2, 1, 4, 3), 7);
  ASSERT_EQ(narrow.w_k.size(), 12u);
  ASSERT_EQ(narrow.w_v.size(), 12u);
  EXPECT_EQ(Bits(narrow.w_k[2 * 4 + 1]), 0xbed8cbe6u);  // -0.4234306216239929
  EXPECT_EQ(Bits(narrow.b_k[3]), 0xbead8c14u);          // -0.33895933628082275
  EXPECT_EQ(Bits(narrow.w_v[0 * 4 + 2]), 0xbed2f47au);  // -0.4120214581489563
  EXPECT_EQ(Bits(narrow.b_v[1]), 0xbe92947cu);          // -0.2862890958786011
  EXPECT_EQ(Bits(narrow.w_q[0]), 0xbd9f8b2cu);          // as with context_dim 8
}

TEST(SeededWeights, AContextDimOfDModelGivesTheSameWeightsAsTheDefault) {
  const AttentionWeights by_default = SeededWeights(Resolved(24, 4, 2, 0), 31);
  const AttentionWeights explicit_dim = SeededWeights(Resolved(24, 4, 2, 0, 24), 31);
  EXPECT_EQ(by_default.w_q, explicit_dim.w_q);
  EXPECT_EQ(by_default.w_k, explicit_dim.w_k);
  EXPECT_EQ(by_default.b_k, explicit_dim.b_k);
  EXPECT_EQ(by_default.w_v, explicit_dim.w_v);
  EXPECT_EQ(by_default.b_v, explicit_dim.b_v);
  EXPECT_EQ(by_default.w_o, explicit_dim.w_o);
}

TEST(SeededWeights, KeyValueTensorsReadTheContextDimAsFanIn) {
  const HeadConfig config = Resolved(6, 4, 2, 3, 10);
  AttentionWeights weights = SeededWeights(config, 99);
  const auto fields = Fields(weights);
  const double fan_ins[8] = {6, 6, 10, 10, 10, 10, 12, 12};
  const size_t sizes[8] = {6 * 12, 12, 10 * 6, 6, 10 * 6, 6, 12 * 6, 6};
  for (size_t t = 0; t < fields.size(); ++t) {
    SCOPED_TRACE(fields[t].first);
    const std::vector<float>& tensor = *fields[t].second;
    ASSERT_EQ(tensor.size(), sizes[t]);
    for (size_t i = 0; i < tensor.size(); ++i) {
      const double u = RecipeUniform(99, t, i);
      ASSERT_EQ(Bits(tensor[i]),
                Bits(static_cast<float>((2.0 * u - 1.0) * (1.0 / std::sqrt(fan_ins[t])))))
          << "element " << i;
    }
  }
  EXPECT_THAT(ValidateWeights(config, weights), IsOk());
}

TEST(SeededWeights, FollowsTheRecipeForEveryTensor) {
  const HeadConfig config = Resolved(6, 4, 2, 3);
  AttentionWeights weights = SeededWeights(config, 99);
  const auto fields = Fields(weights);
  for (size_t t = 0; t < fields.size(); ++t) {
    SCOPED_TRACE(fields[t].first);
    const double fan_in = t < 6 ? 6.0 : 12.0;  // w_o and b_o read num_heads * head_dim
    const std::vector<float>& tensor = *fields[t].second;
    ASSERT_FALSE(tensor.empty());
    for (size_t i = 0; i < tensor.size(); ++i) {
      const double u = RecipeUniform(99, t, i);
      ASSERT_EQ(Bits(tensor[i]), Bits(static_cast<float>((2.0 * u - 1.0) / std::sqrt(fan_in))))
          << "element " << i;
    }
  }
}

TEST(SeededWeights, HasTheShapesOfTheConfigAndValidates) {
  const HeadConfig config = Resolved(10, 4, 2, 3);
  const AttentionWeights weights = SeededWeights(config, 5);
  EXPECT_EQ(weights.w_q.size(), 10u * 12u);
  EXPECT_EQ(weights.b_q.size(), 12u);
  EXPECT_EQ(weights.w_k.size(), 10u * 6u);
  EXPECT_EQ(weights.b_k.size(), 6u);
  EXPECT_EQ(weights.w_v.size(), 10u * 6u);
  EXPECT_EQ(weights.b_v.size(), 6u);
  EXPECT_EQ(weights.w_o.size(), 12u * 10u);
  EXPECT_EQ(weights.b_o.size(), 10u);
  EXPECT_THAT(ValidateWeights(config, weights), IsOk());
}

TEST(SeededWeights, StayWithinOneOverSqrtFanIn) {
  const HeadConfig config = Resolved(64, 4, 4, 8);  // fan_in 64 in, 32 out
  AttentionWeights weights = SeededWeights(config, 3);
  const auto fields = Fields(weights);
  for (size_t t = 0; t < fields.size(); ++t) {
    const float bound = t < 6 ? 0.125f : static_cast<float>(1.0 / std::sqrt(32.0));
    for (float value : *fields[t].second) {
      ASSERT_LE(std::abs(value), bound) << fields[t].first;
    }
  }
}

TEST(SeededWeights, IsDeterministicAndDependsOnTheSeed) {
  const HeadConfig config = Resolved(16, 2, 2, 8);
  const AttentionWeights a = SeededWeights(config, 11);
  const AttentionWeights b = SeededWeights(config, 11);
  const AttentionWeights c = SeededWeights(config, 12);
  EXPECT_EQ(a.w_q, b.w_q);
  EXPECT_EQ(a.w_o, b.w_o);
  EXPECT_EQ(a.b_v, b.b_v);
  EXPECT_NE(a.w_q, c.w_q);
  EXPECT_NE(a.w_q, a.w_k);  // streams differ per tensor
}

TEST(ValidateWeights, NamesTheTensorWhoseSizeIsWrong) {
  const HeadConfig config = Resolved(8, 2, 1, 4);
  for (size_t t = 0; t < 8; ++t) {
    AttentionWeights weights = SeededWeights(config, 1);
    auto fields = Fields(weights);
    SCOPED_TRACE(fields[t].first);
    fields[t].second->push_back(0.0f);
    EXPECT_THAT(ValidateWeights(config, weights),
                StatusIs(absl::StatusCode::kInvalidArgument, fields[t].first + ": size"));
    fields[t].second->clear();
    EXPECT_THAT(ValidateWeights(config, weights),
                StatusIs(absl::StatusCode::kInvalidArgument, fields[t].first + ": size"));
  }
}

TEST(ValidateWeights, CatchesKvWeightsSizedForDModelInsteadOfContextDim) {
  const HeadConfig narrow = Resolved(8, 2, 1, 4, 5);
  const AttentionWeights d_model_wide = SeededWeights(Resolved(8, 2, 1, 4), 1);
  EXPECT_THAT(ValidateWeights(narrow, d_model_wide),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "w_k: size 32 does not match the expected [5, 4] = 20"));
  AttentionWeights weights = SeededWeights(narrow, 1);
  EXPECT_THAT(ValidateWeights(narrow, weights), IsOk());
  weights.w_v.resize(32);
  EXPECT_THAT(ValidateWeights(narrow, weights),
              StatusIs(absl::StatusCode::kInvalidArgument, "w_v: size 32"));
}

TEST(ValidateWeights, CatchesKvWeightsSizedForAllHeads) {
  const HeadConfig grouped = Resolved(8, 4, 2, 2);
  const AttentionWeights full = SeededWeights(Resolved(8, 4, 4, 2), 1);
  EXPECT_THAT(ValidateWeights(grouped, full),
              StatusIs(absl::StatusCode::kInvalidArgument, "w_k: size 64"));
}

TEST(ValidateWeights, NamesTheTensorHoldingANonFiniteValue) {
  const HeadConfig config = Resolved(8, 2, 2, 4);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (size_t t = 0; t < 8; ++t) {
      AttentionWeights weights = SeededWeights(config, 1);
      auto fields = Fields(weights);
      SCOPED_TRACE(fields[t].first);
      (*fields[t].second)[fields[t].second->size() - 1] = bad;
      EXPECT_THAT(ValidateWeights(config, weights),
                  StatusIs(absl::StatusCode::kInvalidArgument, fields[t].first + "["));
    }
  }
}

}  // namespace
}  // namespace attnserve::core
