#include "server/allocator_cache.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <utility>

namespace attnserve::server {
namespace {

// Idle, less than this is left cached: the threads' own small allocations.
constexpr int64_t kIdleReleaseFloor = int64_t{1} << 20;

}  // namespace

AllocatorCacheKeeper::AllocatorCacheKeeper(AllocatorCacheOptions options)
    : options_(std::move(options)) {
  thread_ = std::thread([this] { Run(); });
}

AllocatorCacheKeeper::~AllocatorCacheKeeper() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void AllocatorCacheKeeper::Run() {
  using Release = AllocatorCacheOptions::Release;
  // The activity whose idle on_idle was called for (none yet).
  std::optional<absl::Time> idle_told;
  while (!stop_.WaitForNotificationWithTimeout(options_.interval)) {
    // Now before the activity: while a call is in flight the activity is the
    // later "now", so the server never looks idle then, whatever the idle time.
    const absl::Time now = absl::Now();
    const absl::Time last_activity =
        options_.last_activity ? options_.last_activity() : absl::InfinitePast();
    const bool idle = now - last_activity >= options_.idle;
    if (idle && idle_told != last_activity) {
      idle_told = last_activity;
      if (options_.on_idle) options_.on_idle();
    }
    int64_t cached = AllocatorCachedBytes();
    Release release = Release::kNone;
    if (cached > options_.max_bytes) {
      release = Release::kBound;
    } else if (cached >= kIdleReleaseFloor && idle) {
      release = Release::kIdle;
    }
    if (release != Release::kNone) {
      ReleaseAllocatorCache();
      cached = AllocatorCachedBytes();
    }
    if (options_.on_look) options_.on_look(std::max<int64_t>(cached, 0), release);
  }
}

}  // namespace attnserve::server
