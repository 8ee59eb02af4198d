#ifndef ATTNSERVE_SERVER_COMMON_ALLOCATOR_CONTROL_H_
#define ATTNSERVE_SERVER_COMMON_ALLOCATOR_CONTROL_H_

// The one place that talks to the allocator's control interface. The
// attnserve binary runs on jemalloc (cli/jemalloc_settings.cc); tests, a
// -DATTNSERVE_MALLOC=system build and sanitizer builds do not, and then these
// report -1 or do nothing. All thread-safe.

#include <cstdint>

namespace attnserve::server {

// Bytes of freed memory the allocator holds for reuse (jemalloc's dirty
// pages, all arenas); -1 when the process does not run on jemalloc.
int64_t AllocatorCachedBytes();

// Returns the allocator's cache to the system (jemalloc: purges every arena).
void ReleaseAllocatorCache();

// Gives the calling thread's own cache of small freed blocks (jemalloc's
// tcache) back to the shared arenas: for threads that run rarely and would
// otherwise each keep what their last task freed (the metrics endpoint's
// workers).
void ReleaseThreadAllocatorCache();

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_COMMON_ALLOCATOR_CONTROL_H_
