#include "server/openmp_wait.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

TEST(SpinCountFor, DividesTheSpinByOneIterationsCostRounded) {
  // 100 us at 18.5 ns: 5405.4 -> 5405; at 40 ns: 2500; 20 us at 3 ns: 6666.7 -> 6667.
  EXPECT_EQ(SpinCountFor(absl::Microseconds(100), absl::Nanoseconds(18.5)), 5405);
  EXPECT_EQ(SpinCountFor(absl::Microseconds(100), absl::Nanoseconds(40)), 2500);
  EXPECT_EQ(SpinCountFor(absl::Microseconds(20), absl::Nanoseconds(3)), 6667);
  EXPECT_EQ(SpinCountFor(absl::Milliseconds(100), absl::Nanoseconds(10)), 10'000'000);
}

TEST(SpinCountFor, ZeroSpinIsZeroAndAnyOtherSpinIsAtLeastOne) {
  EXPECT_EQ(SpinCountFor(absl::ZeroDuration(), absl::Nanoseconds(20)), 0);
  EXPECT_EQ(SpinCountFor(-absl::Microseconds(5), absl::Nanoseconds(20)), 0);
  EXPECT_EQ(SpinCountFor(absl::Nanoseconds(1), absl::Microseconds(1)), 1);
}

TEST(SpinCountFor, ACostBelowOneNanosecondCountsAsOne) {
  EXPECT_EQ(SpinCountFor(absl::Microseconds(10), absl::ZeroDuration()), 10'000);
  EXPECT_EQ(SpinCountFor(absl::Microseconds(10), absl::Nanoseconds(0.25)), 10'000);
}

TEST(SpinCountFor, AnEndlessSpinIsCappedNotUndefined) {
  EXPECT_EQ(SpinCountFor(absl::InfiniteDuration(), absl::Nanoseconds(20)), int64_t{1'000'000'000'000'000'000});
}

#if defined(__x86_64__) || defined(__i386__)
// A `pause` and a load take a few to a few hundred nanoseconds on any x86 CPU
// (more than the 1 ns floor the measurement clamps to; far less than a
// microsecond, even on a machine that interrupts some runs).
TEST(MeasurePauseCost, IsWhatAPauseCostsOnThisCpu) {
  const absl::Duration cost = MeasurePauseCost();
  EXPECT_GT(cost, absl::Nanoseconds(1));
  EXPECT_LT(cost, absl::Microseconds(1));
}
#endif

TEST(PlanOpenMpWait, TheEnvironmentsChoiceStandsAndNothingIsMeasured) {
  int measured = 0;
  const auto measure = [&measured] {
    ++measured;
    return absl::Nanoseconds(20);
  };
  const OpenMpWaitPlan policy = PlanOpenMpWait("ACTIVE", nullptr, absl::Microseconds(100), measure);
  EXPECT_THAT(policy.environment, IsEmpty());
  EXPECT_THAT(policy.description, HasSubstr("OMP_WAIT_POLICY ACTIVE"));
  const OpenMpWaitPlan count = PlanOpenMpWait(nullptr, "50000", absl::Microseconds(100), measure);
  EXPECT_THAT(count.environment, IsEmpty());
  EXPECT_THAT(count.description, HasSubstr("GOMP_SPINCOUNT 50000"));
  EXPECT_EQ(measured, 0);
}

TEST(PlanOpenMpWait, ZeroSpinSleepsAtOnceWithoutMeasuring) {
  int measured = 0;
  const OpenMpWaitPlan plan = PlanOpenMpWait(nullptr, nullptr, absl::ZeroDuration(), [&measured] {
    ++measured;
    return absl::Nanoseconds(20);
  });
  EXPECT_THAT(plan.environment, ElementsAre(Pair("OMP_WAIT_POLICY", "PASSIVE")));
  EXPECT_THAT(plan.description, HasSubstr("PASSIVE"));
  EXPECT_EQ(measured, 0);
}

TEST(PlanOpenMpWait, ASpinBecomesTheCountForItsTimeAtTheMeasuredCost) {
  int measured = 0;
  const OpenMpWaitPlan plan = PlanOpenMpWait(nullptr, nullptr, absl::Microseconds(100), [&measured] {
    ++measured;
    return absl::Nanoseconds(40);
  });
  EXPECT_THAT(plan.environment, ElementsAre(Pair("GOMP_SPINCOUNT", "2500")));
  EXPECT_THAT(plan.description, HasSubstr("100us"));
  EXPECT_THAT(plan.description, HasSubstr("GOMP_SPINCOUNT=2500"));
  EXPECT_THAT(plan.description, HasSubstr("40.0 ns"));
  EXPECT_EQ(measured, 1);
}

}  // namespace
}  // namespace attnserve::server
