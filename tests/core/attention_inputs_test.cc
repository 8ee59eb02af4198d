#include "core/attention_inputs.h"

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::IsOk;
using ::attnserve::testing::StatusIs;
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

TEST(SequenceLayout, PaddedWithoutLengthsIsUniform) {
  const absl::StatusOr<SequenceLayout> layout = SequenceLayout::Padded(3, 4);
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->batch(), 3);
  EXPECT_EQ(layout->rows(), 12);
  EXPECT_EQ(layout->max_length(), 4);
  EXPECT_TRUE(layout->is_padded());
  EXPECT_TRUE(layout->is_uniform());
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(layout->length(b), 4);
    EXPECT_EQ(layout->row_offset(b), 4 * b);
  }
}

TEST(SequenceLayout, PaddedWithShortLengthsKeepsItsRows) {
  const absl::StatusOr<SequenceLayout> layout = SequenceLayout::Padded(2, 5, {5, 2});
  ASSERT_THAT(layout, IsOk());
  EXPECT_EQ(layout->rows(), 10);
  EXPECT_EQ(layout->max_length(), 5);
  EXPECT_EQ(layout->length(1), 2);
  EXPECT_EQ(layout->row_offset(1), 5);
  EXPECT_FALSE(layout->is_uniform());
  // Every length short of padded_len: still padding, so not uniform.
  EXPECT_FALSE(SequenceLayout::Padded(2, 5, {4, 4})->is_uniform());
}

TEST(SequenceLayout, PackedPutsSequencesBackToBack) {
  const absl::StatusOr<SequenceLayout> layout = SequenceLayout::Packed({3, 1, 4});
  ASSERT_THAT(layout, IsOk());
  EXPECT_FALSE(layout->is_padded());
  EXPECT_EQ(layout->batch(), 3);
  EXPECT_EQ(layout->rows(), 8);
  EXPECT_EQ(layout->max_length(), 4);
  EXPECT_EQ(layout->row_offset(0), 0);
  EXPECT_EQ(layout->row_offset(1), 3);
  EXPECT_EQ(layout->row_offset(2), 4);
  EXPECT_FALSE(layout->is_uniform());
  EXPECT_TRUE(SequenceLayout::Packed({2, 2})->is_uniform());
}

TEST(SequenceLayout, ADefaultLayoutHasNoSequences) {
  const SequenceLayout layout;
  EXPECT_EQ(layout.batch(), 0);
  EXPECT_EQ(layout.rows(), 0);
}

TEST(SequenceLayout, BadPaddedLayoutsAreInvalidArgument) {
  EXPECT_THAT(SequenceLayout::Padded(0, 3), StatusIs(kInvalid, "batch"));
  EXPECT_THAT(SequenceLayout::Padded(2, 0), StatusIs(kInvalid, "padded_len"));
  EXPECT_THAT(SequenceLayout::Padded(2, 3, {3}), StatusIs(kInvalid, "lengths"));
  EXPECT_THAT(SequenceLayout::Padded(2, 3, {3, 4}), StatusIs(kInvalid, "lengths[1]"));
  EXPECT_THAT(SequenceLayout::Padded(2, 3, {0, 3}), StatusIs(kInvalid, "lengths[0]"));
  EXPECT_THAT(SequenceLayout::Padded(int64_t{1} << 40, int64_t{1} << 40),
              StatusIs(kInvalid, "overflows"));
}

TEST(SequenceLayout, BadPackedLayoutsAreInvalidArgument) {
  EXPECT_THAT(SequenceLayout::Packed({}), StatusIs(kInvalid, "lengths"));
  EXPECT_THAT(SequenceLayout::Packed({2, 0}), StatusIs(kInvalid, "lengths[1]"));
  EXPECT_THAT(SequenceLayout::Packed({-1}), StatusIs(kInvalid, "lengths[0]"));
  EXPECT_THAT(SequenceLayout::Packed({INT64_MAX, 1}), StatusIs(kInvalid, "overflows"));
}

TEST(Precision, HasNames) {
  EXPECT_EQ(PrecisionName(Precision::kFp32), "fp32");
  EXPECT_EQ(PrecisionName(Precision::kBf16), "bf16");
}

TEST(Precision, Bf16SupportIsStable) { EXPECT_EQ(Bf16Supported(), Bf16Supported()); }

}  // namespace
}  // namespace attnserve::core
