// FloatToBf16 against an independent rounding (the nearest of the two
// neighbouring bfloat16 values, compared in double precision), and the
// vectorized FloatsToBf16 and ScaledFloatsToBf16 against it element by
// element.

#include "core/bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/attention_test_util.h"

namespace attnserve::core {
namespace {

using ::attnserve::testing::FreshSeed;
using ::attnserve::testing::SeedTrace;

float FromBits(uint32_t bits) {
  float value = 0.0f;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

uint32_t Bits(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// The bfloat16 nearest to a finite `value`, ties to the even one, found by
// comparing the distances to the truncated value and the next one up in
// double precision (independent of the bit trick under test).
Bf16 NearestBf16(float value) {
  const uint32_t low = Bits(value) & 0xffff0000u;
  const uint32_t high = low + 0x10000u;  // the next bfloat16 away from zero
  const double below = FromBits(low);
  // Past the largest finite value IEEE rounds as if the next value were 2^128
  // (infinity beyond it).
  const double above =
      std::isinf(FromBits(high)) ? std::copysign(std::ldexp(1.0, 128), value) : FromBits(high);
  const double distance_below = std::abs(static_cast<double>(value) - below);
  const double distance_above = std::abs(above - static_cast<double>(value));
  if (distance_below < distance_above) return static_cast<Bf16>(low >> 16);
  if (distance_above < distance_below) return static_cast<Bf16>(high >> 16);
  return static_cast<Bf16>(((low >> 16) & 1u) == 0 ? low >> 16 : high >> 16);
}

std::vector<float> SpecialValues() {
  const float inf = std::numeric_limits<float>::infinity();
  return {0.0f,
          -0.0f,
          1.0f,
          -1.0f,
          inf,
          -inf,
          std::numeric_limits<float>::max(),
          -std::numeric_limits<float>::max(),
          std::numeric_limits<float>::min(),
          std::numeric_limits<float>::denorm_min(),
          FromBits(0x3f808000u),   // exactly between 0x3f80 and 0x3f81: to even (0x3f80)
          FromBits(0x3f818000u),   // exactly between 0x3f81 and 0x3f82: to even (0x3f82)
          FromBits(0x3f808001u),   // just above half: up
          FromBits(0x3f807fffu),   // just below half: down
          FromBits(0x7f7fffffu),   // the largest float rounds to infinity
          FromBits(0x007fffffu)};  // the largest subnormal
}

TEST(Bf16, RoundsToTheNearestEvenAsAnIndependentReferenceDoes) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 random(seed);
  std::vector<float> values = SpecialValues();
  std::uniform_int_distribution<uint32_t> any_bits;
  while (values.size() < 200000) {
    const float value = FromBits(any_bits(random));
    if (!std::isnan(value)) values.push_back(value);
  }
  for (float value : values) {
    ASSERT_EQ(FloatToBf16(value), NearestBf16(value)) << "bits 0x" << std::hex << Bits(value);
  }
}

TEST(Bf16, NanStaysAQuietNanWithItsSign) {
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0xff800001u, 0x7fffffffu}) {
    const Bf16 half = FloatToBf16(FromBits(bits));
    EXPECT_TRUE(std::isnan(Bfloat16ToFloat(half))) << std::hex << bits;
    EXPECT_EQ(half & 0x8000u, (bits >> 16) & 0x8000u) << std::hex << bits;
    EXPECT_NE(half & 0x40u, 0u) << std::hex << bits;  // quiet
  }
}

TEST(Bf16, BulkConversionEqualsTheScalarOneForEveryLengthAndOffset) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE(SeedTrace(seed));
  std::mt19937_64 random(seed);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> values = SpecialValues();
  values.push_back(std::numeric_limits<float>::quiet_NaN());
  values.push_back(-std::numeric_limits<float>::quiet_NaN());
  while (values.size() < 4099) values.push_back(normal(random));
  std::shuffle(values.begin(), values.end(), random);
  // Lengths around the vector widths and offsets that misalign the rows;
  // ScaledFloatsToBf16 (the blocked path's context rows) with factors that
  // move values across BF16's rounding boundaries and into overflow.
  for (int64_t offset : {0, 1, 3, 7}) {
    for (int64_t n : {0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 4000}) {
      std::vector<Bf16> bulk(static_cast<size_t>(n) + 1, 0xabcd);
      FloatsToBf16(values.data() + offset, n, bulk.data());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(bulk[i], FloatToBf16(values[offset + i])) << "n " << n << " i " << i;
      }
      EXPECT_EQ(bulk[n], 0xabcd) << "wrote past n = " << n;
      for (const float factor : {1.0f, 0.37f, 3.0e37f}) {
        std::vector<Bf16> scaled(static_cast<size_t>(n) + 1, 0xabcd);
        ScaledFloatsToBf16(values.data() + offset, n, factor, scaled.data());
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(scaled[i], FloatToBf16(values[offset + i] * factor))
              << "n " << n << " i " << i << " factor " << factor;
        }
        EXPECT_EQ(scaled[n], 0xabcd) << "wrote past n = " << n;
      }
    }
  }
}

}  // namespace
}  // namespace attnserve::core
