#ifndef ATTNSERVE_TESTS_BENCHMARKS_ALLOCATION_COUNTER_H_
#define ATTNSERVE_TESTS_BENCHMARKS_ALLOCATION_COUNTER_H_

#include <cstdint>

namespace attnserve::testing {

// Calls of the global operator new so far in this process (every library's,
// oneDNN's included), counted by the replacement in allocation_counter.cc.
// Thread-safe.
int64_t AllocationCount();

// Of those, the calls made from code inside oneDNN's shared library (the
// caller's address lies in libdnnl), counted only while attribution is on:
// telling them apart costs a symbol lookup per allocation. Thread-safe.
int64_t OneDnnAllocationCount();
void SetAllocationAttribution(bool on);

}  // namespace attnserve::testing

#endif  // ATTNSERVE_TESTS_BENCHMARKS_ALLOCATION_COUNTER_H_
