// The own block kernels of the blocked path (core/kernels/block_kernels.h) against a
// double-precision computation on fresh random operands: every strip height
// (1..kStripRows), key counts across tile edges (1..80: one, two, three and
// more tiles of 16 and their tails), head_dim 16..128, rows further apart
// than head_dim, keys past `valid` packed as zeros, first and later key blocks.
// BF16: the reference takes the same BF16-rounded operands, so both kernels
// are held to FP32 accumulation error.
#include "core/kernels/block_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/bf16.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"

namespace attnserve::core::internal {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::SeedTrace;

// FP32 accumulation of n products: relative to sum |a_i b_i|.
constexpr double kAccumulationTolerance = 1e-5;

// A matrix [rows, cols] with a row stride, in FP32 or BF16; value(r, c) is
// what the kernels see (BF16: the rounded value) as a double.
struct Operand {
  int64_t rows = 0, cols = 0, stride = 0;
  bool bf16 = false;
  std::vector<float> f32;
  std::vector<Bf16> b16;

  Operand(int64_t rows_, int64_t cols_, int64_t stride_, bool bf16_, std::mt19937_64& rng)
      : rows(rows_), cols(cols_), stride(stride_), bf16(bf16_) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    f32.resize(static_cast<size_t>(rows * stride));
    for (float& x : f32) x = normal(rng);
    b16.resize(f32.size());
    for (size_t i = 0; i < f32.size(); ++i) b16[i] = FloatToBf16(f32[i]);
  }
  const void* data() const {
    return bf16 ? static_cast<const void*>(b16.data()) : static_cast<const void*>(f32.data());
  }
  double value(int64_t r, int64_t c) const {
    const int64_t i = r * stride + c;
    return bf16 ? Bfloat16ToFloat(b16[i]) : f32[i];
  }
};

class BlockKernels : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    ATTNSERVE_SKIP_UNLESS_AVAILABLE(
        OwnBlockKernelsAvailable(GetParam(), 16),
        GetParam() ? ::attnserve::testing::CpuInfoHasAvx512Bf16()
                   : ::attnserve::testing::CpuInfoHasAvx512(),
        GetParam() ? "the own BF16 block kernels (AVX512-BF16)" : "the own block kernels (AVX-512)");
  }
};

TEST_P(BlockKernels, ScoresMatchDoublePrecision) {
  const bool bf16 = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (const int64_t head_dim : {16, 32, 64, 80, 128}) {
    for (int64_t rows = 1; rows <= kStripRows; ++rows) {
      for (const int64_t keys : {1, 15, 16, 17, 33, 48, 49, 80}) {
        SCOPED_TRACE(::testing::Message()
                     << "head_dim " << head_dim << " rows " << rows << " keys " << keys);
        const int64_t valid = std::uniform_int_distribution<int64_t>(0, keys)(rng);
        const Operand q(rows, head_dim, head_dim + 3 * 16, bf16, rng);
        const Operand k(keys, head_dim, 3 * head_dim, bf16, rng);
        const int64_t element_bytes = bf16 ? 2 : 4;
        std::vector<char> packed(
            static_cast<size_t>(PackedBlockElements(keys, head_dim) * element_bytes), 'x');
        PackKeyBlock(k.data(), k.stride, keys, valid, head_dim, bf16, packed.data());
        const int64_t tiles = (keys + kKeyTile - 1) / kKeyTile;
        const int64_t stride = tiles * kKeyTile + 5;
        std::vector<float> scores(static_cast<size_t>(rows * stride), -1.0f);
        BlockScores(bf16, q.data(), q.stride, rows, packed.data(), tiles, head_dim, scores.data(),
                    stride);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < tiles * kKeyTile; ++j) {
            double expected = 0.0, magnitude = 0.0;
            if (j < valid) {
              for (int64_t d = 0; d < head_dim; ++d) {
                expected += q.value(r, d) * k.value(j, d);
                magnitude += std::fabs(q.value(r, d) * k.value(j, d));
              }
            }
            ASSERT_NEAR(scores[r * stride + j], expected, kAccumulationTolerance * magnitude)
                << "row " << r << " key " << j << (j >= valid ? " (past valid: 0)" : "");
          }
          // Columns past the tiles are not written.
          for (int64_t j = tiles * kKeyTile; j < stride; ++j)
            ASSERT_EQ(scores[r * stride + j], -1.0f);
        }
      }
    }
  }
}

TEST_P(BlockKernels, ValuesMatchDoublePrecision) {
  const bool bf16 = GetParam();
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  for (const int64_t head_dim : {16, 32, 48, 64, 128}) {
    for (int64_t rows = 1; rows <= kStripRows; ++rows) {
      for (const int64_t block_keys : {1, 2, 16, 17, 47, 80}) {
        for (const bool first : {true, false}) {
          SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " rows " << rows
                                            << " block keys " << block_keys << " first " << first);
          // The kernels take `keys` of the block: BF16 an even count (the
          // pairs), at most the packed (padded) rows.
          const int64_t valid = std::uniform_int_distribution<int64_t>(1, block_keys)(rng);
          const int64_t keys = bf16 ? (valid + 1) / 2 * 2 : valid;
          const Operand p(rows, keys, keys + 7, bf16, rng);
          const Operand v(block_keys, head_dim, head_dim + 16, bf16, rng);
          std::vector<Bf16> v_packed;
          if (bf16) {
            v_packed.assign(static_cast<size_t>(PackedBlockElements(block_keys, head_dim)), 0xffff);
            PackValueBlockBf16(v.b16.data(), v.stride, block_keys, valid, head_dim,
                               v_packed.data());
          }
          const int64_t acc_stride = head_dim + 16;
          std::vector<float> acc(static_cast<size_t>(rows * acc_stride));
          std::normal_distribution<float> normal(0.0f, 1.0f);
          for (float& x : acc) x = first ? std::numeric_limits<float>::quiet_NaN() : normal(rng);
          const std::vector<float> acc_before = acc;
          std::vector<float> alpha(static_cast<size_t>(rows));
          for (float& a : alpha) a = uniform(rng);
          if (bf16) {
            BlockValuesBf16(p.b16.data(), p.stride, rows, keys, v_packed.data(), head_dim,
                            alpha.data(), first, acc.data(), acc_stride);
          } else {
            BlockValuesFp32(p.f32.data(), p.stride, rows, keys, v.f32.data(), v.stride, head_dim,
                            alpha.data(), first, acc.data(), acc_stride);
          }
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t d = 0; d < head_dim; ++d) {
              const double before = first ? 0.0 : acc_before[r * acc_stride + d] * double{alpha[r]};
              double expected = before, magnitude = std::fabs(before);
              for (int64_t j = 0; j < valid; ++j) {  // packed rows past valid are 0
                expected += p.value(r, j) * v.value(j, d);
                magnitude += std::fabs(p.value(r, j) * v.value(j, d));
              }
              ASSERT_NEAR(acc[r * acc_stride + d], expected, kAccumulationTolerance * magnitude)
                  << "row " << r << " dim " << d;
            }
            // Columns past head_dim are not written.
            for (int64_t d = head_dim; d < acc_stride; ++d) {
              if (first) {
                ASSERT_TRUE(std::isnan(acc[r * acc_stride + d]));
              } else {
                ASSERT_EQ(acc[r * acc_stride + d], acc_before[r * acc_stride + d]);
              }
            }
          }
        }
      }
    }
  }
}

// Tied to the CPU (read from /proc/cpuinfo), not to oneDNN's ISA.
TEST(BlockKernelsAvailability, RunWhereTheCpuHasAvx512AndForBf16Avx512Bf16) {
  EXPECT_EQ(OwnBlockKernelsAvailable(false, 16), ::attnserve::testing::CpuInfoHasAvx512());
  EXPECT_EQ(OwnBlockKernelsAvailable(true, 16), ::attnserve::testing::CpuInfoHasAvx512Bf16());
}

TEST(BlockKernelsAvailability, NeedHeadDimInSixteens) {
  EXPECT_FALSE(OwnBlockKernelsAvailable(false, 8));
  EXPECT_FALSE(OwnBlockKernelsAvailable(false, 24));
  EXPECT_FALSE(OwnBlockKernelsAvailable(true, 0));
  EXPECT_EQ(PackedBlockElements(17, 64), 32 * 64);
}

INSTANTIATE_TEST_SUITE_P(Precisions, BlockKernels, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Bf16" : "Fp32";
                         });

}  // namespace
}  // namespace attnserve::core::internal
