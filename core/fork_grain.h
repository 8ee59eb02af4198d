#ifndef ATTNSERVE_CORE_FORK_GRAIN_H_
#define ATTNSERVE_CORE_FORK_GRAIN_H_

// Private to core/: when a loop that copies or converts elements is worth
// forking the OpenMP team for.

#include <cstdint>

namespace attnserve::core::internal {

// A loop over at most this many elements runs on the calling thread. Forking
// wakes the team's other threads and joins them again; the server runs OpenMP
// with OMP_WAIT_POLICY=PASSIVE, so they sleep between regions and each fork is
// a futex wake-up: 4-6 us back to back and 70-80 us at p99 on a 2-vCPU virtual
// machine, more after a stretch of work on one thread (~80 us a barrier inside
// the paged attention). Three copies of ~100 KB each that forked cost a
// 32-session decode step 0.23-0.35 ms more than on one thread
// (docs/measurements.md, "Decode steps: copies that forked"). 2^18 floats are
// 1 MiB, which one thread copies in about 0.1 ms.
inline constexpr int64_t kCopyForkGrain = int64_t{1} << 18;

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_FORK_GRAIN_H_
