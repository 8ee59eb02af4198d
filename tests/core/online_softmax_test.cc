// The row kernels of the blocked path (core/kernels/online_softmax.h) against a
// double-precision computation, on fresh random rows: every width from 1 to 70
// (the 16-lane loop, its tail and both together), keys past `limit` masked,
// rows fed in several key blocks, -inf scores, BF16 output -- on each
// implementation that runs on this CPU (portable, AVX-512, AVX512-BF16), and
// strips of rows against the same rows one by one.
#include "core/kernels/online_softmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"

namespace attnserve::core::internal {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::SeedTrace;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// The row kernels that run on this CPU (the portable one always).
std::vector<SoftmaxKernel> Kernels() {
  std::vector<SoftmaxKernel> kernels;
  for (const SoftmaxKernel kernel :
       {SoftmaxKernel::kPortable, SoftmaxKernel::kAvx512, SoftmaxKernel::kAvx512Bf16,
        SoftmaxKernel::kAvx2}) {
    if (SoftmaxKernelRuns(kernel)) kernels.push_back(kernel);
  }
  return kernels;
}

const char* KernelName(SoftmaxKernel kernel) {
  switch (kernel) {
    case SoftmaxKernel::kPortable:
      return "portable";
    case SoftmaxKernel::kAvx512:
      return "avx512";
    case SoftmaxKernel::kAvx512Bf16:
      return "avx512-bf16";
    case SoftmaxKernel::kAvx2:
      return "avx2";
  }
  return "?";
}


// Each row kernel runs exactly where /proc/cpuinfo shows what it needs, so
// that none of them drops out of the tests below unnoticed.
TEST(OnlineSoftmax, EachKernelRunsWhereTheCpuHasItsInstructions) {
  EXPECT_TRUE(SoftmaxKernelRuns(SoftmaxKernel::kPortable));
  EXPECT_EQ(SoftmaxKernelRuns(SoftmaxKernel::kAvx512), ::attnserve::testing::CpuInfoHasAvx512());
  EXPECT_EQ(SoftmaxKernelRuns(SoftmaxKernel::kAvx512Bf16),
            ::attnserve::testing::CpuInfoHasAvx512Bf16());
  const std::set<std::string> flags = ::attnserve::testing::CpuInfoFlags();
  EXPECT_EQ(SoftmaxKernelRuns(SoftmaxKernel::kAvx2), flags.count("avx2") && flags.count("fma"));
}

// FastExp's relative error: the polynomial's 4e-7 and the rounding of
// x log2(e) to FP32, up to |x| 2^-24 log2(e) ln(2) = |x| 6e-8.
double ExpTolerance(double x) { return 4e-7 + 7e-8 * std::fabs(x); }

TEST(OnlineSoftmax, FastExpMatchesExpWithinItsStatedError) {
  for (double x = -86.0; x <= 0.0; x += 0.001953125) {  // exp(x) >= 2^-124
    const double expected = std::exp(x);
    EXPECT_NEAR(FastExp(static_cast<float>(x)), expected, ExpTolerance(x) * expected) << x;
  }
  EXPECT_EQ(FastExp(-100.0f), 0.0f);
  EXPECT_EQ(FastExp(kMinusInf), 0.0f);
  EXPECT_TRUE(std::isnan(FastExp(std::numeric_limits<float>::quiet_NaN())));
}

// Relative error of the sum l: FP32 accumulation; with BF16 probabilities
// also the degree-4 exponential's 4.2e-5.
constexpr double kSumTolerance = 1e-6;
constexpr double kBf16SumTolerance = 1e-4;
// BF16 probabilities: round to nearest (2^-9 relative) and the exponential.
constexpr double kBf16Tolerance = 4e-3;

// Feeds `scores` [width] in key blocks of `block`, the keys at and past
// `limit` masked, and checks p = exp(scale (x - max)), the running max and
// sum against double.
void CheckRow(SoftmaxKernel kernel, const std::vector<float>& scores, int64_t limit,
              int64_t block, bool bf16, float scale) {
  const int64_t width = static_cast<int64_t>(scores.size());
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < limit; ++j) max = std::max(max, static_cast<double>(scores[j]));
  double sum = 0.0;
  for (int64_t j = 0; j < limit; ++j) sum += std::exp(scale * (scores[j] - max));
  float m = kMinusInf;
  float l = 0.0f;
  for (int64_t j0 = 0; j0 < width; j0 += block) {
    const int64_t n = std::min(block, width - j0);
    std::vector<float> x(scores.begin() + j0, scores.begin() + j0 + n);
    std::vector<uint16_t> p_bf16(static_cast<size_t>(n), 0xffff);
    const float m_before = m;
    const float alpha = OnlineSoftmaxRowOn(kernel, x.data(), std::clamp<int64_t>(limit - j0, 0, n), n, scale,
                                         m, l, bf16 ? p_bf16.data() : nullptr);
    if (m_before != kMinusInf) {
      EXPECT_NEAR(alpha, std::exp(scale * (static_cast<double>(m_before) - m)), 1e-6);
    }
    for (int64_t j = 0; j < n; ++j) {
      const double d = scale * (static_cast<double>(scores[j0 + j]) - m);
      // -inf scores give 0 (also in a block of nothing else, where m is -inf).
      const double expected = j0 + j < limit && scores[j0 + j] != kMinusInf ? std::exp(d) : 0.0;
      const double actual = bf16 ? Bfloat16ToFloat(p_bf16[j]) : x[j];
      // FP32: FastExp's error and the rounding of (x - m) scale log2(e).
      const double tolerance =
          expected > 0.0 ? (bf16 ? kBf16Tolerance : 2.0 * ExpTolerance(d)) * expected : 0.0;
      EXPECT_NEAR(actual, expected, tolerance)
          << "key " << j0 + j << " of " << width << ", limit " << limit;
    }
  }
  if (limit == 0) {
    EXPECT_EQ(m, kMinusInf);
    EXPECT_EQ(l, 0.0f);
    return;
  }
  EXPECT_EQ(m, static_cast<float>(max));
  EXPECT_NEAR(l, sum, (bf16 ? kBf16SumTolerance : kSumTolerance) * sum);
}

TEST(OnlineSoftmax, RowsMatchDoublePrecisionAtEveryWidthLimitAndBlock) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t width = 1; width <= 70; ++width) {
    std::vector<float> scores(static_cast<size_t>(width));
    for (float& s : scores) s = normal(rng);
    if (width > 5) scores[3] = kMinusInf;  // a masked key inside the row
    for (const int64_t limit : {width, width / 2, int64_t{0}}) {
      for (const int64_t block : {width, int64_t{16}, int64_t{7}}) {
        for (const bool bf16 : {false, true}) {
          for (const float scale : {1.0f, 0.125f}) {
            for (const SoftmaxKernel kernel : Kernels()) {
              SCOPED_TRACE(KernelName(kernel));
              CheckRow(kernel, scores, limit, block, bf16, scale);
            }
          }
        }
      }
    }
  }
}

TEST(OnlineSoftmax, OverflowingScoresGiveANonFiniteSum) {
  // +inf scores (overflowing inputs) must not look like a normal row: the
  // blocked path gives such rows weights 0 when l is not finite and positive.
  std::vector<float> x = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  float m = kMinusInf;
  float l = 0.0f;
  OnlineSoftmaxRow(x.data(), 3, 3, 1.0f, m, l, nullptr);
  EXPECT_FALSE(std::isfinite(l) && l > 0.0f);
  for (const SoftmaxKernel kernel : Kernels()) {
    for (const bool bf16 : {false, true}) {
      std::vector<float> y = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
      std::vector<uint16_t> p(3);
      float m2 = kMinusInf, l2 = 0.0f;
      OnlineSoftmaxRowOn(kernel, y.data(), 3, 3, 1.0f, m2, l2, bf16 ? p.data() : nullptr);
      EXPECT_FALSE(std::isfinite(l2) && l2 > 0.0f) << KernelName(kernel) << " bf16 " << bf16;
    }
  }
}

TEST(OnlineSoftmax, Bf16ProbabilitiesHoldDownToExpsFloor) {
  // Whichever way the CPU takes (VCVTNEPS2BF16 with the degree-4 exponential,
  // or rounding in integer lanes), BF16 probabilities are exp(x - max) to
  // BF16's precision down to scores 90 below the row's max (probabilities near
  // exp's floor, 0 below it), 0 past limit; m equals the FP32 row's, l is
  // within the exponential's error of it.
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> below_max(-90.0f, 0.0f);
  for (const int64_t width : {1, 15, 16, 17, 64, 257}) {
    std::vector<float> scores(static_cast<size_t>(width));
    for (float& x : scores) x = below_max(rng);
    const int64_t limit = width - width / 4;
    std::vector<float> fp32 = scores;
    float m32 = kMinusInf, l32 = 0.0f;
    OnlineSoftmaxRow(fp32.data(), limit, width, 1.0f, m32, l32, nullptr);
    for (const SoftmaxKernel kernel : Kernels()) {
    SCOPED_TRACE(KernelName(kernel));
    std::vector<float> x = scores;
    std::vector<uint16_t> p_bf16(static_cast<size_t>(width), 0xffff);
    float m16 = kMinusInf, l16 = 0.0f;
    OnlineSoftmaxRowOn(kernel, x.data(), limit, width, 1.0f, m16, l16, p_bf16.data());
    EXPECT_EQ(m16, m32);
    EXPECT_NEAR(l16, l32, kBf16SumTolerance * l32);
    for (int64_t j = 0; j < width; ++j) {
      const double expected = j < limit ? std::exp(static_cast<double>(scores[j]) - m32) : 0.0;
      const double actual = Bfloat16ToFloat(p_bf16[j]);
      if (expected < 1e-37) {  // at exp's floor (2^-124): 0 or the tiny value
        ASSERT_LE(actual, 2e-37) << "width " << width << " j " << j;
      } else {
        ASSERT_NEAR(actual, expected, kBf16Tolerance * expected) << "width " << width << " j " << j;
      }
    }
    }
  }
}

// Huge finite scores: a mask's stand-in for minus infinity (-1e10, -3e38 near
// FP32's limit, -1e30) or a huge offset (+1e30), on every key of a row or
// among ordinary scores. They are scores like any other: a row of equal
// scores has p = 1 on each key (uniform weights), however large they are.
constexpr float kHugeScores[] = {-1e10f, -3e38f, -1e30f, 1e30f, -1e20f};

TEST(OnlineSoftmax, RowsOfEqualHugeScoresGiveEqualWeights) {
  for (const float huge : kHugeScores) {
    for (const int64_t width : {1, 3, 16, 17, 40}) {
      std::vector<float> scores(static_cast<size_t>(width), huge);
      if (width > 2) scores[1] = kMinusInf;  // a forbidden key among them
      for (const int64_t limit : {width, width - width / 3}) {
        for (const int64_t block : {width, int64_t{7}}) {
          for (const bool bf16 : {false, true}) {
            for (const float scale : {1.0f, 0.125f}) {
              for (const SoftmaxKernel kernel : Kernels()) {
                SCOPED_TRACE(::testing::Message()
                             << KernelName(kernel) << " score " << huge << " width " << width
                             << " block " << block << " bf16 " << bf16 << " scale " << scale);
                CheckRow(kernel, scores, limit, block, bf16, scale);
              }
            }
          }
        }
      }
    }
  }
}

// The distance from |x| to the next FP32 value away from zero.
double Ulp(float x) {
  const float magnitude = std::fabs(x);
  return static_cast<double>(std::nextafter(magnitude, std::numeric_limits<float>::infinity())) -
         magnitude;
}

TEST(OnlineSoftmax, HugeScoresKeepTheirDifferences) {
  // Scores huge + n ulp(huge) (n in [-24, 0]) with scale about 1 / ulp: the
  // exponents scale (x - max) are ordinary, the scores themselves are not,
  // and neither is max scale log2(e) (about 2^23): p must still follow the
  // differences.
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> steps(-24, 0);
  std::uniform_real_distribution<double> per_step(0.25, 1.0);
  for (const float huge : kHugeScores) {
    const double ulp = Ulp(huge);
    for (const int64_t width : {1, 5, 16, 33}) {
      std::vector<float> scores(static_cast<size_t>(width));
      for (float& x : scores) x = static_cast<float>(huge + steps(rng) * ulp);
      const float scale = static_cast<float>(per_step(rng) / ulp);
      for (const int64_t block : {width, int64_t{16}, int64_t{5}}) {
        for (const bool bf16 : {false, true}) {
          for (const SoftmaxKernel kernel : Kernels()) {
            SCOPED_TRACE(::testing::Message()
                         << KernelName(kernel) << " score " << huge << " width " << width
                         << " block " << block << " bf16 " << bf16 << " scale " << scale);
            CheckRow(kernel, scores, width, block, bf16, scale);
          }
        }
      }
    }
  }
}

TEST(OnlineSoftmax, HugeScoresAmongOrdinaryOnes) {
  // Ordinary scores N(0, 3) with huge ones on some keys: huge negative ones
  // get p = 0, one huge positive one takes all the weight; and rows whose
  // first key block is all huge (the running max goes from huge to ordinary,
  // or from ordinary to huge), with -inf keys among them.
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (const float huge : kHugeScores) {
    for (const int64_t width : {2, 16, 17, 40}) {
      for (const bool first_block_huge : {false, true}) {
        std::vector<float> scores(static_cast<size_t>(width));
        for (int64_t j = 0; j < width; ++j) {
          const double u = uniform(rng);
          scores[j] = u < 0.3 ? huge : u < 0.4 ? kMinusInf : normal(rng);
          if (first_block_huge && j < width / 2) scores[j] = huge;
        }
        scores[width - 1] = normal(rng);  // at least one ordinary score
        if (huge > 0.0f) {  // one huge positive score at most: it takes all the weight
          for (float& x : scores) x = x == huge ? normal(rng) : x;
          scores[std::uniform_int_distribution<int64_t>(0, width - 1)(rng)] = huge;
        }
        for (const int64_t block : {width, int64_t{16}, std::max<int64_t>(1, width / 2)}) {
          for (const bool bf16 : {false, true}) {
            for (const float scale : {1.0f, 0.125f}) {
              for (const SoftmaxKernel kernel : Kernels()) {
                SCOPED_TRACE(::testing::Message()
                             << KernelName(kernel) << " score " << huge << " width " << width
                             << " block " << block << " bf16 " << bf16 << " scale " << scale);
                CheckRow(kernel, scores, width, block, bf16, scale);
              }
            }
          }
        }
      }
    }
  }
}

TEST(OnlineSoftmax, AStripEqualsItsRowsOneByOne) {
  // Rows of different limits (0, partial, full; -inf scores), a state carried
  // from an earlier block, FP32 in place and BF16, every strip height, and
  // strips where some rows hold huge scores (-1e10 on every key, or huge
  // offsets) among ordinary rows: the strip's interleaved passes give each row
  // exactly what OnlineSoftmaxRow gives.
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const int64_t width : {16, 48, 512, 1024}) {
    for (int64_t rows = 1; rows <= 8; ++rows) {
      for (const bool bf16 : {false, true}) {
        for (const bool huge_rows : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "width " << width << " rows " << rows << " bf16 "
                                            << bf16 << " huge rows " << huge_rows);
          const int64_t stride = width + 16;
          std::vector<float> scores(static_cast<size_t>(rows * stride));
          for (float& x : scores) x = normal(rng);
          std::vector<int64_t> limits(static_cast<size_t>(rows));
          std::vector<float> m(static_cast<size_t>(rows)), l(static_cast<size_t>(rows));
          for (int64_t r = 0; r < rows; ++r) {
            limits[r] = std::uniform_int_distribution<int64_t>(0, width)(rng);
            if (r == 0) limits[r] = 0;
            if (r == 1) limits[r] = width;
            scores[r * stride + width / 2] = kMinusInf;
            m[r] = r % 3 == 0 ? kMinusInf : normal(rng);
            if (huge_rows && r % 2 == 1) {  // every key -1e10, or -1e10 plus ordinary offsets
              for (int64_t j = 0; j < width; ++j) {
                scores[r * stride + j] =
                    r % 4 == 1 ? -1e10f : -1e10f + 1024.0f * std::round(normal(rng));
              }
              m[r] = r % 3 == 0 ? kMinusInf : -1e10f;
            }
            l[r] = m[r] == kMinusInf ? 0.0f : 1.5f;
          }
          std::vector<float> strip_x = scores, strip_m = m, strip_l = l;
          std::vector<float> strip_alpha(static_cast<size_t>(rows));
          std::vector<uint16_t> strip_p(scores.size(), 0xffff), row_p(scores.size(), 0xffff);
          OnlineSoftmaxStrip(strip_x.data(), stride, rows, limits.data(), width, 0.125f,
                             strip_m.data(), strip_l.data(), strip_alpha.data(),
                             bf16 ? strip_p.data() : nullptr);
          std::vector<float> row_x = scores;
          for (int64_t r = 0; r < rows; ++r) {
            const float alpha =
                OnlineSoftmaxRow(row_x.data() + r * stride, limits[r], width, 0.125f, m[r], l[r],
                                 bf16 ? row_p.data() + r * stride : nullptr);
            ASSERT_EQ(strip_alpha[r], alpha) << "row " << r;
            ASSERT_EQ(strip_m[r], m[r]) << "row " << r;
            ASSERT_EQ(strip_l[r], l[r]) << "row " << r;
            for (int64_t j = 0; j < width; ++j) {
              if (bf16) {
                ASSERT_EQ(strip_p[r * stride + j], row_p[r * stride + j]) << r << " " << j;
              } else {
                ASSERT_EQ(strip_x[r * stride + j], row_x[r * stride + j]) << r << " " << j;
              }
            }
          }
        }
      }
    }
  }
}

TEST(OnlineSoftmax, ScaleAndAddAndScaleInto) {
  std::vector<float> o = {1.0f, 2.0f, 3.0f};
  const std::vector<float> add = {0.5f, 0.25f, 0.125f};
  ScaleAndAdd(o.data(), add.data(), 3, 2.0f, /*first=*/false);
  EXPECT_EQ(o, (std::vector<float>{2.5f, 4.25f, 6.125f}));
  ScaleAndAdd(o.data(), add.data(), 3, 2.0f, /*first=*/true);
  EXPECT_EQ(o, add);
  std::vector<float> to(3, -1.0f);
  ScaleInto(o.data(), 3, 2.0f, to.data());
  EXPECT_EQ(to, (std::vector<float>{1.0f, 0.5f, 0.25f}));
  EXPECT_EQ(o, add);  // the source unchanged
}

}  // namespace
}  // namespace attnserve::core::internal
