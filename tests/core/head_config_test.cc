#include "core/head_config.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
using ::testing::HasSubstr;

HeadConfig Config(int64_t d_model, int64_t num_heads, int64_t num_kv_heads = 0,
                  int64_t head_dim = 0, float scale = 0.0f) {
  HeadConfig config;
  config.d_model = d_model;
  config.num_heads = num_heads;
  config.num_kv_heads = num_kv_heads;
  config.head_dim = head_dim;
  config.scale = scale;
  return config;
}

TEST(ResolveHeadConfig, FillsTheDefaultsOfBertBase) {
  const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Config(768, 12));
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->d_model, 768);
  EXPECT_EQ(resolved->num_heads, 12);
  EXPECT_EQ(resolved->num_kv_heads, 12);
  EXPECT_EQ(resolved->head_dim, 64);
  EXPECT_EQ(resolved->scale, 0.125f);
  EXPECT_EQ(resolved->q_width(), 768);
  EXPECT_EQ(resolved->kv_width(), 768);
  EXPECT_EQ(resolved->group_size(), 1);
}

TEST(ResolveHeadConfig, KeepsExplicitValues) {
  const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Config(100, 8, 2, 3, 0.5f));
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->num_kv_heads, 2);
  EXPECT_EQ(resolved->head_dim, 3);
  EXPECT_EQ(resolved->scale, 0.5f);
  EXPECT_EQ(resolved->q_width(), 24);
  EXPECT_EQ(resolved->kv_width(), 6);
  EXPECT_EQ(resolved->group_size(), 4);
}

TEST(ResolveHeadConfig, DefaultScaleIsOneOverSqrtOfHeadDim) {
  const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Config(10, 1, 0, 3));
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->scale, static_cast<float>(1.0 / std::sqrt(3.0)));
}

TEST(ResolveHeadConfig, AcceptsMultiQueryAttention) {
  const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Config(64, 8, 1));
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->group_size(), 8);
  EXPECT_EQ(resolved->kv_width(), 8);
}

TEST(ResolveHeadConfig, AcceptsTheLimits) {
  EXPECT_THAT(ResolveHeadConfig(Config(kMaxDModel, kMaxHeads, 1, kMaxHeadDim)), IsOk());
}

TEST(ResolveHeadConfig, RejectsNonPositiveDModel) {
  EXPECT_THAT(ResolveHeadConfig(Config(0, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.d_model"));
  EXPECT_THAT(ResolveHeadConfig(Config(-8, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.d_model"));
}

TEST(ResolveHeadConfig, RejectsDModelAboveTheLimit) {
  EXPECT_THAT(ResolveHeadConfig(Config(kMaxDModel + 1, 1, 0, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.d_model"));
}

TEST(ResolveHeadConfig, RejectsNonPositiveNumHeads) {
  EXPECT_THAT(ResolveHeadConfig(Config(8, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_heads"));
  EXPECT_THAT(ResolveHeadConfig(Config(8, -2)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_heads"));
}

TEST(ResolveHeadConfig, RejectsNumHeadsAboveTheLimit) {
  EXPECT_THAT(ResolveHeadConfig(Config(kMaxDModel, kMaxHeads + 1, 0, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_heads"));
}

TEST(ResolveHeadConfig, RejectsNumKvHeadsThatDoNotDivideNumHeads) {
  const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Config(768, 12, 5));
  EXPECT_THAT(resolved, StatusIs(absl::StatusCode::kInvalidArgument,
                                 "head_config.num_kv_heads: 5 does not divide num_heads 12"));
}

TEST(ResolveHeadConfig, RejectsMoreKvHeadsThanHeads) {
  EXPECT_THAT(ResolveHeadConfig(Config(64, 4, 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_kv_heads"));
}

TEST(ResolveHeadConfig, RejectsNegativeNumKvHeads) {
  EXPECT_THAT(ResolveHeadConfig(Config(64, 4, -1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_kv_heads"));
}

TEST(ResolveHeadConfig, RejectsADefaultHeadDimThatDoesNotDivide) {
  EXPECT_THAT(ResolveHeadConfig(Config(768, 5)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "head_config.num_heads: 5 does not divide d_model 768"));
  // d_model < num_heads would give head_dim 0.
  EXPECT_THAT(ResolveHeadConfig(Config(2, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.num_heads"));
  // An explicit head_dim needs no division.
  EXPECT_THAT(ResolveHeadConfig(Config(768, 5, 0, 64)), IsOk());
}

TEST(ResolveHeadConfig, ContextDimDefaultsToDModel) {
  const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Config(96, 6, 3));
  ASSERT_THAT(resolved, IsOk());
  EXPECT_EQ(resolved->context_dim, 96);
}

TEST(ResolveHeadConfig, KeepsAnExplicitContextDimUpToTheLimit) {
  for (int64_t context_dim : {int64_t{1}, int64_t{24}, int64_t{96}, int64_t{1000}, kMaxDModel}) {
    SCOPED_TRACE(context_dim);
    HeadConfig config = Config(96, 6, 3);
    config.context_dim = context_dim;
    const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(config);
    ASSERT_THAT(resolved, IsOk());
    EXPECT_EQ(resolved->context_dim, context_dim);
    EXPECT_EQ(resolved->d_model, 96);
  }
}

TEST(ResolveHeadConfig, RejectsBadContextDims) {
  HeadConfig config = Config(96, 6);
  config.context_dim = -24;
  EXPECT_THAT(ResolveHeadConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "head_config.context_dim: must be positive, got -24"));
  config.context_dim = kMaxDModel + 1;
  EXPECT_THAT(ResolveHeadConfig(config),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "head_config.context_dim: 65537 exceeds the limit"));
}

HeadConfig Rotary(int64_t rotary_dim, float theta = 10000.0f) {
  HeadConfig config = Config(64, 4);  // head_dim 16
  config.rotary.rotary_dim = rotary_dim;
  config.rotary.theta = theta;
  return config;
}

TEST(ResolveHeadConfig, AcceptsRotaryDimsUpToHeadDim) {
  for (int64_t rotary_dim : {0, 2, 8, 16}) {
    SCOPED_TRACE(rotary_dim);
    const absl::StatusOr<HeadConfig> resolved = ResolveHeadConfig(Rotary(rotary_dim, 500000.0f));
    ASSERT_THAT(resolved, IsOk());
    EXPECT_EQ(resolved->rotary.rotary_dim, rotary_dim);
    EXPECT_EQ(resolved->rotary.theta, 500000.0f);
  }
}

TEST(ResolveHeadConfig, RejectsBadRotaryDims) {
  for (int64_t rotary_dim : {-2, 3, 15, 18}) {
    SCOPED_TRACE(rotary_dim);
    EXPECT_THAT(ResolveHeadConfig(Rotary(rotary_dim)),
                StatusIs(absl::StatusCode::kInvalidArgument, "head_config.rotary.rotary_dim"));
  }
}

TEST(ResolveHeadConfig, RejectsBadRotaryTheta) {
  for (float theta : {1.0f, 0.5f, 0.0f, -10000.0f, std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
    SCOPED_TRACE(theta);
    EXPECT_THAT(ResolveHeadConfig(Rotary(8, theta)),
                StatusIs(absl::StatusCode::kInvalidArgument, "head_config.rotary.theta"));
  }
}

TEST(ResolveHeadConfig, RejectsBadHeadDim) {
  EXPECT_THAT(ResolveHeadConfig(Config(8, 2, 0, -4)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.head_dim"));
  EXPECT_THAT(ResolveHeadConfig(Config(8, 2, 0, kMaxHeadDim + 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, "head_config.head_dim"));
}

TEST(ResolveHeadConfig, RejectsScalesThatAreNotFiniteAndPositive) {
  for (float scale :
       {-0.5f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::quiet_NaN()}) {
    SCOPED_TRACE(scale);
    EXPECT_THAT(ResolveHeadConfig(Config(8, 2, 0, 0, scale)),
                StatusIs(absl::StatusCode::kInvalidArgument, "head_config.scale"));
  }
}

TEST(ResolveHeadConfig, IsIdempotent) {
  const absl::StatusOr<HeadConfig> once = ResolveHeadConfig(Config(96, 6, 3));
  ASSERT_THAT(once, IsOk());
  const absl::StatusOr<HeadConfig> twice = ResolveHeadConfig(*once);
  ASSERT_THAT(twice, IsOk());
  EXPECT_EQ(twice->d_model, once->d_model);
  EXPECT_EQ(twice->num_heads, once->num_heads);
  EXPECT_EQ(twice->num_kv_heads, once->num_kv_heads);
  EXPECT_EQ(twice->head_dim, once->head_dim);
  EXPECT_EQ(twice->scale, once->scale);
  EXPECT_EQ(twice->context_dim, once->context_dim);
}

}  // namespace
}  // namespace attnserve::core
