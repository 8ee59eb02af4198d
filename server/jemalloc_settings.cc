// jemalloc's settings for the attnserve binary (linked only when it links
// jemalloc: ATTNSERVE_MALLOC=jemalloc). jemalloc reads this symbol at start-up;
// MALLOC_CONF in the environment overrides it.
//
// A server is idle between bursts, and jemalloc gives freed pages back only
// while it runs: a background thread purges them on a timer even when no
// allocation happens. Dirty pages (freed, still mapped) go back after 5 s,
// so RSS falls back within seconds of a burst (docs/measurements.md, "Memory
// after load"); reuse within that time needs no new page faults.
extern "C" {
// NOLINTNEXTLINE: the name is jemalloc's.
extern const char* malloc_conf;
const char* malloc_conf = "background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:0";
}
