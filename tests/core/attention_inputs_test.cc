#include "core/attention_inputs.h"

#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/cpu_features.h"
#include "tests/core/status_matchers.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::CpuInfoFlags;
using ::attnserve::testing::CpuInfoHasAvx512Bf16;
using ::attnserve::testing::IsaNameCapsBelowBf16;
using ::attnserve::testing::IsOk;
using ::attnserve::testing::MachineRunsBf16;
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

// The flags the tests read are the CPU's: /proc/cpuinfo parses, and agrees
// with the compiler's own CPU check on flags that differ between the CPUs we
// run on (AVX2, AVX-512F), so a reader that found nothing cannot pass for a
// CPU without AVX512-BF16.
TEST(CpuFeatures, CpuInfoFlagsAreTheCpus) {
  const std::set<std::string> flags = CpuInfoFlags();
  ASSERT_FALSE(flags.empty()) << "no flags line in /proc/cpuinfo";
#if defined(__x86_64__)
  EXPECT_EQ(flags.count("sse2"), 1u);
  EXPECT_EQ(flags.count("avx2") == 1, static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(flags.count("avx512f") == 1, static_cast<bool>(__builtin_cpu_supports("avx512f")));
#endif
}

TEST(CpuFeatures, IsaNamesBelowAvx512CoreBf16CapIt) {
  for (const char* below : {"AVX2", "avx2", "SSE41", "AVX512_CORE", "AVX512_CORE_VNNI"}) {
    EXPECT_TRUE(IsaNameCapsBelowBf16(below)) << below;
  }
  for (const char* not_below : {"ALL", "AVX512_CORE_BF16", "AVX512_CORE_AMX", "NO_SUCH_ISA", ""}) {
    EXPECT_FALSE(IsaNameCapsBelowBf16(not_below)) << not_below;
  }
  EXPECT_FALSE(IsaNameCapsBelowBf16(nullptr));
}

// BF16 runs in BF16 exactly where the CPU has AVX512-BF16 (read above, apart
// from the core's check) and ONEDNN_MAX_CPU_ISA does not cap oneDNN below it
// on purpose; a probe that answered no on such a CPU would turn every BF16
// test into a skip and every BF16 request into FP32.
TEST(Precision, Bf16SupportedExactlyWhereTheCpuHasAvx512Bf16AndTheIsaIsNotCapped) {
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  SCOPED_TRACE(absl::StrCat("/proc/cpuinfo avx512_bf16: ", CpuInfoHasAvx512Bf16() ? "yes" : "no",
                            ", ONEDNN_MAX_CPU_ISA=", cap == nullptr ? "(unset)" : cap));
  EXPECT_EQ(Bf16Supported(), MachineRunsBf16());
}

}  // namespace
}  // namespace attnserve::core
