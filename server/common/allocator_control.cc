#include "server/common/allocator_control.h"

#include <cstddef>
#include <cstdint>

// jemalloc's control interface, when the process runs on jemalloc; null
// otherwise (a weak reference: the binary links jemalloc, tests do not).
extern "C" int mallctl(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen)
    __attribute__((weak));

namespace attnserve::server {
namespace {

// jemalloc's MALLCTL_ARENAS_ALL: "every arena" in arena.<i> and stats.arenas.<i>.
#define ATTNSERVE_ARENAS_ALL "4096"

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

void ReleaseThreadAllocatorCache() {
  if (mallctl == nullptr) return;
  mallctl("thread.tcache.flush", nullptr, nullptr, nullptr, 0);
}

}  // namespace attnserve::server
