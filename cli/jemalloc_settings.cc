// jemalloc's settings for the attnserve and attnctl binaries (linked only when
// they link jemalloc: ATTNSERVE_MALLOC=jemalloc; attnserve_link_allocator).
// jemalloc reads this symbol at start-up; MALLOC_CONF in the environment
// overrides it.
//
// Freed pages stay with jemalloc until attnserve gives them back
// (server/allocator_cache.h): a call's buffers -- its request, its response,
// gRPC's read buffers -- are reused by the next call without page faults.
// jemalloc's own timed release (dirty_decay_ms) is off: it returned pages
// still being reused call after call (a 50 MB map response faulted 12000
// pages a call with a 5 s decay, 2-40 with none; docs/measurements.md, "What
// the wire costs"). The keeper releases them after --allocator_cache_idle_ms
// without calls and whenever they pass --max_allocator_cache_bytes, so RSS still falls back
// after a burst ("Memory after load"). attnctl has no keeper: it holds at
// most what its largest calls needed, until it exits.
//
// narenas:1: one arena for all threads. A request is received on one gRPC
// thread, freed on another, and the next one arrives on a third: with an
// arena per thread (jemalloc's default, 4 per CPU) each arena must fill its
// own cache before reuse starts (B=8 S=128 requests: 17-19 faults a call
// after 120 warm-up calls, 1-2 with one arena), and the cache is spread over
// them. On 2 cores the one arena's lock costs nothing measurable (32 clients
// of B=1 S=16: 1164 against 995 req/s, medians of 3 alternated runs).
// muzzy_decay_ms:0: released pages are returned at once (MADV_DONTNEED).
// oversize_threshold:0 turns off jemalloc's arena for allocations over 8 MiB,
// which frees their pages at once: a response's output and maps (up to
// --max_attention_map_bytes) would be fresh pages on every call.
//
// lg_extent_max_active_fit:30: a freed extent may serve a request of any
// smaller size (jemalloc's default refuses one over 64 times the request).
// gRPC sizes its read buffers call by call from a running average of what the
// socket held, so the sizes of a call's buffers drift; with the default, the
// freed extents often did not fit the next call's and jemalloc mapped fresh
// pages. The server at B=1 S=2048 (12.6 MB a call): 315-323 page faults a
// call after 30 warm-up calls and RSS growing by ~0.5 MB a call, against 0-26
// with the setting; one-message map responses 57-128 against 0
// (docs/measurements.md, "The server's read buffers"). In attnctl receiving
// 50 MB map responses it cut the faults of 20 calls from 300,000 to 71,000
// and RSS from 1.2 GB to 300 MB ("attnctl's large responses").
extern "C" {
// NOLINTNEXTLINE: the name is jemalloc's.
extern const char* malloc_conf;
const char* malloc_conf =
    "narenas:1,dirty_decay_ms:-1,muzzy_decay_ms:0,oversize_threshold:0,lg_extent_max_active_fit:30";
}
