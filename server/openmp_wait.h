#ifndef ATTNSERVE_SERVER_OPENMP_WAIT_H_
#define ATTNSERVE_SERVER_OPENMP_WAIT_H_

// How the compute executor's OpenMP threads wait between parallel regions.
//
// libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it loads, so the
// server chooses them before anything runs and starts itself again with them
// (attnserve_main.cc). A waiting libgomp thread spins GOMP_SPINCOUNT times (one
// `pause` and one load each) and then sleeps on a futex. A spin long enough to
// bridge the gaps between one forward's parallel regions spares each region
// the wake-up of sleeping threads; a spin that outlasts a request takes the
// cores from gRPC's threads between requests (docs/measurements.md, "Thread
// arrangement" and "A spin bounded in time"). While libgomp runs more threads
// than there are CPUs it cuts every spin to at most 100 iterations, whatever
// GOMP_SPINCOUNT says. What a count means in time
// depends on the CPU (a `pause` takes ~5 ns on some, ~40 ns on others), so the
// server measures the loop's cost at start and asks for a time, not a count.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace attnserve::server {

// The spin loop's iterations that last `spin`, given one iteration's cost:
// spin / pause_cost rounded to the nearest, at least 1 for a spin above zero;
// 0 for a spin of zero (or less). A cost below 1 ns counts as 1 ns (a clock
// too coarse for it). Pure arithmetic: thread-safe.
int64_t SpinCountFor(absl::Duration spin, absl::Duration pause_cost);

// One iteration of a spin loop like libgomp's (a relaxed load of a flag, a
// `pause`), timed on this thread: the median of 21 runs of 2000 iterations
// (about 1 ms in all; a few runs the scheduler interrupts do not move it).
// At least 1 ns. Thread-safe.
absl::Duration MeasurePauseCost();

// What the server sets before libgomp loads, and what the start-up log says.
struct OpenMpWaitPlan {
  // Variables to set before running the binary again; empty: the environment
  // already chose (nothing to set, no second start).
  std::vector<std::pair<std::string, std::string>> environment;
  // One line for the start-up log: the policy and why.
  std::string description;
};

// The plan, given the environment's OMP_WAIT_POLICY and GOMP_SPINCOUNT
// (nullptr when unset) and --openmp_spin_us as `spin`:
//   - either variable set: the environment's choice, nothing set;
//   - spin of zero: OMP_WAIT_POLICY=PASSIVE (threads sleep at once);
//   - otherwise GOMP_SPINCOUNT=SpinCountFor(spin, measure_pause()).
// `measure_pause` is called once, and only in the last case. Thread-safe if
// `measure_pause` is.
OpenMpWaitPlan PlanOpenMpWait(const char* omp_wait_policy, const char* gomp_spincount,
                              absl::Duration spin,
                              const std::function<absl::Duration()>& measure_pause);

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_OPENMP_WAIT_H_
