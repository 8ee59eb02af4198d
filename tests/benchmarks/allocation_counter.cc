#include "tests/benchmarks/allocation_counter.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

namespace {

std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_onednn_allocations{0};
std::atomic<bool> g_attribute{false};

// Whether `address` is code of oneDNN's shared library. dladdr takes the
// loader's lock and does not allocate.
bool InOneDnn(void* address) {
  Dl_info info{};
  return dladdr(address, &info) != 0 && info.dli_fname != nullptr &&
         std::strstr(info.dli_fname, "libdnnl") != nullptr;
}

void* Allocate(std::size_t size, void* caller) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (g_attribute.load(std::memory_order_relaxed) && InOneDnn(caller)) {
    g_onednn_allocations.fetch_add(1, std::memory_order_relaxed);
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}

}  // namespace

// The process's global allocation functions, counting. In their own
// translation unit, so that no caller sees malloc and free inside them.
void* operator new(std::size_t size) { return Allocate(size, __builtin_return_address(0)); }
void* operator new[](std::size_t size) { return Allocate(size, __builtin_return_address(0)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace attnserve::testing {

int64_t AllocationCount() { return g_allocations.load(std::memory_order_relaxed); }

int64_t OneDnnAllocationCount() { return g_onednn_allocations.load(std::memory_order_relaxed); }

void SetAllocationAttribution(bool on) { g_attribute.store(on, std::memory_order_relaxed); }

}  // namespace attnserve::testing
