#include "server/allocator_cache.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <utility>

// jemalloc's control interface, when the process runs on jemalloc; null
// otherwise (a weak reference: the binary links jemalloc, tests do not).
extern "C" int mallctl(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen)
    __attribute__((weak));

namespace attnserve::server {
namespace {

// jemalloc's MALLCTL_ARENAS_ALL: "every arena" in arena.<i> and stats.arenas.<i>.
#define ATTNSERVE_ARENAS_ALL "4096"

// Idle, less than this is left cached: the threads' own small allocations.
constexpr int64_t kIdleReleaseFloor = int64_t{1} << 20;

template <typename T>
bool ReadControl(const char* name, T* value) {
  size_t size = sizeof(T);
  return mallctl(name, value, &size, nullptr, 0) == 0 && size == sizeof(T);
}

}  // namespace

int64_t AllocatorCachedBytes() {
  if (mallctl == nullptr) return -1;
  // Statistics are a snapshot taken when the epoch advances.
  uint64_t epoch = 1;
  if (mallctl("epoch", nullptr, nullptr, &epoch, sizeof(epoch)) != 0) return -1;
  size_t dirty_pages = 0, page = 0;
  if (!ReadControl("stats.arenas." ATTNSERVE_ARENAS_ALL ".pdirty", &dirty_pages) ||
      !ReadControl("arenas.page", &page)) {
    return -1;
  }
  return static_cast<int64_t>(dirty_pages * page);
}

void ReleaseAllocatorCache() {
  if (mallctl == nullptr) return;
  mallctl("arena." ATTNSERVE_ARENAS_ALL ".purge", nullptr, nullptr, nullptr, 0);
}

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
