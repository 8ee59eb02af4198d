#ifndef ATTNSERVE_SERVER_ALLOCATOR_CACHE_H_
#define ATTNSERVE_SERVER_ALLOCATOR_CACHE_H_

#include <cstdint>
#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/common/allocator_control.h"

namespace attnserve::server {

// The allocator's cache of freed memory. The attnserve binary runs on jemalloc
// (cli/jemalloc_settings.cc), which keeps what a call frees -- its request,
// its response buffers, gRPC's read buffers -- mapped, for the next call to
// reuse without page faults or zero-filling (on these virtual machines a fault
// per 4 KiB page costs more than sending the page: docs/measurements.md, "What
// the wire costs"). jemalloc's own timed release returned pages still in use
// call after call, so the binary turns it off and AllocatorCacheKeeper gives
// the cache back instead: once the server has been idle for a moment, and at
// once whenever the cache passes its bound.

struct AllocatorCacheOptions {
  // The cache is released whenever it holds more at a look
  // (--max_allocator_cache_bytes).
  int64_t max_bytes = int64_t{512} << 20;
  // ... and whenever calls have been inactive this long (down to 1 MiB).
  absl::Duration idle = absl::Seconds(2);
  // How often it looks.
  absl::Duration interval = absl::Milliseconds(250);
  // When calls were last active (AttentionServiceImpl::last_activity: now
  // while one is in flight).
  std::function<absl::Time()> last_activity;
  // Called on the keeper's thread once each time calls turn idle (inactive
  // for `idle`), before the cache is released: the owner frees what it keeps
  // for the next call (AttentionServiceImpl::ReleaseComputeMemory), which the
  // following looks then give back with the cache.
  std::function<void()> on_idle;
  // Called on the keeper's thread after each look, with the cached bytes then
  // and whether (and why) it released them: for the metrics.
  enum class Release { kNone, kIdle, kBound };
  std::function<void(int64_t cached_bytes, Release release)> on_look;
};

// A thread that keeps the allocator's cache within its options (see above).
// Without jemalloc it releases nothing but still calls on_idle. The destructor
// stops the thread.
class AllocatorCacheKeeper {
 public:
  explicit AllocatorCacheKeeper(AllocatorCacheOptions options);
  ~AllocatorCacheKeeper();
  AllocatorCacheKeeper(const AllocatorCacheKeeper&) = delete;
  AllocatorCacheKeeper& operator=(const AllocatorCacheKeeper&) = delete;

 private:
  void Run();

  const AllocatorCacheOptions options_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace attnserve::server

#endif  // ATTNSERVE_SERVER_ALLOCATOR_CACHE_H_
