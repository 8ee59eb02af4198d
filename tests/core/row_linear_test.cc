// RowLinear (one row through a linear layer, core/kernels/row_linear.h)
// against a double-precision reference on random shapes, and Linear taking it
// for one FP32 row through weights from memory.

#include "core/kernels/row_linear.h"

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/kernels/primitives.h"
#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"
#include "tests/core/cpu_features.h"

namespace attnserve::core::internal {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::RandomNormal;
using ::attnserve::testing::SeedTrace;

// Each y[o] within 1e-5 of the sum of |x[k] w[k, o]| from the double sum.
void ExpectMatchesReference(const std::vector<float>& x, const std::vector<float>& w,
                            int64_t w_stride, const std::vector<float>& b, int64_t out,
                            const float* y) {
  const int64_t in = static_cast<int64_t>(x.size());
  for (int64_t o = 0; o < out; ++o) {
    double sum = b[static_cast<size_t>(o)];
    double magnitude = std::abs(sum);
    for (int64_t k = 0; k < in; ++k) {
      const double term = static_cast<double>(x[static_cast<size_t>(k)]) *
                          w[static_cast<size_t>(k * w_stride + o)];
      sum += term;
      magnitude += std::abs(term);
    }
    ASSERT_NEAR(y[o], sum, 1e-5 * magnitude) << "output " << o;
  }
}

TEST(RowLinear, MatchesTheDoubleReferenceOnRandomShapes) {
  ATTNSERVE_SKIP_UNLESS_AVAILABLE(RowLinearTakes(1024, 1024),
                                  ::attnserve::testing::CpuInfoHasAvx512(), "RowLinear (AVX-512)");
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 rng(seed);
  // Rows not a multiple of 4 (the pass), outputs not of 16 (the vector), a
  // wider matrix's column block (stride > out), and more threads than runs.
  const int64_t shapes[][3] = {{1024, 3072, 3072}, {1023, 1000, 1011}, {517, 33, 40},
                               {3, 17, 17},        {1, 5, 5},          {4096, 512, 1536}};
  for (const auto& [in, out, stride] : shapes) {
    SCOPED_TRACE(::testing::Message() << "in " << in << " out " << out << " stride " << stride);
    const std::vector<float> x = RandomNormal(static_cast<size_t>(in), rng);
    const std::vector<float> w = RandomNormal(static_cast<size_t>(in * stride), rng);
    const std::vector<float> b = RandomNormal(static_cast<size_t>(out), rng);
    std::vector<float> y(static_cast<size_t>(out) + 1, 7.0f);  // one past: untouched
    std::vector<float> partials(static_cast<size_t>((omp_get_max_threads() - 1) * out));
    RowLinear(x.data(), in, out, w.data(), stride, b.data(), y.data(), partials.data());
    ExpectMatchesReference(x, w, stride, b, out, y.data());
    EXPECT_EQ(y.back(), 7.0f);
  }
}

TEST(RowLinear, TakesOnlyWeightsFromMemoryOnCpusWithAvx512) {
  EXPECT_EQ(RowLinearTakes(1024, 3072), ::attnserve::testing::CpuInfoHasAvx512());
  EXPECT_FALSE(RowLinearTakes(64, 192));  // in cache: oneDNN's matmul
}

}  // namespace
}  // namespace attnserve::core::internal
