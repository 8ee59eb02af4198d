#include "server/openmp_wait.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace attnserve::server {
namespace {

// What libgomp's spin runs once per iteration besides the load: `pause` on
// x86 (its cpu_relax); elsewhere GCC 12's libgomp has only a compiler barrier.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  asm volatile("" ::: "memory");
#endif
}

}  // namespace

int64_t SpinCountFor(absl::Duration spin, absl::Duration pause_cost) {
  if (spin <= absl::ZeroDuration()) return 0;
  const double pause_ns = std::max(1.0, absl::ToDoubleNanoseconds(pause_cost));
  // Capped where a double still converts (an infinite spin included).
  const double count = std::min(std::round(absl::ToDoubleNanoseconds(spin) / pause_ns), 1e18);
  return std::max<int64_t>(1, static_cast<int64_t>(count));
}

absl::Duration MeasurePauseCost() {
  constexpr int kRuns = 21;
  constexpr int kIterations = 2000;  // ~10-80 us a run
  // Never set: the loop reads it as libgomp's reads the word it waits on.
  static std::atomic<int> never_set{0};
  std::vector<double> ns_per_iteration;
  ns_per_iteration.reserve(kRuns);
  // Run 0 wakes the core (a core just idle may run slower for a moment) and
  // is not counted.
  for (int run = -1; run < kRuns; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kIterations; ++i) {
      if (never_set.load(std::memory_order_relaxed) != 0) break;
      CpuRelax();
    }
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
        kIterations;
    if (run >= 0) ns_per_iteration.push_back(ns);
  }
  // The median: a run the scheduler interrupts reads long, and a few such
  // runs do not move it.
  std::nth_element(ns_per_iteration.begin(), ns_per_iteration.begin() + kRuns / 2,
                   ns_per_iteration.end());
  return absl::Nanoseconds(std::max(1.0, ns_per_iteration[kRuns / 2]));
}

OpenMpWaitPlan PlanOpenMpWait(const char* omp_wait_policy, const char* gomp_spincount,
                              absl::Duration spin,
                              const std::function<absl::Duration()>& measure_pause) {
  OpenMpWaitPlan plan;
  if (omp_wait_policy != nullptr || gomp_spincount != nullptr) {
    plan.description = absl::StrCat(
        "OpenMP wait policy from the environment: OMP_WAIT_POLICY ",
        omp_wait_policy != nullptr ? omp_wait_policy : "(unset)", ", GOMP_SPINCOUNT ",
        gomp_spincount != nullptr ? gomp_spincount : "(unset)",
        " (--openmp_spin_us applies only when neither is set)");
    return plan;
  }
  if (spin <= absl::ZeroDuration()) {
    plan.environment = {{"OMP_WAIT_POLICY", "PASSIVE"}};
    plan.description =
        "OpenMP threads sleep as soon as they wait (OMP_WAIT_POLICY=PASSIVE: --openmp_spin_us=0)";
    return plan;
  }
  const absl::Duration pause_cost = measure_pause();
  const int64_t count = SpinCountFor(spin, pause_cost);
  plan.environment = {{"GOMP_SPINCOUNT", absl::StrCat(count)}};
  plan.description = absl::StrFormat(
      "OpenMP threads spin %s before they sleep (--openmp_spin_us): GOMP_SPINCOUNT=%d at %.1f ns "
      "per spin iteration, measured at start",
      absl::FormatDuration(spin), count, absl::ToDoubleNanoseconds(pause_cost));
  return plan;
}

}  // namespace attnserve::server
